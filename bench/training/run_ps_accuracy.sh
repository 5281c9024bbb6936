#!/usr/bin/env bash
# Why the asynchronous parameter server trails mirrored on the synthetic set (bench/RESULTS.md,
# "The parameter server's accuracy", issue 18 item 6): the throughput job of bench/training/run_ps.sh
# (synthetic, 16,384 samples, batches of 64, one epoch) with 3 workers, mirrored on 3 ranks and
# on 1 (the sequential run every asynchronous one approximates), and ps with and without its
# lookahead (Note [Lookahead] in mpidp/train/ps_strategy.py); without it, with the staleness
# bound S = 2, 1, 0 and --staleness-lr; 2 workers; plain SGD and Adam instead of the default
# SGD with momentum. REPEATS times, interleaved; prints the medians of the held-out accuracy,
# the mean staleness and samples/s.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
MPIEXEC=$(dirname "$PY")/mpiexec
OUT=bench/out/ps_accuracy.jsonl
mkdir -p bench/out
: > "$OUT"
JOB=(--dataset synthetic --synthetic-samples 16384 --batch-size 64 --epochs 1 --eval-every 0 --lr 0.05
     --no-progress)
run() {  # tag, ranks, flags...
  local tag=$1 n=$2; shift 2
  "$MPIEXEC" -n "$n" "$PY" -m mpidp.train "${JOB[@]}" "$@" | grep "^{" | tail -1 |
    sed "s/}\$/, \"tag\": \"$tag\"}/" >> "$OUT"
}
for rep in $(seq "${REPEATS:-3}"); do
  run "momentum: mirrored, 3 ranks" 3
  run "momentum: mirrored, 1 rank" 1
  run "momentum: ps, 3 workers" 4 --strategy ps
  run "momentum: ps, 3 workers, --no-ps-lookahead" 4 --strategy ps --no-ps-lookahead
  run "momentum: ps, 3 workers, --no-ps-lookahead --staleness-lr" 4 --strategy ps \
    --no-ps-lookahead --staleness-lr
  for s in 2 1 0; do
    run "momentum: ps, 3 workers, --no-ps-lookahead --staleness $s" 4 --strategy ps \
      --no-ps-lookahead --staleness "$s"
  done
  run "momentum: mirrored, 2 ranks" 2
  run "momentum: ps, 2 workers" 3 --strategy ps
  run "momentum: ps, 2 workers, --no-ps-lookahead" 3 --strategy ps --no-ps-lookahead
  run "sgd lr 0.5: mirrored, 3 ranks" 3 --optimizer sgd --lr 0.5
  run "sgd lr 0.5: ps, 3 workers, --no-ps-lookahead" 4 --strategy ps --no-ps-lookahead \
    --optimizer sgd --lr 0.5
  run "adam lr 0.001: mirrored, 3 ranks" 3 --optimizer adam --lr 0.001
  run "adam lr 0.001: ps, 3 workers" 4 --strategy ps --optimizer adam --lr 0.001
  run "adam lr 0.001: ps, 3 workers, --no-ps-lookahead" 4 --strategy ps --no-ps-lookahead \
    --optimizer adam --lr 0.001
  echo "repetition $rep done" >&2
done
"$PY" - "$OUT" <<'EOF' | tee bench/out/ps_accuracy.md
import statistics, sys
from mpidp.report import records
rows = {}
for r in records.load(sys.argv[1]):
    rows.setdefault(r["tag"], []).append(r)
print("| optimizer: run | held-out accuracy | mean staleness | samples/s | runs |")
print("|---|---:|---:|---:|---:|")
for tag, rs in rows.items():
    med = lambda k: statistics.median(r.get(k, 0.0) for r in rs)
    print(f"| {tag} | {100 * med('final_accuracy'):.2f}% | {med('staleness_mean'):.2f} | "
          f"{med('samples_per_s'):,.0f} | {len(rs)} |")
EOF
