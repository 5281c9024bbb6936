"""Tier 2: the fault matrix, each fault injected into ``python -m mpidp.train`` under
``mpiexec -n 3`` (tests/mpi/bodies/user_factories.py). Every job must end within BOUND_S (the
subprocess timeout, far below pytest's) with a non-zero exit, a message naming the rank and
the cause, and its newest checkpoint complete: one of an earlier step, loaded with
``torch.load(weights_only=True)``. Also the watchdog's own cases
(tests/mpi/bodies/body_watchdog.py): a stopped rank, a stall across emulated nodes, and
debug-mode fingerprints."""
import os
import re
import sys

import pytest
import torch

from mpirun import BODIES, RUN_BODY, assert_ok, body, finished, run
from mpidp.runtime.launcher import mpiexec

sys.path.insert(0, str(BODIES))
import user_factories  # noqa: E402

N = 3
BOUND_S = 60  # a fault ends the job well within this, or the test fails
USER = {"PYTHONPATH": str(BODIES)}
# the watchdog's bound (MPIDP_TIMEOUT_S) where a test waits for it, so that only the fault
# ends the job: at least 4 times a bound no healthy run of the same job fired at on the busy
# 2-core machine (ps 0.75 s: 7 runs, one of 8 fired at 0.5 s in its set-up; mirrored 0.5 s: 10
# runs, one of 3 fired at 0.33 s; the watchdog body's first all-reduces 0.25 s: 8 runs)
WATCHDOG_PS = {"MPIDP_TIMEOUT_S": "3"}          # ps under the training tool
WATCHDOG_MIRRORED = {"MPIDP_TIMEOUT_S": "2"}    # mirrored under the training tool
WATCHDOG_BODY = {"MPIDP_TIMEOUT_S": "2"}        # tests/mpi/bodies/body_watchdog.py
# mirrored on 3 ranks: 15 steps of 32 per epoch, checkpoints after steps 5 and 10, so a fault
# in step 8 leaves the checkpoint of step 5 the newest (rank 0 wrote it before step 6)
MIRRORED = ("--model", "user_factories:tiny_model", "--epochs", 1, "--checkpoint-every", 5,
            "--optimizer", "adam", "--no-progress")
IN_STEP_8 = 1 + 7 * 32 + 5  # the item a rank fetches in step 8 (one is read at start-up)
# ps on 2 workers + 1 server: 45 steps per epoch, a checkpoint at each epoch's end
PS = ("--strategy", "ps", "--model", "user_factories:tiny_model", "--epochs", 2,
      "--optimizer", "momentum", "--no-progress", "--dataset", "user_factories:ps_faulty_digits")
FIELDS = {"format", "model", "optimizer", "epoch", "step_in_epoch", "global_step", "world_size",
          "train_samples", "data_order", "rng", "settings"}


def train(flags, env, directory):
    return run(N, ["-m", "mpidp.train", *map(str, flags), "--checkpoint-dir", directory],
               env=dict(USER, **env), timeout_s=BOUND_S)


def failed(proc, *patterns) -> str:
    """The job's output, checked: non-zero exit, no summary, every pattern present."""
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-5000:]
    assert '"event": "summary"' not in out, out[-5000:]
    for p in patterns:
        assert re.search(p, out), f"{p!r} is not in the output:\n{out[-5000:]}"
    return out


def newest_checkpoint_is_complete(directory, steps, model=user_factories.tiny_model) -> None:
    """The newest checkpoint is one of ``steps``, and whole: every field, every parameter of
    ``model()`` with its shape, every rank's RNG state, an optimizer state."""
    newest = sorted(directory.glob("ckpt-*.pt"))[-1]
    state = torch.load(newest, weights_only=True)
    assert state["global_step"] in steps and newest.name == f"ckpt-{state['global_step']:09d}.pt"
    assert FIELDS <= set(state) and state["format"] == "mpidp-checkpoint-1", sorted(state)
    shapes = {k: v.shape for k, v in model().state_dict().items()}
    assert {k: v.shape for k, v in state["model"].items()} == shapes
    assert len(state["rng"]) == N and state["world_size"] == N and state["optimizer"]


def test_exception_on_one_rank_aborts_the_job(tmp_path):
    proc = train((*MIRRORED, "--dataset", "user_factories:faulty_digits"),
                 dict(FAULT="raise", FAULT_RANK="1", FAULT_AT=str(IN_STEP_8)), tmp_path)
    failed(proc, r"mpidp: rank 1 of 3 on \S+: uncaught RuntimeError: injected fault")
    newest_checkpoint_is_complete(tmp_path, {5})


