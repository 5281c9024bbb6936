"""Tier 2: ``python -m mpidp.train`` under mpiexec -n 1, 2, 3 — the default run's accuracy,
what the user sees, central == mirrored, kill-and-resume equality, every bad input."""
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from mpirun import BODIES, assert_ok, body, mpiexec, run

USER = {"PYTHONPATH": str(BODIES)}  # tests/mpi/user_factories.py


def train(n, *flags, env=None, timeout_s=180):
    return run(n, ["-m", "mpidp.train", *map(str, flags)], env=env, timeout_s=timeout_s)


def summary_of(proc):
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{(proc.stdout + proc.stderr)[-6000:]}"
    lines = [json.loads(l) for l in proc.stdout.splitlines() if l.startswith("{")]
    assert len(lines) == 1 and lines[0]["event"] == "summary", proc.stdout
    return lines[0]


def model_of(path):
    return torch.load(path, weights_only=True)["model"]


def test_default_run_trains_digits_to_95_percent():
    t0 = time.monotonic()
    proc = train(2)
    elapsed = time.monotonic() - t0
    s = summary_of(proc)
    assert s["final_accuracy"] >= 0.95, s
    assert (s["strategy"], s["ranks"], s["dataset"], s["model"]) == ("mirrored", 2, "digits", "mlp")
    assert s["samples_per_s"] > 0 and 0 <= s["wait_fraction"] <= 1 and s["total_s"] < elapsed
    epochs = [l for l in proc.stdout.splitlines() if l.startswith("epoch")]
    assert len(epochs) == 20 and epochs[-1].startswith("epoch  20/20")  # rank 0 only
    assert "held-out acc" in epochs[0] and "samples/s" in epochs[0] and "comm" in epochs[0]
    assert "[rank 1]" not in proc.stdout
    print(f"default run: {100 * s['final_accuracy']:.2f}% in {elapsed:.1f} s")


