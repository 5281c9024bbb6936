#!/usr/bin/env bash
# The compression figures in bench/RESULTS.md ("Compression", issue 17).
# 1. Step time and communication: `python -m mpidp.bench train` on an emulated cluster
#    (tests/harness/multinode_cluster.py, root) of 2 nodes x 1 rank, unshaped and with every link
#    shaped to 1 Gbit/s: mpidp's DDP with no hook, fp16, bf16 and PowerSGD ranks 1, 2, 4
#    (from the first step), and no all-reduce (the bound); the training benchmark's MLP, CNN
#    and small transformer; 1 thread per rank, medians of REPEATS.
# 2. Final accuracy: `python -m mpidp.train` (digits, 20 epochs, 2 ranks on this node: the
#    numbers do not depend on the link) with each --compression, mlp and cnn, 3 seeds.
# Writes bench/out/compression_*.json and .txt; bench/training/summarize_compression.py makes the table.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
MPIEXEC=$(dirname "$PY")/mpiexec
MODES=none,mpidp,mpidp-fp16,mpidp-bf16,mpidp-powersgd-1,mpidp-powersgd-2,mpidp-powersgd-4
mkdir -p bench/out
for rate in none 1gbit; do
  shape=()
  [ "$rate" != none ] && shape=(--rate "$rate")
  "$PY" tests/harness/multinode_cluster.py --nodes 2 "${shape[@]}" -- \
    "$MPIEXEC" -n 2 -ppn 1 "$PY" -m mpidp.bench train --models mlp,cnn,transformer \
    --modes "$MODES" --steps "${STEPS:-10}" --warmup 3 --repeats "${REPEATS:-3}" \
    --json "bench/out/compression_2x1_$rate.json" | tee "bench/out/compression_2x1_$rate.txt"
done
out=bench/out/compression_accuracy.jsonl
: > "$out"
for model in mlp cnn; do
  for c in none fp16 bf16 "powersgd --powersgd-rank 1" "powersgd --powersgd-rank 2" \
           "powersgd --powersgd-rank 4"; do
    for seed in 0 1 2; do
      # shellcheck disable=SC2086
      "$MPIEXEC" -n 2 "$PY" -m mpidp.train --model "$model" --compression $c --seed "$seed" \
        --no-progress --threads-per-rank 1 | grep '^{' |
        "$PY" -c "import json,sys; s=json.loads(sys.stdin.read()); \
print(json.dumps({'model': '$model', 'compression': '$c', 'seed': $seed, \
'accuracy': s['final_accuracy']}))" >> "$out"
    done
  done
  echo "  accuracy: $model done" >&2
done
"$PY" bench/training/summarize_compression.py | tee bench/out/compression_table.md
