"""What a checkpoint costs training, written synchronously and with --async-checkpoint
(bench/RESULTS.md, "Asynchronous checkpoints"): ``python bench/resilience/async_checkpoint.py`` runs
``python -m mpidp.train`` on 2 ranks with this file's model (an MLP 64-2048-2048-10 on the
digits: 4.3 M parameters, with Adam's state a 52 MB checkpoint) without checkpoints, with
checkpoints every K steps, and the same with --async-checkpoint, the three interleaved in
each of R repetitions; prints the medians as a markdown table: the run's seconds, rank 0's
seconds of training spent on checkpoints (summary "checkpoint_wait_s") and per checkpoint.
The ``big_mlp`` factory is what ``--model async_checkpoint:big_mlp`` names."""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def big_mlp():
    from mpidp.workloads import models
    return models.mlp(64, hidden=(2048, 2048), classes=10)


def run(mode: str, args, directory: str) -> dict:
    flags = ["--model", "async_checkpoint:big_mlp", "--optimizer", "adam", "--lr", "0.001",
             "--epochs", str(args.epochs), "--no-progress", "--threads-per-rank", "1"]
    if mode != "none":
        flags += ["--checkpoint-dir", directory, "--checkpoint-every", str(args.every)]
    if mode == "async":
        flags.append("--async-checkpoint")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parent))
    out = subprocess.run([str(Path(sys.executable).parent / "mpiexec"), "-n", "2",
                          sys.executable, "-m", "mpidp.train", *flags], env=env, check=True,
                         capture_output=True, text=True, timeout=600).stdout
    summary = json.loads([l for l in out.splitlines() if l.startswith("{")][-1])
    written = len(list(Path(directory).glob("ckpt-*.pt"))) if mode != "none" else 0
    return {"total_s": summary["total_s"], "wait_s": summary["checkpoint_wait_s"],
            "steps": summary["global_step"], "kept": written}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--every", type=int, default=10, help="checkpoint every K steps")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    results = {m: [] for m in ("none", "sync", "async")}
    for _ in range(args.repeats):
        for mode in results:
            with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/tmp")) as d:
                os.chmod(d, 0o700)
                results[mode].append(run(mode, args, d))
    steps = results["none"][0]["steps"]
    per_epoch = steps // args.epochs  # one at each epoch's end, and every K steps within
    checkpoints = args.epochs + sum(1 for s in range(args.every, steps, args.every)
                                    if s % per_epoch)
    med = {m: {k: statistics.median(r[k] for r in rs) for k in ("total_s", "wait_s")}
           for m, rs in results.items()}
    print(f"2 ranks, {steps} steps, a checkpoint every {args.every} steps and at each epoch's "
          f"end ({checkpoints} checkpoints), medians of {args.repeats}\n")
    print("| checkpoints | run (s) | vs none | training's time on checkpoints (s) | "
          "per checkpoint (ms) |")
    print("|---|---|---|---|---|")
    for m in results:
        t, w = med[m]["total_s"], med[m]["wait_s"]
        print(f"| {m} | {t:.2f} | {t / med['none']['total_s']:.2f}x | {w:.3f} | "
              f"{1000 * w / checkpoints if m != 'none' else 0:.1f} |")


if __name__ == "__main__":
    main()
