"""In-job recovery on Open MPI with ULFM (docs/recovery.md): a 3-rank mirrored run of the
digits MLP, rank 1 killed with SIGKILL at its 300th item (mid-epoch 1), REPEATS times with
MPIDP_RECOVERY=respawn and REPEATS with shrink. From the job's JSON log (the "recovery"
record: Note [Recovering a run] in mpidp/train/in_job.py) and the time the dying rank wrote
just before its kill: detection (the kill to a survivor's recovery starting), each phase of
the recovery (leaving the old group, the shrink, the spawn of the replacement, the new group,
the state handed over), and the kill to the next completed training step. Medians and every
run. Needs a Python whose environment has Open MPI's wheel and sees mpidp (docs/recovery.md,
"Set-up"); as root, Open MPI's OMPI_ALLOW_RUN_AS_ROOT* are set for its launches.

    python bench/resilience/in_job.py --python .venv-ompi/bin/python [--repeats 5] [--json F]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from mpidp.runtime.launcher import OPEN_MPI_FT_ARGS  # noqa: E402

FIGURES = ("detection_s", "leave_s", "shrink_s", "spawn_s", "group_s", "handover_s",
           "kill_to_next_step_s")
AS_ROOT = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def one_loss(python: Path, mode: str, work: Path) -> dict:
    """One killed run; its recovery's figures (seconds), or {"error": ...}."""
    log, when = work / f"{mode}.json", work / f"{mode}.kill"
    line = [str(python.with_name("mpiexec")), *OPEN_MPI_FT_ARGS, "-n", "3", str(python), "-m",
            "mpidp.train", "--dataset", "user_factories:dying_digits", "--epochs", "2",
            "--optimizer", "adam", "--no-progress", "--device", "cpu", "--log-json", str(log)]
    env = {**os.environ, **AS_ROOT, "PYTHONPATH": str(ROOT / "tests" / "mpi" / "bodies"),
           "DIE_RANK": "1", "DIE_AT_ITEM": "300", "FAULT_ONCE_FILE": str(work / f"{mode}.once"),
           "FAULT_TIME_FILE": str(when), "MPIDP_RECOVERY": mode}
    proc = subprocess.run(line, capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300, errors="replace")
    records = [json.loads(l) for l in log.read_text().splitlines()] if log.exists() else []
    found = [r for r in records if r.get("event") == "recovery"]
    if proc.returncode != 0 or len(found) != 1 or not when.exists():
        return {"error": f"exit {proc.returncode}, {len(found)} recovery record(s): "
                         f"{(proc.stdout + proc.stderr)[-600:]}"}
    r, killed_at = found[0], float(when.read_text().split()[0])
    detection = r["began_at"] - killed_at
    return {"detection_s": detection, **r["phases_s"],
            "kill_to_next_step_s": detection + r["next_step_s"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--python", type=Path, default=ROOT / ".venv-ompi" / "bin" / "python",
                   help="the Python of an environment with Open MPI's wheel")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", help="write every run's figures here")
    args = p.parse_args()
    if not args.python.with_name("mpiexec").exists():
        print(f"in_job.py: no mpiexec beside {args.python}: see docs/recovery.md, Set-up",
              file=sys.stderr)
        return 2
    runs: dict = {"respawn": [], "shrink": []}
    for i in range(args.repeats):
        for mode in runs:  # alternating, so the machine's hour weighs on both alike
            with tempfile.TemporaryDirectory() as work:
                got = one_loss(args.python, mode, Path(work))
            runs[mode].append(got)
            print(f"in_job.py: {mode} {i + 1}/{args.repeats}: "
                  + (got["error"] if "error" in got else
                     ", ".join(f"{k} {v:.3f}" for k, v in got.items())), flush=True)
    print("\n| figure (median s) | " + " | ".join(runs) + " |")
    print("|---|" + "---|" * len(runs))
    for name in FIGURES:
        cells = []
        for mode in runs:
            values = [r[name] for r in runs[mode] if name in r]
            cells.append(f"{statistics.median(values):.3f} ({min(values):.3f}–"
                         f"{max(values):.3f})" if values else "—")
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))
    return 0 if all("error" not in r for rs in runs.values() for r in rs) else 1


if __name__ == "__main__":
    sys.exit(main())
