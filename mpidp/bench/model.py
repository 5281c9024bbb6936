"""``python -m mpidp.bench model``: the alpha-beta-gamma scale model (mpidp/bench/costs.py)
calibrated from ``mpidp.bench allreduce --json`` files, its predictions of all-reduce time and
DDP scaling efficiency for clusters of 1 to 1024 nodes, and its check against published
figures. Needs neither mpiexec nor MPI. Presets and their sources: docs/scale-model.md."""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Optional

from .. import files
from ..errors import OutputError
from . import costs, loss
from .calibration import calibrate, host_costs, load_measurements
from .harness import parse_size

PREDICTED = ("ring", "mpi", "hier", "ps")


HOROVOD_README = "Horovod README, 2017: 32 servers x 4 Pascal GPUs, 25 GbE RoCE"
HOROVOD_DOCS = "Horovod docs/benchmarks.rst: 128 servers x 4 Pascal GPUs, 25 GbE RoCE"
PUBLISHED_EFFICIENCY = tuple((nodes, m, eff, src) for nodes, src, figures in (
    (32, HOROVOD_README, (("inception3", 0.90), ("resnet101", 0.90), ("vgg16", 0.79))),
    (128, HOROVOD_DOCS, (("inception3", 0.90), ("resnet101", 0.90), ("vgg16", 0.68))))
    for m, eff in figures)
PUBLISHED_BUSBW = (  # nccl-tests all_reduce_perf, large messages, one node of 8 GPUs
    ("h100x8", 370.0, "nccl-tests issue 212 (NVIDIA): H100 NVLink ring ~370 GB/s"),
    ("a100x8", 200.0, "nccl-tests issue 149 (user): 8 A100-SXM4-80GB ~200 GB/s"),
)



def add_arguments(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--calibrate", action="append", default=[], metavar="FILE.json",
      help="an `mpidp.bench allreduce --json` file (repeat for more)")
    a("--label", action="append", default=[],
      help="a name per --calibrate file, in order; else the file's stem")
    a("--mode", default="in_place", choices=("in_place", "out_of_place"), help="which time to fit")
    a("--gamma", default="ceiling", choices=("ceiling", "fit"),
      help="gamma from the file's memory ceiling (add_GBps), or fitted where the rows can tell it "
           "from beta (else the ceiling)")
    a("--ring-piece-bytes", default="1M",
      help="mpidp's ring pipelining piece (MPIDP_RING_PIECE_BYTES)")
    a("--short-msg-bytes", default="2048", help="MPICH's MPIR_CVAR_ALLREDUCE_SHORT_MSG_SIZE")
    a("--systems", default="25gbe,ib100,ib400,nvlink8", help=f"from {','.join(costs.SYSTEMS)}")
    a("--host-ranks-per-node", type=int, default=1, help="ranks per CPU host node")
    a("--nodes-max", type=int, default=1024, help="predict for 1, 2, 4 ... nodes up to this")
    a("--size", default="25M", help="all-reduce size to predict (default: one DDP bucket)")
    a("--link-efficiency", type=float, default=0.9, help="share of every link's line rate reached")
    a("--ps-servers", type=int, default=0, help="parameter servers (0: one per worker node)")
    a("--models", default=",".join(costs.MODELS),
      help=f"DDP presets, from {','.join(costs.MODELS)}")
    a("--ddp-algorithm", default="ring", choices=("ring", "mpi", "hier", "best"))
    a("--bucket-cap-mb", type=float, default=25.0, help="DDP bucket size, MiB (torch's default)")
    a("--overlap", type=float, default=1.0, help="speed of communication during compute, 0..1")
    a("--backward-fraction", type=float, default=2 / 3, help="backward's share of compute")
    a("--compute-scale", type=float, default=1.0,
      help="divide the presets' P100 compute times by this (a faster GPU) in the predictions")
    a("--loss-model", default="resnet50", help=f"the model of a lost node's cost, from "
      f"{','.join(costs.MODELS)}")
    a("--optimizer-slots", type=int, default=2,
      help="optimizer state per parameter, in parameters (Adam: 2), handed over with it")
    a("--checkpoint-every-s", type=float, default=600.0,
      help="a relaunch's checkpoint interval: half of it, on average, is redone")
    a("--read-GBps", type=float, default=2.0,
      help="GB/s at which a relaunch's rank 0 reads the checkpoint")
    a("--json", metavar="FILE", help="write everything as JSON")
    a("--plot", metavar="FILE.png", help="plot the predictions (needs matplotlib)")


