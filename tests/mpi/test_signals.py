"""Tier 2: Ctrl-C and SIGTERM end a job promptly and cleanly (issue 14, item 3).

- The shared-memory wait notices a signal (Note [Interrupting a wait] in csrc/shm.c): a rank
  waiting alone in an all-reduce sends itself SIGINT and must raise KeyboardInterrupt within a
  second (tests/mpi/bodies/body_signals.py), for the inline call and the sliced one.
- Shutdown ends and joins DDP's communication thread before it frees the windows that thread
  waits in (Note [Stopping the users first] in mpidp/runtime/resources.py).
- ``python -m mpidp.train`` on 2 ranks, signalled through mpiexec at a seeded random moment of
  training (Note [Interrupted run] in mpidp/train/cli.py): the job ends within END_S with exit
  code 128 + the signal's number, no segfault, no traceback, one line naming the newest good
  checkpoint and the --resume command, and no process of it left. MPIDP_TEST_INTERRUPTS runs
  (default 3) of SIGINT, and one of SIGTERM.
- A Ctrl-C whose KeyboardInterrupt rank 0 loses (a library catches it) still ends the run
  with rank 0's line (Note [A lost interrupt] in mpidp/train/interrupts.py).
- The same signals while the ranks still import torch (before MPI starts) end every rank
  with the same exit code and one line from rank 0, not a traceback per rank.
"""
import os
import random
import re
import signal
import time
from pathlib import Path

import pytest

from mpirun import BODIES, Job, assert_ok, body, run

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


def interrupt_training(tmp_path: Path, signum: int, seed: int) -> str:
    """Starts the training tool on 2 ranks, signals mpiexec ``signum`` at a seeded random
    moment after training started, and checks how the job ends; returns its output."""
    delay_s = random.Random(seed).uniform(0.0, 2.5)
    directory = tmp_path / f"ckpt-{seed}"
    with Job(2, ["-m", "mpidp.train", "--epochs", "1000", "--checkpoint-dir", directory,
                 "--checkpoint-every", "10", "--no-progress", "--seed", seed],
             tmp_path / f"out-{seed}.txt") as job:
        job.wait_for(lambda: "mpidp.train: mirrored" in job.text, START_S)
        time.sleep(delay_s)
        job.proc.send_signal(signum)  # Hydra forwards it to every rank
        sent = time.monotonic()
        code = job.wait(END_S)
        took = time.monotonic() - sent
        left = job.left_behind()
    text = job.text
    where = f"seed {seed} ({delay_s:.2f} s into training, ended after {took:.1f} s):\n{text[-4000:]}"
    name = signal.Signals(signum).name
    assert code == 128 + signum, f"exit {code}; {where}"
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
    assert not left, f"processes {left} of the job still run; {where}"
    return text


@pytest.mark.parametrize("seed", range(INTERRUPTS))
def test_ctrl_c_ends_training_cleanly(tmp_path, seed):
    interrupt_training(tmp_path, signal.SIGINT, seed)


def test_sigterm_ends_training_cleanly(tmp_path):
    interrupt_training(tmp_path, signal.SIGTERM, 1000)


def test_an_interrupt_the_main_thread_loses_still_ends_the_run(tmp_path):
    """Rank 0 alone gets SIGINT at its 40th item, and its data set catches the
    KeyboardInterrupt: the main thread never learns of it, and the others never had it, so
    only the watcher can end the run, as rank 0 with its line; without it the run would
    train its 60 epochs to the end (or, in a rank's wait, rank 1 would say it)."""
    proc = run(2, ["-m", "mpidp.train", "--dataset", "user_factories:faulty_digits",
                   "--epochs", 60, "--checkpoint-dir", tmp_path, "--checkpoint-every", 10,
                   "--no-progress"],
               dict(PYTHONPATH=str(BODIES), FAULT="lost_int", FAULT_RANK="0", FAULT_AT="40"),
               timeout_s=120)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 128 + signal.SIGINT, f"exit {proc.returncode}:\n{text[-4000:]}"
    assert "Traceback" not in text and '"event": "summary"' not in text, text[-4000:]
    lines = [l for l in text.splitlines() if "interrupted by SIGINT" in l]
    assert len(lines) == 1 and lines[0].startswith("mpidp.train: interrupted by SIGINT; "), text


def _torch_loaded(job: Job) -> bool:
    """Whether every rank of ``job`` is inside ``import torch`` (its library mapped)."""
    ranks = [p for p, r in job.processes().items() if r is not None]
    try:
        return len(ranks) == 2 and all("libtorch" in Path(f"/proc/{p}/maps").read_text()
                                       for p in ranks)
    except OSError:
        return False


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_while_importing_ends_with_one_line(tmp_path, signum):
    """A signal to mpiexec while the ranks import torch (before MPI has started): every rank
    ends with 128 + the signal's number, rank 0 says so in one line, no traceback (Note
    [Interrupted run] in mpidp/train/cli.py)."""
    with Job(2, ["-m", "mpidp.train", "--no-progress"], tmp_path / "out.txt") as job:
        job.wait_for(lambda: _torch_loaded(job), START_S)
        job.proc.send_signal(signum)
        code = job.wait(END_S)
        left = job.left_behind()
    text = job.text
    assert code == 128 + signum and "Traceback" not in text, f"exit {code}:\n{text}"
    assert text.count("mpidp.train: interrupted while starting\n") == 1, text
    assert not left, f"processes {left} still run:\n{text}"
