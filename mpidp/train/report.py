"""What the user sees of a training run, from rank 0 only (every rank with ``verbose``): a
progress bar with loss and samples/s, one line per epoch, JSON lines (per epoch, with every
rank's compute and wait time, and a final summary) to ``--log-json`` (appended to a file of
ours, never through a link: Note [Writing a file] in mpidp/files.py)."""
from __future__ import annotations

import json
import sys
from typing import Optional

from tqdm import tqdm

from ..files import AppendedFile


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
        self._bar: Optional[tqdm] = None

    def line(self, text: str) -> None:
        """A log line (through the bar, so it does not tear it)."""
        if self.speaks:
            tqdm.write(self.prefix + text + "\n", file=sys.stdout, end="")  # one write: see emit
            sys.stdout.flush()

    def record(self, event: dict) -> None:
        """One JSON line in the --log-json file (rank 0); OutputError if it cannot be
        written."""
        if self._json is not None:
            self._json.write_line(json.dumps(event, sort_keys=True))

    def start_epoch(self, epoch: int, epochs: int, steps: int, done: int) -> None:
        if self.progress:
            self._bar = tqdm(total=steps, initial=done, desc=f"epoch {epoch + 1}/{epochs}",
                             unit="step", leave=False, dynamic_ncols=True, mininterval=0.5,
                             file=sys.stderr)

    def step(self, loss: float, samples_per_s: float) -> None:
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{samples_per_s:,.0f}",
                                  refresh=False)
            self._bar.update(1)

    def end_epoch(self, event: dict) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        acc = event.get("test_accuracy")
        acc_text = f"  held-out acc {100 * acc:6.2f}%" if acc is not None else ""
        self.line(f"epoch {event['epoch']:>3}/{event['epochs']}  train loss "
                  f"{event['train_loss']:.4f}{acc_text}  {event['samples_per_s']:,.0f} samples/s"
                  f"  comm {100 * event['wait_fraction']:4.1f}%  {event['time_s']:.2f} s")
        self.record(event)

    def summary(self, event: dict) -> None:
        """The final summary: one JSON line on stdout (rank 0) and in the log."""
        if self.rank == 0:
            emit(json.dumps(event, sort_keys=True))
        self.record(event)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._json is not None:
            self._json.close()
            self._json = None