# ---- predictions ----------------------------------------------------------------------------

def machine(system: costs.System, algorithm: str, args, host: dict) -> costs.Machine:
    """The alpha/beta/gamma of ``system`` for ``algorithm``: mpidp's own algorithms on CPU hosts
    pay the calibrated software latency of a ring step on top of the link's."""
    link = costs.LINKS[system.link]
    beta = 1 / (link.bytes_per_s * args.link_efficiency)
    if system.gpu is None:
        sw = host["ring_alpha_s"] if algorithm in ("ring", "hier") else 0.0
        return costs.Machine(link.alpha_s + sw, beta, host["gamma_s_per_byte"],
                             host["node_alpha_s"], host["node_beta_s_per_byte"])
    node = costs.LINKS[system.node_link]
    return costs.Machine(link.alpha_s, beta, 3 / costs.GPUS[system.gpu], node.alpha_s,
                         1 / (node.bytes_per_s * args.link_efficiency))


def allreduce_s(algorithm: str, nbytes: float, system: costs.System, nodes: int,
                args, host: dict) -> float:
    """Predicted seconds of one all-reduce of ``nbytes`` on ``nodes`` nodes of ``system``."""
    if algorithm == "best":
        return min(allreduce_s(a, nbytes, system, nodes, args, host)
                   for a in ("ring", "mpi", "hier"))
    g, m = per_node(system, args), machine(system, algorithm, args, host)
    piece = args.piece_bytes if system.gpu is None else 1 << 62  # NCCL: unsegmented
    if algorithm == "ring":
        t = costs.flat_ring(nbytes, nodes, g, system.nics, m,
                            costs.ring_segments(nbytes, nodes * g, piece))
    elif algorithm == "hier":
        t = costs.hier(nbytes, nodes, g, costs.ring_segments(nbytes, nodes, piece))
    elif algorithm == "mpi":
        t = costs.mpi_smp(nbytes, nodes, g, args.short_bytes)
    else:
        t = costs.parameter_server(nbytes, nodes * g, args.ps_servers or nodes, g / system.nics)
    return costs.seconds(t, m)


def per_node(system: costs.System, args) -> int:
    return system.per_node or args.host_ranks_per_node


def ddp(model: costs.Model, system: costs.System, nodes: int, args, host: dict, compute_s: float,
        bucket_bytes: float) -> float:
    """Seconds per DDP step of ``model`` on ``nodes`` nodes of ``system``."""
    return costs.ddp_step_s(model.params * 4, compute_s,
                            lambda b: allreduce_s(args.ddp_algorithm, b, system, nodes, args, host),
                            bucket_bytes, args.backward_fraction, args.overlap)


def busbw_GBps(nbytes: float, seconds: float, ranks: int) -> Optional[float]:
    return nbytes / seconds * 2 * (ranks - 1) / ranks / 1e9 if seconds > 0 else None


def predict(args, host: dict) -> dict:
    """All-reduce times and DDP efficiencies on 1, 2, 4 ... nodes of every chosen system."""
    nodes = [1 << i for i in range(args.nodes_max.bit_length())]
    ar, dp = [], []
    bucket = args.bucket_cap_mb * 2**20
    for name in args.system_names:
        s = costs.SYSTEMS[name]
        compute = {m: costs.MODELS[m].compute_s / args.compute_scale for m in args.model_names}
        one = {m: ddp(costs.MODELS[m], s, 1, args, host, compute[m], bucket)
               for m in args.model_names}
        for k in nodes:
            ranks = k * per_node(s, args)
            times = {a: allreduce_s(a, args.size_bytes, s, k, args, host) for a in PREDICTED}
            ar.append({"system": name, "nodes": k, "ranks": ranks, "size": args.size_bytes,
                       "time_s": times, "busbw_GBps": {a: busbw_GBps(args.size_bytes, t, ranks)
                                                       for a, t in times.items()}})
            for m in args.model_names:
                step = ddp(costs.MODELS[m], s, k, args, host, compute[m], bucket)
                dp.append({"system": name, "model": m, "nodes": k, "ranks": ranks,
                           "compute_s": compute[m], "step_s": step,
                           "efficiency": compute[m] / step, "efficiency_vs_node": one[m] / step})
    return {"nodes": nodes, "allreduce": ar, "ddp": dp, "lost_node": lost_node(args, host)}


