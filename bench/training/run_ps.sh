#!/usr/bin/env bash
# The parameter server's figures recorded in bench/RESULTS.md: samples/s of ps against
# mirrored on the same number of workers, without and with one worker 2x slower
# (--straggler 1:2), n=3 (1 server, 2 workers) and n=4 (1 server, 3 workers); held-out
# accuracy on the default digits job; staleness histograms for S=inf and S=2. REPEATS times,
# configurations interleaved; appends summaries to bench/out/ps.jsonl and prints medians.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
MPIEXEC=${MPIEXEC:-$(dirname "$PY")/mpiexec}
OUT=bench/out/ps.jsonl
mkdir -p bench/out
: > "$OUT"
THROUGHPUT=(--dataset synthetic --synthetic-samples 16384 --batch-size 64 --epochs 1 --lr 0.05
            --eval-every 0 --no-progress)
run() {  # tag, ranks, flags...
  local tag=$1 n=$2; shift 2
  "$MPIEXEC" -n "$n" "$PY" -m mpidp.train "$@" | grep "^{" | tail -1 | \
    sed "s/}\$/, \"tag\": \"$tag\"}/" >> "$OUT"
}
for rep in $(seq "${REPEATS:-3}"); do
  for workers in 2 3; do
    for slow in none 1:2; do
      extra=(); [ "$slow" = none ] || extra=(--straggler "$slow")
      run "throughput w$workers $slow" "$workers" "${THROUGHPUT[@]}" "${extra[@]}"
      run "throughput w$workers $slow" $((workers + 1)) "${THROUGHPUT[@]}" --strategy ps "${extra[@]}"
    done
  done
  for slow in none 1:2; do
    extra=(); [ "$slow" = none ] || extra=(--straggler "$slow")
    run "accuracy $slow" 2 --no-progress "${extra[@]}"
    run "accuracy $slow" 3 --no-progress --strategy ps "${extra[@]}"
  done
  run "staleness S=2" 3 --no-progress --strategy ps --staleness 2 --straggler 1:2
  echo "repetition $rep done" >&2
done
"$PY" bench/training/summarize_ps.py "$OUT" | tee bench/out/ps.md
