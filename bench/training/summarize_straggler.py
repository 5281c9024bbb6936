"""The straggler table and plot of bench/RESULTS.md from bench/training/run_straggler.sh's JSON logs
(bench/out/straggler/CONDITION.CONFIG.REP.jsonl): per condition and strategy the medians over
repetitions of samples/s (the run's samples over its training seconds), the training seconds
until the held-out accuracy first reached the target (the epochs' times added up; "-" when
it never did), and the final accuracy; then each one's samples/s against mirrored's in the
same condition. ``--plot FILE.png`` draws each strategy's samples/s, its ratio to mirrored's and its
final accuracy, one panel per condition."""
import argparse
import statistics
import sys
from pathlib import Path

from mpidp.report import read_run

CONDITIONS = {"local": "one machine", "straggler": "one machine, straggler 1:2",
              "cluster": "nodes at 1 Gbit/s, a rank each, straggler 1:2",
              "cluster2": "2 nodes at 1 Gbit/s, ranks round-robin, straggler 1:2"}
ORDER = ("mirrored", "localsgd-4", "localsgd-16", "diloco-16", "diloco-64", "ps", "ps-window")


def figures(path: Path, target: float) -> dict:
    run = read_run(path)
    epochs, summary = run["epochs"], run["summary"]
    elapsed, reached = 0.0, None
    for e in epochs:
        elapsed += e["time_s"]
        if reached is None and e["test_accuracy"] is not None and e["test_accuracy"] >= target:
            reached = elapsed
    return {"samples_per_s": summary["samples_per_s"], "to_target_s": reached,
            "accuracy": summary["final_accuracy"]}


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("directory", type=Path)
    p.add_argument("--target", type=float, default=0.95)
    p.add_argument("--plot", metavar="FILE.png")
    args = p.parse_args()
    runs: dict = {}
    for path in sorted(args.directory.glob("*.jsonl")):
        condition, config, _ = path.name.split(".", 2)
        runs.setdefault((condition, config), []).append(figures(path, args.target))
    if not runs:
        print(f"no runs in {args.directory}", file=sys.stderr)
        return 1
    rows = {}
    for key, rs in runs.items():
        reached = [r["to_target_s"] for r in rs]
        rows[key] = {"samples_per_s": median(r["samples_per_s"] for r in rs),
                     "to_target_s": median(reached) if reached.count(None) * 2 < len(rs)
                     else None,
                     "accuracy": median(r["accuracy"] for r in rs), "runs": len(rs)}
    print(f"| condition | strategy | samples/s | vs mirrored | s to {100 * args.target:.0f}% | "
          "final accuracy | runs |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for condition, label in CONDITIONS.items():
        base = rows.get((condition, "mirrored"))
        for config in ORDER:
            r = rows.get((condition, config))
            if r is None:
                continue
            ratio = f"{r['samples_per_s'] / base['samples_per_s']:.2f}×" if base else "-"
            to = f"{r['to_target_s']:.2f}" if r["to_target_s"] is not None else "-"
            print(f"| {label} | {config} | {r['samples_per_s']:,.0f} | {ratio} | {to} | "
                  f"{100 * r['accuracy']:.2f}% | {r['runs']} |")
    if args.plot:
        plot(rows, args.plot)
    return 0


def plot(rows: dict, path: str) -> None:
    """One panel per condition: each strategy's samples/s as a bar, labelled with its ratio
    to mirrored's and its final accuracy."""
    import matplotlib  # deferred: only --plot needs it
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    from mpidp import files
    conditions = [c for c in CONDITIONS if any(k[0] == c for k in rows)]
    fig, axes = plt.subplots(1, len(conditions), figsize=(5.2 * len(conditions), 3.8),
                             sharey=True, squeeze=False)
    for ax, condition in zip(axes[0], conditions):
        configs = [c for c in ORDER if (condition, c) in rows]
        speeds = [rows[condition, c]["samples_per_s"] for c in configs]
        base = rows.get((condition, "mirrored"), {}).get("samples_per_s")
        ax.barh(range(len(configs)), speeds, color=[f"C{ORDER.index(c)}" for c in configs])
        for y, (c, v) in enumerate(zip(configs, speeds)):
            ratio = f"{v / base:.2f}× " if base else ""
            ax.text(v, y, f" {ratio}· {100 * rows[condition, c]['accuracy']:.2f}%",
                    va="center", fontsize=8)
        ax.set_yticks(range(len(configs)), configs)
        ax.invert_yaxis()
        ax.set_xlim(0, max(speeds) * 1.45)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x / 1000:.0f}k"))
        ax.set_title(CONDITIONS[condition], fontsize=10)
        ax.set_xlabel("samples/s (median): × mirrored · final accuracy")
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle("Stragglers across the range (digits, 2 workers): mirrored, local SGD, "
                 "DiLoCo, parameter server", fontsize=11)
    fig.tight_layout()
    files.write_atomically(path, lambda f: fig.savefig(f, format="png", dpi=100), what="plot")


if __name__ == "__main__":
    sys.exit(main())