def lost_node(args, host: dict) -> list:
    """The seconds per phase, after the loss is known, of a node lost on 2, 4 ... nodes of
    every chosen system: in-job (shrunk, respawned) and a relaunch (mpidp/bench/loss.py)."""
    model, rows = costs.MODELS[args.loss_model], []
    state = model.params * 4 * (1 + args.optimizer_slots)
    bucket = args.bucket_cap_mb * 2**20
    for name in args.system_names:
        s = costs.SYSTEMS[name]
        g, m = per_node(s, args), machine(s, "mpi", args, host)
        for k in (1 << i for i in range(1, args.nodes_max.bit_length())):
            step = ddp(model, s, k, args, host, model.compute_s / args.compute_scale, bucket)
            phases = {"shrink": loss.in_job_s(k * g, g, state, step, m, respawn=False),
                      "respawn": loss.in_job_s(k * g, g, state, step, m),
                      "relaunch": loss.relaunch_s(k * g, k, state, step, m,
                                                  args.read_GBps * 1e9, args.checkpoint_every_s)}
            rows.append({"system": name, "nodes": k, "ranks": k * g, "model": args.loss_model,
                         "state_bytes": state, "step_s": step, "phases_s": phases,
                         "total_s": {w: sum(p.values()) for w, p in phases.items()}})
    return rows


def published(args, host: dict) -> list:
    """The model against published figures, each with its source; nothing tuned to match."""
    rows, ring = [], argparse.Namespace(**dict(vars(args), ddp_algorithm="ring"))
    for nodes, m, eff, src in PUBLISHED_EFFICIENCY:
        model = costs.MODELS[m]
        step = ddp(model, costs.SYSTEMS["horovod"], nodes, ring, host, model.compute_s, 64 << 20)
        rows.append({"check": f"DDP efficiency {m}", "setting": f"{nodes * 4} GPUs ({nodes} x 4)",
                     "model": model.compute_s / step, "published": eff, "unit": "",
                     "source": src})
    for name, bw, src in PUBLISHED_BUSBW:
        s, n = costs.SYSTEMS[name], float(1 << 30)
        bus = busbw_GBps(n, allreduce_s("ring", n, s, 1, args, host), s.per_node)
        rows.append({"check": "all-reduce busbw", "setting": f"{name}, 1 GiB, ring",
                     "model": bus, "published": bw, "unit": "GB/s", "source": src})
    for r in rows:
        r["gap"] = r["model"] - r["published"]
    return rows


# ---- output ---------------------------------------------------------------------------------

def table(header: list, rows: list, align: str) -> str:
    """Whole lines, columns aligned: ``align`` has '<' or '>' per column."""
    cells = [list(map(str, header))] + [[str(c) for c in r] for r in rows]
    width = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(f"{c:{a}{w}}" for c, a, w in zip(r, align, width)).rstrip()
                     for r in cells)


def _g(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.3g}"


def _rate(s_per_byte: float) -> str:
    return "inf (bound)" if s_per_byte == 0 else f"{1 / s_per_byte / 1e9:.3g}"


