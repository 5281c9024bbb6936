"""Tier 2: the standing chaos suite (issue 14, item 5). Each trial starts a short run of
``python -m mpidp.train`` on 2 ranks, and at a random moment of its training does one of
these to a random rank:

- kill: SIGKILL (a crash, an out-of-memory kill);
- stop: SIGSTOP (a hung node: the rank neither runs nor dies; the watchdog ends the job);
- int: SIGINT to that rank alone;
- term: SIGTERM to that rank alone (with --checkpoint-on-signal where the strategy has it:
  the run checkpoints at one step on every rank first).

The job must end within a bound with the fault's exit code, no segfault, no process left, and
every checkpoint in its directory whole. Then the run is continued as a user would (--resume
if a checkpoint exists, else from the start) and must end with the parameters of an
uninterrupted run, bit for bit. The kill and stop trials run under the supervisor (python -m
mpidp.run, --max-restarts 1): it relaunches the job from its newest checkpoint itself, which
then ends as the uninterrupted run (or, before the first checkpoint, it says why not and the
test runs it again from the start). Strategies: mirrored, central, and ps with one worker and
staleness 0 (a deterministic schedule; with more workers ps is asynchronous by design).

Seeded: trial i takes strategy i mod 3 and fault i mod 4, and draws the rank and the moment
from MPIDP_CHAOS_SEED and i. CI runs MPIDP_CHAOS_TRIALS=4 (every fault, every strategy);
``MPIDP_CHAOS_TRIALS=48 pytest tests/mpi/test_chaos.py`` runs the long loop (bench/RESULTS.md).
"""
import json
import os
import random
import re
import signal
import time

import pytest

from mpidp.train import checkpoint
from mpirun import BODIES, Job

SEED = int(os.environ.get("MPIDP_CHAOS_SEED", "14"))
TRIALS = int(os.environ.get("MPIDP_CHAOS_TRIALS", "4"))
STRATEGIES = ("mirrored", "central", "ps")
FAULTS = ("kill", "stop", "int", "term")
N = 2
RUN = ("-m", "mpidp.train", "--dataset", "user_factories:slow_digits", "--epochs", 3,
       "--optimizer", "adam", "--no-progress")
# mirrored writes its checkpoints in the background (Note [Asynchronous checkpoints]): a
# fault may come while one is being written
FLAGS = {"mirrored": ("--strategy", "mirrored", "--checkpoint-every", 5, "--async-checkpoint"),
         "central": ("--strategy", "central", "--checkpoint-every", 5),
         "ps": ("--strategy", "ps", "--staleness", 0)}  # checkpoints at epoch ends
TRAINING_S = {"mirrored": 2.5, "central": 2.5, "ps": 4.5}  # about how long each trains
USER = {"PYTHONPATH": str(BODIES)}
# the watchdog's bound in the faulty runs (MPIDP_TIMEOUT_S): well above the ~4 s a rank
# signalled alone waits for rank 0 to end the job before it does so itself (cli.py), so that
# rank 0's watchdog, waiting in a collective meanwhile, does not end it first
TIMEOUT_S = 10
# a stop trial's bound: only the watchdog ends it (no rank is signalled), so it need only
# outlast the run's slowest legitimate wait (a step of ~32 ms, a checkpoint)
STOP_TIMEOUT_S = 5
START_S = 90   # to the run's first line (imports and init on a busy machine)
END_S = 25     # from the fault to the end of the job (a stop: the watchdog's bound first)
RUN_S = 120    # a whole run
SIGSEGV = re.compile(r"Segmentation fault|SIGSEGV|signal 11\b|EXIT CODE: 139")
EXPECTED = {"stop": 124, "int": 128 + signal.SIGINT, "term": 128 + signal.SIGTERM}
# the faults a relaunch can help run under the supervisor (python -m mpidp.run), which
# relaunches the job from its newest checkpoint itself: the supervised variant
SUPERVISED = ("kill", "stop")
SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "int": signal.SIGINT,
           "term": signal.SIGTERM}
_reference = {}


def flags_of(strategy, fault, directory):
    on_signal = ("--checkpoint-on-signal",) if fault == "term" and strategy != "ps" else ()
    return (*RUN, *FLAGS[strategy], *on_signal, "--checkpoint-dir", directory)


def finish(flags, log, resume):
    """Runs ``flags`` (with --resume) to its end, its data at full speed (SLOW_S=0: only the
    faulty run must last long enough to be hit mid-training); returns its summary."""
    with Job(N, [*flags, *(("--resume",) if resume else ())], log,
             dict(USER, SLOW_S="0")) as job:
        code = job.wait(RUN_S)
    text = job.text
    assert code == 0, f"exit {code}:\n{text[-4000:]}"
    summaries = summaries_in(text)
    assert len(summaries) == 1, text[-4000:]
    return summaries[0]


def summaries_in(text):
    return [s for s in (json.loads(l) for l in text.splitlines() if l.startswith("{"))
            if s.get("event") == "summary"]


def sha256_of(summary):
    return summary["parameters_sha256"]


