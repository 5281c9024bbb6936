"""Tier 2: ``python -m mpidp.horovod.run``, horovodrun's command line, launching a Horovod
script on this machine: the mpiexec line it runs is printed first, every rank runs, and the
job's exit code is its own (the mapping itself: tests/unit/test_horovod.py)."""
import json
import os
import re
import subprocess
import sys

from mpirun import ROOT

SCRIPT = ("import sys, mpidp.horovod as hvd; from mpidp import config; hvd.init(); "
          "print(f'rank {hvd.rank()} of {hvd.size()} fusion '"
          "f'{config.get().horovod_fusion_bytes}', flush=True); "
          "hvd.allreduce(hvd.allreduce(__import__('torch').ones(2))); "
          "sys.exit(3 if hvd.rank() == 1 and 'fail' in sys.argv else 0)")


def horovodrun(*args, env=None):
    return subprocess.run([sys.executable, "-m", "mpidp.horovod.run", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def test_horovodrun_runs_the_script_on_every_rank_and_passes_its_exit_code_on(tmp_path):
    """Also horovodrun's --timeline-filename and --fusion-threshold-mb, which set the HOROVOD_*
    variables mpidp.horovod maps: both take effect (the timeline is written at the end)."""
    timeline = tmp_path / "timeline.json"
    proc = horovodrun("-np", "2", "-H", "localhost:2", "--timeline-filename", str(timeline),
                      "--fusion-threshold-mb", "0.00390625", sys.executable, "-c", SCRIPT,
                      env={"HOROVOD_WITH_PYTORCH": "1"})  # a build variable: ignored
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.match(rf"mpidp\.horovod\.run: HOROVOD_TIMELINE={re.escape(str(timeline))} "
                    r"HOROVOD_FUSION_THRESHOLD=4096 \S*mpiexec -n 2 -hosts localhost:2 "
                    r"\S*python", proc.stderr), proc.stderr
    assert sorted(re.findall(r"rank \d of \d fusion \d+", proc.stdout)) == \
        [f"rank {r} of 2 fusion 4096" for r in (0, 1)], proc.stdout
    events = json.loads(timeline.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    assert sum("allreduce" in str(e.get("name", "")).lower() for e in events) >= 2, events[:20]
    failed = horovodrun("-np", "2", sys.executable, "-c", SCRIPT, "fail")
    assert failed.returncode != 0 and "rank 1 of 2" in failed.stdout, \
        failed.stdout + failed.stderr


def test_a_horovod_variable_mpidp_refuses_ends_every_rank_in_one_line():
    failed = horovodrun("-np", "2", sys.executable, "-c", SCRIPT,
                        env={"HOROVOD_CYCLE_TIME": "0.1"})
    out = failed.stdout + failed.stderr
    assert failed.returncode != 0, out
    assert "HOROVOD_CYCLE_TIME='0.1': not supported by mpidp.horovod: mpidp has no " \
           "background cycle" in out, out
    assert "rank 0 of 2" not in out and "rank 1 of 2" not in out, out  # init refused it
