#!/usr/bin/env bash
# The training figures recorded in bench/RESULTS.md, in one run: mpidp DDP (pack/unpack and
# gradient-as-bucket-view, buckets of 1, 25, 100 MiB) vs torch DDP on gloo vs no all-reduce,
# MLP and CNN, on 1 and 2 ranks with 1 thread each, plus one process with 2 threads (the
# reference a 2-rank job must beat to be worth it). Writes bench/out/train_*.json, then a
# markdown summary (bench/training/summarize_train.py).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
MPIEXEC=${MPIEXEC:-$(dirname "$PY")/mpiexec}
mkdir -p bench/out
ARGS=(--models mlp,cnn --steps "${STEPS:-20}" --warmup 5 --repeats "${REPEATS:-5}")
"$MPIEXEC" -n 2 "$PY" -m mpidp.bench train "${ARGS[@]}" --bucket-mb 1,25,100 \
  --json bench/out/train_n2.json | tee bench/out/train_n2.txt
"$MPIEXEC" -n 1 "$PY" -m mpidp.bench train "${ARGS[@]}" --bucket-mb 25 \
  --json bench/out/train_n1.json | tee bench/out/train_n1.txt
"$MPIEXEC" -n 1 "$PY" -m mpidp.bench train "${ARGS[@]}" --modes none --threads 2 \
  --json bench/out/train_n1_t2.json | tee bench/out/train_n1_t2.txt
"$PY" bench/training/summarize_train.py bench/out/train_n1.json bench/out/train_n2.json \
  bench/out/train_n1_t2.json | tee bench/out/train_summary.md
