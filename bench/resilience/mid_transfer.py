"""Ranks lost mid-transfer on Open MPI with ULFM, with the tcp transport's RDMA put (Open MPI's
default flags, set on the command line, which mpidp then leaves alone) and without it (mpidp's
setting under fault tolerance: Note [A peer lost mid-transfer] in mpidp/runtime/recovery.py).
Per setting: REPEATS runs of tests/mpi/bodies/lost_mid_transfer.py (4 ranks, shrinking; a
rank killed at a random moment into a 16 MiB all-reduce, MPI's then mpidp's ring), each
counted as ended (every survivor told of both losses, exact) or hung (the body still
running after BODY_HANG_S, 20 s here against a few seconds a run, its stacks written); and
the cost, ``python -m mpidp.bench
allreduce`` of 64 MiB at 3 ranks under fault tolerance, MPI's and the ring, in launches that
alternate between the two settings. Needs a Python whose environment has Open MPI's wheel
and sees mpidp (docs/recovery.md, "Set-up"); as root, OMPI_ALLOW_RUN_AS_ROOT* are set.

    python bench/resilience/mid_transfer.py --python .venv-ompi/bin/python [--repeats 8]
        [--pairs 3] [--json F]
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

AS_ROOT = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
OPEN_MPI_DEFAULT = "send,put,inplace,need-ack,need-csum,hetero-rdma"  # ompi_info, 5.0.11
SETTINGS = {"with put (Open MPI's default)": ("--mca", "btl_tcp_flags", OPEN_MPI_DEFAULT),
            "without put (mpidp's)": ()}
BODY = ROOT / "tests" / "mpi" / "bodies" / "lost_mid_transfer.py"


def trial(python: Path, flags: tuple) -> str:
    """One run of the body: "ended" or "hung" (or "failed: ..." for anything else)."""
    env = {**os.environ, **AS_ROOT, "MPIDP_RECOVERY": "shrink", "BODY_HANG_S": "20",
           "PYTHONUNBUFFERED": "1"}
    line = [str(python.with_name("mpiexec")), *OPEN_MPI_FT_ARGS, *flags, "-n", "4",
            str(python), str(BODY)]
    try:
        proc = subprocess.run(line, capture_output=True, text=True, env=env, timeout=120,
                              errors="replace")
    except subprocess.TimeoutExpired:
        return "hung"
    out = (proc.stdout + proc.stderr).replace("\0", "")
    if "Timeout (0:00:20)!" in out:
        return "hung"
    oks = sorted(l for l in proc.stdout.replace("\0", "").splitlines() if l.startswith("ok "))
    return "ended" if proc.returncode == 0 and oks == ["ok 0", "ok 1"] else \
        f"failed: exit {proc.returncode}: {out[-300:]}"


def cost(python: Path, flags: tuple, work: Path) -> dict:
    """µs per call of a 64 MiB all-reduce at 3 ranks under fault tolerance, per algorithm:
    the bench's average over the ranks of its repeats' medians (main takes the median over
    launches)."""
    out = work / "allreduce.json"
    line = [str(python.with_name("mpiexec")), *OPEN_MPI_FT_ARGS, *flags, "-n", "3",
            str(python), "-m", "mpidp.bench", "allreduce", "--algorithms", "mpi,ring",
            "-b", "64M", "-e", "64M", "-n", "8", "-w", "2", "-r", "3", "--json", str(out)]
    env = {**os.environ, **AS_ROOT, "MPIDP_RECOVERY": "shrink"}
    proc = subprocess.run(line, capture_output=True, text=True, env=env, timeout=600,
                          errors="replace")
    if proc.returncode != 0:
        return {"error": (proc.stdout + proc.stderr)[-600:]}
    rows = json.loads(out.read_text())["rows"]
    return {r["algorithm"]: r["in_place"]["time_us"]["avg"] for r in rows}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--python", type=Path, default=ROOT / ".venv-ompi" / "bin" / "python",
                   help="the Python of an environment with Open MPI's wheel")
    p.add_argument("--repeats", type=int, default=8, help="runs of the body per setting")
    p.add_argument("--pairs", type=int, default=3, help="alternating cost launches per setting")
    p.add_argument("--json", help="write every run's outcome and figure here")
    args = p.parse_args()
    if not args.python.with_name("mpiexec").exists():
        print(f"mid_transfer: error: no mpiexec beside {args.python}", file=sys.stderr)
        return 2
    found = {name: {"trials": [], "cost_us": []} for name in SETTINGS}
    for k in range(args.repeats):
        for name, flags in SETTINGS.items():
            found[name]["trials"].append(trial(args.python, flags))
            print(f"mid_transfer: trial {k + 1}/{args.repeats} {name}: "
                  f"{found[name]['trials'][-1][:80]}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.pairs):
            order = list(SETTINGS.items())
            for name, flags in order if k % 2 == 0 else order[::-1]:
                found[name]["cost_us"].append(cost(args.python, flags, Path(tmp)))
                print(f"mid_transfer: cost {k + 1}/{args.pairs} {name}: "
                      f"{found[name]['cost_us'][-1]}", flush=True)
    print("| tcp transport | runs ended | runs hung | 64 MiB MPI_Allreduce, µs "
          "| 64 MiB ring, µs |")
    print("|---|---|---|---|---|")
    for name, f in found.items():
        medians = [statistics.median(c[a] for c in f["cost_us"] if a in c)
                   if any(a in c for c in f["cost_us"]) else float("nan")
                   for a in ("mpi", "ring")]
        print(f"| {name} | {f['trials'].count('ended')} of {len(f['trials'])} | "
              f"{f['trials'].count('hung')} | {medians[0]:,.0f} | {medians[1]:,.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(found, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
