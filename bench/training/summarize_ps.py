"""Markdown summary of bench/training/run_ps.sh: medians of samples/s and accuracy per (tag,
strategy), ps/mirrored ratios, and the summed staleness histograms.
Usage: python bench/training/summarize_ps.py bench/out/ps.jsonl"""
import collections
import statistics
import sys

from mpidp.report import records


def main(path):
    runs = records.load(path, lines=True)
    groups = collections.defaultdict(list)
    for r in runs:
        groups[(r["tag"], r["strategy"], r.get("staleness_mean") is not None)].append(r)
    print("| run | strategy | ranks | samples/s (median) | ps / mirrored | held-out accuracy "
          "(median) | runs |")
    print("|---|---|---|---|---|---|---|")
    tags = sorted({r["tag"] for r in runs}, key=lambda t: [r["tag"] for r in runs].index(t))
    for tag in tags:
        rows = {k[1]: v for k, v in groups.items() if k[0] == tag}
        base = statistics.median(r["samples_per_s"] for r in rows["mirrored"]) \
            if "mirrored" in rows else None
        for strategy, rs in sorted(rows.items()):
            speed = statistics.median(r["samples_per_s"] for r in rs)
            ratio = f"{speed / base:.2f}×" if base and strategy == "ps" else "-"
            acc = statistics.median(r["final_accuracy"] for r in rs)
            print(f"| {tag} | {strategy} | {rs[0]['ranks']} | {speed:,.0f} | {ratio} | "
                  f"{100 * acc:.2f}% | {len(rs)} |")
    print()
    for tag in tags:
        hist = collections.Counter()
        for r in runs:
            if r["tag"] == tag and r["strategy"] == "ps" and tag.startswith(("accuracy",
                                                                             "staleness")):
                hist.update({int(k): v for k, v in r["staleness_histogram"].items()})
        if hist:
            total = sum(hist.values())
            cells = ", ".join(f"{k}: {100 * v / total:.1f}%" for k, v in sorted(hist.items()))
            print(f"- staleness, {tag} (ps, n=3): {cells} of {total} pushes")


if __name__ == "__main__":
    main(sys.argv[1])
