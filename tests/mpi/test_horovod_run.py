"""Tier 2: ``python -m mpidp.horovod.run``, horovodrun's command line, launching a Horovod
script on this machine: the mpiexec line it runs is printed first, every rank runs, and the
job's exit code is its own (the mapping itself: tests/unit/test_horovod.py)."""
import json
import os
import re
import subprocess
import sys

from mpirun import ROOT

SCRIPT = ("import mpidp.horovod as hvd; from mpidp import config; hvd.init(); "
          "print(f'rank {hvd.rank()} of {hvd.size()} fusion '"
          "f'{config.get().horovod_fusion_bytes}', flush=True); "
          "hvd.allreduce(hvd.allreduce(__import__('torch').ones(2)))")


def horovodrun(*args, env=None):
    return subprocess.run([sys.executable, "-m", "mpidp.horovod.run", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def test_horovodrun_runs_the_script_on_every_rank_and_passes_its_exit_code_on(tmp_path):
    """Also the HOROVOD_* variables: those mapped take effect (the fusion threshold, the
    timeline, written at the end), one refused ends every rank in one line, non-zero."""
    timeline = tmp_path / "timeline.json"
    proc = horovodrun("-np", "2", "-H", "localhost:2", sys.executable, "-c", SCRIPT,
                      env={"HOROVOD_FUSION_THRESHOLD": "4096", "HOROVOD_TIMELINE": str(timeline),
                           "HOROVOD_WITH_PYTORCH": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.match(r"mpidp\.horovod\.run: \S*mpiexec -n 2 -hosts localhost:2 \S*python",
                    proc.stderr), proc.stderr
    assert sorted(re.findall(r"rank \d of \d fusion \d+", proc.stdout)) == \
        [f"rank {r} of 2 fusion 4096" for r in (0, 1)], proc.stdout
    events = json.loads(timeline.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    assert sum("allreduce" in str(e.get("name", "")).lower() for e in events) >= 2, events[:20]
    failed = horovodrun("-np", "2", sys.executable, "-c", SCRIPT,
                        env={"HOROVOD_CYCLE_TIME": "0.1"})
    assert failed.returncode != 0, failed.stdout + failed.stderr
    assert "HOROVOD_CYCLE_TIME='0.1': not supported by mpidp.horovod: mpidp has no " \
           "background cycle" in failed.stdout + failed.stderr, failed.stdout + failed.stderr
