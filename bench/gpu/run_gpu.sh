#!/usr/bin/env bash
# The GPU tier and the GPU benchmarks in one pass, for a machine with one CUDA device and a
# Python that already holds torch and CuPy (docs/tests.md, "On a GPU machine").
#   bash bench/gpu/run_gpu.sh [OUTDIR]          (default bench/out/gpu)
# It installs into that Python (meant for a lent machine that is thrown away after: a virtual
# environment made from a venv's python3 would not see its torch) the wheels in .whl/ if there
# are any (mpi4py and mpich where the machine has no MPI and no package index) and mpidp,
# editable, then writes into OUTDIR: device.txt, tier.log (pytest -m
# gpu), kernels.{log,json} and allreduce-n{1,2}.{log,json} (8 files). Each step has a time limit, so
# one that hangs costs its limit and the rest still run.
set -u
OUTDIR=${1:-bench/out/gpu}
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1
step() { echo "== $* ($(date +%T))"; }

step device
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  nvcc --version | tail -2; python3 --version
  python3 -c 'import torch, cupy; print("torch", torch.__version__, "cuda", torch.version.cuda,
"cupy", cupy.__version__)'; } 2>&1 | tee "$OUTDIR/device.txt"

step install
PY=$(python3 -c 'import sys; print(sys.executable)')
PATH=$(dirname "$PY"):$PATH  # python and mpiexec (the mpich wheel's, beside it)
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps .whl/*.whl || exit 1
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . > /tmp/mpidp-install.log 2>&1 \
    || { tail -30 /tmp/mpidp-install.log; exit 1; }
timeout 40 mpiexec -n 1 python -m mpidp.doctor --timeout-s 30 2>&1 | tail -25

step "GPU tier"
timeout 200 python -m pytest -m gpu tests/gpu -p no:cacheprovider -rs -q --timeout 90 \
    --durations=10 2>&1 | tee "$OUTDIR/tier.log" | tail -60

step kernels
timeout 60 python -m mpidp.bench kernels --sizes 1M,64M,256M --ops sum \
    --json "$OUTDIR/kernels.json" > "$OUTDIR/kernels.log" 2>&1
tail -40 "$OUTDIR/kernels.log"

step "all-reduce, 1 rank"
timeout 60 mpiexec -n 1 python -m mpidp.bench allreduce --device gpu --algorithms nccl,ring \
    -b 8 -e 256M -f 16 -r 3 --json "$OUTDIR/allreduce-n1.json" > "$OUTDIR/allreduce-n1.log" 2>&1
tail -20 "$OUTDIR/allreduce-n1.log"

step "all-reduce, 2 ranks sharing the GPU (host-staged; NCCL refuses two ranks on one GPU)"
timeout 60 mpiexec -n 2 python -m mpidp.bench allreduce --device gpu --algorithms staged \
    -b 8 -e 64M -f 16 -r 3 --json "$OUTDIR/allreduce-n2.json" > "$OUTDIR/allreduce-n2.log" 2>&1
tail -20 "$OUTDIR/allreduce-n2.log"
step done
