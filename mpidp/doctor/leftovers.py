"""Files that MPICH and Hydra leave behind when a job dies without MPI_Finalize (MPI_Abort, a
kill, a segfault): which of them belong to dead jobs on this host. Reads directories and
/proc only; never deletes anything.

Note [Leftover files]: measured with the mpich 5.0.2 wheel (ch4, Hydra). A job creates
  - ``/dev/shm/mpich_shm_<hex>_0``, its node's shared memory, about 1 MiB per local rank
    (1061440 B for 1 rank, 2118784 B for 2, 3176128 B for 3), open and mapped by every local
    rank until MPI_Finalize removes it; MPI_Abort or a killed rank leaves it;
  - ``/tmp/hydra_hwloc_xmlfile_XXXXXX`` (about 5.5 KiB; a fixed /tmp, not $TMPDIR), held open
    by Hydra's proxy, removed when the proxy ends normally (also after a killed rank), left
    after MPI_Abort;
  - ``/dev/shm/mpich_shar_tmpXXXXXX`` (``/tmp/`` when /dev/shm is unusable) for each shared
    window (MPI_Win_allocate_shared, mpidp.init's windows), unlinked as soon as the node's
    ranks have mapped it: left only by a job killed in those milliseconds.
UCX's ``/dev/shm/ucx_shm_posix_*`` and the System V segment are unlinked while the job runs and
vanish with it. All are mode 0600, owned by the job's user, and held (open or mapped) by a
process of that user while the job lives: a file of ours that no process of ours holds is a
dead job's."""
from __future__ import annotations

import os
import stat
from typing import Iterable, List, NamedTuple, Optional, Sequence, Tuple

# (directory, name prefix) of each kind of leftover, in the order they are reported
PATTERNS: Tuple[Tuple[str, str], ...] = (("/dev/shm", "mpich_shm_"),
                                         ("/dev/shm", "mpich_shar_tmp"),
                                         ("/tmp", "hydra_hwloc_xmlfile_"),
                                         ("/tmp", "mpich_shar_tmp"))


def globs(patterns: Sequence[Tuple[str, str]] = PATTERNS) -> str:
    """The patterns as a reader writes them: "/dev/shm/mpich_shm_*, ..."."""
    return ", ".join(f"{directory}/{prefix}*" for directory, prefix in patterns)


class Leftover(NamedTuple):
    path: str
    size_bytes: int
    pattern: str  # the kind, as a glob: "/dev/shm/mpich_shm_*"


def candidates(patterns: Sequence[Tuple[str, str]], uid: int) -> List[Leftover]:
    """Regular files (never a symlink) named ``prefix*`` in each directory and owned by
    ``uid``, in pattern order then by name; a directory that cannot be read is skipped."""
    out = []
    for directory, prefix in patterns:
        directory = os.path.realpath(directory)  # /proc names files by their real path
        try:
            names = sorted(n for n in os.listdir(directory) if n.startswith(prefix))
        except OSError:
            continue
        for name in names:
            path = os.path.join(directory, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode) and st.st_uid == uid:
                out.append(Leftover(path, st.st_size, os.path.join(directory, prefix) + "*"))
    return out


def _user_pids(proc: str, uid: int) -> Iterable[str]:
    try:
        entries = os.listdir(proc)
    except OSError:
        return
    for pid in entries:
        if not pid.isdigit():
            continue
        try:
            if os.stat(os.path.join(proc, pid)).st_uid == uid:
                yield pid
        except OSError:  # exited since the listing
            continue


def _open_files(proc: str, pid: str) -> set:
    fd_dir = os.path.join(proc, pid, "fd")
    out = set()
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return out
    for fd in fds:
        try:
            out.add(os.readlink(os.path.join(fd_dir, fd)))
        except OSError:
            continue
    return out


def held(paths: Iterable[str], proc: str = "/proc", uid: Optional[int] = None) -> set:
    """Those of ``paths`` that a process of ``uid`` (default: this user) has open or mapped,
    from /proc/PID/fd and /proc/PID/maps; a process that cannot be read counts as holding
    nothing. The open files of every process are read first; maps only for what is left."""
    uid = os.geteuid() if uid is None else uid
    paths = set(paths)
    left = set(paths)
    if not left:
        return left
    pids = list(_user_pids(proc, uid))
    for pid in pids:
        left -= _open_files(proc, pid)
        if not left:
            return paths
    for pid in pids:
        try:
            with open(os.path.join(proc, pid, "maps"), encoding="utf-8",
                      errors="surrogateescape") as f:
                maps = f.read()
        except OSError:
            continue
        left = {p for p in left if p + "\n" not in maps}  # a mapping's line ends with its path
        if not left:
            break
    return paths - left


def dead_files(patterns: Sequence[Tuple[str, str]] = PATTERNS, proc: str = "/proc",
               uid: Optional[int] = None) -> List[Leftover]:
    """The files matching ``patterns`` that this user (or ``uid``) owns, no process of theirs
    holds, and that still exist after the check (a job that was finishing removes its own)."""
    uid = os.geteuid() if uid is None else uid
    found = candidates(patterns, uid)
    busy = held([f.path for f in found], proc, uid)
    return [f for f in found if f.path not in busy and os.path.lexists(f.path)]
