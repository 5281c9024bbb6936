#!/usr/bin/env bash
# The all-reduce figures recorded in bench/RESULTS.md: n=2, float32, sum, 8 B .. 256 MiB,
# every algorithm side by side in one run, medians of 3 repeats. Writes bench/out/.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
MPIEXEC=${MPIEXEC:-$(dirname "$PY")/mpiexec}
mkdir -p bench/out
"$MPIEXEC" -n "${NP:-2}" "$PY" -m mpidp.bench allreduce -b 8 -e 256M -f 2 -n "${ITERS:-20}" -w 5 -r 3 \
  --dtype float32 --op sum --algorithms auto,shm,ring,hier,mpi,gloo \
  --json bench/out/allreduce_n2.json --plot bench/out/allreduce_n2.png "$@" | tee bench/out/allreduce_n2.txt
