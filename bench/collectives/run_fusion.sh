#!/usr/bin/env bash
# The fusion figures recorded in bench/RESULTS.md: bucket pack/unpack GB/s against memcpy of
# the same bytes, and 1,000 x 4 KiB float32 tensors averaged through buckets against 1,000
# separate all-reduces, 2 ranks. Writes bench/out/fusion_n2.{json,txt}.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
MPIEXEC=${MPIEXEC:-$(dirname "$PY")/mpiexec}
mkdir -p bench/out
"$MPIEXEC" -n "${NP:-2}" "$PY" -m mpidp.bench fusion -r 5 --json bench/out/fusion_n2.json "$@" \
  | tee bench/out/fusion_n2.txt
