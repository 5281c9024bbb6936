"""Markdown summary of bench/training/run_strategies.sh: the default job's accuracy and time, and the
median samples/s of each (model, ranks, strategy) with central's ratio to mirrored.
Usage: python bench/training/summarize_strategies.py bench/out/strategies.jsonl"""
import statistics
import sys

from mpidp.report import records


def main(path):
    runs = records.load(path, lines=True)
    default = [r for r in runs if r["job"] == "default"]
    if default:
        acc = [100 * r["final_accuracy"] for r in default]
        wall = [r["wall_s"] for r in default]
        print(f"Default job (mpiexec -n 2 python -m mpidp.train), {len(default)} runs: held-out "
              f"accuracy {min(acc):.2f}–{max(acc):.2f}% (median {statistics.median(acc):.2f}%), "
              f"wall time median {statistics.median(wall):.1f} s (max {max(wall):.1f} s), of "
              f"which training {statistics.median(r['total_s'] for r in default):.2f} s.\n")
    table = {}
    for r in runs:
        if r["job"] == "throughput":
            table.setdefault((r["model"], r["ranks"], r["strategy"]), []).append(r)
    print("| model | ranks | strategy | samples/s (median) | vs mirrored | waiting for comm | runs |")
    print("|---|---|---|---|---|---|---|")
    for (model, ranks, strategy), rs in sorted(table.items(), key=lambda kv: (
            ["mlp", "cnn"].index(kv[0][0]), kv[0][1], kv[0][2] != "mirrored")):
        speed = statistics.median(r["samples_per_s"] for r in rs)
        mirrored = table.get((model, ranks, "mirrored"))
        ratio = speed / statistics.median(r["samples_per_s"] for r in mirrored) if mirrored \
            else None
        wait = statistics.median(r["wait_fraction"] for r in rs)
        print(f"| {model} | {ranks} | {strategy} | {speed:,.0f} | "
              f"{f'{ratio:.2f}×' if ratio else '-'} | {100 * wait:.0f}% | {len(rs)} |")


if __name__ == "__main__":
    main(sys.argv[1])
