"""Checkpoints that lose nothing and prove themselves: written atomically and readable by
the owner only (Note [Writing a file] in mpidp/files/__init__.py), each carrying a SHA-256 digest of
its contents (Note [Checkpoint digest]), the run's newest K kept (Note [Checkpoint
retention]), loaded with ``torch.load(weights_only=True)`` without following a symlink; a
corrupt, truncated, foreign or incomplete one reported by name and passed over for the
previous good one. A directory other users can write to is refused (Note [Checkpoint
directory])."""
from __future__ import annotations

import errno
import hashlib
import os
import random
import re
import stat
import struct
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import numpy as np
import torch

from .. import files
from ..errors import OutputError
from .checkpoint_names import existing, path_for, step_of  # existing, path_for: also ours

FORMAT = "mpidp-checkpoint-1"
MODE = 0o600  # checkpoints are readable by their owner only
# what a training checkpoint holds (the loop's _save writes them, set-up and resume read them)
KEYS = ("format", "model", "optimizer", "epoch", "step_in_epoch", "global_step", "world_size",
        "train_samples", "data_order", "rng", "settings")
# and where the run has one, "comm_hook": the communication hook's state (Note [Compression
# state in checkpoints] in compress.py)

# Note [Checkpoint digest]
# torch.save writes a zip archive, and torch.load checks none of the archive's CRCs: bytes
# flipped inside a tensor's storage load silently. So every checkpoint carries the SHA-256 of
# its archive, in the one place of a zip meant for free text: the archive comment, after the
# 22-byte end-of-central-directory record (EOCD) that ends the archive:
#     [the archive exactly as torch.save wrote it, its EOCD's comment length set to 88]
#     b"mpidp-checkpoint-sha256:" + 64 hex digits       (the comment, 88 bytes)
# The digest covers the archive as torch.save wrote it (comment length 0): ``save`` hashes
# the bytes as they stream to the file (no second pass, no copy in memory), then writes the
# comment length and the comment. ``read`` hashes every byte before the comment length, then
# two zero bytes, and compares before handing the file to torch.load, which (like any zip
# reader) accepts the comment: ``torch.load(path)`` still reads a checkpoint. A file without
# the comment (truncated, not mpidp's, or from before digests) or whose digest differs is
# named and passed over. The digest proves the file is the one mpidp wrote, against disks,
# copies and truncation; it is no signature (whoever can write the file can recompute it):
# against other users, Note [Checkpoint directory].
_LABEL = b"mpidp-checkpoint-sha256:"
_COMMENT_BYTES = len(_LABEL) + 64
_EOCD = b"PK\x05\x06"
_EOCD_BYTES = 22
_CHUNK_BYTES = 1 << 22

# Note [Checkpoint directory]
# Whoever can write to the checkpoint directory can replace a checkpoint with weights of
# their choosing for the next --resume (the digest does not stop them: Note [Checkpoint
# digest]). So set-up refuses a --checkpoint-dir that another user may write to: one owned
# by another user, or whose mode grants write to its group or to all (a sticky bit does not
# help: it stops others deleting our files, not adding theirs). --allow-shared-checkpoint-dir
# accepts it. A directory mpidp creates is created 0700. Checkpoints are created 0600, never
# through a symlink (Note [Writing a file]), and read without following one.

# Note [Checkpoint retention]
# After each write ``save`` keeps the newest ``keep`` usable checkpoints and deletes the older
# usable ones (``retention_plan``, a pure rule). Usable: a regular file owned by us (not a
# symlink) whose digest checks (Note [Checkpoint digest]), at a step no higher than the one
# just written. Counted toward ``keep`` and deleted is only what we verified as ours; every
# other file named like a checkpoint is left in place, not counted, and named once in the
# log (``Retention.note``: one line each, not again at later saves):
# - a file that is not usable: damaged, truncated, not mpidp's, another user's, a symlink
#   (a planted ckpt-000000999.pt must not hold a slot for ever), not a regular file;
# - a file ahead of this run (a step higher than the one just written: what a resume passed
#   over, or a run on another number of ranks, fewer steps an epoch, never reaches): not
#   read at all.
# Never deleted either: the checkpoint just written (the newest usable one, since nothing
# counted is ahead of it) and the one the run resumed from, for the whole run: the run can
# always go back to where it started, so at most keep + 1 of its files are kept (keep + 2
# under local SGD and DiLoCo, which also keep the newest written at a meeting: the one a
# relaunch on another number of ranks can take, Note [Resuming on another number of ranks]). Cost: a
# digest reads the whole file, so a ``Retention`` (one per run, rank 0's) remembers each file
# it wrote or checked by path and identity (device, inode, size, mtime, ctime: a rewrite
# changes one of them, and ctime cannot be set back): a file is hashed at most once per run
# (one an earlier run left, at the first save; the one resumed from, by the resume's ``read``
# only, which ``Retention.verified`` records; one this process wrote, never), and a later
# save costs a directory listing and an lstat a file.


