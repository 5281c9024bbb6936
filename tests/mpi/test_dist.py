"""Tier 2: torch.distributed on the "mpidp" backend under mpiexec (tests/mpi/bodies/body_dist.py,
tests/mpi/bodies/body_dist_faults.py): every collective exact (at n = 1, 2, 3 with the
other bodies: test_together.py), torch's DDP, ZeRO and
checkpoint on it; the rendezvous without MASTER_ADDR (over MPI), with mpidp://, and with
torch's env:// where a launcher set MASTER_ADDR; a stall and an uncaught exception with
torch.distributed initialised; SyncBatchNorm and uneven inputs (torch's Join) in mpidp's
DistributedDataParallel and in torch's on the backend (tests/mpi/bodies/body_syncbn.py,
tests/mpi/bodies/body_join.py, tests/mpi/bodies/body_uneven.py)."""
import re
import socket

from mpirun import assert_ok, body, run

NO_MASTER = {"MASTER_ADDR": None, "MASTER_PORT": None}
# the watchdog's bound where a test waits for it: 8 times a bound no healthy run of the same
# jobs fired at (the backend's set-up and all-reduces; mpidp's DDP built and a step: 7 runs
# each on the busy 2-core machine with the bound at 0.25 s)
WATCHDOG = {"MPIDP_TIMEOUT_S": "2"}


INIT = ("import torch, torch.distributed as dist; dist.init_process_group({args}); "
        "t = torch.ones(2) * (dist.get_rank() + 1); dist.all_reduce(t); "
        "s = dist.distributed_c10d._get_default_store(); "
        "exec('while isinstance(s, dist.PrefixStore): s = s.underlying_store'); "
        "print(f'ok {{dist.get_rank()}} {{t.tolist()}} {{type(s).__name__}}', flush=True)")
# one string, one write: with PYTHONUNBUFFERED (tests/harness/mpirun.py) print's pieces are
# written one by one, and the two ranks' lines could interleave in mpiexec's output


def test_init_method_mpidp_and_env_with_master_addr():
    proc = run(2, ["-c", INIT.format(args='"mpidp", init_method="mpidp://"')], env=NO_MASTER)
    assert_ok(proc, 2)
    assert proc.stdout.count("[3.0, 3.0] MPIStore") == 2, proc.stdout
    with socket.socket() as s:  # a free port for torch's own TCPStore (torch's, not mpidp's)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = run(2, ["-c", INIT.format(args='"mpidp"')],
               env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    assert_ok(proc, 2)
    assert proc.stdout.count("[3.0, 3.0] TCPStore") == 2, proc.stdout


def test_uncaught_exception_with_torch_distributed_prints_and_ends_the_job():
    proc = body(2, "body_dist_faults.py", env=NO_MASTER, extra=["raise"], timeout_s=60)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert re.search(r"Traceback \(most recent call last\):\n(.*\n)*RuntimeError: injected "
                     r"fault\n", out), out
    assert re.search(r"mpidp: rank 1 of 2 on \S+: uncaught RuntimeError: injected fault; "
                     r"aborting the job", out), out


def test_stall_through_the_backend_is_named_by_the_watchdog():
    proc = body(2, "body_dist_faults.py", env=dict(NO_MASTER, **WATCHDOG),
                extra=["stall"], timeout_s=60)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 124, out
    assert re.search(r"mpidp: watchdog: rank 0 of 2 on \S+: collective #\d+, allreduce "
                     r"float32\[4\] op=sum algorithm=\w+, has not completed after \d+ s", out), out
    assert "not arrived: rank 1" in out, out


def test_uneven_inputs_without_join_end_the_job_naming_join():
    """The rank out of batches shuts down; the other raises at once, not after the
    watchdog's timeout (Note [A rank that has shut down] in csrc/shm.c)."""
    proc = body(2, "body_uneven.py", env={"MPIDP_TIMEOUT_S": "120"}, timeout_s=60)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert re.search(r"mpidp: rank 1 of 2 on \S+: uncaught CommunicationError: rank 1: "
                     r"allreduce failed: rank 0 has shut down \(mpidp.shutdown, or the end of "
                     r"its script\) without reaching this collective, .* If ranks run "
                     r"different numbers of batches, wrap the training loop in "
                     r"`with model.join\(\):`", out), out


def test_monitored_barrier_names_the_late_rank():
    proc = body(2, "body_dist_faults.py", env=NO_MASTER, extra=["monitored"], timeout_s=60)
    assert_ok(proc, 2)
    assert "caught 0: Ranks 1 failed to pass monitoredBarrier in 1000 ms" in proc.stdout, \
        proc.stdout
    assert "caught 1: Rank 1 successfully reached monitoredBarrier, but received errors while " \
        "waiting for send/recv from rank 0" in proc.stdout, proc.stdout


def test_a_groups_timeout_raises_naming_the_operation_and_the_late_rank():
    proc = body(3, "body_dist_faults.py", env=NO_MASTER, extra=["timeout"], timeout_s=90)
    assert_ok(proc, 3)
    caught = re.search(r"caught 0 ([\d.]+) DistBackendError: mpidp: rank 0: process group \S+ "
                       r"of ranks \[0, 2\]: barrier timed out: after the timeout of 1 s, rank 2 "
                       r"had not reached it\. A collective cannot be taken back", proc.stdout)
    assert caught and 1.0 <= float(caught.group(1)) <= 4.5, proc.stdout
    assert re.search(r"after 0: DistBackendError: mpidp: rank 0: process group \S+ of ranks "
                     r"\[0, 2\] is unusable: barrier timed out", proc.stdout), proc.stdout
    # the late rank passes or times out: Note [A group's timeout]
    assert re.search(r"(passed|caught) 2 ", proc.stdout), proc.stdout


def test_torchs_barrier_timeout_semantics():
    proc = body(2, "body_dist_faults.py", env=NO_MASTER, extra=["torch_timeout"], timeout_s=90)
    assert_ok(proc, 2)
    assert "caught 0 matched=True early=False: mpidp: rank 0: process group" in proc.stdout, \
        proc.stdout
    own = re.search(r"barrier timeout 0 ([\d.]+): .* barrier timed out: after the timeout of "
                    r"0\.5 s, rank 1 had not reached it", proc.stdout)
    assert own and 0.4 <= float(own.group(1)) <= 3.0, proc.stdout
    assert "caught 1" not in proc.stdout, proc.stdout
