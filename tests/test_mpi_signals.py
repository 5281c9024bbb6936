"""Tier 2: Ctrl-C and SIGTERM end a job promptly and cleanly (issue 14, item 3).

- The shared-memory wait notices a signal (Note [Interrupting a wait] in csrc/shm.c): a rank
  waiting alone in an all-reduce sends itself SIGINT and must raise KeyboardInterrupt within a
  second (tests/mpi/body_signals.py), for the inline call and the sliced one.
- Shutdown ends and joins DDP's communication thread before it frees the windows that thread
  waits in (Note [Stopping the users first] in mpidp/resources.py).
- ``python -m mpidp.train`` on 2 ranks, signalled through mpiexec at a seeded random moment of
  training (Note [Interrupted run] in mpidp/train/cli.py): the job ends within END_S with exit
  code 128 + the signal's number, no segfault, no traceback, one line naming the newest good
  checkpoint and the --resume command, and no process of it left. MPIDP_TEST_INTERRUPTS runs
  (default 3) of SIGINT, and one of SIGTERM.
"""
import os
import random
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from mpirun import assert_ok, body, mpiexec

ROOT = Path(__file__).parent.parent
END_S = 10  # the job ends within this after the signal, or the test fails
START_S = 60  # to the first line of the run (imports and init on a busy machine)
INTERRUPTS = int(os.environ.get("MPIDP_TEST_INTERRUPTS", "3"))
SIGSEGV = re.compile(r"Segmentation fault|SIGSEGV|signal 11\b|EXIT CODE: 139")


@pytest.mark.parametrize("nbytes", [8, 1 << 16])
def test_shm_wait_notices_a_signal(nbytes):
    proc = body(2, "body_signals.py", env={"BODY_CASE": "allreduce", "BODY_BYTES": str(nbytes)},
                timeout_s=60)
    assert_ok(proc, 2)


def test_shutdown_stops_the_ddp_thread_before_freeing():
    proc = body(2, "body_signals.py", env={"BODY_CASE": "ddp"}, timeout_s=60)
    assert_ok(proc, 2)
    assert not SIGSEGV.search(proc.stdout + proc.stderr)


def _processes_with(tag: str) -> list:
    """Pids of this user's processes whose environment holds ``tag``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if tag.encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def interrupt_training(tmp_path: Path, signum: int, seed: int) -> str:
    """Starts the training tool on 2 ranks, signals mpiexec ``signum`` at a seeded random
    moment after training started, and checks how the job ends; returns its output."""
    delay_s = random.Random(seed).uniform(0.0, 2.5)
    directory = tmp_path / f"ckpt-{seed}"
    log = tmp_path / f"out-{seed}.txt"
    tag = f"MPIDP_TEST_TAG={uuid.uuid4().hex}"
    env = dict(os.environ, PYTHONUNBUFFERED="1", MPIDP_TEST_TAG=tag.split("=")[1])
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "mpidp.train", "--epochs", "1000",
           "--checkpoint-dir", str(directory), "--checkpoint-every", "10", "--no-progress",
           "--seed", str(seed)]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                start_new_session=True)
    try:
        t0 = time.monotonic()
        while "mpidp.train: mirrored" not in log.read_text():
            assert proc.poll() is None, f"ended before training:\n{log.read_text()}"
            assert time.monotonic() - t0 < START_S, f"no start in {START_S} s"
            time.sleep(0.05)
        time.sleep(delay_s)
        proc.send_signal(signum)  # Hydra forwards it to every rank
        sent = time.monotonic()
        try:
            proc.wait(timeout=END_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"seed {seed}: still running {END_S} s after "
                                 f"{signal.Signals(signum).name}:\n{log.read_text()[-4000:]}")
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = log.read_text()
    where = f"seed {seed} ({delay_s:.2f} s into training, ended after {took:.1f} s):\n{text[-4000:]}"
    name = signal.Signals(signum).name
    assert proc.returncode == 128 + signum, f"exit {proc.returncode}; {where}"
    assert not SIGSEGV.search(text), where
    assert "Traceback" not in text, where
    lines = [l for l in text.splitlines() if l.startswith(f"mpidp.train: interrupted by {name}")]
    assert len(lines) == 1, where
    if "newest good checkpoint" in lines[0]:
        path = re.search(r"newest good checkpoint (\S+);", lines[0]).group(1)
        assert Path(path).parent == directory and Path(path).exists(), where
        assert lines[0].rstrip().endswith(f"--seed {seed} --resume"), where
    else:
        assert "no good checkpoint" in lines[0], where
    for _ in range(40):  # every process of the job gone (ranks are in sessions of their own)
        left = _processes_with(tag)
        if not left:
            break
        time.sleep(0.05)
    assert not left, f"processes {left} of the job still run; {where}"
    return text


@pytest.mark.parametrize("seed", range(INTERRUPTS))
def test_ctrl_c_ends_training_cleanly(tmp_path, seed):
    interrupt_training(tmp_path, signal.SIGINT, seed)


def test_sigterm_ends_training_cleanly(tmp_path):
    interrupt_training(tmp_path, signal.SIGTERM, 1000)