class Checkpoint(NamedTuple):
    """A checkpoint read and checked: where, its state, and its digest (hex)."""
    path: Path
    state: dict
    sha256: str


def shared_directory_problem(directory: Path) -> Optional[str]:
    """Why another user could write to ``directory`` (Note [Checkpoint directory]), or None."""
    st = os.stat(directory)
    if st.st_uid != os.geteuid():
        return f"is owned by another user (uid {st.st_uid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by other users (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def save(directory: Path, state: dict, global_step: int, keep: int,
         retention: Optional["Retention"] = None, kept=()) -> Path:
    """Writes ``state`` as the checkpoint of ``global_step``, with its digest (Note
    [Checkpoint digest]), then keeps the newest ``keep`` usable ones (Note [Checkpoint
    retention]; ``retention``: the run's memory of the files checked, a fresh one if None;
    ``kept``: paths never deleted, None among them ignored: the checkpoint the run resumed
    from, and under local SGD and DiLoCo the newest written at a meeting). The file appears
    complete or not at all (Note [Writing a file]): a crash or a failed write at any point
    leaves every earlier checkpoint as it was. OutputError names the file and the cause of a
    failed write. Not collective (rank 0 calls it)."""
    directory = Path(directory)
    final = path_for(directory, global_step)
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError("checkpoint", final, exc) from exc
    files.write_atomically(final, lambda f: _write_archive(f, dict(state, format=FORMAT)),
                           what="checkpoint", mode=MODE)
    retention = retention if retention is not None else Retention()
    retention.written(final)
    retention.apply(directory, global_step, keep,
                    (final.name, *(Path(p).name for p in kept if p)))
    files.remove_abandoned(directory)  # left by a process killed mid-write
    return final


def retention_plan(listing: list, keep: int, written_step: int, protected=()) -> tuple:
    """Note [Checkpoint retention] as a pure rule. ``listing``: (step, path, problem) of each
    file named like a checkpoint, ``problem`` None for a usable checkpoint of ours, else one
    line saying what is wrong (a file ahead of ``written_step`` need not have been checked);
    ``protected``: paths never deleted. Returns (the paths to delete, oldest last; (path, why)
    of each file left in place and not counted)."""
    assert keep >= 1, keep
    usable = sorted(((s, p) for s, p, problem in listing
                     if s <= written_step and problem is None), reverse=True)
    delete = [p for _, p in usable[keep:] if p not in protected]
    left = [(p, f"checkpoint {p} is ahead of this run (step {s}; this run has written step "
                f"{written_step})" if s > written_step else problem)
            for s, p, problem in sorted(listing, reverse=True)
            if s > written_step or problem is not None]
    return delete, left