def report(fits: list, host: dict, pred: dict, checks: list, args) -> str:
    out = ["# mpidp scale model: alpha-beta-gamma, formulas and assumptions in docs/scale-model.md"]
    if fits:
        out += ["", f"## calibration ({args.mode}, relative least squares)", table(
            ["label", "ranks", "nodes", "algorithm", "rows", "alpha_us", "beta_GBps", "gamma_GBps",
             "gamma_from", "median_err", "max_err"],
            [[f["label"], f["nranks"], f["nodes"], f["algorithm"], len(f["points"]),
              f"{f['alpha_s'] * 1e6:.2f}", _rate(f["beta_s_per_byte"]),
              _rate(f["gamma_s_per_byte"]), f["gamma_from"], f"{f['median_rel_error']:.1%}",
              f"{f['max_rel_error']:.1%}"] for f in fits], "<>>>>>>>>>>")]
        if any(f["beta_s_per_byte"] == 0 for f in fits):
            out.append("# beta 'inf (bound)': gamma alone (the ceiling's, a DRAM rate) explains "
                       "more than the size-dependent time; cache-resident sizes reduce faster")
    out += ["", f"## host costs (from {host['source']}): gamma {_rate(host['gamma_s_per_byte'])} "
            f"GB/s, mpidp ring step +{host['ring_alpha_s'] * 1e6:.1f} us, node link "
            f"{host['node_alpha_s'] * 1e6:.1f} us / {_rate(host['node_beta_s_per_byte'])} GB/s; "
            f"links at {args.link_efficiency:.0%} of line rate"]
    size = pred["allreduce"][0]["size"] if pred["allreduce"] else 0
    out += ["", f"## all-reduce of {size} bytes, predicted: ms (busbw GB/s of the fastest)", table(
        ["system", "nodes", "ranks"] + [f"{a}_ms" for a in PREDICTED] + ["best", "busbw"],
        [[r["system"], r["nodes"], r["ranks"]] + [f"{r['time_s'][a] * 1e3:.4g}" for a in PREDICTED]
         + _best(r) for r in pred["allreduce"]], "<>>" + ">" * len(PREDICTED) + ">>")]
    out += ["", "## DDP scaling efficiency vs one GPU without communication "
            f"({args.ddp_algorithm}, buckets {args.bucket_cap_mb:g} MiB, overlap "
            f"{args.overlap:g}, P100 compute / {args.compute_scale:g})", table(
                ["system", "nodes", "ranks"] + args.model_names,
                _ddp_rows(pred["ddp"], args.model_names), "<>>" + ">" * len(args.model_names))]
    out += [] if not pred["lost_node"] else [
        "", f"## a lost node, {args.loss_model} ({args.optimizer_slots} optimizer slots): "
            "seconds from the loss known to the next step done (detection apart; a "
            f"relaunch's redo: the failed step and {args.checkpoint_every_s / 2:g} s, half its "
            "checkpoint interval)", table(
                ["system", "nodes", "ranks", "shrunk", "respawned", "relaunch", "its redo",
                 "all / respawned"],
                [[r["system"], r["nodes"], r["ranks"]] + [
                    f"{r['total_s'][w]:.3g}" for w in ("shrink", "respawn")] + [
                    f"{r['total_s']['relaunch'] - r['phases_s']['relaunch']['redo_s']:.3g}",
                    f"{r['phases_s']['relaunch']['redo_s']:.3g}",
                    f"{r['total_s']['relaunch'] / r['total_s']['respawn']:.1f}x"]
                 for r in pred["lost_node"]], "<>>>>>>>")]
    out += ["", "## model vs published (Horovod: NCCL ring, 64 MB fusion buffer, P100 compute)",
            table(["check", "setting", "model", "published", "gap", "source"],
                  [[c["check"], c["setting"], _fmt(c["model"], c["unit"]),
                    _fmt(c["published"], c["unit"]), _fmt(c["gap"], c["unit"], sign=True),
                    c["source"]] for c in checks], "<<>>><")]
    return "\n".join(out)


def _fmt(x: float, unit: str, sign: bool = False) -> str:
    if unit:
        return f"{x:+.0f} {unit}" if sign else f"{x:.0f} {unit}"
    return f"{x * 100:+.1f} pts" if sign else f"{x:.0%}"


def _best(r: dict) -> list:
    a = min(r["time_s"], key=r["time_s"].get)
    return [a, _g(r["busbw_GBps"][a])] if r["time_s"][a] > 0 else ["-", "-"]


def _ddp_rows(rows: list, models: list) -> list:
    by = {}
    for r in rows:
        by.setdefault((r["system"], r["nodes"], r["ranks"]), {})[r["model"]] = r["efficiency"]
    return [list(key) + [f"{effs[m]:.1%}" for m in models] for key, effs in by.items()]


