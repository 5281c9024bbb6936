"""Markdown summary of bench/training/run_train.sh's JSON files: samples/s per model, mode and world
size, with mpidp's ratios to torch DDP (gloo), to the no-all-reduce bound and to one process
with 2 threads. Usage:
python bench/training/summarize_train.py train_n1.json train_n2.json [t2.json]"""
import sys

from mpidp.report import records


def main(paths):
    rows = [r for p in paths for r in records.load(p)["rows"]]
    models = sorted({r["model"] for r in rows}, key=["mlp", "cnn"].index)
    print("| model | ranks × threads | mode | bucket | samples/s | vs torch DDP | of bound "
          "| vs 1 proc × 2 threads | wait for comm |")
    print("|---|---|---|---|---|---|---|---|---|")
    for m in models:
        two_threads = next((r for r in rows if r["model"] == m and r["threads"] == 2), None)
        for r in (x for x in rows if x["model"] == m):
            peers = [x for x in rows if x["model"] == m and x["ranks"] == r["ranks"]
                     and x["threads"] == r["threads"]]
            torch_row = next((x for x in peers if x["mode"] == "torch"), None)
            bound = next((x for x in peers if x["mode"] == "none"), None)
            s = r["samples_per_s"]
            cells = [m, f"{r['ranks']} × {r['threads']}", r["mode"],
                     f"{r['bucket_mb']:g} MiB" if r["bucket_mb"] else "-", f"{s:.0f}",
                     f"{s / torch_row['samples_per_s']:.2f}×" if torch_row else "-",
                     f"{100 * s / bound['samples_per_s']:.0f}%" if bound else "-",
                     f"{s / two_threads['samples_per_s']:.2f}×" if two_threads and
                     r["ranks"] == 2 else "-",
                     f"{100 * r['wait_share']:.0f}%" if r["mode"].startswith("mpidp") else "-"]
            print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