@pytest.mark.parametrize("n", [1, 3])
def test_json_log_has_every_rank_and_a_summary(n, tmp_path):
    log = tmp_path / "log.jsonl"
    s = summary_of(train(n, "--epochs", 2, "--log-json", log, "--no-progress",
                         "--model", "cnn", "--eval-every", 2))
    events = [json.loads(l) for l in log.read_text().splitlines()]
    assert [e["event"] for e in events] == ["epoch", "epoch", "summary"]
    for e in events[:2]:
        assert [r["rank"] for r in e["ranks"]] == list(range(n))
        assert all(r["compute_s"] > 0 and r["wait_s"] >= 0 for r in e["ranks"])
        assert sum(r["samples"] for r in e["ranks"]) == -(-1438 // n) * n  # padded shards
    assert events[0]["test_accuracy"] is None and events[1]["test_accuracy"] is not None
    assert events[2] == s


def test_verbose_logs_from_every_rank():
    proc = train(2, "--epochs", 1, "--verbose", "--no-progress")
    summary_of(proc)
    assert "[rank 0] epoch" in proc.stdout and "[rank 1] epoch" in proc.stdout


@pytest.mark.parametrize("n", [2, 3])
def test_central_ends_with_the_parameters_of_mirrored(n, tmp_path):
    runs = {}
    for strategy in ("mirrored", "central"):
        s = summary_of(train(n, "--strategy", strategy, "--optimizer", "sgd", "--epochs", 2,
                             "--no-progress", "--checkpoint-dir", tmp_path / strategy))
        runs[strategy] = s
    a, b = (model_of(runs[k]["checkpoint"]) for k in ("mirrored", "central"))
    assert a.keys() == b.keys()
    if n == 2:  # a sum of two is exact in any order: bit for bit
        assert runs["mirrored"]["parameters_sha256"] == runs["central"]["parameters_sha256"]
        assert all(torch.equal(a[k], b[k]) for k in a)
    else:  # three ranks: MPI_Reduce and our all-reduce may add in another order
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


def _kill_rank(mark: str, rank: int) -> bool:
    """SIGKILL the rank of the run tagged ``mark`` (found by its environment)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"KILL_TEST_MARK={mark}".encode() in env and f"PMI_RANK={rank}".encode() in env:
            os.kill(int(pid), signal.SIGKILL)
            return True
    return False


RESUMABLE = ("--dataset", "user_factories:slow_digits", "--epochs", 3, "--checkpoint-every", 10,
             "--optimizer", "adam", "--no-progress")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    d = tmp_path_factory.mktemp("uninterrupted")
    return summary_of(train(2, *RESUMABLE, "--checkpoint-dir", d, env=USER))


@pytest.mark.parametrize("victim", [0, 1])
def test_sigkill_then_resume_ends_bitwise_equal(victim, uninterrupted, tmp_path):
    mark = uuid.uuid4().hex
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "mpidp.train", *map(str, RESUMABLE),
           "--checkpoint-dir", str(tmp_path)]
    env = dict(os.environ, KILL_TEST_MARK=mark, **USER)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "ckpt-000000030.pt").exists():  # mid-epoch 2 of 3
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.01)
        assert _kill_rank(mark, victim)
        out = proc.communicate(timeout=60)[0]
    finally:
        proc.kill()
    assert proc.returncode != 0, out
    assert "global_step" not in out  # it did not finish
    resumed = summary_of(train(2, *RESUMABLE, "--checkpoint-dir", tmp_path, "--resume", env=USER))
    assert resumed["resumed_from"] is not None
    assert resumed["parameters_sha256"] == uninterrupted["parameters_sha256"]
    a, b = model_of(resumed["checkpoint"]), model_of(uninterrupted["checkpoint"])
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_corrupt_checkpoint_is_reported_and_the_previous_one_used(uninterrupted, tmp_path):
    flags = ("--epochs", 2, "--checkpoint-every", 10, "--optimizer", "adam", "--no-progress")
    summary_of(train(2, *flags, "--epochs", 1, "--checkpoint-dir", tmp_path))
    newest = sorted(tmp_path.glob("ckpt-*.pt"))[-1]
    newest.write_bytes(newest.read_bytes()[:1000])
    proc = train(2, *flags, "--checkpoint-dir", tmp_path, "--resume")
    s = summary_of(proc)
    assert f"checkpoint {newest} is corrupt or truncated" in proc.stdout + proc.stderr
    assert s["resumed_from"].endswith("ckpt-000000020.pt")
    reference = summary_of(train(2, *flags, "--checkpoint-dir", tmp_path / "ref"))
    assert s["parameters_sha256"] == reference["parameters_sha256"]


BAD = [
    (2, ("--batch-size", 0), "--batch-size must be an integer >= 1, got 0"),
    (2, ("--model", "resnet"), "unknown model 'resnet'"),
    (2, ("--model", "no_such_pkg.models:net"), "cannot import 'no_such_pkg.models'"),
    (2, ("--model", "user_factories:not_a_model"), "returned str, not a torch.nn.Module"),
    (2, ("--dataset", "user_factories:nothing"), "has no 'nothing'"),
    (2, ("--resume", "--checkpoint-dir", "{tmp}"), "--resume: no usable checkpoint in"),
    (2, ("--resume",), "--resume needs --checkpoint-dir"),
    (3, ("--dataset", "synthetic", "--synthetic-samples", 2), "3 ranks but only 2 training"),
    (2, ("--strategy", "ps"), "--strategy ps: the parameter server is not available yet"),
    (2, ("--epochs", "many"), "argument --epochs: invalid int value: 'many'"),
    (1, ("--no-such-flag",), "unrecognized arguments: --no-such-flag"),
]


@pytest.mark.parametrize("n,flags,message", BAD, ids=[" ".join(map(str, b[1])) for b in BAD])
def test_bad_input_is_one_line_and_exit_code_2(n, flags, message, tmp_path):
    flags = [str(f).replace("{tmp}", str(tmp_path)) for f in flags]
    proc = train(n, *flags, env=USER, timeout_s=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(errors) == 1, proc.stderr  # one line, from rank 0 only
    assert errors[0].startswith("mpidp.train: error: ") and message in errors[0], errors[0]
    assert "Traceback" not in proc.stdout + proc.stderr


def test_user_model_and_the_python_api():
    summary_of(train(2, "--model", "user_factories:tiny_model", "--epochs", 2, "--no-progress",
                     env=USER))
    assert_ok(body(2, "body_fit.py", env=USER), 2)
