#!/usr/bin/env bash
# The cross-node all-reduce figures in bench/RESULTS.md ("Across nodes"): an emulated cluster
# (tests/harness/multinode_cluster.py, root) of 2 nodes with 1 rank each, unshaped and with every
# link shaped to 1 Gbit/s, and 2 nodes with 2 ranks each, unshaped and at 1 Gbit/s (4 ranks on 2
# cores: correctness-grade timing below the link-bound sizes);
# every algorithm and MPI_Allreduce and gloo side by side in one run, medians of 3 repeats.
# Then the scale model calibrated from these sweeps. Writes bench/out/.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
MPIEXEC=$(dirname "$PY")/mpiexec
ALGOS=auto,doubling,hier,ring,mpi,gloo
mkdir -p bench/out
sweep() {  # name nodes per-node rate max-size iters
  local rate=()
  [ "$4" != none ] && rate=(--rate "$4")
  "$PY" tests/harness/multinode_cluster.py --nodes "$2" "${rate[@]}" -- \
    "$MPIEXEC" -n $(($2 * $3)) -ppn "$3" "$PY" -m mpidp.bench allreduce -b 8 -e "$5" -f 4 \
    -n "$6" -w 3 -r 3 --algorithms "$ALGOS" --json "bench/out/$1.json" \
    --plot "bench/out/$1.png" | tee "bench/out/$1.txt"
}
sweep multinode_2x1 2 1 none 64M 20
sweep multinode_2x1_1gbit 2 1 1gbit 16M 5
sweep multinode_2x2 2 2 none 16M 10
sweep multinode_2x2_1gbit 2 2 1gbit 16M 5
"$PY" -m mpidp.bench model --calibrate bench/out/multinode_2x1.json \
  --calibrate bench/out/multinode_2x1_1gbit.json --json bench/out/model.json \
  --plot bench/out/model.png | tee bench/out/model.txt
