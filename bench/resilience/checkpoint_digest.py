"""What a checkpoint's digest costs (Note [Checkpoint digest] in mpidp/train/checkpoint.py):
``python bench/resilience/checkpoint_digest.py [--sizes-mb 10,100,1000] [--repeats 5] [--dir DIR]
[--json FILE]`` (one process, no MPI). For a state of float32 tensors of each size, side by
side in one run, the median of ``--repeats``:
  no digest   a checkpoint written as before digests: torch.save into a new file beside the
              final name, fsync, rename, directory fsync (files.write_atomically)
  save        checkpoint.save: the same, the digest computed as the bytes stream out and
              written as the archive's comment
  sha256      hashlib's SHA-256 over the same bytes in memory: the digest alone
  torch.load  torch.load(weights_only=True) of the file written without digest
  read        checkpoint.read: the digest checked (a pass over the file), then torch.load
Files are written under ``--dir`` (default: a temporary directory on the disk of /tmp; the
page cache is warm for the loads, as it is for a resume right after a run)."""
from __future__ import annotations

import argparse
import hashlib
import io
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from mpidp import files
from mpidp.train import checkpoint

TENSOR_MB = 10  # the state is tensors of this size (a model's layers), the last one smaller


def state_of(size_mb: int) -> dict:
    counts = [TENSOR_MB * (1 << 20) // 4] * (size_mb // TENSOR_MB)
    if size_mb % TENSOR_MB:
        counts.append(size_mb % TENSOR_MB * (1 << 20) // 4)
    return {"model": {f"layer{i}": torch.rand(n) for i, n in enumerate(counts)}, "epoch": 1}


def save_without_digest(state: dict, path: Path) -> None:
    files.write_atomically(path, lambda f: torch.save(dict(state, format=checkpoint.FORMAT), f),
                           what="checkpoint", mode=checkpoint.MODE)


def measure(size_mb: int, repeats: int, directory: Path) -> dict:
    """The figures of one size: each the median of ``repeats`` runs, the variants taking
    turns within each run (the disk's write-back drifts; turns share the drift)."""
    state = state_of(size_mb)
    buffer = io.BytesIO()
    torch.save(dict(state, format=checkpoint.FORMAT), buffer)
    payload = buffer.getbuffer()
    plain, ours = directory / "plain.pt", checkpoint.path_for(directory, 1)
    variants = {"no_digest_s": lambda: save_without_digest(state, plain),
                "save_s": lambda: checkpoint.save(directory, state, 1, keep=1),
                "sha256_s": lambda: hashlib.sha256(payload).digest(),
                "torch_load_s": lambda: torch.load(plain, weights_only=True),
                "read_s": lambda: checkpoint.read(ours)}
    runs = {name: [] for name in variants}
    for _ in range(repeats):
        for name, body in variants.items():
            t0 = time.perf_counter()
            body()
            runs[name].append(time.perf_counter() - t0)
    row = {"size_mb": size_mb, "file_bytes": len(payload),
           **{name: statistics.median(times) for name, times in runs.items()}}
    del payload
    buffer.close()
    plain.unlink()
    ours.unlink()
    return row


def table(rows: list) -> str:
    lines = [f"{'state':>8} {'no digest':>10} {'save':>8} {'ratio':>6} {'sha256':>8} "
             f"{'sha256':>8} {'torch.load':>11} {'read':>8} {'ratio':>6}",
             f"{'(MB)':>8} {'(s)':>10} {'(s)':>8} {'':>6} {'(s)':>8} {'(GB/s)':>8} {'(s)':>11} "
             f"{'(s)':>8} {'':>6}"]
    for r in rows:
        lines.append(f"{r['size_mb']:>8} {r['no_digest_s']:>10.3f} {r['save_s']:>8.3f} "
                     f"{r['save_s'] / r['no_digest_s']:>6.2f} {r['sha256_s']:>8.3f} "
                     f"{r['file_bytes'] / r['sha256_s'] / 1e9:>8.2f} "
                     f"{r['torch_load_s']:>11.3f} {r['read_s']:>8.3f} "
                     f"{r['read_s'] / r['torch_load_s']:>6.2f}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes-mb", default="10,100,1000",
                   help="state sizes in MB of float32 (comma-separated)")
    p.add_argument("--repeats", type=int, default=5, help="runs per figure (the median)")
    p.add_argument("--dir", default=None, help="where the files go (default: under /tmp)")
    p.add_argument("--json", metavar="FILE", help="write every figure as JSON")
    args = p.parse_args()
    directory = Path(tempfile.mkdtemp(prefix="ckpt-digest-", dir=args.dir))
    try:
        rows = [measure(int(s), args.repeats, directory) for s in args.sizes_mb.split(",")]
    finally:
        shutil.rmtree(directory)
    print(f"# checkpoint digest: torch {torch.__version__}, {os.cpu_count()} cores, median of "
          f"{args.repeats}; ratio: with digest / without (1.00: no cost)")
    print(table(rows))
    if args.json:
        files.write_json(args.json, {"rows": rows}, what="benchmark results")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
