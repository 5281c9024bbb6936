"""Tier 2: ``python -m mpidp.train`` under mpiexec -n 1, 2, 3 — the default run's accuracy,
what the user sees, central == mirrored, kill-and-resume equality, bad input refused in one
line (every case in one process: tests/unit/test_train_refusals.py)."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from file_faults import flip_bytes_in_a_tensor, small_tmpfs
from mpidp.train import checkpoint
from mpidp.workloads import data
from mpirun import BODIES, ROOT, Job, assert_ok, body, mpiexec, run

USER = {"PYTHONPATH": str(BODIES)}  # tests/mpi/bodies/user_factories.py
END_S = 10  # a job signalled with --checkpoint-on-signal ends within this


# on a GPU host --device auto would move mirrored to the GPU and leave central and ps on the
# CPU: these tests compare runs bit for bit, so they stay on the CPU there (tests/gpu/test_gpu.py
# trains on the GPU)
ON_CPU = ("--device", "cpu") if torch.cuda.is_available() else ()


def train(n, *flags, env=None, timeout_s=180, supervised=None):
    """``python -m mpidp.train flags`` on n ranks; ``supervised``: under the supervisor (python
    -m mpidp.run) with these options."""
    device = () if "--device" in flags else ON_CPU
    return run(n, ["-m", "mpidp.train", *map(str, flags), *device], env=env,
               timeout_s=timeout_s, supervised=supervised)


def summary_of(proc):
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{(proc.stdout + proc.stderr)[-6000:]}"
    lines = [json.loads(l) for l in proc.stdout.splitlines() if l.startswith("{")]
    assert len(lines) == 1 and lines[0]["event"] == "summary", proc.stdout
    return lines[0]


def model_of(path):
    return torch.load(path, weights_only=True)["model"]


_default = {}


def default_run():
    """``mpiexec -n 2 python -m mpidp.train`` with no flags and its seconds, once per session:
    what a user sees, and the mirrored reference of the parameter server's accuracy."""
    if not _default:
        t0 = time.monotonic()
        proc = train(2)
        _default["run"] = proc, time.monotonic() - t0
    return _default["run"]


def test_default_run_trains_digits_to_95_percent():
    proc, elapsed = default_run()
    s = summary_of(proc)
    assert s["final_accuracy"] >= 0.95, s
    assert (s["strategy"], s["ranks"], s["dataset"], s["model"]) == ("mirrored", 2, "digits", "mlp")
    assert s["samples_per_s"] > 0 and 0 <= s["wait_fraction"] <= 1 and s["total_s"] < elapsed
    epochs = [l for l in proc.stdout.splitlines() if l.startswith("epoch")]
    assert len(epochs) == 20 and epochs[-1].startswith("epoch  20/20")  # rank 0 only
    assert "held-out acc" in epochs[0] and "samples/s" in epochs[0] and "comm" in epochs[0]
    assert "[rank 1]" not in proc.stdout
    print(f"default run: {100 * s['final_accuracy']:.2f}% in {elapsed:.1f} s")


