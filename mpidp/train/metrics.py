"""What the user sees of a training run, from rank 0 only (every rank with ``verbose``): whole
lines on one stream (Note [One stream]) — progress within a long epoch, one line per epoch, a
last line a person reads — and JSON lines (per epoch, with every rank's compute and wait
time, and a final summary) to ``--log-json`` (appended to a file of ours, never through a
link: Note [Writing a file] in mpidp/files/__init__.py) and the summary on stdout."""
from __future__ import annotations

import json
import sys
import time
from typing import Optional

from ..files import AppendedFile

# Note [One stream]
# mpiexec forwards each rank's stdout and its stderr separately, so their order is lost on
# the way: a progress bar redrawn with carriage returns on stderr tore the epoch lines on
# stdout in a terminal (a line glued to a stale bar, or indented by its width) and left bar
# fragments in a redirected log. So everything rank 0 shows of a run is whole lines on stdout,
# each in one write (``emit``): progress within a long epoch is a line of its own (step,
# percent, loss, samples/s) after the first 2 s of the epoch and then every 10 s, the same in
# a terminal, a pipe and a file; a short epoch (the digits job's 0.1 s) shows only its epoch
# line. Warnings and errors go to stderr, whole lines too. Other ranks speak only with
# --verbose, each line prefixed with its rank.
PROGRESS_FIRST_S, PROGRESS_EVERY_S = 2.0, 10.0


def emit(text: str, stream=None) -> None:
    """One line in one write: with ``python -u`` (or PYTHONUNBUFFERED) ``print`` writes the text
    and its newline separately, and mpiexec may put another rank's line between the two."""
    stream = sys.stdout if stream is None else stream
    stream.write(text + "\n")
    stream.flush()


class Report:
    """Rank 0's (or with ``verbose`` every rank's) view of the run."""

    def __init__(self, rank: int, size: int, progress: bool, verbose: bool,
                 log_json: Optional[str]):
        self.rank, self.size = rank, size
        self.speaks = rank == 0 or verbose
        self.progress = progress and rank == 0
        self.prefix = f"[rank {rank}] " if verbose and size > 1 else ""
        self._json = AppendedFile(log_json, "JSON log") if log_json and rank == 0 else None
        self._epoch = (0, 0, 0)  # (epoch, epochs, steps) of the epoch under way
        self._done, self._next_progress = 0, float("inf")

    def line(self, text: str) -> None:
        """A log line, whole, on stdout (Note [One stream])."""
        if self.speaks:
            emit(self.prefix + text)

    def record(self, event: dict) -> None:
        """One JSON line in the --log-json file (rank 0); OutputError if it cannot be
        written."""
        if self._json is not None:
            self._json.write_line(json.dumps(event, sort_keys=True))

    def start_epoch(self, epoch: int, epochs: int, steps: int, done: int) -> None:
        self._epoch, self._done = (epoch, epochs, steps), done
        self._next_progress = time.monotonic() + PROGRESS_FIRST_S if self.progress \
            else float("inf")

    def step(self, loss: float, samples_per_s: float) -> None:
        self._done += 1
        now = time.monotonic()
        if now >= self._next_progress:  # Note [One stream]
            epoch, epochs, steps = self._epoch
            self.line(f"  step {self._done}/{steps} of epoch {epoch + 1}/{epochs} "
                      f"({100 * self._done / max(steps, 1):.0f}%)  loss {loss:.4f}  "
                      f"{samples_per_s:,.0f} samples/s")
            self._next_progress = now + PROGRESS_EVERY_S

    def end_epoch(self, event: dict) -> None:
        self._next_progress = float("inf")
        acc = event.get("test_accuracy")
        acc_text = f"  held-out acc {100 * acc:6.2f}%" if acc is not None else ""
        # an epoch taken up part-way (a resume, an in-job recovery): its loss is of the
        # steps trained since
        part = f" (its last {event['steps']} of {event['epoch_steps']} steps)" \
            if event.get("steps", 0) < event.get("epoch_steps", 0) else ""
        self.line(f"epoch {event['epoch']:>3}/{event['epochs']}  train loss "
                  f"{event['train_loss']:.4f}{part}{acc_text}  "
                  f"{event['samples_per_s']:,.0f} samples/s"
                  f"  comm {100 * event['wait_fraction']:4.1f}%  {event['time_s']:.2f} s")
        self.record(event)

    def summary(self, event: dict, log_json: Optional[str] = None) -> None:
        """The final summary: one JSON line on stdout (rank 0) and in the log, then the line
        a person reads."""
        if self.rank == 0:
            emit(json.dumps(event, sort_keys=True))
            emit(ending(event, log_json))
        self.record(event)

    def close(self) -> None:
        if self._json is not None:
            self._json.close()
            self._json = None


def ending(summary: dict, log_json: Optional[str] = None) -> str:
    """The run's last line: what it reached, how fast, where its outputs went."""
    acc, loss = summary.get("final_accuracy"), summary.get("final_train_loss")
    reached = f"{100 * acc:.2f}% held-out accuracy" if acc is not None else \
        f"train loss {loss:.4f}" if loss is not None else "nothing left to train"
    where = [f"checkpoint {summary['checkpoint']}"] if summary.get("checkpoint") else []
    if log_json:
        where.append(f"JSON log {log_json}")
    epochs = f"{summary['epochs']} epoch" + ("s" if summary["epochs"] != 1 else "")
    ranks = f"{summary['workers']} worker(s) + {summary['servers']} server(s)" \
        if "servers" in summary else f"{summary['ranks']} rank(s)"
    return (f"mpidp.train: done: {reached} after {epochs} on {ranks}; "
            f"{summary['total_s']:.1f} s of training, "
            f"{summary['samples_per_s']:,.0f} samples/s" +
            (f"; {', '.join(where)}" if where else ""))
