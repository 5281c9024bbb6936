"""The job's processes on this machine: the launcher started so that it dies with the
supervisor, and every process of an attempt known to be gone before the next starts (Note
[The job's processes])."""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os
import select
import signal
import subprocess
import time
from typing import Mapping, Optional, Sequence

# Note [The job's processes]
# Hydra's mpiexec starts a proxy per node in a session of its own, and the proxy each rank in
# another (setsid), so the launcher's session holds none of the ranks and killing its process
# group misses them: after mpiexec died of SIGKILL its ranks lived on for 1.3-1.7 s, and a
# relaunch started beside them. Two things close that:
# - The launcher dies with the supervisor: it is started with PR_SET_PDEATHSIG = SIGKILL
#   (Linux), so a supervisor killed outright (SIGKILL, the out-of-memory killer) takes its
#   mpiexec along, and Hydra's proxies then end the ranks, as after any mpiexec killed.
#   A supervisor that dies between the fork and the prctl call is caught too: the child
#   compares its parent with the supervisor's pid taken before the fork, and ends at once
#   where they differ. Until the ranks are gone they still hold the run's lock, whose
#   descriptor they inherited (Note [One run per directory] in mpidp/run_lock.py): a
#   supervisor started again on the same directory waits a few seconds for them, and is
#   refused if they remain, never run beside them.
# - Each attempt's processes on this machine are known by a pipe: its write end is inherited
#   by the launcher, the proxies and the ranks (Hydra keeps inherited descriptors, and so do
#   Python, MPICH and torch), the supervisor keeps the read end, which reads end-of-file once
#   the last of them has exited. When the launcher has exited, any process still holding the
#   pipe is a leftover: the supervisor SIGKILLs each (found by the pipe in /proc/PID/fd; the
#   signal goes through a pidfd opened before the pipe is looked for again, so a pid reused
#   meanwhile is never hit; nothing is sent to the launcher's process group, whose number may
#   be another's once the launcher was reaped) and waits up to END_S for the end-of-file
#   before it judges the exit, relaunches, or ends. A process that outlives that (stuck in
#   the kernel: a hung file system or device) is kept in mind across attempts: while any
#   remains the supervisor does not relaunch (it ends with the job's exit code and one line
#   naming them) and leaves the lock files in place, which they hold.
# Whatever inherits the pipe counts as the job's: an ssh ControlMaster that Hydra's ssh
# launcher started (ControlPersist in ~/.ssh/config) holds it and is killed as a leftover
# with the rest (the next ssh starts a new one).
# Processes on other nodes hold no descriptor of ours; Hydra's proxies there end their ranks
# when mpiexec's connection drops (and a job's rank 0 there holds no lock: Note [One run per
# directory]).

PR_SET_PDEATHSIG = 1
_prctl = None


def _die_with_parent(parent: int) -> None:
    """In the launcher, between fork and exec: SIGKILL when the supervisor (pid ``parent``)
    dies; the end at once where it died before the prctl call."""
    if _prctl is not None:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)


def _load_prctl():
    global _prctl
    if _prctl is None and os.uname().sysname == "Linux":
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _prctl = libc.prctl  # resolved here, before any fork
    return _prctl


class Launch:
    """One attempt's launcher (``popen``) and the pipe that tells when all of this machine's
    processes of that attempt are gone."""

    def __init__(self, line: Sequence[str], env: Optional[Mapping[str, str]],
                 keep_fds: Sequence[int] = ()):
        read_end, write_end = os.pipe()  # both close-on-exec; pass_fds hands on write_end
        try:
            self.popen = subprocess.Popen(
                list(line), start_new_session=True, env=env,
                pass_fds=(write_end, *keep_fds),
                preexec_fn=functools.partial(_die_with_parent, os.getpid())
                if _load_prctl() is not None else None)
        except BaseException:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)
        self._read_end: Optional[int] = read_end
        self._pipe = os.readlink(f"/proc/self/fd/{read_end}") \
            if os.path.exists(f"/proc/self/fd/{read_end}") else None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def gone(self, timeout_s: float) -> bool:
        """Whether every process of the attempt on this machine has exited, waiting at most
        ``timeout_s`` for it."""
        if self._read_end is None:
            return True
        deadline = time.monotonic() + timeout_s
        while True:
            ready, _, _ = select.select([self._read_end], [], [],
                                        max(0.0, deadline - time.monotonic()))
            if not ready:
                return False
            if not os.read(self._read_end, 4096):  # end of file: no writer left
                os.close(self._read_end)
                self._read_end = None
                return True

    def end_leftovers(self, timeout_s: float) -> list:
        """Once the launcher has exited: SIGKILL every process still holding the attempt's
        pipe (Note [The job's processes]) and wait up to ``timeout_s`` for them to go.
        Returns the pids of those still there after that (none, normally)."""
        assert self.popen.poll() is not None, "the launcher still runs"
        if self.gone(0.0):
            return []
        for pid in self.holders():
            _kill_holder(pid, self._pipe)
        return [] if self.gone(timeout_s) else self.holders()

    def close(self) -> None:
        if self._read_end is not None:
            os.close(self._read_end)
            self._read_end = None

    def holders(self) -> list:
        """The other processes of this machine with the attempt's pipe open."""
        if self._pipe is None or self._read_end is None:
            return []
        found = []
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            if self._pipe in _open_files(entry.name):
                found.append(int(entry.name))
        return found


def _kill_holder(pid: int, pipe: str) -> None:
    """SIGKILL to process ``pid`` if it still holds ``pipe``: through a pidfd taken before
    that is checked, so that a pid reused since the scan is never hit (os.kill where this
    Python or kernel has no pidfds)."""
    try:
        fd = os.pidfd_open(pid)
    except AttributeError:  # Python < 3.9
        fd = None
    except OSError as exc:
        if exc.errno != errno.ENOSYS:  # gone (ESRCH), or not ours
            return
        fd = None  # Linux < 5.3
    try:
        if pipe not in _open_files(str(pid)):
            return
        if fd is None:
            os.kill(pid, signal.SIGKILL)
        else:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    finally:
        if fd is not None:
            os.close(fd)


def _open_files(pid: str) -> set:
    """What the descriptors of process ``pid`` name ("pipe:[123]", paths); empty where it is
    gone or not ours to look at."""
    names = set()
    try:
        with os.scandir(f"/proc/{pid}/fd") as fds:
            for fd in fds:
                try:
                    names.add(os.readlink(fd.path))
                except OSError:  # closed meanwhile
                    pass
    except OSError:
        pass
    return names
