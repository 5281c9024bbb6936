"""``python -m mpidp.bench train``: training samples/s of mpidp's DistributedDataParallel
against torch's DDP on gloo, torch's DDP on the mpidp torch.distributed backend, and no
gradient all-reduce at all (the upper bound), with the share of step time spent waiting for
communication and a bucket-size sweep."""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from .. import files
from .harness import Gloo

# model -> (input shape, batch per rank, factory arguments): the benchmark sizes
MODELS = {"mlp": ((784,), 64, {"hidden": (2048, 2048)}), "cnn": ((3, 32, 32), 32, {}),
          "transformer": ((32, 128), 16, {})}


def _transformer():
    """A small transformer encoder (2 layers, width 128, 4 heads) classifying sequences of 32
    vectors: about 400 K parameters."""
    import torch
    from torch import nn

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            layer = nn.TransformerEncoderLayer(128, 4, dim_feedforward=512, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.head = nn.Linear(128, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.encoder(x).mean(1))
    return Encoder()


HOOK_MODES = ("mpidp-fp16", "mpidp-bf16")  # and mpidp-powersgd-R: rank R


def _hook(mode: str) -> tuple:
    """(state, hook) of a compression mode: mpidp's own hooks, PowerSGD from the first step
    (the steady state is what is timed)."""
    from ..ddp.compression import bf16_compress_hook, fp16_compress_hook
    from ..ddp.powersgd import PowerSGDState, powerSGD_hook
    if mode == "mpidp-fp16":
        return None, fp16_compress_hook
    if mode == "mpidp-bf16":
        return None, bf16_compress_hook
    try:
        rank = int(mode.rsplit("-", 1)[1])
    except ValueError:
        raise SystemExit(f"mode {mode!r}: expected mpidp-powersgd-R with R a rank") from None
    return PowerSGDState(matrix_approximation_rank=rank, start_powerSGD_iter=0), powerSGD_hook


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default="mlp,cnn",
                   help="comma-separated, from mlp,cnn,transformer")
    p.add_argument("--modes", default="none,mpidp,mpidp-view,torch",
                   help="none (no all-reduce: the bound), mpidp (our DDP), mpidp-view (with "
                        "gradient_as_bucket_view=True), torch (torch's DDP on gloo), "
                        "torch-mpidp (torch's DDP on the mpidp torch.distributed backend), "
                        "torch-mpidp-view (with gradient_as_bucket_view=True), mpidp-fp16, "
                        "mpidp-bf16, mpidp-powersgd-R (our DDP with a compression hook; R: "
                        "PowerSGD's rank)")
    p.add_argument("--bucket-mb", default="25",
                   help="comma-separated bucket caps in MiB for mpidp (a sweep: 1,25,100)")
    p.add_argument("--algorithm", default="auto", help="mpidp all-reduce algorithm")
    p.add_argument("--steps", type=int, default=20, help="timed steps per repetition")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps before each repetition")
    p.add_argument("--repeats", type=int, default=5, help="repetitions (the median is reported)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--json", default=None, help="write the results to this JSON file")


class _Run:
    """One model under one mode: its optimizer, data and a step function."""

    def __init__(self, name: str, mode: str, bucket_mb: float, args, rank: int, gloo):
        import torch
        import mpidp
        from mpidp.workloads import models
        shape, self.batch, kwargs = MODELS[name]
        torch.manual_seed(0)
        module = _transformer() if name == "transformer" else models.BUILTIN[name](**kwargs)
        if mode.startswith("mpidp"):
            self.model = mpidp.DistributedDataParallel(
                module, bucket_cap_mb=bucket_mb, algorithm=args.algorithm,
                gradient_as_bucket_view=mode == "mpidp-view")
            if mode in HOOK_MODES or mode.startswith("mpidp-powersgd-"):
                self.model.register_comm_hook(*_hook(mode))
        elif mode.startswith("torch"):
            from torch.nn.parallel import DistributedDataParallel
            self.model = DistributedDataParallel(
                module, bucket_cap_mb=bucket_mb, gradient_as_bucket_view=mode.endswith("view"),
                process_group=gloo.mpidp_group if mode.startswith("torch-mpidp") else None)
        else:
            self.model = module
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        gen = torch.Generator().manual_seed(rank)
        self.inputs = [torch.randn((self.batch,) + shape, generator=gen) for _ in range(4)]
        self.labels = [torch.randint(0, 10, (self.batch,), generator=gen) for _ in range(4)]
        self.loss = torch.nn.functional.cross_entropy
        self.i = 0

    def step(self) -> None:
        k = self.i % len(self.inputs)
        self.i += 1
        self.optimizer.zero_grad()
        self.loss(self.model(self.inputs[k]), self.labels[k]).backward()
        self.optimizer.step()

    def stat_s(self, key: str) -> float:
        """comm_stats[key] of mpidp's DDP: wait_s (backward waiting for buckets) or comm_s
        (the communication thread busy), 0 for the others."""
        stats = getattr(self.model, "comm_stats", None)
        return stats[key] if stats else 0.0