# A SIGKILLed process says nothing, and Hydra SIGKILLs the others at once: the launcher's
# message is the one, naming a process by pid and host and the signal. (Its pid is the dead
# one's, or, when Hydra's clean-up races its report, one of the processes it killed.)
KILLED = (r"BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES\n=   PID \d+ RUNNING AT \S+",
          r"Killed \(signal 9\)")


def test_sigkill_of_one_rank_ends_the_job(tmp_path):
    pid_file = tmp_path / "victim.pid"
    proc = train((*MIRRORED, "--dataset", "user_factories:faulty_digits"),
                 dict(FAULT="kill", FAULT_RANK="1", FAULT_AT=str(IN_STEP_8),
                      FAULT_PID_FILE=str(pid_file)), tmp_path / "ckpt")
    failed(proc, *KILLED)
    assert pid_file.exists()  # the fault happened where it was meant to
    newest_checkpoint_is_complete(tmp_path / "ckpt", {5})


def test_stalled_rank_is_named_by_the_watchdog(tmp_path):
    proc = train((*MIRRORED, "--dataset", "user_factories:faulty_digits"),
                 dict(WATCHDOG_MIRRORED, FAULT="sleep", FAULT_RANK="1",
                      FAULT_AT=str(IN_STEP_8)), tmp_path)
    failed(proc, r"mpidp: watchdog: rank [02] of 3 on \S+: collective #\d+, allreduce float32"
                 r"\[\d+\] op=avg algorithm=shm \(DDP gradient bucket 1 of 1\), has not "
                 r"completed after \d+ s \(MPIDP_TIMEOUT_S=2\); aborting the job",
           r"arrived at collective #\d+: ranks 0, 2\n  not arrived: rank 1\n",
           r"rank 1 \(pid \d+ on \S+\): in no mpidp operation for [\d.]+ s \(its last "
           r"collective: #\d+\): in its own code")
    assert proc.returncode == 124
    newest_checkpoint_is_complete(tmp_path, {5})


def test_mismatched_shapes_are_named(tmp_path):
    proc = train((*MIRRORED, "--model", "user_factories:sync_model"),
                 dict(FAULT="shape", FAULT_RANK="1", FAULT_AT="8"), tmp_path)
    failed(proc, r"uncaught MismatchError",
           r"rank 0: allreduce float32\[16\] op=avg algorithm=shm\n"
           r"  rank 1: allreduce float32\[15\] op=avg algorithm=shm  <- differs from rank 0")
    newest_checkpoint_is_complete(tmp_path, {5}, user_factories.sync_model)


def test_skipped_collective_is_named(tmp_path):
    proc = train((*MIRRORED, "--model", "user_factories:sync_model"),
                 dict(FAULT="skip", FAULT_RANK="1", FAULT_AT="8"), tmp_path)
    # rank 1 went on to backward: its gradient all-reduce meets the others' forward one
    failed(proc, r"uncaught MismatchError",
           r"rank 0: allreduce float32\[16\] op=avg algorithm=shm\n"
           r"  rank 1: allreduce float32\[\d+\] op=avg algorithm=shm  <- differs from rank 0")
    newest_checkpoint_is_complete(tmp_path, {5}, user_factories.sync_model)


@pytest.mark.parametrize("victim,fault,epochs,steps", [(0, "kill_push", 2, {45}),
                                                       (2, "kill_server", 3, {45, 90})],
                         ids=["worker-killed-mid-push", "server-killed-mid-step"])
def test_parameter_server_rank_killed(victim, fault, epochs, steps, tmp_path):
    """A worker dies holding a lock on the server's window, its gradient added but not
    counted; or the server dies between draining pushes and publishing. Neither leaves a
    rank hanging, and the checkpoints stay whole (the server's dies in epoch 3, so that the
    job may end while rank 0 writes epoch 2's: that one is then absent, never partial)."""
    pid_file = tmp_path / "victim.pid"
    proc = train((*PS, "--epochs", epochs),
                 dict(FAULT=fault, FAULT_RANK=str(victim), FAULT_AT="2",
                      FAULT_EPOCH=str(epochs - 1), FAULT_PID_FILE=str(pid_file)),
                 tmp_path / "ckpt")
    failed(proc, *KILLED)
    assert pid_file.exists()
    newest_checkpoint_is_complete(tmp_path / "ckpt", steps)


