"""The lock that makes one run the only writer of a checkpoint directory or a JSON log, held
for the run's life by the training tool's rank 0 or by the supervisor for its whole
supervised run (Note [One run per directory])."""
from __future__ import annotations

import errno
import fcntl
import json
import os
import secrets
import shlex
import socket
import sys
import time
from pathlib import Path
from typing import Optional

from . import _pid_alive, _remove  # (Note [Writing a file]'s)

# Note [One run per directory]
# Two runs writing one checkpoint directory or one JSON log mix their files with no error:
# each passes the emptiness check before the other's first checkpoint, both name the same
# ckpt-....pt, and each log replaces the other's (AppendedFile publishes a copy). So the
# writer of a run (the training tool's rank 0, which writes both; the supervisor for the
# whole supervised run) holds an exclusive flock(2) on a lock file for the run's life:
# D/.mpidp-lock in a checkpoint directory, .NAME.lock beside a log NAME. The kernel drops
# the lock when the last descriptor of its open file closes, however the holder ends
# (SIGKILL included), so a crash never leaves it "held"; the file itself is removed at a
# clean release (by the process that took it: a child that user code forked inside fit
# leaves it alone), and found again (locked afresh) after a crash. The holder writes who it
# is into the file (one JSON line: pid, host, start, command line, a random token of the
# process; written over the old line, then cut to its length, so that a full disk leaves
# the old line rather than none), mode 0644 so that other users can read it, and a run that
# finds the lock held is refused in one line naming that (exit 2). Straight after a holder
# was killed its job's ranks may hold the lock a second or two longer (Note [The job's
# processes] in mpidp/run/processes.py): where the recorded holder is a process of this host
# that has ended, a run waits up to HOLDER_GONE_WAIT_S for the lock before it is refused.
# A lock file another user's crashed run left, which we cannot open for writing: it is
# opened read-only (flock needs no more), and when free it is replaced by one of ours; where
# the directory does not let us remove it (sticky), we hold it without writing our name. One
# we cannot even read (0600, from an mpidp before 0644) cannot be flocked, and so is refused
# in one line ("cannot lock"): removing a file whose holder may be alive would let two runs in.
# The supervisor's job is its own run: the supervisor names its locks in MPIDP_RUN_LOCK for
# the job ("TOKEN:DEV:INO" per lock file, comma-separated), and a training tool that finds
# the lock held goes on without a lock of its own where the lock file is one of those (by
# device and inode: it needs no record, which a full disk may have kept the supervisor from
# writing) or where the record carries that token (a rank 0 on another node, whose device
# numbers of a shared file system may differ). The supervisor also lets its job inherit the
# lock's descriptor (where mpiexec keeps it: on this machine), so that ranks left running
# after a supervisor was killed still hold the directory until they are gone.
# What this does not cover: a job's rank 0 on another node (a host list whose first host is
# not this one) holds neither the lock nor an inherited descriptor of it. If the supervisor
# dies outright, its launcher dies with it and Hydra's proxies end the ranks when its
# connection drops; until they have, a run started again on the same directory on the
# supervisor's host finds the lock free and may start beside that rank 0 (seconds, bounded
# by the proxies' teardown). A file system without flock (a Lustre or NFS mount without
# lock support) cannot be locked: the run goes on, with a warning saying that nothing stops
# a second run there.
LOCK_VARIABLE = "MPIDP_RUN_LOCK"  # the supervisor's locks, for its job: TOKEN:DEV:INO,...
HOLDER_GONE_WAIT_S = 5.0  # how long a run waits for the processes of an ended holder
_TOKEN = secrets.token_hex(8)  # this process's


class InUseError(ValueError):
    """The lock is held by another run; ``str()`` is one line naming it."""


class LockError(ValueError):
    """The lock file cannot be opened or created; ``str()`` is one line naming it."""


class RunLock:
    """One run's hold on a checkpoint directory or a log file (Note [One run per
    directory]): ``lock_run`` takes it; ``release`` (or the end of the process) lets it go.
    ``held``: this process holds the flock (False: its supervisor does, or the file system
    cannot lock); ``warning``: a line to show where it could not be locked."""

    def __init__(self, path: Path, fd: Optional[int], warning: Optional[str] = None):
        self.path, self.fd, self.warning = path, fd, warning
        self.owner = os.getpid()  # a child forked by user code must not release it

    @property
    def held(self) -> bool:
        return self.fd is not None

    @property
    def identity(self) -> str:
        """"TOKEN:DEV:INO" of the held lock: how the holder's job knows it (LOCK_VARIABLE)."""
        st = os.fstat(self.fd)
        return f"{_TOKEN}:{st.st_dev}:{st.st_ino}"

    def release(self, remove: bool = True) -> None:
        """Lets the lock go; ``remove``: the lock file too (only where no process this one
        started may still hold an inherited descriptor of it). Nothing in a process forked
        from the one that took it: the lock and its file stay its parent's."""
        if os.getpid() != self.owner:
            return
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
    """This process's token (the first field of each of its locks' ``identity``)."""
    return _TOKEN


def job_variable(locks) -> str:
    """The value of LOCK_VARIABLE for the job of a process holding ``locks``."""
    return ",".join(lock.identity for lock in locks if lock.held) or _TOKEN


