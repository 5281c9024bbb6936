"""The supervisor's loop: launch, wait, judge the exit, probe the nodes, relaunch with
--resume on the ones that answer (Note [Supervising a run])."""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple, Optional, Sequence

from .. import files
from ..files import run_lock
from ..errors import OutputError
from ..runtime.exit import REFUSED, output_failure
from ..runtime.hostlist import format_hosts
from ..runtime.launcher import OPEN_MPI_FT_ARGS, Mpiexec
from ..train import checkpoint_names
from . import allocation, policy, probe
from .processes import Launch

PROG = "mpidp.run"
HEARTBEAT_S = 10.0  # Note [Heartbeat]: how often the nodes of a running job are probed
END_S = 20.0  # a job ended by the supervisor has this long to abort before it is killed
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

# Note [Supervising a run]
# The supervisor owns the launch: it runs `mpiexec -n N [-hosts ...] COMMAND` in a session of
# its own (a Ctrl-C at the terminal reaches the supervisor alone, which passes each signal on
# once: Hydra takes a second Ctrl-C as "kill everything now"), waits for it, and judges the
# exit (Note [What is retried] in policy.py). Ranks go to the first hosts of the list whose
# slots hold them (as Hydra places them), and only those are launched on and watched. To
# relaunch it probes every node of the original list (Note [Probing the nodes] in probe.py:
# a node dropped at one restart is back at the next once it answers), keeps those that
# answer, and relaunches the same command with --resume on min(N, their slots) ranks, down
# to --min-ranks (the training tool resumes on another number of ranks where its mode can:
# docs/operations.md). Without a host list (none given, no HYDRA_HOST_FILE) the job runs on
# this machine and is relaunched there on N ranks. Each restart is one line on stderr and one
# "restart" event in the command's --log-json file, and the end of the supervision one
# "supervised" event (the restarts, and the steps lost: those the failed attempts had logged
# past the checkpoint each restart resumed from, so at least that many). If the supervisor
# stops while its job runs (an error of its own), it ends the job first. For the whole
# supervised run it holds the lock of the checkpoint directory and of the log, which its job
# shares (Note [One run per directory] in mpidp/run_lock.py), and no attempt starts before every
# process of the previous one on this machine is gone: one that SIGKILL does not end within
# END_S ends the supervision instead, in one line naming it (Note [The job's processes] in
# processes.py). Nothing lives outside the checkpoint directory and the log, and no port is
# opened. A log it cannot write ends the supervision in one line (exit 3 where the cause
# stays, a full disk: Note [Exit codes] in mpidp/runtime/exit.py).
#
# Note [Heartbeat]
# A node lost with its network leaves its peers waiting in a collective that never ends, and
# only the watchdog (MPIDP_TIMEOUT_S, 180 s by default: it must outlast a slow checkpoint or
# step) would end the job. With a host list the supervisor does not wait for that: every
# --heartbeat seconds while the job runs it probes the job's nodes as it probes them before a
# relaunch, and a node that fails two probes in a row (one slow answer from a busy node is
# not a loss) ends the job (SIGINT to the launcher: it ends a --checkpoint-on-signal run
# too; SIGKILL to the launcher's session after END_S) and counts as a lost node: relaunched
# without it, and not probed again before that relaunch. A node is found lost within about
# heartbeat + 2 x probe timeout.


class Attempt(NamedTuple):
    ranks: int
    hosts: Optional[list]  # [Host], or None: this machine
    resumed_from: Optional[Path]


def option_value(command: Sequence[str], name: str) -> Optional[str]:
    """The value of ``name`` (``--name X`` or ``--name=X``) in ``command``, the last one wins."""
    found = None
    for i, word in enumerate(command):
        if word == name and i + 1 < len(command):
            found = command[i + 1]
        elif word.startswith(name + "="):
            found = word.split("=", 1)[1]
    return found


def with_resume(command: Sequence[str]) -> list:
    return list(command) + ([] if "--resume" in command else ["--resume"])


def placed(hosts: Sequence, ranks: int) -> list:
    """The first hosts of ``hosts`` whose slots hold ``ranks`` ranks: where Hydra puts them."""
    out, room = [], 0
    for h in hosts:
        if room >= ranks:
            break
        out.append(h)
        room += h.slots
    return out


