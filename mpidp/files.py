"""The files mpidp writes (checkpoints, the JSON log, the timeline, benchmark results): each
created beside its final name under a name no one can guess, and renamed over it
(Note [Writing a file]); and the lock that makes one run the only writer of a checkpoint
directory or a log (Note [One run per directory])."""
from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import secrets
import shlex
import shutil
import socket
import stat
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, BinaryIO, Callable, Optional

from .errors import OutputError

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


# Note [One run per directory]
# Two runs writing one checkpoint directory or one JSON log mix their files with no error:
# each passes the emptiness check before the other's first checkpoint, both name the same
# ckpt-....pt, and each log replaces the other's (AppendedFile publishes a copy). So the
# writer of a run (the training tool's rank 0, which writes both; the supervisor for the
# whole supervised run) holds an exclusive flock(2) on a lock file for the run's life:
# D/.mpidp-lock in a checkpoint directory, .NAME.lock beside a log NAME. The kernel drops
# the lock when the last descriptor of its open file closes, however the holder ends
# (SIGKILL included), so a crash never leaves it "held"; the file itself is removed at a
# clean release, and found again (locked afresh) after a crash. The holder writes who it is
# into the file (one JSON line: pid, host, start, command line, a random token of the
# process), and a run that finds the lock held is refused in one line naming that (exit 2).
# The supervisor's job is its own run: the supervisor names its token in MPIDP_RUN_LOCK for
# the job, and a training tool that finds the lock held under that token goes on without a
# lock of its own. The supervisor also lets its job inherit the lock's descriptor (where
# mpiexec keeps it: on this machine), so that ranks left running after a supervisor was
# killed still hold the directory until they are gone. A file system without flock (a
# Lustre or NFS mount without lock support) cannot be locked: the run goes on, with a
# warning saying that nothing stops a second run there.
LOCK_VARIABLE = "MPIDP_RUN_LOCK"  # the supervisor's token, for its job
_TOKEN = secrets.token_hex(8)  # this process's


class InUseError(ValueError):
    """The lock is held by another run; ``str()`` is one line naming it."""


class RunLock:
    """One run's hold on a checkpoint directory or a log file (Note [One run per
    directory]): ``lock_run`` takes it; ``release`` (or the end of the process) lets it go.
    ``held``: this process holds the flock (False: its supervisor does, or the file system
    cannot lock); ``warning``: a line to show where it could not be locked."""

    def __init__(self, path: Path, fd: Optional[int], warning: Optional[str] = None):
        self.path, self.fd, self.warning = path, fd, warning

    @property
    def held(self) -> bool:
        return self.fd is not None

    def release(self, remove: bool = True) -> None:
        """Lets the lock go; ``remove``: the lock file too (only where no process this one
        started may still hold an inherited descriptor of it)."""
        fd, self.fd = self.fd, None
        if fd is None:
            return
        try:
            if remove:
                _remove(str(self.path))
        finally:
            os.close(fd)

    def __del__(self):
        if getattr(self, "fd", None) is not None:
            self.release()


def lock_path(target, directory: bool) -> Path:
    """The lock file of the checkpoint directory (``directory``) or the file ``target``."""
    target = Path(target)
    return target / ".mpidp-lock" if directory else target.parent / f".{target.name}.lock"


def run_token() -> str:
    """This process's token: what a supervisor puts in LOCK_VARIABLE for its job."""
    return _TOKEN


def lock_run(target, what: str, *, directory: bool, command: Optional[str] = None) -> RunLock:
    """Takes the run's lock on ``target`` (a checkpoint directory if ``directory``, which
    must exist, else a file, whose directory must exist): Note [One run per directory].
    ``what`` names it in messages ("--checkpoint-dir ck"); ``command``: this run's command
    line (default: this process's). Returns the RunLock; a lock held by this process's
    supervisor (LOCK_VARIABLE) is returned not held. InUseError, one line naming the run that
    holds it; OutputError where the lock file cannot be created. Not collective."""
    path = lock_path(target, directory)
    for _ in range(100):  # another run may remove the file between our open and our flock
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise OutputError(f"the lock file of {what}", path, exc) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _holder(fd) if exc.errno in (errno.EAGAIN, errno.EACCES) else None
            os.close(fd)
            if exc.errno not in (errno.EAGAIN, errno.EACCES):  # no locks on this file system
                return RunLock(path, None, f"warning: cannot lock {what} ({exc.strerror}): "
                                           "nothing stops a second run from using it too")
            if holder.get("token") and holder.get("token") == os.environ.get(LOCK_VARIABLE):
                return RunLock(path, None)  # our supervisor's: this run is its job
            raise InUseError(f"{what} is in use by another run ({describe_holder(holder)}): "
                             "wait for it to end, or choose another") from None
        try:
            same = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            same = None
        mine = os.fstat(fd)
        if same is None or (same.st_dev, same.st_ino) != (mine.st_dev, mine.st_ino):
            os.close(fd)  # removed (and perhaps created again) by its last holder: again
            continue
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                  "command": command or shlex.join(sys.orig_argv), "token": _TOKEN}
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        except OSError:  # a full disk: held all the same, only not named to a second run
            pass
        return RunLock(path, fd)
    raise OutputError(f"the lock file of {what}", path,
                      OSError(errno.EBUSY, "removed and created again at every try"))


def _holder(fd: int) -> dict:
    """What the holder of the lock file ``fd`` wrote (it writes just after locking: an empty
    file is read again, for at most a second); {} where nothing readable is there."""
    for _ in range(20):
        try:
            text = os.pread(fd, 4096, 0)
        except OSError:
            return {}
        if text.strip():
            try:
                found = json.loads(text)
            except ValueError:
                return {}
            return found if isinstance(found, dict) else {}
        time.sleep(0.05)
    return {}


def describe_holder(holder: dict) -> str:
    """The lock holder of ``holder`` (what ``_holder`` read) in words: pid, host, start,
    command line, and whether that process has ended (its ranks still holding the lock)."""
    if not holder:
        return "one that has not written its name"
    pid, host = holder.get("pid"), holder.get("host")
    words = f"pid {pid} on {host}"
    if isinstance(holder.get("started"), (int, float)):
        words += ", since " + time.strftime("%Y-%m-%d %H:%M:%S",
                                             time.localtime(holder["started"]))
    command = str(holder.get("command", ""))
    if command:
        words += ": " + (command if len(command) <= 200 else command[:197] + "...")
    if host == socket.gethostname() and isinstance(pid, int) and not _pid_alive(pid):
        words += f"; pid {pid} has ended, processes it started still hold it"
    return words
