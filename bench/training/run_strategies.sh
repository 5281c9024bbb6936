#!/usr/bin/env bash
# The training tool's figures recorded in bench/RESULTS.md: the default job (python -m
# mpidp.train, no flags, 2 ranks) — held-out accuracy and wall time — and samples/s of the
# mirrored and central strategies on 1 and 2 ranks (synthetic MNIST-shaped data, mlp and cnn),
# REPEATS times with the configurations interleaved. Appends each run's summary JSON to
# bench/out/strategies.jsonl, then prints a markdown table of medians.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
MPIEXEC=${MPIEXEC:-$(dirname "$PY")/mpiexec}
OUT=bench/out/strategies.jsonl
mkdir -p bench/out
: > "$OUT"
for rep in $(seq "${REPEATS:-5}"); do
  start=$EPOCHREALTIME
  line=$("$MPIEXEC" -n 2 "$PY" -m mpidp.train --no-progress | grep "^{" | tail -1)
  wall=$(awk -v a="$start" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.2f", b - a }')
  echo "${line%\}}, \"wall_s\": $wall, \"job\": \"default\"}" >> "$OUT"
  for model in mlp cnn; do
    for n in 1 2; do
      for strategy in mirrored central; do
        "$MPIEXEC" -n "$n" "$PY" -m mpidp.train --no-progress --dataset synthetic \
          --synthetic-samples 32768 --batch-size 64 --epochs 1 --eval-every 0 --model "$model" \
          --strategy "$strategy" | grep "^{" | tail -1 | sed 's/}$/, "job": "throughput"}/' >> "$OUT"
      done
    done
  done
  echo "repetition $rep done" >&2
done
"$PY" bench/training/summarize_strategies.py "$OUT" | tee bench/out/strategies.md