def test_the_synthetic_default_converges(tmp_path):
    """settings.DEFAULT_LR: the synthetic set with every default (2 ranks, 20 epochs) trains
    down and stays down (with the digits' lr it diverged: 46% -> 11% held out by epoch 30)."""
    log = tmp_path / "log.jsonl"
    s = summary_of(train(2, "--dataset", "synthetic", "--no-progress", "--log-json", log))
    losses = [e["train_loss"] for e in map(json.loads, log.read_text().splitlines())
              if e["event"] == "epoch"]
    assert len(losses) == 20 and losses[-1] < 0.01 and max(losses[5:]) < losses[0] / 10, losses
    assert s["final_accuracy"] > 0.6, s
    from mpidp import report  # the real run's log drawn (python -m mpidp.report)
    assert report.main([str(log)]) == 0
    assert (tmp_path / "log.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("n,epochs,model", [(1, 4, "mlp"), (3, 2, "cnn")])
def test_json_log_has_every_rank_and_a_summary(n, epochs, model, tmp_path):
    """Every epoch's event holds every rank's figures; held-out accuracy only for the epochs
    --eval-every 2 scores (the fourth too, on one rank)."""
    log = tmp_path / "log.jsonl"
    s = summary_of(train(n, "--epochs", epochs, "--log-json", log, "--no-progress",
                         "--model", model, "--eval-every", 2))
    # a "straggler" event may come too where one of the oversubscribed ranks lags (tested below)
    events = [e for e in map(json.loads, log.read_text().splitlines())
              if e["event"] != "straggler"]
    assert [e["event"] for e in events] == ["epoch"] * epochs + ["summary"]
    for e in events[:epochs]:
        assert [r["rank"] for r in e["ranks"]] == list(range(n))
        assert all(r["compute_s"] > 0 and r["wait_s"] >= 0 for r in e["ranks"])
        assert sum(r["samples"] for r in e["ranks"]) == -(-1438 // n) * n  # padded shards
    assert [e["test_accuracy"] is not None for e in events[:epochs]] == \
        [False, True] * (epochs // 2)
    assert events[epochs] == s


def test_verbose_logs_from_every_rank():
    proc = train(2, "--epochs", 1, "--verbose", "--no-progress")
    summary_of(proc)
    assert "[rank 0] epoch" in proc.stdout and "[rank 1] epoch" in proc.stdout


@pytest.mark.parametrize("n", [2, 3])
def test_central_ends_with_the_parameters_of_mirrored(n, tmp_path, tmp_path_factory):
    """On 2 ranks the kill tests' uninterrupted runs (RESUMABLE: Adam, whose state the root
    alone holds under central, 3 epochs; the mirrored one made once per session, shared with
    them) end bit for bit equal; on 3 ranks plain SGD over 2 epochs, to rounding."""
    if n == 2:
        runs = {k: uninterrupted(2, k, tmp_path_factory) for k in ("mirrored", "central")}
    else:
        runs = {}
        for strategy in ("mirrored", "central"):
            runs[strategy] = summary_of(train(n, "--strategy", strategy, "--optimizer", "sgd",
                                              "--epochs", 2, "--no-progress",
                                              "--checkpoint-dir", tmp_path / strategy))
    a, b = (model_of(runs[k]["checkpoint"]) for k in ("mirrored", "central"))
    assert a.keys() == b.keys()
    if n == 2:  # a sum of two is exact in any order: bit for bit
        assert runs["mirrored"]["parameters_sha256"] == runs["central"]["parameters_sha256"]
        assert all(torch.equal(a[k], b[k]) for k in a)
    else:  # three ranks: MPI_Reduce and our all-reduce may add in another order
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


RESUMABLE = ("--dataset", "user_factories:dying_digits", "--epochs", 3, "--checkpoint-every",
             10, "--optimizer", "adam", "--no-progress")
# PowerSGD's state (every rank's error feedback, the Q's) and ZeRO's sharded optimizer state
# must resume too (PowerSGD with a seed whose seeding once overflowed)
MODES = {"mirrored": ("--strategy", "mirrored"), "central": ("--strategy", "central"),
         "powersgd": ("--compression", "powersgd", "--powersgd-rank", 2,
                      "--powersgd-start-step", 5, "--seed", 12345),
         "zero": ("--zero",),
         "async": ("--async-checkpoint", "--dataset", "user_factories:slowly_written_digits")}
_uninterrupted = {}


def uninterrupted(n, strategy, tmp_path_factory):
    """The reference run of a (ranks, mode of MODES), made once per session."""
    strategy = "mirrored" if strategy == "async" else strategy  # it trains as mirrored
    if (n, strategy) not in _uninterrupted:
        d = tmp_path_factory.mktemp(f"uninterrupted-{n}-{strategy}")
        _uninterrupted[n, strategy] = summary_of(train(n, *RESUMABLE, *MODES[strategy],
                                                       "--checkpoint-dir", d, env=USER))
    return _uninterrupted[n, strategy]


# (ranks, strategy, the rank that dies, at which of its items, the checkpoint resumed from):
# 2 ranks take 23 steps of 32 per epoch, 3 ranks 15; checkpoints every 10 steps and at each
# epoch's end, so each crash falls in epoch 2 with a mid-epoch checkpoint to go back to (the
# first item is read once at start-up, for the input shape). Rank 0 (the writer) dies under
# --zero, a rank of three under --compression powersgd: both are mirrored underneath, with
# their own state to resume. Under --async-checkpoint rank 1 dies 5 steps after checkpoint 30
# was handed to rank 0's writer, which is still writing it (user_factories.
# slowly_written_digits holds that write open): the job's end cuts it short, checkpoint 23
# (the epoch's end) is the newest whole one, and the run resumed from it ends as the
# uninterrupted (synchronous) one (Note [Asynchronous checkpoints]). The chaos suite
# (tests/mpi/test_chaos.py) faults random ranks of mirrored (there with asynchronous
# checkpoints), central and ps runs at random moments and resumes them bit-exact too.
# ZeRO and PowerSGD run under the supervisor (python -m mpidp.run, issue 30): it relaunches
# the killed job with --resume itself (the fault strikes once: FAULT_ONCE_FILE); the
# asynchronous row is resumed by hand, after its half-written checkpoint is looked at.
KILLS = [(2, "async", 1, 1 + 719 + 11 * 32 + 5, "ckpt-000000023.pt"),
         (2, "zero", 0, 1 + 719 + 11 * 32 + 5, "ckpt-000000030.pt"),
         (3, "powersgd", 2, 1 + 480 + 11 * 32 + 5, "ckpt-000000020.pt")]
SUPERVISED = ("--max-restarts", 1)


def once(tmp_path_factory):
    """A FAULT_ONCE_FILE path of its own (tests/mpi/bodies/user_factories.inject)."""
    return tmp_path_factory.mktemp("fault") / "struck"


def relaunched(proc, n, resume_file):
    """The supervisor's line for one relaunch of a killed job on ``n`` ranks from
    ``resume_file`` (Note [Supervising a run] in mpidp/run/supervisor.py) is in its output."""
    assert re.search(r"^mpidp\.run: the job failed after [\d.]+ s \(exit \d+: a rank was "
                     rf"killed \(SIGKILL\)\); restart 1 of 1: {n} rank\(s\), from "
                     rf"{re.escape(resume_file)}$", proc.stdout + proc.stderr, re.M), \
        (proc.stdout + proc.stderr)[-6000:]


@pytest.mark.parametrize("n,strategy,victim,item,resume_file", KILLS,
                         ids=[f"n{k[0]}-{k[1]}-rank{k[2]}" for k in KILLS])
def test_sigkill_then_resume_ends_bitwise_equal(n, strategy, victim, item, resume_file,
                                                tmp_path, tmp_path_factory):
    reference = uninterrupted(n, strategy, tmp_path_factory)
    flags = (*RESUMABLE, *MODES[strategy], "--checkpoint-dir", tmp_path)
    dying = dict(USER, DIE_RANK=str(victim), DIE_AT_ITEM=str(item), SLOW_WRITE_AT="30")
    if strategy == "async":
        killed = train(n, *flags, env=dying)
        out = killed.stdout + killed.stderr
        assert killed.returncode != 0 and "Killed" in out and '"event": "summary"' not in out
        # checkpoint 30 cut short mid-write: its temporary file is left
        assert not (tmp_path / "ckpt-000000030.pt").exists()
        assert [p.name for p in tmp_path.glob(".ckpt-000000030.pt.tmp-*")], \
            list(tmp_path.iterdir())
        digest = checkpoint.read(tmp_path / resume_file).sha256[:12]  # (rotated by resume)
        proc = train(n, *flags, "--resume", env=USER)
        assert f"resuming from {tmp_path / resume_file} (sha256 {digest}): epoch 2, step" \
            in proc.stdout
    else:
        proc = train(n, *flags, env=dict(dying, FAULT_ONCE_FILE=str(once(tmp_path_factory))),
                     supervised=SUPERVISED)
        relaunched(proc, n, resume_file)
    resumed = summary_of(proc)
    assert resumed["resumed_from"] == str(tmp_path / resume_file)
    assert resumed["parameters_sha256"] == reference["parameters_sha256"]
    a, b = model_of(resumed["checkpoint"]), model_of(reference["checkpoint"])
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not list(tmp_path.glob(".*.tmp-*"))  # the resumed run removed what was left
    if strategy == "zero":  # on 2 ranks ZeRO's reduce-scatter adds as the all-reduce does
        assert reference["parameters_sha256"] == \
            uninterrupted(n, "mirrored", tmp_path_factory)["parameters_sha256"]
        assert len(resumed["zero_optimizer_state_bytes"]) == n
    if strategy == "zero":
        return  # the rest is the loop's, the same as mirrored's, which checks it
    # resuming the finished run trains nothing and changes nothing (PowerSGD resumed with
    # another rank: its Q's do not fit, which one line says, and start afresh)
    other = ("--powersgd-rank", 1) if strategy == "powersgd" else ()
    again = train(n, *flags, *other, "--resume", env=USER)
    assert summary_of(again)["parameters_sha256"] == reference["parameters_sha256"]
    assert "is the end of the run: nothing left to train" in again.stdout
    if other:
        assert "\nthe checkpoint's PowerSGD state does not fit these settings (another " \
            "--powersgd-rank or number of ranks): what does not fit starts afresh\n" in \
            again.stdout


def _checkpoint_line(proc_or_text, signame):
    """The one line of a run that checkpointed on ``signame``, and the checkpoint it names."""
    text = proc_or_text if isinstance(proc_or_text, str) \
        else proc_or_text.stdout + proc_or_text.stderr
    lines = [l for l in text.splitlines()
             if l.startswith(f"mpidp.train: checkpoint written on {signame}: ")]
    assert len(lines) == 1 and "Traceback" not in text, text[-6000:]
    path = Path(re.search(r"on \w+: (\S+); resume with: mpiexec -n 2 ", lines[0]).group(1))
    assert path.exists() and lines[0].endswith(" --checkpoint-on-signal --resume"), lines[0]
    return path


def _resume_ends_as_uninterrupted(flags, path, reference, env=USER):
    proc = train(2, *flags, "--resume", env=env)
    resumed = summary_of(proc)
    assert resumed["resumed_from"] == str(path), proc.stdout
    assert resumed["parameters_sha256"] == reference["parameters_sha256"]


def test_sigusr1_to_mpiexec_checkpoints_then_resume_ends_bitwise_equal(tmp_path,
                                                                        tmp_path_factory):
    """--checkpoint-on-signal (Note [Checkpoint on signal] in mpidp/train/on_signal.py): SIGUSR1
    to mpiexec, which Hydra forwards to every rank, once the run has written its first
    checkpoint: every rank stops at one step, a checkpoint is written, the job ends with
    exit code 138 within END_S and one line naming it; --resume from it ends with the
    parameters of an uninterrupted run."""
    reference = uninterrupted(2, "mirrored", tmp_path_factory)
    flags = (*RESUMABLE, "--dataset", "user_factories:slow_digits", "--checkpoint-dir",
             tmp_path, "--checkpoint-on-signal")
    log = tmp_path.parent / f"{tmp_path.name}.out"
    env = dict(os.environ, PYTHONUNBUFFERED="1", **USER)
    with open(log, "w") as out:
        proc = subprocess.Popen([mpiexec(), "-n", "2", sys.executable, "-m", "mpidp.train",
                                 *map(str, flags)], stdout=out, stderr=subprocess.STDOUT,
                                env=env, cwd=ROOT,
                                start_new_session=True)
    try:
        t0 = time.monotonic()
        while not (tmp_path / "ckpt-000000010.pt").exists():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() - t0 < 60, "no checkpoint in 60 s"
            time.sleep(0.02)
        proc.send_signal(signal.SIGUSR1)
        proc.wait(timeout=END_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = log.read_text()
    assert proc.returncode == 138 and '"event": "summary"' not in text, text[-6000:]
    path = _checkpoint_line(text, "SIGUSR1")
    assert 10 < checkpoint.read(path).state["global_step"] < 69, path
    _resume_ends_as_uninterrupted(flags, path, reference, env=dict(USER, SLOW_S="0"))


def test_a_signal_on_one_rank_stops_every_rank_at_one_step(tmp_path, tmp_path_factory):
    """SIGUSR1 reaches rank 1 alone, while it fetches batch 11 of epoch 2 (global step 35):
    the per-step agreement stops rank 0 too, after that same step, with its checkpoint."""
    reference = uninterrupted(2, "mirrored", tmp_path_factory)
    flags = (*RESUMABLE, "--dataset", "user_factories:faulty_digits", "--checkpoint-dir",
             tmp_path, "--checkpoint-on-signal")
    proc = train(2, *flags, env=dict(USER, FAULT="usr1", FAULT_RANK="1",
                                     FAULT_AT=str(1 + 719 + 11 * 32 + 5)), timeout_s=60)
    assert proc.returncode == 138, proc.stdout + proc.stderr
    path = _checkpoint_line(proc, "SIGUSR1")
    assert path == tmp_path / "ckpt-000000035.pt"
    state = checkpoint.read(path).state
    assert (state["epoch"], state["step_in_epoch"]) == (1, 12)
    _resume_ends_as_uninterrupted(flags, path, reference)


SGD_EPOCH = ("--optimizer", "sgd", "--lr-scaling", "none", "--epochs", 1, "--no-progress")
_sgd_epoch = {}


def sgd_epoch(tmp_path_factory):
    """The summary of one epoch of plain SGD on 2 ranks in batches of 32 (SGD_EPOCH), made
    once per session: what one rank on the concatenated batch and the local strategies
    meeting after every step must end as."""
    if not _sgd_epoch:
        d = tmp_path_factory.mktemp("sgd-epoch")
        _sgd_epoch["summary"] = summary_of(train(2, *SGD_EPOCH, "--batch-size", 32,
                                                 "--checkpoint-dir", d))
    return _sgd_epoch["summary"]


def test_n_ranks_equal_one_rank_on_the_concatenated_batch(tmp_path, tmp_path_factory):
    """Rank r's batch k is every n-th sample of the one-rank batch k of n times the size."""
    one = summary_of(train(1, *SGD_EPOCH, "--batch-size", 64, "--checkpoint-dir",
                           tmp_path / "1"))
    two = sgd_epoch(tmp_path_factory)
    a, b = model_of(one["checkpoint"]), model_of(two["checkpoint"])
    for k in a:  # same samples, same steps; only the order of additions differs
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)
    assert one["global_step"] == two["global_step"] == 23


def test_amp_fp16_and_async_checkpoints_resume_exactly(tmp_path):
    """Note [Training device], Note [Asynchronous checkpoints]: --amp fp16 (autocast on the
    CPU, a gradient scaler) with checkpoints written in the background; the checkpoint holds
    the scaler's state, and a resume from step 30 ends bit for bit as the run did."""
    flags = ("--amp", "fp16", "--async-checkpoint", "--epochs", 2, "--checkpoint-every", 10,
             "--no-progress", "--checkpoint-dir", tmp_path)
    whole = summary_of(train(2, *flags))
    assert (whole["amp"], whole["device"]) == ("fp16", "cpu") and whole["final_accuracy"] > 0.8
    assert 0 < whole["checkpoint_wait_s"] < whole["total_s"]
    saved = torch.load(tmp_path / "ckpt-000000030.pt", weights_only=True)
    assert saved["amp_scaler"]["scale"] > 0 and saved["settings"]["amp"] == "fp16"
    end = torch.load(tmp_path / "ckpt-000000046.pt", weights_only=True)["amp_scaler"]
    for later in ("ckpt-000000040.pt", "ckpt-000000046.pt"):
        (tmp_path / later).unlink()
    resumed = summary_of(train(2, *flags, "--resume"))
    assert resumed["resumed_from"] == str(tmp_path / "ckpt-000000030.pt")
    assert resumed["parameters_sha256"] == whole["parameters_sha256"]
    # the scaler resumed too: its growth tracker counts every step since the last backoff
    assert torch.load(resumed["checkpoint"], weights_only=True)["amp_scaler"] == end


def test_resume_on_another_number_of_ranks_takes_each_sample_once(tmp_path):
    """Note [Resuming on another number of ranks]: 46 samples in batches of 4, --amp bf16. A
    run on 2 ranks (6 steps an epoch) is resumed from its checkpoint after step 2 (sample
    cursor 16) on 3 ranks, and that run from its checkpoint after step 4 (cursor 16 + 2·3·4)
    on 2 again: the samples each took before the checkpoint it was resumed from, and what the
    last took after, make up the data set, each sample once; each log says what changed; the
    next epoch is sharded over the new number; the steps add up."""
    flags = ("--dataset", "user_factories:recorded_digits", "--batch-size", 4, "--epochs", 2,
             "--checkpoint-every", 2, "--keep-checkpoints", 9, "--amp", "bf16", "--no-progress")

    def run(n, name, resume_from=None):
        d, log = tmp_path / name, tmp_path / f"{name}-samples"
        d.mkdir(mode=0o700)
        log.mkdir()
        if resume_from is not None:
            (d / resume_from.name).write_bytes(resume_from.read_bytes())
        proc = train(n, *flags, "--checkpoint-dir", d, *(("--resume",) if resume_from else ()),
                     env=dict(USER, SAMPLE_LOG_DIR=str(log)))
        s = summary_of(proc)
        assert s["amp"] == "bf16"
        return d, [[int(l) for l in f.read_text().split()][1:]  # without the start-up item
                   for f in sorted(log.iterdir())], s, proc.stdout

    a, a_took, *_ = run(2, "a")
    b, b_took, _, b_out = run(3, "b", a / "ckpt-000000002.pt")
    _, c_took, c, c_out = run(2, "c", b / "ckpt-000000004.pt")
    taken = [i for r in a_took for i in r[:2 * 4]] + [i for r in b_took for i in r[:2 * 4]] + \
        [i for r in c_took for i in r[:3]]
    assert sorted(taken) == list(range(46))
    assert [len(r) for r in c_took] == [3 + 23] * 2  # the rest, then a whole epoch each
    assert {i for r in c_took for i in r[3:]} == set(range(46))
    assert c["global_step"] == 4 + 1 + 6
    for out, n, m, rest, at, new in ((b_out, 2, 3, 30, 16, "; rank 2 starts its generator "
                                      "from --seed"), (c_out, 3, 2, 6, 40, "")):
        assert (f"the checkpoint was written by {n} ranks, this run has {m}: the rest of the "
                f"epoch ({rest} of 46 samples, from position {at}) shared out over {m}; "
                f"--lr-scaling linear now counts {m} ranks{new}\n") in out, out


def test_corrupt_checkpoint_is_reported_and_the_previous_one_used(tmp_path, tmp_path_factory):
    """8 bytes inverted inside a tensor of the newest checkpoint (torch.load alone would take
    them): one warning names it, the run resumes from the previous one, printing its digest,
    and ends as an uninterrupted run does. The checkpoints are copies of the uninterrupted
    2-rank run's last ones (50, 60, 69; the kill tests' reference, made once per session):
    69 damaged, the run resumes from 60 and ends as that run did."""
    reference = uninterrupted(2, "mirrored", tmp_path_factory)
    for old in Path(reference["checkpoint"]).parent.glob("ckpt-*.pt"):
        (tmp_path / old.name).write_bytes(old.read_bytes())
    *_, previous, newest = sorted(tmp_path.glob("ckpt-*.pt"))
    digest = checkpoint.read(previous).sha256[:12]  # read now: the resumed run may rotate it
    flip_bytes_in_a_tensor(newest)
    proc = train(2, *RESUMABLE, "--checkpoint-dir", tmp_path, "--resume", env=USER)
    s = summary_of(proc)
    warnings = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(warnings) == 1 and warnings[0].startswith(
        f"mpidp.train: warning: checkpoint {newest} is corrupt: its SHA-256 is"), proc.stderr
    assert f"resuming from {previous} (sha256 {digest}): epoch 3, step 14" in proc.stdout
    assert s["resumed_from"] == str(previous) and previous.name == "ckpt-000000060.pt"
    assert s["parameters_sha256"] == reference["parameters_sha256"]


def test_retention_keeps_the_resumed_and_written_checkpoints_past_damaged_and_planted_files(
        tmp_path, tmp_path_factory):
    """Note [Checkpoint retention], the reported case: the uninterrupted 2-rank run's last
    checkpoints (50, 60, 69), the newest damaged and a symlink planted at 999, resumed on 3
    ranks keeping 1 (checkpoints at 62, 64, 66): the resume passes over 999 and 69 and
    continues from 60; each save deletes only this run's older usable checkpoints (50, 62,
    64), never the one resumed from nor the one written; 999 and 69 are left and named once;
    the last line's checkpoint exists and the next resume takes it."""
    reference = uninterrupted(2, "mirrored", tmp_path_factory)
    d = tmp_path / "ck"
    d.mkdir(mode=0o700)
    for old in Path(reference["checkpoint"]).parent.glob("ckpt-*.pt"):
        (d / old.name).write_bytes(old.read_bytes())
    assert sorted(p.name for p in d.iterdir()) == [f"ckpt-0000000{s}.pt" for s in (50, 60, 69)]
    flip_bytes_in_a_tensor(d / "ckpt-000000069.pt")
    (d / "ckpt-000000999.pt").symlink_to(d / "ckpt-000000060.pt")
    proc = train(3, *RESUMABLE, "--checkpoint-every", 2, "--keep-checkpoints", 1,
                 "--checkpoint-dir", d, "--resume", env=USER)
    s = summary_of(proc)
    assert s["resumed_from"] == str(d / "ckpt-000000060.pt") and s["global_step"] == 66
    assert proc.stdout.splitlines()[-1].endswith(f"; checkpoint {d}/ckpt-000000066.pt")
    assert sorted(p.name for p in d.iterdir()) == [f"ckpt-000000{s}.pt" for s in
                                                   ("060", "066", "069", "999")]
    left = [l for l in proc.stdout.splitlines() if "left in place" in l]
    end = "; left in place, not counted toward --keep-checkpoints"
    assert left == [f"checkpoint {d}/ckpt-000000{s}.pt is ahead of this run (step {int(s)}; "
                    f"this run has written step 62){end}" for s in ("999", "069")], proc.stdout
    skipped = []
    again = checkpoint.load_latest(d, skipped.append, checkpoint.KEYS)
    assert again.path == d / "ckpt-000000066.pt" and len(skipped) == 2, skipped


def test_a_full_disk_ends_the_job_with_one_line(tmp_path):
    """The second checkpoint does not fit: one line names the file and the cause, the job
    ends (exit code 3: a relaunch would fail the same way, Note [Exit codes] in
    mpidp/runtime/exit.py), no temporary is left, and the first checkpoint is whole."""
    with small_tmpfs(tmp_path / "small", size="1536k") as small:  # one checkpoint fits
        proc = train(2, "--epochs", 1, "--checkpoint-every", 10, "--optimizer", "adam",
                     "--no-progress", "--checkpoint-dir", small)
        assert proc.returncode == 3, proc.stdout + proc.stderr
        ours = [l for l in proc.stderr.splitlines() if l.startswith("mpidp")]
        assert ours == [f"mpidp.train: error: rank 0: cannot write checkpoint "
                        f"{small}/ckpt-000000020.pt: No space left on device; aborting the "
                        "job"], proc.stderr
        assert "Traceback" not in proc.stderr and os.listdir(small) == ["ckpt-000000010.pt"]
        assert checkpoint.read(small / "ckpt-000000010.pt").state["global_step"] == 10


def test_a_second_run_on_a_supervised_runs_directory_is_refused(tmp_path):
    """The issue's two runs on one directory (Note [One run per directory] in mpidp/run_lock.py):
    run A under the supervisor, its job writing checkpoints into the directory the
    supervisor holds; a second supervisor, and a plain run on 2 ranks with --seed 7, on the
    same directory and log are each refused in one line naming A's supervisor, exit 2 (every
    rank ends); A goes on, and ends on Ctrl-C as a supervised run does, letting go of both."""
    d, log = tmp_path / "ck", tmp_path / "log.jsonl"
    flags = ["-m", "mpidp.train", *ON_CPU, "--dataset", "user_factories:slow_digits",
             "--epochs", 100, "--checkpoint-every", 10, "--checkpoint-dir", d, "--log-json",
             log, "--no-progress"]
    with Job(1, flags, tmp_path / "a.out", env=USER, supervised=[]) as a:
        a.wait_for(lambda: (d / "ckpt-000000010.pt").exists(), 120)
        again = run(1, [*flags, "--seed", 7], env=USER, supervised=[], timeout_s=60)
        plain = train(2, *flags[2:], "--seed", 7, env=USER)
        assert a.proc.poll() is None, a.text[-4000:]
        a.proc.send_signal(signal.SIGINT)
        assert a.wait(60) == 130, a.text[-4000:]
    holder = rf"is in use by another run \(pid {a.proc.pid} on [^,]+, since [-0-9 :]+: " \
        rf"\S+ -m mpidp\.run -n 1 -- .*\): wait for it to end, or choose another"
    assert again.returncode == 2, again.stdout + again.stderr
    assert re.fullmatch(rf"mpidp\.run: error: --checkpoint-dir {d} {holder}\n", again.stderr), \
        again.stderr
    ours = [l for l in plain.stderr.splitlines() if l.strip()]
    assert plain.returncode == 2 and len(ours) == 1, plain.stdout + plain.stderr
    assert re.fullmatch(rf"mpidp\.train: error: --checkpoint-dir {d} {holder}", ours[0]), ours
    events = [json.loads(l)["event"] for l in log.read_text().splitlines()]
    assert events.count("supervised") == 1 and "summary" not in events, events  # A's alone
    assert not (d / ".mpidp-lock").exists()
    assert not (tmp_path / ".log.jsonl.lock").exists()


# Every bad input refused before the first training collective is checked in one process
# (tests/unit/test_train_refusals.py: each flag's line, exit code 2, nothing created); these
# run the whole path under mpiexec: refused by argparse before MPI starts, by the ranks'
# agreement after mpidp.init (a ps job before its banner), by rank 0's check of its outputs
# in Trainer.fit (creating nothing) — one line from rank 0 alone, exit code 2, no traceback.
BAD = [
    (2, ("--epochs", "many"), "argument --epochs: invalid int value: 'many'"),
    (2, ("--strategy", "ps", "--num-ps", 2), "--num-ps 2 needs at least 3 ranks"),
    (2, ("--resume", "--checkpoint-dir", "{tmp}/new"), "--checkpoint-dir {tmp}/new does not "
     "exist, so there is nothing to continue"),
]


@pytest.mark.parametrize("n,flags,message", BAD, ids=[" ".join(map(str, b[1])) for b in BAD])
def test_bad_input_is_one_line_and_exit_code_2(n, flags, message, tmp_path):
    flags = [str(f).replace("{tmp}", str(tmp_path)) for f in flags]
    proc = train(n, *flags, env=USER, timeout_s=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(errors) == 1, proc.stderr  # one line, from rank 0 only
    assert errors[0].startswith("mpidp.train: error: ") and \
        message.replace("{tmp}", str(tmp_path)) in errors[0], errors[0]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not (tmp_path / "new").exists()  # nothing created by a command that fails
    assert "worker(s)" not in proc.stdout  # a ps job is refused before its banner counts them


def test_a_bad_setting_is_one_line_and_exit_code_2():
    """Note [Settings read at init] in mpidp/config.py: mpidp.init reads them, not an import,
    and raises on every rank; the tool says it in one line (this one needs the group; every
    variable's parsing: tests/unit/test_config_launcher.py; the tool's line for each:
    tests/unit/test_train_refusals.py)."""
    variable, value = "MPIDP_EMULATE_NODE_SIZE", "7"
    proc = train(2, "--epochs", 1, env={variable: value}, timeout_s=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(errors) == 1, proc.stderr  # one line, from rank 0 only
    assert errors[0].startswith(f"mpidp.train: error: {variable}={value!r}: ") and \
        "more than the 2 rank(s) of the group" in errors[0], errors[0]
    assert "Traceback" not in proc.stdout + proc.stderr


def test_a_terminal_gets_whole_lines_in_order(tmp_path):
    """Note [One stream]: under a pseudo-terminal (as a person runs it) every line rank 0
    shows arrives whole and in order — the start line, the banner, progress lines within the
    3 s epoch, the epoch line, the summary and the last line a person reads — with no
    carriage-return redraws."""
    import pty
    primary, secondary = pty.openpty()
    env = dict(os.environ, PYTHONPATH=str(BODIES), SLOW_S="0.004")
    proc = subprocess.Popen([mpiexec(), "-n", "2", sys.executable, "-m", "mpidp.train",
                             "--dataset", "user_factories:slow_digits", "--epochs", "1",
                             "--log-json", str(tmp_path / "run.jsonl"), *ON_CPU],
                            stdin=secondary, stdout=secondary, stderr=secondary, env=env,
                            cwd=ROOT, start_new_session=True)
    os.close(secondary)
    chunks = []
    try:
        while True:
            try:
                chunk = os.read(primary, 1 << 16)
            except OSError:  # the terminal closed: every process of the job has ended
                break
            if not chunk:
                break
            chunks.append(chunk)
        proc.wait(timeout=120)
    finally:
        os.close(primary)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = b"".join(chunks).decode()
    assert proc.returncode == 0 and "\r" not in text.replace("\r\n", "\n"), text
    lines = text.replace("\r\n", "\n").splitlines()
    patterns = [r"mpidp\.train: starting \(loading PyTorch, then MPI\)",
                r"mpidp\.train: mirrored on 2 rank\(s\), 1 node\(s\); .* parameters\)",
                r"training on cpu \(.*\), \d+ torch thread\(s\) per rank",
                r"  step \d+/23 of epoch 1/1 \(\d+%\)  loss \d\.\d{4}  [\d,]+ samples/s",
                r"epoch   1/1  train loss \d\.\d{4}  held-out acc +\d+\.\d\d%  [\d,]+ "
                r"samples/s  comm +\d+\.\d%  \d+\.\d\d s",
                # a loaded machine may slow one rank enough for the straggler line, which is
                # ours and whole too (mpidp/train/stragglers.py); it may or may not come
                r"straggler: rank \d on \S+ computes \d+\.\dx as long per sample as the median "
                r"of the other ranks \(epoch 1\); in a synchronous job the others wait for it "
                r"at every step",
                r"\{\"amp\": .*\}",
                r"mpidp\.train: done: \d+\.\d\d% held-out accuracy after 1 epoch on 2 "
                r"rank\(s\); .* samples/s; JSON log .*run\.jsonl"]
    kinds = []
    for line in lines:
        kind = [i for i, p in enumerate(patterns) if re.fullmatch(p, line)]
        assert len(kind) == 1, f"a line not whole or not ours: {line!r}\n{text}"
        kinds.append(kind[0])
    optional = {5}  # the straggler line
    assert kinds == sorted(kinds) and set(kinds) | optional == set(range(len(patterns))), kinds


def test_help_is_printed_once_under_mpiexec():
    proc = train(2, "--help")
    assert proc.returncode == 0 and proc.stdout.count("usage: python -m mpidp.train") == 1
    text = " ".join(proc.stdout.split())
    assert "--device {auto,cpu,cuda}" in text and "(default: None)" not in text
    assert "(default 0.7) (default: 0.7)" not in text and "(default 0.7)" in text


def test_user_model_and_the_python_api():
    summary_of(train(2, "--model", "user_factories:tiny_model", "--epochs", 2, "--no-progress",
                     env=USER))
    assert_ok(body(2, "body_fit.py", env=USER), 2)


@pytest.mark.parametrize("n,servers", [(3, 1), (4, 2)])
def test_parameter_server_trains_as_well_as_mirrored(n, servers, tmp_path):
    def late_accuracy(scores):  # the mean of the last 5 epochs: one epoch's score moves ±1 point
        assert len(scores) == 20, scores
        return sum(scores[15:]) / 5

    log = tmp_path / "ps.jsonl"
    data_set = ("--dataset", "user_factories:ps_faulty_digits")  # the digits; faults on demand
    # with 1 server the workers meet it in shared memory, rank 1 a 2x straggler (the case
    # the parameter server is for: its accuracy still holds); with 2 through MPI windows
    slow = ("--straggler", "1:2") if servers == 1 else ()
    memory = {} if servers == 1 else {"MPIDP_PS_MEMORY": "window"}
    ps = summary_of(train(n, "--strategy", "ps", "--num-ps", servers, "--no-progress",
                          "--log-json", log, "--checkpoint-dir", tmp_path / "ckpt", *data_set,
                          *slow, env=dict(USER, **memory)))
    assert ps["ps_memory"] == ("shared" if servers == 1 else "window")
    # the mirrored reference: the default run's epoch lines (k of the held-out samples right,
    # said to 0.01%, which names k)
    held_out = len(data.digits()[1])
    mirrored = late_accuracy([round(float(p) * held_out / 100) / held_out for p in re.findall(
        r"^epoch +\d+/20 .* held-out acc +(\d+\.\d\d)%", default_run()[0].stdout, re.M)])
    ps_scores = [e["test_accuracy"] for e in map(json.loads, log.read_text().splitlines())
                 if e["event"] == "epoch"]
    assert late_accuracy(ps_scores) >= mirrored - 0.01, (late_accuracy(ps_scores), mirrored)
    assert (ps["workers"], ps["servers"]) == (n - servers, servers)
    assert sum(ps["staleness_histogram"].values()) == ps["pushes"] == 20 * 45  # every batch
    assert len(ps["server_applies"]) == servers and min(ps["server_applies"]) > 0
    for epoch in [e for e in map(json.loads, log.read_text().splitlines())
                  if e["event"] == "epoch"]:  # every worker's share logged, servers take none
        roles = [r["samples"] for r in epoch["ranks"]]
        assert sum(roles) == 1438 and roles[n - servers:] == [0] * servers, epoch
        delays = [r["straggler_delay_s"] > 0 for r in epoch["ranks"]]
        assert delays == [False, bool(slow)] + [False] * (n - 2), epoch
    # checkpoints at epoch ends hold the servers' optimizer state; resume continues the run,
    # here on the other shape: other numbers of workers and servers (the servers' momentum
    # re-cut for the new shard map: Note [Resuming on another number of ranks]), under the
    # supervisor (python -m mpidp.run): a worker (4 ranks) or a server (3 ranks) is killed in
    # the resumed run's first epoch, and the supervisor relaunches it from the same checkpoint
    m, k = {(3, 1): (4, 2), (4, 2): (3, 1)}[n, servers]
    victim, fault = {4: ("0", "kill_push"), 3: ("2", "kill_server")}[m]
    proc = train(m, "--strategy", "ps", "--num-ps", k, "--no-progress", "--epochs", 22,
                 "--checkpoint-dir", tmp_path / "ckpt", "--resume", *data_set,
                 supervised=SUPERVISED,
                 env=dict(USER, FAULT=fault, FAULT_RANK=victim, FAULT_AT="5", FAULT_EPOCH="0",
                          FAULT_ONCE_FILE=str(tmp_path / "struck")))
    relaunched(proc, m, "ckpt-000000900.pt")
    more = summary_of(proc)
    assert more["resumed_from"].endswith("ckpt-000000900.pt") and more["global_step"] == 990
    assert more["final_accuracy"] >= 0.9 and (more["workers"], more["servers"]) == (m - k, k)
    assert f"the checkpoint was written by {n} ranks, this run has {m}: the epochs now " \
        f"shared by {m - k} workers, {k} server(s) (the servers' optimizer state re-cut from " \
        f"{servers})" in proc.stdout


def test_straggler_slows_only_its_rank_and_is_reported(tmp_path):
    """--straggler 1:5: rank 1 alone sleeps 4x its own compute after each step, which every
    epoch event records (its compute_s holds the sleep; how fast the job then runs is
    bench/'s to measure, not a test's), and the report names rank 1 once."""
    log = tmp_path / "log.jsonl"
    proc = train(2, "--epochs", 2, "--straggler", "1:5", "--log-json", log, "--no-progress")
    summary_of(proc)
    events = [json.loads(line) for line in log.read_text().splitlines()]
    epochs = [e for e in events if e["event"] == "epoch"]
    assert len(epochs) == 2
    for e in epochs:
        rank0, rank1 = e["ranks"]
        assert rank0["straggler_delay_s"] == 0 and rank1["straggler_delay_s"] > 0, e
        # slept 4x what it computed, and counted as computing: compute >= 5/4 of the sleep
        assert rank1["compute_s"] >= 1.25 * rank1["straggler_delay_s"] * (1 - 1e-9), e
    # Note [Straggler report]: named once, when it becomes the straggler (epoch 1)
    found = [e for e in events if e["event"] == "straggler"]
    assert [(e["rank"], e["epoch"]) for e in found] == [(1, 1)], found
    assert found[0]["slowdown"] >= 1.5 and found[0]["host"], found  # stragglers.MARGIN
    lines = [l for l in proc.stdout.splitlines() if l.startswith("straggler: ")]
    assert len(lines) == 1 and re.match(r"straggler: rank 1 on \S+ computes \d+\.\dx as long "
                                        r"per sample as the median of the other ranks "
                                        r"\(epoch 1\)", lines[0]), proc.stdout


def test_compression_auto_on_one_node_says_none_and_why():
    proc = train(2, "--compression", "auto", "--epochs", 1, "--no-progress")
    assert summary_of(proc)["compression"] == "none"
    assert "\n--compression auto: none (one node: gradients cross shared memory" in proc.stdout, \
        proc.stdout


def _final_model(proc):
    return model_of(summary_of(proc)["checkpoint"])


def test_localsgd_and_diloco_every_step_are_mirrored(tmp_path, tmp_path_factory):
    """Note [Local steps]: meeting after every step, post-local SGD and DiLoCo (an outer SGD
    of lr 1 without momentum) with SGD train as mirrored — up to rounding: they average
    updated parameters or updates, mirrored averages gradients. (With momentum, whose buffers
    post-local SGD averages too, the runs start 1 ulp apart and drift as rounding does.)"""
    base = SGD_EPOCH  # in batches of 32, as sgd_epoch's mirrored run
    mirrored = model_of(sgd_epoch(tmp_path_factory)["checkpoint"])
    for flags in (("--strategy", "localsgd", "--sync-every", 1),
                  ("--strategy", "diloco", "--sync-every", 1, "--outer-lr", 1,
                   "--outer-momentum", 0)):
        local = _final_model(train(2, *base, *flags, "--checkpoint-dir", tmp_path / flags[1]))
        for k in mirrored:
            torch.testing.assert_close(local[k], mirrored[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("flags", [("--strategy", "localsgd", "--sync-every", 4,
                                    "--local-sgd-warmup-steps", 12, "--model",
                                    "user_factories:batchnorm_model"),
                                   ("--strategy", "diloco", "--sync-every", 4,
                                    "--optimizer", "adam", "--lr", 0.003)],
                         ids=["localsgd", "diloco"])
def test_local_strategies_resume_between_meetings_exactly(flags, tmp_path, tmp_path_factory):
    """Note [Local steps]: checkpoints between meetings change nothing and hold every rank's
    own state: a run checkpointing every 10 steps whose rank 1 is killed in step 13, under the
    supervisor (python -m mpidp.run), which relaunches it from step 10 (the third interval of
    4; localsgd still in its mirrored warm-up there, BatchNorm buffers broadcast, then
    averaged), ends bit for bit as a run that neither checkpoints nor fails. DiLoCo resumed
    with other outer settings takes them."""
    base = (*flags, "--dataset", "user_factories:dying_digits", "--epochs", 1, "--no-progress")
    plain = summary_of(train(2, *base, env=USER))
    d = tmp_path / "killed"
    run_flags = (*base, "--checkpoint-every", 10, "--checkpoint-dir", d)
    proc = train(2, *run_flags, supervised=SUPERVISED,
                 env=dict(USER, DIE_RANK="1", DIE_AT_ITEM=str(1 + 12 * 32 + 5),
                          FAULT_ONCE_FILE=str(once(tmp_path_factory))))
    relaunched(proc, 2, "ckpt-000000010.pt")
    resumed = summary_of(proc)
    assert resumed["resumed_from"] == str(d / "ckpt-000000010.pt"), proc.stdout
    assert resumed["parameters_sha256"] == plain["parameters_sha256"]
    if flags[1] == "diloco":  # this run's outer settings, not the checkpoint's
        saved = torch.load(resumed["checkpoint"], weights_only=True)
        assert saved["optimizer"]["outer"]["param_groups"][0]["lr"] == 0.7
        (d / "ckpt-000000023.pt").unlink()
        (d / "ckpt-000000020.pt").unlink()
        other = summary_of(train(2, *run_flags, "--outer-lr", 0.2, "--resume", env=USER))
        saved = torch.load(other["checkpoint"], weights_only=True)
        assert saved["optimizer"]["outer"]["param_groups"][0]["lr"] == 0.2
        assert other["parameters_sha256"] != plain["parameters_sha256"]


def test_local_sgd_on_fewer_ranks_resumes_the_meeting_checkpoint_retention_kept(tmp_path):
    """Note [Resuming on another number of ranks] and Note [Checkpoint retention]: local SGD
    checkpointing every 2 steps, meeting every 8, keeping one checkpoint: the newest written at
    a meeting (step 16) is kept beside the newest, also across a resume. Rank 1 dies in step
    19 (kept: 16 and 18); resumed on 2 ranks from 18, it dies again in step 21 (kept: 18, the
    one resumed from, 20 and still 16); resumed on 3 ranks, the run passes over 20 and 18 in one
    line each (2 diverged models cannot move to 3 ranks) and continues from 16."""
    flags = ("--strategy", "localsgd", "--sync-every", 8, "--dataset",
             "user_factories:dying_digits", "--epochs", 1, "--no-progress",
             "--checkpoint-every", 2, "--keep-checkpoints", 1, "--checkpoint-dir", tmp_path)

    def kept():
        return sorted(int(p.name[5:14]) for p in tmp_path.glob("ckpt-*.pt"))

    # one item is read at start-up, then 32 a step
    killed = train(2, *flags, env=dict(USER, DIE_RANK="1", DIE_AT_ITEM=str(1 + 18 * 32 + 5)))
    assert killed.returncode != 0 and kept() == [16, 18], (kept(), killed.stdout[-3000:])
    killed = train(2, *flags, "--resume",
                   env=dict(USER, DIE_RANK="1", DIE_AT_ITEM=str(1 + 2 * 32 + 5)))
    assert killed.returncode != 0 and kept() == [16, 18, 20], (kept(), killed.stdout[-3000:])
    proc = train(3, *flags, "--resume", env=USER)
    resumed = summary_of(proc)
    assert resumed["resumed_from"] == str(tmp_path / "ckpt-000000016.pt")
    for step in (20, 18):
        assert f"{tmp_path / f'ckpt-{step:09d}.pt'} holds 2 ranks' own localsgd models " \
            "between meetings, which cannot move to 3 ranks; passed over" in proc.stderr
    assert resumed["ranks"] == 3 and resumed["global_step"] > 16, resumed


def test_resume_says_what_changed_and_meets_when_overdue(tmp_path):
    """Note [What a resume may change] in setup.py: a localsgd checkpoint 7 steps past its last
    meeting (--sync-every 8), resumed with --sync-every 4 and another --lr, --lr-scaling and
    --amp: one line per changed setting and one for the meeting, from rank 0 only, none for the
    checkpointing flags; the ranks meet at once, then every 4 steps (each step's checkpoint
    holds the steps since the last meeting: 1, 2, 3, none at a meeting)."""
    base = ("--strategy", "localsgd", "--epochs", 1, "--no-progress", "--checkpoint-dir",
            tmp_path)
    summary_of(train(2, *base, "--sync-every", 8, "--checkpoint-every", 7,
                     "--keep-checkpoints", 9))
    for later in ("ckpt-000000014.pt", "ckpt-000000021.pt", "ckpt-000000023.pt"):
        (tmp_path / later).unlink()
    assert checkpoint.load(tmp_path / "ckpt-000000007.pt")["comm_hook"]["since"] == 7
    proc = train(2, *base, "--sync-every", 4, "--lr", 0.02, "--lr-scaling", "sqrt",
                 "--amp", "bf16", "--checkpoint-every", 1, "--keep-checkpoints", 30, "--resume")
    assert summary_of(proc)["resumed_from"] == str(tmp_path / "ckpt-000000007.pt")
    lines = proc.stdout.splitlines()
    said = [l for l in lines if l.startswith("resuming with") or "meet" in l]
    assert said == [
        "resuming with --lr 0.02 (the checkpoint was trained with 0.05)",
        "resuming with --lr-scaling sqrt (the checkpoint was trained with linear)",
        "resuming with --sync-every 4 (the checkpoint was trained with 8)",
        "resuming with --amp bf16 (the checkpoint was trained with off)",
        "--strategy localsgd: the checkpoint is 7 steps past the ranks' last meeting and "
        "--sync-every is 4: they meet now"], proc.stdout
    since = [checkpoint.load(tmp_path / f"ckpt-{s:09d}.pt").get("comm_hook", {}).get("since")
             for s in range(8, 24)]
    assert since == [1, 2, 3, None] * 4, since


def test_a_parameter_trained_on_some_ranks_only_is_named_at_the_meeting():
    proc = train(2, "--strategy", "localsgd", "--model", "user_factories:rank_branch_model",
                 "--optimizer", "adam", "--epochs", 1, "--no-progress", env=USER)
    assert proc.returncode != 0
    assert "--strategy localsgd: parameter 'branch.weight' received a gradient on some ranks " \
        "only since the last meeting" in proc.stdout + proc.stderr, proc.stderr[-3000:]
