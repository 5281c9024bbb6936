#!/usr/bin/env bash
# The Horovod comparison recorded in bench/RESULTS.md: builds Horovod's venv if needed
# (bench/horovod/build_horovod.sh), then three 2-rank launches of bench/horovod/horovod_compare.py: all-reduce
# latency and training throughput with Horovod's default 1 ms cycle, the same with
# HOROVOD_CYCLE_TIME=0.1; both again without Horovod in the process (its idle background
# thread keeps a core busy on rank 1). Writes bench/out/horovod_*.json and .txt.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${HOROVOD_VENV:-bench/out/horovod-venv}
bash bench/horovod/build_horovod.sh "$VENV"
PY=$VENV/bin/python
RUN=("$VENV/bin/mpiexec" -n 2 "$PY" bench/horovod/horovod_compare.py --reps "${REPS:-5}")
"${RUN[@]}" --train --json bench/out/horovod_cycle1.json | tee bench/out/horovod_cycle1.txt
HOROVOD_CYCLE_TIME=0.1 "${RUN[@]}" --train --json bench/out/horovod_cycle0.1.json \
  | tee bench/out/horovod_cycle0.1.txt
"${RUN[@]}" --no-horovod --train --json bench/out/horovod_none.json | tee bench/out/horovod_none.txt
