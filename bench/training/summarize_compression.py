"""The compression table of bench/RESULTS.md from bench/training/run_compression.sh's output: per
model and link, each mode's step time, communication time per step (the DDP communication
thread busy) and its ratio to no compression, and the final accuracy (median of 3 seeds)."""
import statistics
import sys
from pathlib import Path

from mpidp.report import records

OUT = Path(__file__).parents[1] / "out"
MODES = {"mpidp": "none", "mpidp-fp16": "fp16", "mpidp-bf16": "bf16",
         "mpidp-powersgd-1": "powersgd --powersgd-rank 1",
         "mpidp-powersgd-2": "powersgd --powersgd-rank 2",
         "mpidp-powersgd-4": "powersgd --powersgd-rank 4"}


def main() -> int:
    accuracy: dict = {}
    for r in records.load(OUT / "compression_accuracy.jsonl"):
        accuracy.setdefault((r["model"], r["compression"]), []).append(r["accuracy"])
    print("| model | link | compression | step ms | comm ms/step | comm cut (none / this) | "
          "of bound | accuracy (median of 3) |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for rate in ("none", "1gbit"):
        path = OUT / f"compression_2x1_{rate}.json"
        if not path.exists():
            print(f"missing {path}", file=sys.stderr)
            continue
        rows = records.load(path)["rows"]
        for model in dict.fromkeys(r["model"] for r in rows):
            same = {r["mode"]: r for r in rows if r["model"] == model}
            base, bound = same["mpidp"], same.get("none")
            for mode, flag in MODES.items():
                r = same.get(mode)
                if r is None:
                    continue
                acc = accuracy.get((model, flag))
                acc_text = f"{100 * statistics.median(acc):.2f}%" if acc else "-"
                of = f"{100 * r['samples_per_s'] / bound['samples_per_s']:.0f}%" \
                    if bound else "-"
                print(f"| {model} | {'1 Gbit/s' if rate == '1gbit' else 'unshaped'} | "
                      f"{flag.replace(' --powersgd-rank ', ' rank ')} | "
                      f"{1e3 * r['step_s']:.1f} | {1e3 * r['comm_s_per_step']:.1f} | "
                      f"{base['comm_s_per_step'] / max(r['comm_s_per_step'], 1e-9):.2f}x | "
                      f"{of} | {acc_text} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
