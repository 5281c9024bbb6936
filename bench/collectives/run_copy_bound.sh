#!/usr/bin/env bash
# Issue 32, item 3: one node's large all-reduce against the memory's real limit, and where the
# rest goes. Each launch measures its own bound (numpy's copy and a copy with non-temporal
# stores, every rank at once: harness memory_ceiling) beside the shm all-reduce of SIZES, with
# one setting changed per launch: the chunk (MPIDP_SHM_CHUNK_BYTES: the cache-resident unit of
# the sliced protocol) and how peers are reached (MPIDP_SHM_PEERS: cross-memory attach or a
# shared window). Prints one table row per launch; JSON in bench/out/copy_bound/.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
MPIEXEC=${MPIEXEC:-$(dirname "$PY")/mpiexec}
SIZE=${SIZE:-64M}
OUT=bench/out/copy_bound
mkdir -p "$OUT"
run() {  # name, then VAR=value settings
    local name=$1; shift
    env "$@" "$MPIEXEC" -n "${NP:-2}" "$PY" -m mpidp.bench allreduce -b "$SIZE" -e "$SIZE" \
        -n "${ITERS:-10}" -w 3 -r "${REPEATS:-5}" --algorithms shm,mpi \
        --json "$OUT/$name.json" > "$OUT/$name.txt"
    "$PY" - "$OUT/$name.json" "$name" <<'EOF'
import json, sys
data = json.load(open(sys.argv[1]))
c = data["ceiling"]
row = {r["algorithm"]: r for r in data["rows"]}
cells = []
for algo in ("shm", "mpi"):
    for mode in ("in_place", "out_of_place"):
        m = row[algo][mode]
        cells.append(f"{m['algbw_GBps']:.2f} ({m['algbw_GBps'] / c['copy_GBps']:.0%} / "
                     f"{m['algbw_GBps'] / c['stream_copy_GBps']:.0%})")
print(f"| {sys.argv[2]} | {c['copy_GBps']:.2f} | {c['stream_copy_GBps']:.2f} | "
      + " | ".join(cells) + " |")
EOF
}
echo "| launch | numpy copy GB/s | non-temporal copy GB/s | shm in place: algbw (of copy / of non-temporal) | shm out of place | MPI in place | MPI out of place |"
echo "|---|---|---|---|---|---|---|"
for chunk in ${CHUNKS:-65536 262144 1048576}; do
    run "chunk-$chunk" MPIDP_SHM_CHUNK_BYTES="$chunk"
done
run "peers-window" MPIDP_SHM_PEERS=window
