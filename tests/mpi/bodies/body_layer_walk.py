"""Run under mpiexec at any world size (on one node or emulated nodes): the walk of a DDP gradient and of a torch.distributed
all_reduce down to the C call, recorded with a profiler on every thread — every call from one
mpidp module to another goes to the same layer or a lower one (Note [Layers] in
pyproject.toml: the contract's order), never back up; and the walk reaches the C call. Prints
the walks (docs/architecture.md quotes them)."""
import sys
import threading
import tomllib
from pathlib import Path

import torch
import torch.distributed as dist

import mpidp
from bodykit import expect, finish

ROOT = Path(__file__).resolve().parents[3]
layers = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"][
    "contracts"][0]["layers"]
LEVEL = {}  # package or module -> its layer's depth (0: the top)
for depth, layer in enumerate(layers):
    for name in layer.split("|"):
        LEVEL[name.strip()] = depth


def level(module: str) -> int:
    while module not in LEVEL:
        module = module.rpartition(".")[0]
    return LEVEL[module]


calls, c_calls = [], []
phase = ["setup"]  # "step" once the set-up is done: the walk docs/architecture.md counts


def profile(frame, event, arg):
    # rank 0's store server (mpidp-store, started by init_process_group inside the walk) polls
    # for requests on its own clock: a poll that falls in the step is not the all-reduce's walk
    if threading.current_thread().name == "mpidp-store":
        return
    if event == "c_call":
        caller = frame.f_globals.get("__name__", "")
        if caller.startswith("mpidp.") and type(arg).__module__ in (None, "builtins") and \
                getattr(arg, "__self__", None) is not None and \
                type(arg.__self__).__module__ == "mpidp._ext":
            c_calls.append((caller, type(arg.__self__).__name__ + "." + arg.__name__))
        return
    if event != "call":
        return
    callee = frame.f_globals.get("__name__", "")
    back = frame.f_back
    caller = back.f_globals.get("__name__", "") if back is not None else ""
    if callee.startswith("mpidp.") and caller.startswith("mpidp.") and callee != caller:
        calls.append((caller, back.f_code.co_name, callee, frame.f_code.co_name, phase[0]))


def walk(what, fn):
    calls.clear()
    c_calls.clear()
    phase[0] = "setup"
    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    up = [c for c in calls if level(c[2]) < level(c[0])]
    expect(not up, f"{what}: calls up a layer: {up[:5]}")
    expect(c_calls, f"{what}: no C call reached: {calls[:40]}")
    seen, step = [], []
    for caller, _, callee, fn_name, when in calls:
        for m in (caller, callee):
            if m not in seen:
                seen.append(m)
            if when == "step" and m not in step:
                step.append(m)
    expect(step, f"{what}: no call recorded after the set-up")
    if rank == 0:
        print(f"{what}: {len(seen)} modules: " + " -> ".join(seen) +
              f"; C: {sorted(set(c for _, c in c_calls))}", flush=True)
        # the step alone, after the set-up: what docs/architecture.md's walk lists
        print(f"{what}, the step: {len(step)} modules: " + ", ".join(step), flush=True)


g = mpidp.init()
rank = mpidp.rank()
torch.manual_seed(0)
x = torch.randint(-3, 4, (4, 64)).float()


def two_steps():  # the thread starts inside the walk, so the profiler follows it there
    model = mpidp.DistributedDataParallel(torch.nn.Linear(64, 64))  # a 16 KiB bucket: the
    for k in range(3):  # framed path, not the one C call of small arrays; the third step is
        phase[0] = "step" if k == 2 else "setup"  # one after the buckets' rebuild
        model(x).sum().backward()
        model.zero_grad()


walk("DDP gradient", two_steps)
t = torch.full((1 << 12,), float(rank + 1))  # past the one-C-call size: the framed path


def all_reduce():
    dist.init_process_group("mpidp")
    dist.all_reduce(t)
    phase[0] = "step"
    dist.all_reduce(t)


walk("dist.all_reduce", all_reduce)
n = mpidp.size()
expect(torch.equal(t, torch.full_like(t, n * n * (n + 1) / 2)), f"all_reduce: {t[:4]}")
dist.destroy_process_group()
finish(rank)