class Retention:
    """One run's memory for Note [Checkpoint retention]: the files named like a checkpoint it
    wrote or checked, by path and identity, whether each is usable, and those already named
    through ``note`` (one line each; None: named nowhere)."""

    def __init__(self, note: Optional[Callable[[str], None]] = None):
        self.note = note
        self._checked: dict = {}  # path -> (its _identity, problem or None)
        self._named: set = set()

    def written(self, path: Path) -> None:
        """``path`` was just written by ``save``: ours and usable, without reading it."""
        self._checked[path] = (_identity(os.lstat(path)), None)

    def verified(self, path: Path) -> None:
        """``path`` was just read and its digest checked (``read``, by the resume): not
        hashed again while it stays the same; usable if it is a regular file of ours."""
        st = os.lstat(path)
        self._checked[Path(path)] = (_identity(st), _not_ours(path, st))

    def apply(self, directory: Path, written_step: int, keep: int, protected_names) -> None:
        """Deletes what ``retention_plan`` says in ``directory``; names each file left."""
        listing = []
        for path in existing(directory):
            step = step_of(path)
            listing.append((step, path, None if step > written_step else self._problem(path)))
        protected = {directory / n for n in protected_names if n}
        delete, left = retention_plan(listing, keep, written_step, protected)
        for path in delete:
            path.unlink(missing_ok=True)
            self._checked.pop(path, None)
        for path, why in left:
            if path not in self._named:
                self._named.add(path)
                if self.note is not None:
                    self.note(f"{why}; left in place, not counted toward --keep-checkpoints")

    def _problem(self, path: Path) -> Optional[str]:
        """What makes ``path`` unusable, or None: remembered while the file stays the same."""
        try:
            identity = _identity(os.lstat(path))
        except OSError as exc:
            return f"checkpoint {path} cannot be read: {exc.strerror}"
        known = self._checked.get(path)
        if known is None or known[0] != identity:
            known = self._checked[path] = (identity, _check_ours(path))
        return known[1]


def _identity(st: os.stat_result) -> tuple:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _check_ours(path: Path) -> Optional[str]:
    """Why ``path`` is not a usable checkpoint of ours (a regular file we own, not followed
    through a symlink, its digest checked: Note [Checkpoint retention]), or None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        return (f"checkpoint {path} is a symbolic link" if exc.errno == errno.ELOOP else
                f"checkpoint {path} cannot be read: {exc.strerror}")
    with os.fdopen(fd, "rb") as f:
        problem = _not_ours(path, os.fstat(fd))
        if problem is not None:
            return problem
        try:
            _verify(f, path)
        except _Bad as exc:
            return str(exc)
    return None


def _not_ours(path: Path, st: os.stat_result) -> Optional[str]:
    """Why the file at ``path`` with status ``st`` is not a regular file of ours, or None."""
    if not stat.S_ISREG(st.st_mode):
        return f"checkpoint {path} is not a regular file"
    if st.st_uid != os.geteuid():
        return f"checkpoint {path} is owned by another user (uid {st.st_uid})"
    return None


class _Hashing:
    """The file torch.save writes to: passes each write on to ``f``, hashing it and keeping
    the last bytes; keeps the file system's error (torch would replace it with its own)."""

    def __init__(self, f):
        self.f, self.sha256, self.tail, self.error = f, hashlib.sha256(), b"", None

    def write(self, data) -> int:
        try:
            n = self.f.write(data)
        except OSError as exc:
            self.error = exc
            raise
        self.sha256.update(data)
        self.tail = (self.tail + bytes(memoryview(data)[-_EOCD_BYTES:]))[-_EOCD_BYTES:]
        return n

    def flush(self) -> None:
        try:
            self.f.flush()
        except OSError as exc:
            self.error = exc
            raise


def _write_archive(f, state: dict) -> str:
    """torch.save of ``state`` into ``f``, then its digest as the archive comment (Note
    [Checkpoint digest]). Returns the digest."""
    out = _Hashing(f)
    try:
        torch.save(state, out)
    except RuntimeError:
        if out.error is not None:
            raise out.error from None
        raise
    assert out.tail[:4] == _EOCD and out.tail[20:] == b"\0\0", "torch.save wrote no zip end"
    digest = out.sha256.hexdigest()
    f.seek(-2, os.SEEK_END)
    f.write(struct.pack("<H", _COMMENT_BYTES) + _LABEL + digest.encode())
    return digest


class _Bad(ValueError):
    """A checkpoint that is not good: str() is one line naming it and why."""