def checkpoint_directory(d, resume: bool) -> None:
    """The training tool's --checkpoint-dir ``d`` made ready, as the tool and its supervisor
    both do before locking it: under --resume (``resume``) it must exist (a typo must not
    leave an empty directory), else it is created 0700 where missing. ValueError, one line."""
    d = Path(d)
    if resume and not d.is_dir():
        raise ValueError(f"--resume: --checkpoint-dir {d} does not exist, so there is "
                         "nothing to continue")
    try:
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--checkpoint-dir {d}: cannot create: {exc.strerror}") from None


def lock_run(target, what: str, *, directory: bool, command: Optional[str] = None) -> RunLock:
    """Takes the run's lock on ``target`` (a checkpoint directory if ``directory``, which
    must exist, else a file, whose directory must exist): Note [One run per directory].
    ``what`` names it in messages ("--checkpoint-dir ck"); ``command``: this run's command
    line (default: this process's). Returns the RunLock; a lock held by this process's
    supervisor (LOCK_VARIABLE) is returned not held. InUseError, one line naming the run that
    holds it (after up to HOLDER_GONE_WAIT_S where that run has ended on this host);
    LockError, one line, where the lock file cannot be opened. Not collective."""
    path = lock_path(target, directory)
    tries, wait_until = 0, None
    while True:
        fd, writable = _open_lock_file(path, what)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES):  # no locks on this file system
                os.close(fd)
                return RunLock(path, None, f"warning: cannot lock {what} ({exc.strerror}): "
                                           "nothing stops a second run from using it too")
            ours, holder = _supervisors(fd)
            os.close(fd)
            if ours:
                return RunLock(path, None)  # our supervisor's: this run is its job
            if _has_ended(holder):  # its processes still ending: wait for them a little
                wait_until = wait_until or time.monotonic() + HOLDER_GONE_WAIT_S
                if time.monotonic() < wait_until:
                    time.sleep(0.1)
                    continue
            raise InUseError(f"{what} is in use by another run ({describe_holder(holder)}): "
                             "wait for it to end, or choose another") from None
        try:
            same = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            same = None
        mine = os.fstat(fd)
        if same is None or (same.st_dev, same.st_ino) != (mine.st_dev, mine.st_ino) or \
                not writable and _unlinked(path):
            os.close(fd)  # removed (perhaps created again), or a stale file replaced: again
            tries += 1
            if tries < 100:
                continue
            raise LockError(f"{what}: cannot lock: its lock file {path} was removed and "
                            "created again at every try")
        if writable:
            _write_record(fd, command)
        return RunLock(path, fd)


def _open_lock_file(path: Path, what: str) -> tuple:
    """(descriptor, writable): the lock file at ``path`` opened for writing (created 0644
    where missing), or read-only where it is another user's (Note [One run per directory])."""
    flags = os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | flags, 0o644)
    except PermissionError as exc:
        try:
            return os.open(path, os.O_RDONLY | flags), False
        except FileNotFoundError:  # none there, and we may not create one
            raise LockError(f"{what}: cannot lock: {exc.strerror}") from None
        except OSError:  # another user's, 0600 (an mpidp before 0644): who holds it is hidden
            raise LockError(f"{what}: cannot lock: its lock file {path} is not readable "
                            f"({exc.strerror}): its owner may remove it once no run of "
                            "theirs uses it") from None
    except OSError as exc:
        raise LockError(f"{what}: cannot lock: {exc.strerror}") from None
    try:
        os.fchmod(fd, 0o644)  # whatever the umask: the holder is named to other users too
    except OSError:
        pass  # another user's, which we may write
    return fd, True


def _unlinked(path: Path) -> bool:
    """Removes the stale lock file ``path`` (ours locked, another user's); False where the
    directory does not let us (sticky)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


def _write_record(fd: int, command: Optional[str]) -> None:
    """Names the holder in its lock file: over the old record, then cut to its length."""
    record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
              "command": command or shlex.join(sys.orig_argv), "token": _TOKEN}
    data = (json.dumps(record) + "\n").encode()
    try:
        if os.pwrite(fd, data, 0) == len(data):
            os.ftruncate(fd, len(data))
    except OSError:  # a full disk: held all the same, only not named to a second run
        pass


def _supervisors(fd: int) -> tuple:
    """(whether the held lock file ``fd`` is one of this process's supervisor's, what its
    holder wrote): by device and inode, else by the record's token (LOCK_VARIABLE)."""
    entries = [e.split(":") for e in os.environ.get(LOCK_VARIABLE, "").split(",") if e]
    st = os.fstat(fd)
    if any(e[1:] == [str(st.st_dev), str(st.st_ino)] for e in entries):
        return True, {}
    holder = _holder(fd)
    return bool(holder.get("token")) and any(e[0] == holder["token"] for e in entries), holder


def _has_ended(holder: dict) -> bool:
    """Whether the recorded holder is a process of this host that has ended."""
    pid = holder.get("pid")
    return holder.get("host") == socket.gethostname() and isinstance(pid, int) and \
        not _pid_alive(pid)


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
    if _has_ended(holder):
        words += f"; pid {pid} has ended, processes it started still hold it"
    return words
