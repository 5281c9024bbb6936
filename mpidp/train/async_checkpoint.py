"""Checkpoints written while training goes on (``--async-checkpoint``): Note [Asynchronous
checkpoints]."""
from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from . import checkpoint

# Note [Asynchronous checkpoints]
# With --async-checkpoint a checkpoint costs training only a copy. At the step boundary the
# ranks do what is collective as for any checkpoint (every rank's RNG state, the optimizer
# state the servers or ZeRO's owners hold, the communication hook's state) and rank 0 builds
# the state; then, instead of writing it, rank 0 copies every tensor in it (model.state_dict()
# and optimizer.state_dict() hand out the live tensors the next step changes) to fresh host
# memory, pinned for a CUDA tensor with one synchronisation after the copies, and hands the
# copy to a background thread, which writes it exactly as a synchronous checkpoint is
# written (checkpoint.save: a temporary file, its digest, fsync, rename, then Note
# [Checkpoint retention], whose log lines the training thread prints when it next meets the
# writer: one stream, whole lines). At most one write is in flight: a checkpoint due while
# the previous one is still being written waits for it first. The seconds training waited (the
# copy, and any such wait) are added up and reported in the summary as
# checkpoint_wait_s, with checkpoint_write_s, the writing itself. A write that fails is
# raised at the next checkpoint or at the end of the run, on rank 0, as a synchronous one
# would be. The run's end and a stop on a signal wait for the write in flight, so the
# checkpoint they name exists; so does a run ending on an exception or Ctrl-C, before the
# job is ended (a write cut short would leave its temporary file behind). A kill during a write leaves the previous checkpoint whole
# (the rename is the only step that publishes), as for synchronous checkpoints.


def host_copy(obj: Any) -> Any:
    """``obj`` (dicts, lists, tuples of tensors and plain values) with every tensor copied to
    new host memory; CUDA tensors through pinned memory, synchronised once."""
    cuda = []

    def copy(o):
        if torch.is_tensor(o):
            if o.device.type == "cuda":
                host = torch.empty(o.shape, dtype=o.dtype, pin_memory=True)
                host.copy_(o.detach(), non_blocking=True)
                cuda.append(o.device)
                return host
            return o.detach().clone()
        if isinstance(o, dict):
            return {k: copy(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return type(o)(copy(v) for v in o)
        return o

    result = copy(obj)
    for device in set(cuda):
        torch.cuda.synchronize(device)
    return result


class Writer:
    """Rank 0's background checkpoint writer: ``submit`` waits for the write in flight,
    copies the state and starts writing it; ``wait`` waits for the write in flight and
    raises what it raised. ``write_s`` adds up the writer's seconds writing. ``note``: where
    the lines of Note [Checkpoint retention] go, called in the thread that submits or
    waits."""

    def __init__(self, directory: str, keep: int,
                 note: Optional[Callable[[str], None]] = None):
        self.directory, self.keep, self.note = directory, keep, note
        self.write_s = 0.0  # the background thread's seconds writing
        self._notes: list = []  # the retention's lines, until the training thread prints them
        self._retention = checkpoint.Retention(self._notes.append)
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None

    def verified(self, path: Path) -> None:
        """The checkpoint resumed from was read and checked: ``Retention.verified``. Before
        the first ``submit``."""
        assert self._thread is None, "verified after a write started"
        self._retention.verified(path)

    def submit(self, state: dict, global_step: int, kept=()) -> Path:
        """Starts writing ``state`` as the checkpoint of ``global_step`` (``kept``: the
        checkpoints never deleted, checkpoint.save's); returns its path (written once ``wait``
        returns)."""
        self._join()
        copy = host_copy(state)
        self._thread = threading.Thread(target=self._write,
                                        args=(copy, global_step, kept),
                                        name="mpidp-checkpoint-writer")
        self._thread.start()
        return checkpoint.path_for(Path(self.directory), global_step)

    def _write(self, state: dict, global_step: int, kept) -> None:
        t0 = time.perf_counter()
        try:
            checkpoint.save(self.directory, state, global_step, self.keep, self._retention,
                            kept)
        except BaseException as exc:  # raised in the training thread by wait()
            self._error = exc
        self.write_s += time.perf_counter() - t0

    def wait(self) -> None:
        """Returns once no write is in flight; raises the last write's error, if it failed."""
        self._join()

    def close(self) -> None:
        """Waits for the write in flight, raising nothing: for a run ending on an exception,
        which its error must not hide (Note [Asynchronous checkpoints])."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        for line in self._notes if self.note is not None else ():  # no write in flight
            self.note(line)
        self._notes.clear()
        if self._error is not None:
            error, self._error = self._error, None
            raise error
