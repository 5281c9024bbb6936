"""Recovery time under the supervisor (python -m mpidp.run), on an emulated cluster of 2 nodes
x 1 rank (tests/harness/multinode_cluster.py; root): mirrored training of the default MLP on
the digits, node1 lost with its network 2 s after the first checkpoint, REPEATS times. Every
line of the supervisor and the job is stamped as it arrives, and the time from the loss to
training again is split into: detection (to the supervisor's heartbeat line), ending the job
and probing (to its restart line), the launch (to the relaunched job's first line), the
imports and MPI's start (to its banner: reported apart, as the issue asks), and the resume (to
its first epoch line: the checkpoint loaded and one epoch trained). Medians and every run.

    python bench/resilience/recovery.py [--repeats 5] [--heartbeat 2] [--probe-timeout 5] [--json F]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "harness"))
from multinode_cluster import Cluster, unavailable  # noqa: E402

STAGES = ("detection", "ending_and_probe", "launch", "imports_and_mpi_start", "resume")


def one_loss(cluster: Cluster, heartbeat: float, probe: float, work: Path) -> dict:
    directory = work / "ckpt"
    line = [sys.executable, "-m", "mpidp.run", "-n", "2", "--hosts", "node0:1,node1:1",
            "--heartbeat", str(heartbeat), "--probe-timeout", str(probe), "--",
            sys.executable, "-m", "mpidp.train", "--epochs", "150", "--checkpoint-every", "40",
            "--no-progress", "--checkpoint-dir", str(directory)]
    env = {**os.environ, **cluster.env(), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cluster.head_command(line, wd=str(ROOT)), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    lines: list = []

    def read():
        for text in proc.stdout:
            lines.append((time.monotonic(), text.rstrip("\n")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    t0 = time.monotonic()
    while not (directory / "ckpt-000000040.pt").exists():
        if proc.poll() is not None or time.monotonic() - t0 > 120:
            raise RuntimeError("no first checkpoint:\n" + "\n".join(t for _, t in lines))
        time.sleep(0.01)
    time.sleep(2.0)
    lost_at = time.monotonic()
    cluster.kill_node(1, crash=True)
    try:
        proc.wait(timeout=300)
    finally:
        cluster.restore_node(1)
    reader.join(5)

    def first(after: float, words: str) -> float:
        for t, text in lines:
            if t >= after and (text.startswith(words) if words == "epoch " else words in text):
                return t
        raise RuntimeError(f"no line with {words!r} after the loss:\n"
                           + "\n".join(t for _, t in lines[-40:]))

    detected = first(lost_at, "stopped answering while the job ran")
    restarted = first(detected, "restart 1 of")
    launched = first(restarted, "mpidp.train: starting")
    banner = first(launched, "mpidp.train: mirrored on 1 rank(s)")
    training = first(banner, "epoch ")
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}:\n" + "\n".join(t for _, t in lines[-40:]))
    stages = dict(zip(STAGES, (detected - lost_at, restarted - detected, launched - restarted,
                               banner - launched, training - banner)))
    stages["training_again"] = training - lost_at
    stages["training_again_without_imports"] = stages["training_again"] - \
        stages["imports_and_mpi_start"]
    return stages


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--heartbeat", type=float, default=2.0)
    p.add_argument("--probe-timeout", type=float, default=5.0)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if unavailable() is not None:
        print(f"recovery: {unavailable()}", file=sys.stderr)
        return 2
    runs = []
    with Cluster(2) as cluster:
        for i in range(args.repeats):
            with tempfile.TemporaryDirectory(prefix="mpidp-recovery-") as work:
                runs.append(one_loss(cluster, args.heartbeat, args.probe_timeout, Path(work)))
            print(f"loss {i + 1}: " + ", ".join(f"{k} {v:.2f} s" for k, v in runs[-1].items()),
                  flush=True)
    medians = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print(f"median of {len(runs)} (--heartbeat {args.heartbeat:g} --probe-timeout "
          f"{args.probe_timeout:g}): " + ", ".join(f"{k} {v:.2f} s" for k, v in medians.items()))
    if args.json:
        args.json.write_text(json.dumps({"heartbeat_s": args.heartbeat,
                                         "probe_timeout_s": args.probe_timeout,
                                         "median": medians, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