def test_parameter_server_survives_a_worker_that_stops_mid_push(tmp_path):
    """A worker stops (SIGSTOP: the launcher sees no death) inside a push, holding a lock on
    the server's window: the server, whose drain waits for that lock, and the other worker,
    waiting for the staleness bound or the lock, do not hang: the watchdog ends the job."""
    proc = train((*PS, "--staleness", 1),
                 dict(WATCHDOG_PS, FAULT="stop_push", FAULT_RANK="0", FAULT_AT="2"), tmp_path)
    failed(proc, r"mpidp: watchdog: rank [12] of 3 on \S+: ps (worker|server): .* "
                 r"has waited \d+ s without progress \(MPIDP_TIMEOUT_S=3\); aborting the job",
           r"  waiting in an mpidp operation: ranks 1, 2\n", r"  no answer: rank 0\n",
           # a pull, or a push or batch whose shared lock queues behind the server's exclusive one
           r"rank 1 \(pid \d+ on \S+\): in ps worker: .*, for [\d.]+ s",
           r"rank 2 \(pid \d+ on \S+\): in ps server: waiting for a push, or for every worker "
           r"to finish the epoch, for [\d.]+ s")
    assert proc.returncode == 124
    newest_checkpoint_is_complete(tmp_path, {45})


@pytest.mark.parametrize("case,env,patterns", [
    ("stopped", {}, (r"arrived at collective #6: ranks 0, 2\n  not arrived: rank 1 \(no answer\)",
                     r"  rank 1 \(on \S+\): no answer within \d+ s: the process has exited, is stopped")),
    ("late", {"MPIDP_EMULATE_NODE_SIZE": "1"},
     (r"collective #6, allreduce float32\[4\] op=max algorithm=doubling, has not "
      r"completed",
      r"arrived at collective #6: ranks 0, 1\n  not arrived: rank 2\n")),
])
def test_watchdog_names_the_missing_rank(case, env, patterns):
    proc = body(N, "body_watchdog.py", dict(WATCHDOG_BODY, BODY_CASE=case, **env), BOUND_S)
    failed(proc, *patterns)
    assert proc.returncode == 124


# a rank that leaves cleanly while the others wait in an all-reduce: they end within seconds,
# where the watchdog's timeout (MPIDP_TIMEOUT_S) is far longer than BOUND_S
DEPARTED = r"rank 2 has shut down \(mpidp.shutdown, or the end of its script\) without reaching"


def test_rank_that_shut_down_is_an_error_on_every_waiting_rank():
    """On one node, in the shared-memory wait: a CommunicationError on every waiting rank,
    which then leave cleanly too."""
    proc = body(N, "body_watchdog.py", dict(BODY_CASE="departed", MPIDP_TIMEOUT_S="120"),
                BOUND_S)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    for r in (0, 1):
        assert re.search(rf"raised {r}: rank {r}: allreduce failed: {DEPARTED} this "
                         r"collective, and never will; every rank waiting for it raises", out), \
            out[-5000:]


def test_a_rank_whose_process_ended_is_an_error_on_every_waiting_rank():
    """A rank's process ends abruptly (os._exit: no shutdown) while the others wait in the
    node's shared memory, under a launcher that does not end the job for it (Hydra's
    -disable-auto-cleanup, as srun without --kill-on-bad-exit): each raises a
    CommunicationError naming it (Note [A lost peer] in csrc/shm.c), where it would wait for
    the watchdog's long timeout."""
    proc = finished([mpiexec(), "-disable-auto-cleanup", "-n", str(N), sys.executable,
                     str(RUN_BODY), str(BODIES / "body_watchdog.py")],
                    {**os.environ, "BODY_CASE": "lost", "MPIDP_TIMEOUT_S": "120"}, BOUND_S)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-5000:]
    for r in (0, 1):
        assert re.search(rf"raised {r}: rank {r}: allreduce failed: the process of rank 2 on "
                         r"this node has ended \(killed or crashed\) without reaching this "
                         r"collective; every rank waiting for it raises this error", out), \
            out[-5000:]


def test_rank_that_shut_down_ends_the_job_across_nodes():
    """Across emulated nodes, waiting inside MPI (which only an abort ends): the watchdog of a
    waiting rank ends the job naming the rank and the collective, not after its timeout."""
    proc = body(N, "body_watchdog.py", dict(BODY_CASE="departed", MPIDP_TIMEOUT_S="120",
                                            MPIDP_EMULATE_NODE_SIZE="1"), BOUND_S)
    out = failed(proc, r"mpidp: rank [01] of 3 on \S+: collective #6, allreduce float32\[4\] "
                       r"op=sum algorithm=doubling, cannot complete: rank 2 \(after collective "
                       r"#5\) has shut down \(mpidp.shutdown, or the end of its script\) without "
                       r"reaching it, and never will; aborting the job\n  uneven inputs\?")
    assert proc.returncode == 1 and "has not completed after" not in out


def test_debug_mode_names_skipped_and_object_collectives():
    """And look-alike calls from two lines through every entry point: mpidp, Horovod, the
    torch.distributed backend on the caller's thread and on its own."""
    assert_ok(body(N, "body_watchdog.py", dict(BODY_CASE="debug", MPIDP_DEBUG="1",
                                               MPIDP_TIMEOUT_S="1.5"), BOUND_S), N)