def plot(pred: dict, args, path: str) -> None:
    """All-reduce time against nodes per system (top); DDP efficiency per system (bottom)."""
    import matplotlib  # deferred for cost: only --plot needs it
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    systems = args.system_names
    fig = plt.figure(figsize=(4 * max(2, len(systems)), 8))
    grid = fig.add_gridspec(2, len(systems))
    top = fig.add_subplot(grid[0, :])
    for i, name in enumerate(systems):
        for algo, style in (("ring", "-"), ("mpi", "--")):
            pts = [(r["nodes"], r["time_s"][algo]) for r in pred["allreduce"]
                   if r["system"] == name and r["time_s"][algo] > 0]
            if pts:
                top.plot(*zip(*pts), style, color=f"C{i}", marker="o", label=f"{name} {algo}")
    top.set(xscale="log", yscale="log", xlabel="nodes", ylabel="all-reduce time (s)",
            title=f"predicted all-reduce of {args.size_bytes} bytes")
    top.set_xscale("log", base=2)
    top.grid(True, which="both", alpha=0.3)
    top.legend(fontsize=7, ncol=2)
    for i, name in enumerate(systems):
        ax = fig.add_subplot(grid[1, i])
        for m in args.model_names:
            pts = [(r["nodes"], r["efficiency"]) for r in pred["ddp"]
                   if r["system"] == name and r["model"] == m]
            ax.plot(*zip(*pts), marker=".", label=m)
        ax.set_xscale("log", base=2)
        ax.set(ylim=(0, 1.05), xlabel="nodes", title=f"DDP efficiency, {name}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    files.write_atomically(path, lambda f: fig.savefig(f, format="png", dpi=100), what="plot")
    plt.close(fig)


# ---- the command ----------------------------------------------------------------------------

def _checked(ns) -> argparse.Namespace:
    """The flags, checked (ValueError naming the bad one), with sizes in bytes."""
    def names(text, known, what):
        got = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in got if x not in known]
        if bad or not got:
            raise ValueError(f"{what} {text!r}: accepted {', '.join(known)}")
        return got

    def one(text, known, what):
        got = names(text, known, what)
        if len(got) > 1:
            raise ValueError(f"{what} {text!r}: one of {', '.join(known)}")
        return got[0]
    for flag, v, ok in (
            ("--nodes-max", ns.nodes_max, ns.nodes_max >= 1),
            ("--host-ranks-per-node", ns.host_ranks_per_node, ns.host_ranks_per_node >= 1),
            ("--ps-servers", ns.ps_servers, ns.ps_servers >= 0),
            ("--link-efficiency", ns.link_efficiency, 0 < ns.link_efficiency <= 1),
            ("--bucket-cap-mb", ns.bucket_cap_mb, 0 < ns.bucket_cap_mb < math.inf),
            ("--compute-scale", ns.compute_scale, 0 < ns.compute_scale < math.inf),
            ("--overlap", ns.overlap, 0 <= ns.overlap <= 1),
            ("--backward-fraction", ns.backward_fraction, 0 < ns.backward_fraction <= 1),
            ("--optimizer-slots", ns.optimizer_slots, ns.optimizer_slots >= 0),
            ("--checkpoint-every-s", ns.checkpoint_every_s, 0 <= ns.checkpoint_every_s < math.inf),
            ("--read-GBps", ns.read_GBps, 0 < ns.read_GBps < math.inf)):
        if not ok:  # NaN fails every comparison
            raise ValueError(f"{flag} {v!r} is out of range")
    if len(ns.label) > len(ns.calibrate):
        raise ValueError(f"{len(ns.label)} --label for {len(ns.calibrate)} --calibrate files")
    return argparse.Namespace(**dict(
        vars(ns), piece_bytes=parse_size(ns.ring_piece_bytes),
        short_bytes=parse_size(ns.short_msg_bytes), size_bytes=parse_size(ns.size),
        system_names=names(ns.systems, costs.SYSTEMS, "--systems"),
        model_names=names(ns.models, costs.MODELS, "--models"),
        loss_model=one(ns.loss_model, costs.MODELS, "--loss-model")))


def run(ns) -> dict:
    """Everything the command prints and writes, as one dict (ValueError for bad input)."""
    args = _checked(ns)
    fits = []
    for i, path in enumerate(ns.calibrate):
        label = ns.label[i] if i < len(ns.label) else Path(path).stem
        fits += calibrate(load_measurements(path), label, args)
    host = host_costs(fits)
    pred = predict(args, host)
    return {"args": args, "calibration": fits, "host": host, "predictions": pred,
            "published": published(args, host)}


def main(ns) -> int:
    try:
        result = run(ns)
        args = result["args"]
        print(report(result["calibration"], result["host"], result["predictions"],
                     result["published"], args))
        if ns.json:
            flags = {k: v for k, v in vars(args).items() if not callable(v)}
            doc = dict(result, args=flags, argv=sys.argv,
                       systems={n: costs.SYSTEMS[n]._asdict() for n in args.system_names},
                       models={n: costs.MODELS[n]._asdict() for n in args.model_names})
            files.write_json(ns.json, doc, what="scale model results")
        if ns.plot:
            plot(result["predictions"], args, ns.plot)
    except (ValueError, OutputError) as exc:
        print(f"python -m mpidp.bench model: error: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:
        print(f"python -m mpidp.bench model: error: --plot needs matplotlib "
              f"(pip install 'mpidp[bench]'): {exc}", file=sys.stderr)
        return 2
    return 0