def read(path: Path, required: tuple = ()) -> Checkpoint:
    """One checkpoint, checked: a regular file (a symlink is not followed), its digest, a
    dict of mpidp's format holding every key of ``required``. ValueError naming the file and
    what is wrong."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise _Bad(f"checkpoint {path} is a symbolic link: not followed"
                   if exc.errno == errno.ELOOP else
                   f"checkpoint {path} cannot be read: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _Bad(f"checkpoint {path} is not a regular file")
        digest = _verify(f, path)
        f.seek(0)
        try:
            state = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise _Bad(f"checkpoint {path} does not load ({type(exc).__name__}: "
                       f"{str(exc).splitlines()[0] if str(exc) else 'no detail'})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise _Bad(f"checkpoint {path} is not an mpidp checkpoint ({FORMAT})")
    missing = [k for k in required if k not in state]
    if missing:
        raise _Bad(f"checkpoint {path} is incomplete: no {', '.join(map(repr, missing))}")
    return Checkpoint(path, state, digest)


def _verify(f, path: Path) -> str:
    """The digest of the open checkpoint ``f``, checked (Note [Checkpoint digest])."""
    size = os.fstat(f.fileno()).st_size
    end = size - _COMMENT_BYTES - _EOCD_BYTES
    if end < 0:
        raise _Bad(f"checkpoint {path} is corrupt or truncated: too short for an mpidp digest")
    f.seek(end)
    tail = f.read()
    stored = tail[_EOCD_BYTES + len(_LABEL):]
    if tail[:4] != _EOCD or tail[20:22] != struct.pack("<H", _COMMENT_BYTES) or \
            tail[_EOCD_BYTES:_EOCD_BYTES + len(_LABEL)] != _LABEL or \
            not re.fullmatch(rb"[0-9a-f]{64}", stored):
        raise _Bad(f"checkpoint {path} is corrupt or truncated, or not mpidp's: no digest at "
                   "its end")
    h, left, buffer = hashlib.sha256(), end + 20, bytearray(_CHUNK_BYTES)
    f.seek(0)
    while left:
        n = f.readinto(memoryview(buffer)[:min(left, _CHUNK_BYTES)])
        if not n:
            raise _Bad(f"checkpoint {path} is truncated (it shrank while read)")
        h.update(memoryview(buffer)[:n])
        left -= n
    h.update(b"\0\0")
    if h.hexdigest() != stored.decode():
        raise _Bad(f"checkpoint {path} is corrupt: its SHA-256 is {h.hexdigest()[:12]}, its "
                   f"digest says {stored.decode()[:12]}")
    return h.hexdigest()


def load(path: Path, required: tuple = ()) -> dict:
    """The state of one checkpoint, checked by ``read``; ValueError naming the file."""
    return read(path, required).state


def load_latest(directory: Path, warn: Callable[[str], None], required: tuple = (),
                unusable: Callable[[Checkpoint], Optional[str]] = lambda found: None,
                below: Optional[int] = None) -> Optional[Checkpoint]:
    """The newest good checkpoint (``read``) in ``directory`` (at a step under ``below``, if
    given: those at or above it are not read) for which ``unusable`` gives no reason,
    reporting each newer one passed over through ``warn`` (one line naming it and why); None
    when there is none."""
    for path in existing(directory):
        if below is not None and step_of(path) >= below:
            continue
        try:
            found = read(path, required)
        except ValueError as exc:
            warn(str(exc))
            continue
        why = unusable(found)
        if why is None:
            return found
        warn(why)
    return None


def steps_past_meeting(state: dict) -> int:
    """The steps a local SGD or DiLoCo checkpoint's ranks took alone since they last met (its
    ``comm_hook``: Note [Local steps] in local_strategies.py); 0 at a meeting and under every
    other strategy."""
    return int((state.get("comm_hook") or {}).get("since") or 0)


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
    state = {"torch": torch.get_rng_state(), "numpy": torch.from_numpy(keys.astype(np.int64)),
             "numpy_rest": (int(pos), int(has_gauss), float(gauss)),
             "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # this rank's GPU's
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    pos, has_gauss, gauss = state["numpy_rest"]
    np.random.set_state(("MT19937", state["numpy"].numpy().astype(np.uint32), pos, has_gauss,
                         gauss))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def cursor_of(state: dict, batch_size: int) -> int:
    """The sample cursor of a training checkpoint's epoch (Note [Sample cursor] in
    mpidp/workloads/data.py); a checkpoint from before cursors were recorded has its ranks' full batches."""
    cursor = state["data_order"].get("cursor")
    if cursor is None:
        cursor = int(state["world_size"]) * int(state["step_in_epoch"]) * batch_size
    return int(cursor)


def rng_states_for(saved: list, size: int) -> list:
    """Each of ``size`` ranks' generator states from a checkpoint's per-rank ``saved``: rank r
    takes rank r's, a rank the checkpoint had not takes None (its seeded stream stays)."""
    return [saved[r] if r < len(saved) else None for r in range(size)]