def reference(strategy, tmp_path_factory):
    """The uninterrupted run's parameters, once per strategy and session."""
    if strategy not in _reference:
        d = tmp_path_factory.mktemp(f"chaos-reference-{strategy}")
        _reference[strategy] = sha256_of(finish(flags_of(strategy, None, d / "ckpt"),
                                                d / "out.txt", resume=False))
    return _reference[strategy]


def trials() -> list:
    return list(_trials())


def _trials():
    for i in range(TRIALS):
        strategy, fault = STRATEGIES[i % len(STRATEGIES)], FAULTS[i % len(FAULTS)]
        rng = random.Random(f"{SEED}-{i}")
        yield pytest.param(i, strategy, fault, rng.randrange(N),
                           round(rng.uniform(0.0, TRAINING_S[strategy]), 2),
                           id=f"{i}-{strategy}-{fault}")


@pytest.mark.parametrize("trial,strategy,fault,rank,delay_s", trials())
def test_a_fault_at_a_random_moment_then_resume_ends_as_uninterrupted(
        trial, strategy, fault, rank, delay_s, tmp_path, tmp_path_factory):
    expected = reference(strategy, tmp_path_factory)
    directory = tmp_path / "ckpt"
    flags = flags_of(strategy, fault, directory)
    supervised = fault in SUPERVISED
    what = (f"MPIDP_CHAOS_SEED={SEED} trial {trial}: {strategy}, SIG{fault.upper()} to rank "
            f"{rank} {delay_s} s into training" + (" under the supervisor" if supervised else ""))
    bound = STOP_TIMEOUT_S if fault == "stop" else TIMEOUT_S
    with Job(N, flags, tmp_path / "faulty.txt", dict(USER, MPIDP_TIMEOUT_S=str(bound)),
             supervised=("--max-restarts", 1) if supervised else None) as job:
        job.wait_for(lambda: f"mpidp.train: {strategy} on" in job.text, START_S)
        victim = job.rank_pid(rank)
        time.sleep(delay_s)
        try:
            os.kill(victim, SIGNALS[fault])
        except ProcessLookupError:  # the run ended first
            pass
        code = job.wait(END_S + (bound if fault == "stop" else 0)
                        + (RUN_S if supervised else 0))
        left = job.left_behind()
    text = job.text
    where = f"{what}: exit {code}\n{text[-5000:]}"
    assert not SIGSEGV.search(text), where
    assert not left, f"processes {left} of the job still run; {where}"
    finished = summaries_in(text)
    restarted = "mpidp.run: the job failed after " in text
    if finished and not restarted:  # the signal came after the last step: the run ended as usual
        assert code == 0 and sha256_of(finished[0]) == expected, where
        print(f"{what}: too late, the run had finished")
        return
    if fault == "kill":
        assert re.search(r"KILLED BY SIGNAL: 9|Killed", text), where
    if fault == "stop":
        assert f"(MPIDP_TIMEOUT_S={bound}); aborting the job" in text, where
    if supervised and restarted:  # Note [Supervising a run] in mpidp/run/supervisor.py
        cause = "exit 124: the watchdog ended it" if fault == "stop" else r"exit \d+: "
        assert re.search(rf"^mpidp\.run: the job failed after [\d.]+ s \({cause}.*\); restart "
                         r"1 of 1: 2 rank\(s\), from ckpt-\d{9}\.pt$", text, re.M), where
        assert code == 0 and len(finished) == 1 and finished[0]["resumed_from"], where
        assert sha256_of(finished[0]) == expected, f"{what}: resumed to other parameters"
        assert not [p.name for p in directory.iterdir() if ".tmp-" in p.name], where
        for path in checkpoint.existing(directory):  # nothing partial under a checkpoint's name
            checkpoint.read(path, checkpoint.KEYS)
        print(f"{what}: relaunched from {finished[0]['resumed_from']}")
        return
    if supervised:  # before the first checkpoint: not relaunched (Note [What is retried])
        assert "before its first checkpoint: nothing to resume from); not relaunched" in text
    if fault == "kill":
        assert code != 0, where
    else:
        assert code == EXPECTED[fault], where
    if fault in ("int", "term"):  # one line, from rank 0 or the rank that had the signal
        assert "Traceback" not in text, where
        name = SIGNALS[fault].name
        said = re.escape(f"checkpoint written on {name}: ") if fault == "term" and \
            strategy != "ps" else rf"(rank {rank} )?interrupted by {name}[;( ]"
        assert len(re.findall(rf"^mpidp\.train: {said}", text, re.M)) == 1, where
    for path in checkpoint.existing(directory):  # nothing partial under a checkpoint's name
        checkpoint.read(path, checkpoint.KEYS)
    resume = bool(checkpoint.existing(directory))
    summary = finish(flags, tmp_path / "resumed.txt", resume)
    assert sha256_of(summary) == expected, f"{what}: resumed to other parameters:\n{summary}"
    assert not [p.name for p in directory.iterdir() if ".tmp-" in p.name], where
    print(f"{what}: exit {code}, then " + (f"resumed from {summary['resumed_from']}" if resume
                                          else "no checkpoint: ran again from the start"))
