"""Where a run's checkpoints lie and how they are named, without torch: the supervisor
(mpidp.run) reads this much of a checkpoint directory between launches."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

NAME = re.compile(r"^ckpt-(\d{9})\.pt$")


def path_for(directory: Path, global_step: int) -> Path:
    return Path(directory) / f"ckpt-{global_step:09d}.pt"


def existing(directory: Path) -> list:
    """Checkpoint files in ``directory``, newest (highest step) first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := NAME.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def step_of(path: Path) -> Optional[int]:
    """The global step in a checkpoint's name (None: not a checkpoint's name)."""
    m = NAME.match(Path(path).name)
    return int(m.group(1)) if m else None
