#!/usr/bin/env bash
# The torch.distributed backend's figures recorded in bench/RESULTS.md: torch's own DDP on the
# mpidp backend against torch's DDP on gloo, mpidp's DistributedDataParallel and no all-reduce
# (the bound), same models (the training benchmark's MLP and CNN, and a small transformer), same run, 2 ranks
# with 1 thread each, buckets of 25 MiB (torch's DDP also with gradient_as_bucket_view).
# Writes bench/out/backend_n2.json and .txt.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
MPIEXEC=${MPIEXEC:-$(dirname "$PY")/mpiexec}
mkdir -p bench/out
"$MPIEXEC" -n 2 "$PY" -m mpidp.bench train --models mlp,cnn,transformer \
  --modes none,mpidp,torch,torch-mpidp,torch-mpidp-view --steps "${STEPS:-20}" --warmup 5 --repeats "${REPEATS:-7}" \
  --json bench/out/backend_n2.json | tee bench/out/backend_n2.txt