def _time(comm, run: _Run, steps: int, warmup: int) -> tuple:
    """(slowest rank's seconds for ``steps`` steps, mean wait and communication seconds per
    step on this rank)."""
    for _ in range(warmup):
        run.step()
    comm.Barrier()
    w0, c0 = run.stat_s("wait_s"), run.stat_s("comm_s")
    t0 = time.perf_counter()
    for _ in range(steps):
        run.step()
    elapsed = time.perf_counter() - t0
    return (max(comm.allgather(elapsed)), (run.stat_s("wait_s") - w0) / steps,
            (run.stat_s("comm_s") - c0) / steps)


def measure(comm, args, gloo) -> list:
    """Rows: one per (model, mode, bucket cap), with the median samples/s over repetitions;
    the modes are interleaved within each repetition so that drift hits them alike."""
    n, rank = comm.Get_size(), comm.Get_rank()
    modes = [m.strip() for m in args.modes.split(",")]
    buckets = [float(b) for b in args.bucket_mb.split(",")]
    rows = []
    for name in [m.strip() for m in args.models.split(",")]:
        configs = []
        for mode in modes:
            for b in (buckets if mode.startswith("mpidp") else [25.0] if
                      mode.startswith("torch") else [0.0]):
                configs.append((mode, b, _Run(name, mode, b, args, rank, gloo)))
        results = {(mode, b): [] for mode, b, _ in configs}
        waits = {(mode, b): [] for mode, b, _ in configs}
        comms = {(mode, b): [] for mode, b, _ in configs}
        for rep in range(args.repeats):
            for mode, b, run in configs:
                seconds, wait, comm_s = _time(comm, run, args.steps, args.warmup)
                results[(mode, b)].append(n * run.batch * args.steps / seconds)
                waits[(mode, b)].append(wait * args.steps / seconds)
                comms[(mode, b)].append(comm_s)
        for mode, b, run in configs:
            rows.append({"model": name, "mode": mode, "bucket_mb": b if mode != "none" else None,
                         "ranks": n, "threads": args.threads, "batch_per_rank": run.batch,
                         "samples_per_s": statistics.median(results[(mode, b)]),
                         "all_samples_per_s": results[(mode, b)],
                         "wait_share": statistics.median(waits[(mode, b)]),
                         "step_s": n * run.batch / statistics.median(results[(mode, b)]),
                         "comm_s_per_step": statistics.median(comms[(mode, b)])})
        if rank == 0:
            print(f"  {name}: done", file=sys.stderr)
    return rows


def table(rows: list) -> str:
    lines = [f"{'model':>11} {'mode':>16} {'bucket':>7} {'ranks':>5} {'samples/s':>10} "
             f"{'vs torch':>8} {'vs mpidp':>8} {'of bound':>8} {'wait':>6} {'comm ms':>8}"]
    for r in rows:
        same = [x for x in rows if x["model"] == r["model"]]
        torch_row = next((x for x in same if x["mode"] == "torch"), None)
        ours = next((x for x in same if x["mode"] == "mpidp"), None)
        bound = next((x for x in same if x["mode"] == "none"), None)
        vs = f"{r['samples_per_s'] / torch_row['samples_per_s']:.2f}x" if torch_row else "-"
        vs_ours = f"{r['samples_per_s'] / ours['samples_per_s']:.2f}x" if ours else "-"
        of = f"{100 * r['samples_per_s'] / bound['samples_per_s']:.0f}%" if bound else "-"
        bucket = f"{r['bucket_mb']:g}M" if r["bucket_mb"] is not None else "-"
        ours_mode = r["mode"].startswith("mpidp")
        wait = f"{100 * r['wait_share']:.0f}%" if ours_mode else "-"
        comm_ms = f"{1e3 * r.get('comm_s_per_step', 0):.1f}" if ours_mode else "-"
        lines.append(f"{r['model']:>11} {r['mode']:>16} {bucket:>7} {r['ranks']:>5} "
                     f"{r['samples_per_s']:>10.0f} {vs:>8} {vs_ours:>8} {of:>8} {wait:>6} "
                     f"{comm_ms:>8}")
    return "\n".join(lines)


def main(args) -> int:
    import torch
    import mpidp
    for name in args.models.split(","):
        if name.strip() not in MODELS:
            raise SystemExit(f"unknown model {name!r}; accepted: {', '.join(MODELS)}")
    torch.set_num_threads(args.threads)
    g = mpidp.init()
    comm = g.comm
    gloo = Gloo(comm, backend_group="torch-mpidp" in args.modes) \
        if "torch" in args.modes else None
    rows = measure(comm, args, gloo)
    if gloo is not None:
        gloo.close()
    if comm.Get_rank() == 0:
        print(f"# mpidp train benchmark: {comm.Get_size()} ranks, {args.threads} thread(s) per "
              f"rank, {args.steps} steps x {args.repeats} repeats (median), SGD momentum")
        print(table(rows))
        if args.json:
            files.write_json(args.json, {"rows": rows, "argv": sys.argv},
                             what="benchmark results")
    return 0
