#!/usr/bin/env bash
# The straggler benchmark across the synchronous-asynchronous range (bench/RESULTS.md,
# "Stragglers across the range", issue 18): the same job (the digits, batches of 16 per
# worker, 20 epochs, an accuracy score after every epoch) under mirrored, localsgd (H = 4, 16),
# diloco (H = 16, 64) and ps (2 workers + 1 server, against 2 ranks for the others), in three
# conditions: one machine; one machine with --straggler 1:2 (rank 1 computes 2x slower); and
# the emulated cluster (tests/harness/multinode_cluster.py, root) with every link shaped to
# 1 Gbit/s, one rank per node, and the straggler; cluster2: 2 such nodes, the ranks placed
# round-robin (ps's server on worker 0's node). REPEATS times, interleaved; each run's JSON log
# goes to bench/out/straggler/, and bench/training/summarize_straggler.py makes the table and the plot
# (samples/s, seconds to TARGET held-out accuracy, final accuracy).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
MPIEXEC=$(dirname "$PY")/mpiexec
OUT=${OUT:-bench/out/straggler}
rm -rf "$OUT" && mkdir -p "$OUT"
JOB=(--batch-size 16 --epochs 20 --no-progress --threads-per-rank 1)
declare -A FLAGS=(
  [mirrored]="--strategy mirrored"
  [localsgd-4]="--strategy localsgd --sync-every 4"
  [localsgd-16]="--strategy localsgd --sync-every 16"
  [diloco-16]="--strategy diloco --sync-every 16"
  [diloco-64]="--strategy diloco --sync-every 64"
  [ps]="--strategy ps"
  [ps-window]="--strategy ps")
# CONFIGS and CONDITIONS (space-separated) run a subset; ps-window is ps with its shards in
# MPI windows on one node too (MPIDP_PS_MEMORY=window: Note [Node-local shards])
read -r -a ORDER <<< "${CONFIGS:-mirrored localsgd-4 localsgd-16 diloco-16 diloco-64 ps ps-window}"
read -r -a WHERE <<< "${CONDITIONS:-local straggler cluster}"
run() {  # condition, config, repetition
  local condition=$1 config=$2 rep=$3 n=2 extra=()
  case $config in ps*) n=3 ;; esac
  local memory=auto; [ "$config" = ps-window ] && memory=window
  [ "$condition" = local ] || extra=(--straggler 1:2)
  local log="$OUT/$condition.$config.$rep.jsonl"
  # shellcheck disable=SC2086
  local cmd=("$MPIEXEC" -n "$n" "$PY" -m mpidp.train "${JOB[@]}" ${FLAGS[$config]}
             "${extra[@]}" --log-json "$log")
  if [ "$condition" = cluster2 ]; then  # 2 nodes, ranks round-robin: ps's server beside worker 0
    MPIDP_PS_MEMORY=$memory "$PY" tests/harness/multinode_cluster.py --nodes 2 --rate 1gbit -- \
      "${cmd[0]}" -genv MPIDP_PS_MEMORY "$memory" -hosts node0,node1 "${cmd[@]:1}" > /dev/null
  elif [ "$condition" = cluster ]; then
    MPIDP_PS_MEMORY=$memory "$PY" tests/harness/multinode_cluster.py --nodes "$n" --rate 1gbit -- \
      "${cmd[0]}" -genv MPIDP_PS_MEMORY "$memory" -ppn 1 "${cmd[@]:1}" > /dev/null
  else
    MPIDP_PS_MEMORY=$memory "${cmd[@]}" > /dev/null
  fi
}
for rep in $(seq "${REPEATS:-3}"); do
  for condition in "${WHERE[@]}"; do
    for config in "${ORDER[@]}"; do
      run "$condition" "$config" "$rep"
    done
  done
  echo "repetition $rep done" >&2
done
"$PY" bench/training/summarize_straggler.py "$OUT" --target "${TARGET:-0.98}" \
  --plot "${PLOT:-bench/straggler.png}" | tee "${TABLE:-bench/out/straggler.md}"
