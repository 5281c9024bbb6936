"""``python -m mpidp.report RUN.jsonl [--out RUN.png]``: pictures of a training run from the
JSON log of ``python -m mpidp.train --log-json RUN.jsonl`` — loss and held-out accuracy per
epoch, samples/s per epoch, and per rank the seconds computing and waiting for
communication, so a straggler or a communication bottleneck shows at a glance. Needs
matplotlib (``pip install 'mpidp[bench]'``)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Optional, Sequence

from .. import files
from . import records
from ..runtime.helpformat import DefaultsHelpFormatter, Parser

PROG = "mpidp.report"


def read_run(path: Path) -> dict:
    """The epochs, the straggler events and the summary of a JSON log; ValueError naming the
    file and line when it is not one."""
    epochs, stragglers, summary = [], [], None
    for event in records.load(path, lines=True, what="a line of python -m mpidp.train "
                              "--log-json", fits=lambda e: isinstance(e, dict) and "event" in e):
        kind = event["event"]
        if kind == "epoch":
            epochs.append(event)
        elif kind == "straggler":
            stragglers.append(event)
        elif kind == "summary":
            summary = event
    if not epochs:
        raise ValueError(f"{path}: no epoch in this log (was the run written with --log-json?)")
    return {"epochs": epochs, "stragglers": stragglers, "summary": summary}


def per_rank(epochs: list) -> tuple:
    """(ranks, compute seconds, wait seconds, samples), each summed over ``epochs``."""
    ranks = sorted({r["rank"] for e in epochs for r in e["ranks"]})
    compute = {r: 0.0 for r in ranks}
    wait = {r: 0.0 for r in ranks}
    samples = {r: 0 for r in ranks}
    for e in epochs:
        for r in e["ranks"]:
            compute[r["rank"]] += r["compute_s"]
            wait[r["rank"]] += r["wait_s"]
            samples[r["rank"]] += r["samples"]
    return ranks, [compute[r] for r in ranks], [wait[r] for r in ranks], \
        [samples[r] for r in ranks]


def draw(run: dict, out: Path, title: str) -> None:
    import matplotlib  # deferred: only drawing needs it
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    epochs = run["epochs"]
    x = [e["epoch"] for e in epochs]
    fig, ((loss_ax, speed_ax), (time_ax, share_ax)) = plt.subplots(2, 2, figsize=(11, 7.5))
    loss_ax.plot(x, [e["train_loss"] for e in epochs], "o-", color="C0", label="train loss")
    loss_ax.set_xlabel("epoch")
    loss_ax.set_ylabel("train loss", color="C0")
    scored = [(e["epoch"], 100 * e["test_accuracy"]) for e in epochs
              if e.get("test_accuracy") is not None]
    if scored:
        acc_ax = loss_ax.twinx()
        acc_ax.plot(*zip(*scored), "s-", color="C2")
        acc_ax.set_ylabel("held-out accuracy, %", color="C2")
    loss_ax.set_title("loss and held-out accuracy")
    loss_ax.grid(alpha=0.3)
    for ax in (loss_ax, speed_ax):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))

    speed_ax.bar(x, [e["samples_per_s"] for e in epochs], color="C1")
    speed_ax.set_xlabel("epoch")
    speed_ax.set_ylabel("samples/s")
    speed_ax.set_title("samples/s per epoch (all ranks)")
    speed_ax.grid(axis="y", alpha=0.3)

    ranks, compute, wait, samples = per_rank(epochs)
    labels = [str(r) for r in ranks]
    time_ax.bar(labels, compute, color="C0", label="computing")
    time_ax.bar(labels, wait, bottom=compute, color="C3", label="waiting for communication")
    for r in run["stragglers"]:
        time_ax.annotate("straggler", (str(r["rank"]), compute[ranks.index(r["rank"])]
                                       + wait[ranks.index(r["rank"])]),
                         ha="center", va="bottom", fontsize=8)
    time_ax.set_xlabel("rank")
    time_ax.set_ylabel("seconds (all epochs)")
    time_ax.set_title("per rank: computing and waiting")
    time_ax.set_ylim(0, 1.3 * max(c + w for c, w in zip(compute, wait)))
    time_ax.legend(fontsize=8, loc="upper left", ncol=2)
    time_ax.grid(axis="y", alpha=0.3)

    share_ax.bar(labels, samples, color="C4")
    share_ax.set_xlabel("rank")
    share_ax.set_ylabel("samples trained (all epochs)")
    share_ax.set_title("per rank: samples (a parameter server's workers differ)")
    share_ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    files.write_atomically(out, lambda f: fig.savefig(f, format="png", dpi=100), what="plot")


def title_of(run: dict, path: Path) -> str:
    s = run["summary"]
    if s is None:
        return f"{path.name} (the run did not finish)"
    accuracy = f", {100 * s['final_accuracy']:.2f}% held out" \
        if s.get("final_accuracy") is not None else ""
    ranks = f"{s['workers']} worker(s) + {s['servers']} server(s)" if "servers" in s else \
        f"{s['ranks']} rank(s)"
    return (f"{s['strategy']} on {ranks}: {s['model']} on {s['dataset']}, "
            f"{s['epochs']} epochs{accuracy}, {s['samples_per_s']:,.0f} samples/s")


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = Parser(prog=f"python -m {PROG}", description=__doc__.split("\n\n")[0],
               formatter_class=DefaultsHelpFormatter)
    p.add_argument("log", type=Path, help="the JSON log of a run (--log-json)")
    p.add_argument("--out", type=Path, help="the picture to write (default: the log's name "
                   "with .png)")
    args = p.parse_args(argv)
    out = args.out or args.log.with_suffix(".png")
    try:
        run = read_run(args.log)
    except ValueError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    if importlib.util.find_spec("matplotlib") is None:
        print(f"{PROG}: error: drawing needs matplotlib: pip install 'mpidp[bench]'",
              file=sys.stderr)
        return 2
    try:
        draw(run, out, title_of(run, args.log))
    except OSError as exc:
        print(f"{PROG}: error: cannot write {out}: {exc}", file=sys.stderr)
        return 2
    print(f"{PROG}: wrote {out}: loss and accuracy per epoch, samples/s, each rank's "
          "compute and wait")
    return 0

