"""Tier 2: ``python -m mpidp.horovod.run``, horovodrun's command line, launching a Horovod
script on this machine: the mpiexec line it runs is printed first, every rank runs, and the
job's exit code is its own (the mapping itself: tests/unit/test_horovod.py)."""
import re
import subprocess
import sys

from mpirun import ROOT

SCRIPT = ("import sys, mpidp.horovod as hvd; hvd.init(); "
          "print(f'rank {hvd.rank()} of {hvd.size()}', flush=True); "
          "sys.exit(3 if hvd.rank() == 1 and 'fail' in sys.argv else 0)")


def horovodrun(*args):
    return subprocess.run([sys.executable, "-m", "mpidp.horovod.run", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_horovodrun_runs_the_script_on_every_rank_and_passes_its_exit_code_on():
    proc = horovodrun("-np", "2", "-H", "localhost:2", sys.executable, "-c", SCRIPT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.match(r"mpidp\.horovod\.run: \S*mpiexec -n 2 -hosts localhost:2 \S*python",
                    proc.stderr), proc.stderr
    assert sorted(proc.stdout.split("\n")[:2]) == ["rank 0 of 2", "rank 1 of 2"], proc.stdout
    failed = horovodrun("-np", "2", sys.executable, "-c", SCRIPT, "fail")
    assert failed.returncode != 0, failed.stdout + failed.stderr
