"""Markdown summary of an allreduce JSON (bench/collectives/run_allreduce.sh): the sizes and
ratios that bench/RESULTS.md records. Usage:
python bench/collectives/summarize_allreduce.py bench/out/allreduce_n2.json"""
import sys

from mpidp.report import records

SIZES = (8, 4 << 10, 32 << 10, 256 << 10, 1 << 20, 2 << 20, 32 << 20, 64 << 20, 256 << 20)
ALGOS = ("auto", "shm", "ring", "hier", "mpi", "gloo")


def human(n):
    for unit, s in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= s:
            return f"{n // s} {unit}"
    return f"{n} B"


def main(path):
    data = records.load(path)
    rows = {(r["size"], r["algorithm"]): r for r in data["rows"]}
    c = data["ceiling"]
    bound = max(c["copy_GBps"], c.get("stream_copy_GBps", 0))  # Note [Streaming copy]
    print(f"Ceiling (measured in the same run, {data['nranks']} ranks copying at once): copy "
          f"{c['copy_GBps']:.2f} GB/s (non-temporal stores {c.get('stream_copy_GBps', 0):.2f}), "
          f"add {c['add_GBps']:.2f} GB/s per rank -> all-reduce bound algbw = busbw = "
          f"{bound:.2f} GB/s at n=2.\n")
    print("| size | mode | " + " | ".join(f"{a} µs (busbw GB/s)" for a in ALGOS if any(
        (s, a) in rows for s in SIZES)) + " | best mpidp / mpi | best / gloo | best / bound |")
    present = [a for a in ALGOS if any((s, a) in rows for s in SIZES)]
    print("|" + "---|" * (len(present) + 5))
    for s in SIZES:
        if (s, "mpi") not in rows:
            continue
        for mode in ("in_place", "out_of_place"):
            cells, ours = [], []
            for a in present:
                m = rows.get((s, a), {}).get(mode)
                if not m:
                    cells.append("n/a")
                    continue
                cells.append(f"{m['time_us']['avg']:.1f} ({m['busbw_GBps']:.2f})")
                if a in ("auto", "shm", "ring", "hier"):
                    ours.append(m["time_us"]["avg"])
            mpi = rows[(s, "mpi")][mode]["time_us"]["avg"]
            gloo = (rows.get((s, "gloo")) or {}).get("in_place")
            best = min(ours)
            vs_gloo = f"{gloo['time_us']['avg'] / best:.1f}x" if gloo else "n/a"
            print(f"| {human(s)} | {mode.replace('_', '-')} | " + " | ".join(cells) +
                  f" | {mpi / best:.2f}x | {vs_gloo} | {s / best / 1e3 / bound:.0%} |")
    auto_vs_mpi = []
    for (s, a), r in sorted(rows.items()):
        if a == "auto" and (32 << 10) <= s <= (2 << 20):
            auto_vs_mpi.append((s, rows[(s, "mpi")]["in_place"]["time_us"]["avg"] /
                                r["in_place"]["time_us"]["avg"]))
    if auto_vs_mpi:
        print("\nauto speed-up over MPI_Allreduce (in place), 32 KiB..2 MiB: " +
              ", ".join(f"{human(s)} {x:.2f}x" for s, x in auto_vs_mpi))


if __name__ == "__main__":
    main(sys.argv[1])
