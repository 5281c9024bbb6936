"""The files mpidp writes (checkpoints, the JSON log, the timeline, benchmark results): each
created beside its final name under a name no one can guess, and renamed over it
(Note [Writing a file]). The lock that makes one run the only writer of a checkpoint
directory or a log is run_lock.py's, beside this file."""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Callable, Optional

from ..errors import OutputError

# Note [Writing a file]
# mpidp never opens a file by its final name for writing. It creates the file in the final
# name's directory with mkstemp (O_CREAT | O_EXCL | O_NOFOLLOW, a random name, mode 0600),
# writes, flushes and fsyncs it, sets its mode (``mode`` less the umask: checkpoints 0600,
# other outputs 0644), renames it over the final name and fsyncs the directory, so that the
# rename survives a crash. So nothing another user planted in the directory is written
# through: a symlink at the temporary name cannot be placed in advance (the name is random,
# and O_EXCL | O_NOFOLLOW refuse an existing entry), and a symlink or a hard link at the final
# name is replaced by the rename, never followed. A reader sees the old file or the whole new
# one. A failed write removes its temporary and leaves the final name as it was; the error is
# one line naming what, the path and the cause (errors.OutputError). A temporary left by a
# killed process carries its PID (``.NAME.tmp-PID-RANDOM``); ``remove_abandoned`` removes
# those whose process is gone. The JSON log, which grows by lines, is written the same way
# once per run (``AppendedFile``: the earlier lines copied into a file of ours) and appended
# to through that file's descriptor, never by name.

_ABANDONED = re.compile(r"^\..+\.tmp-(\d+)(-[a-z0-9_]+)?$")  # (an older mpidp's: no RANDOM)


def write_atomically(path, write: Callable[[BinaryIO], Any], *, what: str,
                     mode: int = 0o644) -> Any:
    """Creates the file ``path`` whole or not at all: ``write(f)`` fills a new binary file
    beside it, which is then fsynced and renamed over ``path`` (Note [Writing a file]).
    ``what`` names the file in errors ("checkpoint"); ``mode``: its permissions, less the
    umask. Returns what ``write`` returns. Raises OutputError for a failure of the file system
    (the temporary removed, ``path`` untouched); other exceptions of ``write`` pass through,
    the temporary removed. Not collective."""
    path = Path(path)
    f, tmp = _create_beside(path, mode, what)
    try:
        with f:
            result = write(f)
            _publish(f, tmp, path)
        return result
    except BaseException as exc:
        _remove(tmp)
        if isinstance(exc, OSError) and not isinstance(exc, OutputError):
            raise OutputError(what, path, exc) from exc
        raise


def write_json(path, data, *, what: str, indent: Optional[int] = 1) -> None:
    """``data`` as JSON at ``path``, by ``write_atomically``."""
    write_atomically(path, lambda f: f.write(json.dumps(data, indent=indent).encode()),
                     what=what)


class AppendedFile:
    """A text file that grows by lines (the JSON log): opening it publishes a file of ours
    at ``path`` holding the lines of the regular file it replaces (Note [Writing a file]:
    a symlink or anything else at ``path`` is replaced, not read); ``write_line`` appends to
    that file, fsynced. OutputError, naming ``what``, for any failure. Not collective."""

    def __init__(self, path, what: str, mode: int = 0o644):
        self.path, self.what = Path(path), what
        f, tmp = _create_beside(self.path, mode, what)
        try:
            _copy_if_regular(self.path, f)
            _publish(f, tmp, self.path)
        except BaseException as exc:
            f.close()
            _remove(tmp)
            if isinstance(exc, OSError):
                raise OutputError(what, self.path, exc) from exc
            raise
        self._file = f

    def write_line(self, text: str) -> None:
        try:
            self._file.write(text.encode() + b"\n")
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError as exc:
            raise OutputError(self.what, self.path, exc) from exc

    def close(self) -> None:
        try:
            self._file.close()
        except OSError as exc:
            raise OutputError(self.what, self.path, exc) from exc


def check_writable(path, what: str) -> None:
    """OutputError unless a file can be created beside ``path`` (its directory exists and we
    may write there): creates a temporary there and removes it. Not collective."""
    path = Path(path)
    f, tmp = _create_beside(path, 0o600, what)
    f.close()
    _remove(tmp)


def remove_abandoned(directory) -> None:
    """Removes the temporaries in ``directory`` whose writer is no longer running (a process
    of this host killed mid-write). Not collective."""
    for entry in os.scandir(directory):
        m = _ABANDONED.match(entry.name)
        if m and not _pid_alive(int(m.group(1))):
            _remove(entry.path)


def fsync_directory(directory) -> None:
    """Makes the entries of ``directory`` (a rename into it) durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _create_beside(path: Path, mode: int, what: str) -> tuple:
    """(binary file, its name): a new file in ``path``'s directory, from mkstemp."""
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.tmp-{os.getpid()}-")
    except OSError as exc:
        raise OutputError(what, path, exc) from exc
    try:
        os.fchmod(fd, mode & ~_umask())
    except OSError as exc:
        os.close(fd)
        _remove(tmp)
        raise OutputError(what, path, exc) from exc
    return os.fdopen(fd, "wb"), tmp


def _publish(f: BinaryIO, tmp: str, path: Path) -> None:
    f.flush()
    os.fsync(f.fileno())
    os.replace(tmp, path)  # replaces a link at ``path``; never follows it
    fsync_directory(path.parent)


def _copy_if_regular(path: Path, f: BinaryIO) -> None:
    """Copies the regular file at ``path`` into ``f``; nothing when there is none, or when a
    symlink, a FIFO or a device sits there (not opened through: O_NOFOLLOW, O_NONBLOCK)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except (FileNotFoundError, IsADirectoryError):
        return
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a symlink, which O_NOFOLLOW refused to open
            return
        raise
    with os.fdopen(fd, "rb") as old:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            shutil.copyfileobj(old, f)


def _remove(name: str) -> None:
    try:
        os.unlink(name)
    except FileNotFoundError:
        pass


def _umask() -> int:
    """This process's umask, read without changing it (Linux); else by setting it back."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:
        return True
    return True