def launch_line(mpiexec: Mpiexec, attempt: Attempt, command: Sequence[str],
                in_job: bool = False) -> list:
    """The launcher's command line for ``attempt``: with Open MPI's options for a job that
    outlives a lost rank where ``in_job`` (Note [In-job recovery under the supervisor] in
    cli.py)."""
    where = mpiexec.hosts(format_hosts(attempt.hosts)) if attempt.hosts else mpiexec.here()
    if in_job:
        where = [*OPEN_MPI_FT_ARGS, *(a for a in where if a not in OPEN_MPI_FT_ARGS)]
    body = with_resume(command) if attempt.resumed_from is not None else list(command)
    return [mpiexec.path, "-n", str(attempt.ranks), *where, *body]


def _logged_steps(path: Optional[Path], start: int) -> Optional[int]:
    """The highest global_step among the events appended to the JSON log at ``path`` past
    byte ``start`` (None: none, or no log)."""
    if path is None or not path.exists():
        return None
    best = None
    with open(path, "rb") as f:
        f.seek(start)
        for line in f:
            try:
                step = json.loads(line).get("global_step")
            except (ValueError, AttributeError):
                continue
            if isinstance(step, int):
                best = step if best is None else max(best, step)
    return best


class Supervisor:
    def __init__(self, command: Sequence[str], ranks: int, hosts: Optional[list],
                 max_restarts: int, min_ranks: int, mpiexec: Mpiexec,
                 probe_s: float = probe.PROBE_S, heartbeat_s: float = HEARTBEAT_S,
                 in_job: bool = False, first_line: Optional[str] = None):
        self.command, self.ranks, self.hosts = list(command), ranks, hosts
        self.max_restarts, self.min_ranks, self.mpiexec = max_restarts, min_ranks, mpiexec
        self.in_job = in_job  # Note [In-job recovery under the supervisor] in cli.py
        self.first_line = first_line  # said once the run's locks are held
        self.probe_s, self.heartbeat_s = probe_s, heartbeat_s
        self.directory = Path(option_value(command, "--checkpoint-dir"))
        log = option_value(command, "--log-json")
        self.log_path = Path(log) if log else None
        self.signalled: Optional[int] = None
        self.unsent: list = []  # signals for the job, passed on once it runs
        self.child = None  # the launcher of the attempt that runs
        self.launch: Optional[Launch] = None  # that attempt's processes
        self.locks: list = []  # Note [One run per directory]
        self.lingering: list = []  # the Launches of attempts whose processes SIGKILL did not end
        self.leftovers: list = []  # their pids: Note [The job's processes]
        self.restarts = 0
        self.steps_lost = 0

    def say(self, text: str) -> None:
        sys.stderr.write(f"{PROG}: {text}\n")
        sys.stderr.flush()

    def record(self, event: dict) -> None:
        """One event in the command's --log-json file, on a line of its own (a rank killed
        mid-line leaves a torn last line: it is ended first)."""
        if self.log_path is None:
            return
        torn = False
        if self.log_path.exists() and self.log_path.stat().st_size:
            with open(self.log_path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                torn = f.read(1) != b"\n"
        log = files.AppendedFile(self.log_path, "JSON log")
        try:
            log.write_line(("\n" if torn else "") + json.dumps(event, sort_keys=True))
        finally:
            log.close()

    def _on_signal(self, signum: int, frame) -> None:
        """SIGINT, SIGTERM, SIGHUP: the first ends the supervision and goes to the job; each
        later one goes to the job too (Hydra's mpiexec takes a second Ctrl-C as "kill every
        process now")."""
        self.signalled = self.signalled or signum
        self.unsent.append(signum)
        self._pass_signals()

    def _pass_signals(self) -> None:
        while self.unsent and self.child is not None and self.child.poll() is None:
            os.kill(self.child.pid, self.unsent.pop(0))

    def run(self) -> int:
        """Supervises the run to its end; returns the supervisor's exit code (Note [Exit
        codes] in mpidp/runtime/exit.py)."""
        try:
            try:
                self._take_locks()
            except ValueError as exc:  # in use by another run, or unusable
                self.say(f"error: {exc}")
                return REFUSED
            if self.first_line:
                self.say(self.first_line)
            return self._supervise()
        finally:
            self._end_leftovers()
            for lock in reversed(self.locks):  # its file stays while a leftover holds it
                lock.release(remove=not self.leftovers)
            for launch in self.lingering:
                launch.close()

    def _supervise(self) -> int:
        previous = {s: signal.signal(s, self._on_signal) for s in SIGNALS}
        try:
            return self._loop()
        except OutputError as exc:  # its JSON log: the job would not write it either
            self.say(f"error: {exc}; the supervision ends")
            return output_failure(exc)
        finally:
            self._stop_child()
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _take_locks(self) -> None:
        """The checkpoint directory's lock (the directory created 0700 if need be) and the
        log's, for the whole supervised run (Note [One run per directory]); ValueError, one
        line, where another run holds one or it cannot be taken."""
        d, log = self.directory, self.log_path
        if log is not None and not log.parent.is_dir():  # before anything is created
            raise ValueError(f"--log-json {log}: cannot lock: its directory does not exist")
        run_lock.checkpoint_directory(d, "--resume" in self.command)
        targets = [(d, f"--checkpoint-dir {d}", True)]
        if log is not None:
            targets.append((log, f"--log-json {log}", False))
        for target, what, directory in targets:
            lock = run_lock.lock_run(target, what, directory=directory)
            self.locks.append(lock)
            if lock.warning:
                self.say(lock.warning)

    def _start(self, line: list, env: dict) -> None:
        """Launches ``line``: the job shares the supervisor's locks (their token in its
        environment, their descriptors inherited) and dies with the supervisor (Note [The
        job's processes])."""
        env = dict(env, **{run_lock.LOCK_VARIABLE: run_lock.job_variable(self.locks)})
        self.launch = Launch(line, env, [lock.fd for lock in self.locks if lock.held])
        self.child = self.launch.popen

    def _end_leftovers(self) -> bool:
        """Once the launcher has exited: the attempt's processes still on this machine
        SIGKILLed and waited for; ``self.leftovers``: those of every attempt still there
        (Note [The job's processes]). Returns whether this attempt left any."""
        left = False
        if self.launch is not None:
            left = bool(self.launch.end_leftovers(END_S))
            if left:
                self.lingering.append(self.launch)
            else:
                self.launch.close()
            self.launch = None
        self.lingering = [launch for launch in self.lingering if not launch.gone(0.0)]
        self.leftovers = sorted(pid for launch in self.lingering for pid in launch.holders())
        return left

    def _stuck(self) -> str:
        return f"process(es) {', '.join(map(str, self.leftovers))} of the job still run " \
            f"{END_S:g} s after SIGKILL, holding its lock"

    def _stop_child(self) -> None:
        """Whatever made the supervisor stop while its job runs (an error of its own, say),
        the job does not outlive it: SIGINT, then SIGKILL to the launcher's session after
        END_S, and its leftovers SIGKILLed."""
        if self.child is not None and self.child.poll() is None:
            self._end_job()
        if self._end_leftovers():
            self.say(f"{self._stuck()}: its lock files are left in place")

    def _newest(self) -> Optional[Path]:
        found = checkpoint_names.existing(self.directory)
        return found[0] if found else None

    def _loop(self) -> int:
        resumed = "--resume" in self.command
        attempt = Attempt(self.ranks, placed(self.hosts, self.ranks) if self.hosts else None,
                          self._newest() if resumed else None)
        while True:
            line = launch_line(self.mpiexec, attempt, self.command, self.in_job)
            self.say(f"attempt {self.restarts + 1}: {shlex.join(line)}")
            log_start = self.log_path.stat().st_size \
                if self.log_path is not None and self.log_path.exists() else 0
            t0 = time.monotonic()
            # a relaunch overlaps what is left of the failed job's step (Note [Inside an
            # allocation] in allocation.py)
            env = dict(os.environ, **(allocation.BESIDE_STEPS if self.restarts else {}))
            self._start(line, env)
            self._pass_signals()  # one that came before the job started
            code, silent = self._wait(attempt.hosts)
            code = 128 - code if code < 0 else code  # the launcher ended by a signal
            self._end_leftovers()  # before anything looks at the directory or starts again
            took = time.monotonic() - t0
            newest = self._newest()
            v = policy.verdict(code, newest is not None, self.signalled, silent)
            if not v.retry or self.leftovers:  # never a relaunch beside them
                return self._end(code, v.why, took)
            logged = _logged_steps(self.log_path, log_start)
            lost = max(0, logged - checkpoint_names.step_of(newest)) if logged is not None else 0
            if self.restarts >= self.max_restarts:
                self.steps_lost += lost
                return self._end(code, f"{v.why}; --max-restarts {self.max_restarts} spent",
                                 took)
            t_probe = time.monotonic()
            hosts, left_out = self._survivors(attempt.hosts, silent)
            probe_s = time.monotonic() - t_probe
            if self.signalled is not None:
                return self._end(code, f"{v.why}; the supervisor was sent "
                                 f"{signal.Signals(self.signalled).name}", took)
            ranks = self.ranks if hosts is None else min(self.ranks, sum(h.slots for h in hosts))
            if ranks < self.min_ranks:
                gone = ", ".join(h.name for h in left_out)
                return self._end(code, f"{v.why}; not answering: {gone or 'none'}; the "
                                 f"{ranks} slot(s) left are fewer than --min-ranks "
                                 f"{self.min_ranks}", took)
            self.restarts += 1
            self.steps_lost += lost
            where = "" if hosts is None else (
                (f"{', '.join(h.name for h in left_out)} does not answer; " if left_out else "")
                + f"on {format_hosts(hosts)}, ")
            self.say(f"the job failed after {took:.1f} s ({v.why}); restart {self.restarts} of "
                     f"{self.max_restarts}: {where}{ranks} rank(s), from {newest.name}")
            self.record({"event": "restart", "restart": self.restarts, "exit_code": code,
                         "cause": v.why, "ranks": ranks, "resumed_from": str(newest),
                         "hosts": None if hosts is None else format_hosts(hosts),
                         "lost_hosts": [h.name for h in left_out], "steps_lost": lost,
                         "failed_after_s": round(took, 3), "probe_s": round(probe_s, 3)})
            attempt = Attempt(ranks, None if hosts is None else placed(hosts, ranks), newest)

    def _wait(self, hosts: Optional[list]) -> tuple:
        """(the job's exit code, the names of the nodes whose silence ended it, or None):
        Note [Heartbeat]."""
        beat = self.heartbeat_s if hosts and self.heartbeat_s > 0 else None
        while True:
            try:
                return self.child.wait(beat), None
            except subprocess.TimeoutExpired:
                pass
            silent = self._silent(hosts)
            if silent:  # once more: one slow answer from a busy node is not a lost node
                silent = self._silent([h for h in hosts if h.name in silent])
            if not silent or self.signalled is not None or self.child.poll() is not None:
                continue
            self.say(f"{', '.join(silent)} stopped answering while the job ran (twice no "
                     f"answer within {self.probe_s:g} s): ending the job")
            return self._end_job(), silent

    def _silent(self, hosts: list) -> list:
        alive = probe.answering(hosts, self.mpiexec, self.probe_s)
        return [h.name for h in hosts if h not in alive]

    def _end_job(self) -> int:
        """Ends the running job: SIGINT to the launcher, which passes it to every rank it
        still reaches (the training tool then aborts the job, also with
        --checkpoint-on-signal, and also where a rank waits on a lost node: Note [A lost
        interrupt] in mpidp/train/interrupts.py), and SIGKILL to the launcher's session after
        END_S if it still runs."""
        try:
            os.kill(self.child.pid, signal.SIGINT)
            return self.child.wait(END_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.child.pid, signal.SIGKILL)
            return self.child.wait()

    def _survivors(self, running: Optional[list], silent: Optional[list]):
        """(the hosts that answer, those that do not); (None, []) without a host list. After
        a heartbeat found ``silent`` among the ``running`` job's hosts, those hosts are not
        asked again (the others answered it just now); the rest of the list is."""
        if self.hosts is None:
            return None, []
        known = running if silent else []
        asked = [h for h in self.hosts if h not in known]
        alive = set(probe.answering(asked, self.mpiexec, self.probe_s) if asked else [])
        alive |= {h for h in known if h.name not in silent}
        return [h for h in self.hosts if h in alive], [h for h in self.hosts if h not in alive]

    def _end(self, code: int, why: str, took: float) -> int:
        """The last line and event; returns the supervisor's exit code: the job's, or 128 +
        the signal the supervisor got where the job did not finish (after a second Ctrl-C
        Hydra's mpiexec exits with 255: the supervisor still says 130)."""
        restarts = f" after {self.restarts} restart(s)" if self.restarts else ""
        stuck = f"; {self._stuck()}" if self.leftovers else ""
        if code == 0:
            self.say(f"the run finished{restarts}; {self.steps_lost} step(s) lost{stuck}")
        else:
            self.say(f"the job ended after {took:.1f} s ({why}{stuck}){restarts}; not "
                     "relaunched")
        self.record({"event": "supervised", "exit_code": code, "restarts": self.restarts,
                     "steps_lost": self.steps_lost, "ended": why})
        return 128 + self.signalled if self.signalled is not None and code != 0 else code
