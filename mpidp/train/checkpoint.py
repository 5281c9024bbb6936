"""Checkpoints that lose nothing: written atomically (temporary file, fsync, rename, fsync of
the directory), the last K kept, loaded with ``torch.load(weights_only=True)``, a corrupt or
truncated one reported by name and passed over for the previous good one."""
from __future__ import annotations

import os
import random
import re
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

FORMAT = "mpidp-checkpoint-1"
_NAME = re.compile(r"^ckpt-(\d{9})\.pt$")


def path_for(directory: Path, global_step: int) -> Path:
    return Path(directory) / f"ckpt-{global_step:09d}.pt"


def existing(directory: Path) -> list:
    """Checkpoint files in ``directory``, newest (highest step) first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def save(directory: Path, state: dict, global_step: int, keep: int) -> Path:
    """Writes ``state`` as the checkpoint of ``global_step`` and deletes all but the newest
    ``keep``. The file appears complete or not at all: a crash at any point leaves every
    earlier checkpoint as it was."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = path_for(directory, global_step)
    tmp = directory / f".{final.name}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(dict(state, format=FORMAT), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            tmp.unlink()
    _fsync_directory(directory)
    for old in existing(directory)[keep:]:
        old.unlink(missing_ok=True)
    for stale in directory.glob(".ckpt-*.pt.tmp-*"):  # left by a process killed mid-write
        if not _pid_alive(stale.name.rsplit("-", 1)[-1]):
            stale.unlink(missing_ok=True)
    return final


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pid_alive(text: str) -> bool:
    try:
        os.kill(int(text), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


def load(path: Path) -> dict:
    """One checkpoint, checked to be mpidp's; ValueError naming the file when it is not."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ValueError(f"checkpoint {path} is corrupt or truncated ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else 'no detail'})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"checkpoint {path} is not an mpidp checkpoint ({FORMAT})")
    return state


def load_latest(directory: Path, warn: Callable[[str], None]) -> Optional[tuple]:
    """(path, state) of the newest checkpoint that loads, reporting each bad one through
    ``warn``; None when there is none."""
    for path in existing(directory):
        try:
            return path, load(path)
        except ValueError as exc:
            warn(f"{exc}; trying the previous one")
    return None


def seed_rng(seed: int, rank: int) -> None:
    """Seeds torch's, numpy's and Python's global generators with a stream per (seed, rank)
    (dropout, augmentation and user code draw from them)."""
    words = np.random.SeedSequence([seed, rank]).generate_state(4)
    torch.manual_seed(int(words[0]) << 32 | int(words[1]))
    np.random.seed(int(words[2]))
    random.seed(int(words[3]))


def rng_state() -> dict:
    """This process's generator states, in types ``torch.load(weights_only=True)`` accepts."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"torch": torch.get_rng_state(), "numpy": torch.from_numpy(keys.astype(np.int64)),
            "numpy_rest": (int(pos), int(has_gauss), float(gauss)), "python": random.getstate()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    pos, has_gauss, gauss = state["numpy_rest"]
    np.random.set_state(("MT19937", state["numpy"].numpy().astype(np.uint32), pos, has_gauss,
                         gauss))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
