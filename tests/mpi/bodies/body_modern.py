"""Run under mpiexec at n = 2 or 3: torch's newer layers on the "mpidp" backend, each scenario
run twice in this one launch — on a mesh of mpidp groups and on a mesh of gloo groups (gloo's
rendezvous through the default group's store, mpidp's over MPI) — and compared:

- group names and descriptions, a sub-group destroyed and the job going on;
- DeviceMesh (1-D, 2-D, ``mesh["dp"]``) and the functional collectives, and the coalesced
  forms (``all_gather_coalesced``, ``_coalescing_manager``): exact (small integers);
- DTensor ``redistribute`` between Shard, Replicate and Partial: exact (small integers);
- tensor parallelism (``parallelize_module``, Colwise then Rowwise): the forward of integer
  weights exact, and a few SGD steps within the tolerance below;
- FSDP2 ``fully_shard`` per layer + Adam, with and without ``reshard_after_forward`` and with
  bfloat16 parameters reduced in float32: within the tolerance below;
- ``torch.distributed.checkpoint``: the sharded model and optimizer saved and loaded back
  exactly; with ``--save DIR`` the state is also written there (and its full tensors, for
  the check), with ``--load DIR`` a state saved by a launch of another size is loaded here
  and must equal what that launch saved, exactly.

Note [Tolerance against gloo]: where every value is a small integer the sums are exact in
any order, and mpidp must equal gloo bit for bit. Training sums float32 values: FSDP2's
reduce-scatter of the gradients (AVG, as FSDP2 asks for float32 and bfloat16 reductions) and
TP's all-reduces (the row-parallel layer's partial outputs, the column-parallel layer's
input gradients) add n numbers per element, and mpidp's ring (whose every block starts at
another rank) and gloo's algorithm add them in different orders: the same to within an ulp
per addition. At n = 2 there is one addition, a + b = b + a, and the two must be equal bit
for bit; at n = 3, a few Adam or SGD steps keep the difference within rtol 1e-5, atol 1e-6
(the largest seen is printed: about 2e-9).

Prints 'ok <rank>'."""
import argparse
import os
import shutil
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.checkpoint as dcp
from mpi4py import MPI
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               parallelize_module)

from bodykit import expect, finish

warnings.filterwarnings("ignore", category=FutureWarning)  # torch's deprecation notes
warnings.filterwarnings("ignore", category=UserWarning)  # and its advice (DTensor's, DCP's)
torch.set_num_threads(1)
parser = argparse.ArgumentParser()
parser.add_argument("--save", help="also save the FSDP2 state here (DCP)")
parser.add_argument("--load", help="load a state another launch saved here (DCP)")
args = parser.parse_args()

dist.init_process_group("mpidp")
rank, n = dist.get_rank(), dist.get_world_size()
BACKENDS = ("mpidp", "gloo")
RTOL, ATOL = 1e-5, 1e-6  # Note [Tolerance against gloo]
worst = [0.0]


def mesh(backend, shape, names):
    """A DeviceMesh of ``backend``'s groups: mpidp's as torch makes them from the default
    group, gloo's by torch's backend_override."""
    override = None if backend == "mpidp" else {name: "gloo" for name in names}
    return init_device_mesh("cpu", shape, mesh_dim_names=names, backend_override=override)


def ints(*shape, seed=0, of=None):
    """Small integers as floats, rank ``of``'s (default: this rank's)."""
    gen = torch.Generator().manual_seed(1000 * seed + (rank if of is None else of))
    return torch.randint(-4, 5, shape, generator=gen).float()


def same(what, got, want, exact=True):
    """Records a failure unless ``got`` equals ``want`` (nested lists/dicts of tensors)."""
    if isinstance(want, dict):
        expect(got.keys() == want.keys(), f"{what}: keys {sorted(got)} != {sorted(want)}")
        for k in want:
            same(f"{what}[{k}]", got[k], want[k], exact)
        return
    if isinstance(want, (list, tuple)):
        expect(len(got) == len(want), f"{what}: {len(got)} items, want {len(want)}")
        for i, (a, b) in enumerate(zip(got, want)):
            same(f"{what}[{i}]", a, b, exact)
        return
    if isinstance(want, torch.Tensor):
        got, want = got.detach().float(), want.detach().float()
        ok = got.shape == want.shape and (torch.equal(got, want) if exact else
                                          torch.allclose(got, want, rtol=RTOL, atol=ATOL))
        diff = (got - want).abs().max().item() if got.shape == want.shape and got.numel() \
            else float("inf")
        if not exact:
            worst[0] = max(worst[0], diff)
        expect(ok, f"{what}: differs by {diff:.3g} (shapes {tuple(got.shape)}, "
                   f"{tuple(want.shape)})")
        return
    expect(got == want, f"{what}: {got!r} != {want!r}")


# ---- group names and descriptions; a sub-group destroyed -----------------------------------

def names():
    world = dist.group.WORLD
    expect(isinstance(world.group_name, str) and world.group_name, "WORLD has no name")
    expect(dist.distributed_c10d._resolve_process_group(world.group_name) is world,
           "WORLD's name does not resolve to it")
    everyone = dist.new_group(list(range(n)), group_desc="everyone")
    expect(everyone.group_desc == "everyone", f"group_desc is {everyone.group_desc!r}")
    name = everyone.group_name
    t = torch.ones(3)
    dist.all_reduce(t, group=everyone)
    dist.destroy_process_group(everyone)
    expect(everyone.g.comm == MPI.COMM_NULL and not everyone._thread.thread.is_alive(),
           "the destroyed group's communicator or thread lives on")
    try:
        dist.distributed_c10d._resolve_process_group(name)
        expect(False, "a destroyed group's name still resolves")
    except Exception:  # noqa: BLE001 - torch's error for an unknown name
        pass
    again = dist.new_group(list(range(n)))
    u = torch.ones(3)
    dist.all_reduce(u, group=again)
    w = torch.ones(3)
    dist.all_reduce(w)
    same("collectives after a destroy", [t, u, w], [torch.full((3,), float(n))] * 3)


# ---- what gloo does not do: PREMUL_SUM, coalescing with a device; what mpidp refuses ------

def beyond_gloo():
    x = ints(2 * n, 3, seed=5)
    total = sum(ints(2 * n, 3, seed=5, of=r) for r in range(n))
    half = x.clone()
    dist.all_reduce(half, op=dist._make_nccl_premul_sum(0.5))
    quarter = torch.empty(2, 3)
    dist.reduce_scatter_tensor(quarter, x, op=dist._make_nccl_premul_sum(0.25))
    root = x.clone()
    dist.reduce(root, n - 1, op=dist._make_nccl_premul_sum(2.0))
    coalesced = [x.clone(), x.clone()]
    with dist._coalescing_manager(device=torch.device("cpu"), async_ops=True) as cm:
        dist.all_reduce(coalesced[0])  # gloo: "does not implement startCoalescing"
        dist.broadcast(coalesced[1], n - 1)
    cm.wait()
    same("coalescing manager with a device", coalesced,
         [total, ints(2 * n, 3, seed=5, of=n - 1)])
    same("PREMUL_SUM (all_reduce, reduce_scatter_tensor, reduce)",
         [half, quarter] + ([root] if rank == n - 1 else [x]),
         [total * 0.5, total[2 * rank:2 * rank + 2] * 0.25] +
         ([total * 2.0] if rank == n - 1 else [x]))
    for what, call, kind, words in (
            ("PREMUL_SUM of integers", lambda: dist.all_reduce(
                torch.ones(2, dtype=torch.int64), op=dist._make_nccl_premul_sum(2.0)),
             TypeError, "PREMUL_SUM needs a floating-point tensor"),
            ("split_group", lambda: dist.group.WORLD.split_group([0]), NotImplementedError,
             "does not support split_group")):
        try:
            call()
            expect(False, f"{what} was not refused")
        except kind as exc:
            expect(words in str(exc), f"{what} refused with {exc}")
    t = torch.ones(3)
    dist.all_reduce(t)  # the group goes on
    same("a collective after the refusals", t, torch.full((3,), float(n)))


# ---- DeviceMesh and the functional collectives ---------------------------------------------

def mesh_collectives(backend):
    out = {}
    m1 = mesh(backend, (n,), ("w",))
    x, xn = ints(6, seed=1), ints(2 * n, 3, seed=2)
    out["all_reduce"] = funcol.all_reduce(x, "sum", m1)
    out["all_gather"] = funcol.all_gather_tensor(x, 0, m1)
    out["reduce_scatter"] = funcol.reduce_scatter_tensor(xn, "sum", 0, m1)
    out["all_to_all"] = funcol.all_to_all_single(xn, None, None, m1)
    out["broadcast"] = funcol.broadcast(x, n - 1, m1)
    out["all_reduce_coalesced"] = funcol.all_reduce_coalesced([x, 2 * xn], "sum", m1)
    out["all_gather_coalesced"] = funcol.all_gather_into_tensor_coalesced([x, xn], m1)
    out["reduce_scatter_coalesced"] = funcol.reduce_scatter_tensor_coalesced(
        [xn, 3 * xn], "sum", [0, 0], m1)
    out = {k: [funcol.wait_tensor(t) for t in v] if isinstance(v, list) else
           funcol.wait_tensor(v) for k, v in out.items()}
    pg = m1.get_group()
    lists = [[torch.empty(6), torch.empty(2 * n, 3)] for _ in range(n)]  # one list per rank
    dist.all_gather_coalesced(lists, [x, xn], group=pg)
    out["all_gather_coalesced (c10d)"] = lists
    a, b = x.clone(), xn.clone()
    with dist._coalescing_manager(group=pg):  # the fast path: allreduce_coalesced
        dist.all_reduce(a, group=pg)
        dist.all_reduce(b, group=pg)
    out["coalescing manager"] = [a, b]
    gathered, scattered = torch.empty(n * 6), torch.empty(2, 3)
    with dist._coalescing_manager(group=pg, async_ops=True) as cm:
        dist.all_gather_into_tensor(gathered, x, group=pg)
    cm.wait()
    with dist._coalescing_manager(group=pg, async_ops=True) as cm:
        dist.reduce_scatter_tensor(scattered, xn, group=pg)
    cm.wait()
    out["coalescing manager (tensors)"] = [gathered, scattered]
    m2 = mesh(backend, (n, 1), ("dp", "tp"))
    out["2-D dp"] = funcol.wait_tensor(funcol.all_reduce(x, "sum", m2["dp"]))
    out["2-D tp"] = funcol.wait_tensor(funcol.all_reduce(x, "sum", m2["tp"]))
    out["2-D (mesh, dim)"] = funcol.wait_tensor(funcol.all_gather_tensor(x, 0, (m2, 0)))
    y = x.clone()
    dist.all_reduce(y, group=m2.get_group("dp"))
    out["2-D get_group"] = y
    out["sizes"] = (m2["dp"].size(), m2["tp"].size(), m2.get_local_rank("dp"))
    return out


# ---- DTensor redistribute ------------------------------------------------------------------

def dtensor(backend):
    m = mesh(backend, (n,), ("w",))
    full = torch.arange(2 * n * 3 * n, dtype=torch.float32).reshape(2 * n, 3 * n)
    out = {}
    d = distribute_tensor(full, m, [Shard(0)])
    r = d.redistribute(m, [Replicate()])
    s1 = r.redistribute(m, [Shard(1)])
    s0 = s1.redistribute(m, [Shard(0)])
    out["shard, replicate, shard(1), shard(0)"] = [d.full_tensor(), r.to_local(),
                                                   s1.to_local(), s0.to_local()]
    p = DTensor.from_local(ints(2 * n, 3, seed=3), m, [Partial()])
    out["partial to replicate"] = p.redistribute(m, [Replicate()]).to_local()
    out["partial to shard"] = p.redistribute(m, [Shard(0)]).to_local()
    out["partial max to replicate"] = DTensor.from_local(
        ints(2 * n, 3, seed=4), m, [Partial("max")]).redistribute(m, [Replicate()]).to_local()
    summed = s1.sum(dim=1)  # over the sharded dimension: a Partial
    out["sum over shards (partial)"] = [str(summed.placements[0]), summed.full_tensor(),
                                        summed.redistribute(m, [Shard(0)]).to_local()]
    out["matmul"] = (d @ distribute_tensor(full.T.contiguous(), m, [Shard(1)])).full_tensor()
    return out


# ---- tensor parallelism --------------------------------------------------------------------

def tp_model(integer):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4 * n), nn.ReLU(), nn.Linear(4 * n, 5))
    if integer:
        with torch.no_grad():
            for k, p in enumerate(model.parameters()):
                p.copy_(torch.randint(-2, 3, p.shape, generator=torch.Generator()
                                      .manual_seed(k)).float())
    return model


def tp(backend):
    m = mesh(backend, (n,), ("tp",))
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    out = {}
    model = parallelize_module(tp_model(True), m, plan)
    x = torch.randint(-3, 4, (4, 8), generator=torch.Generator().manual_seed(7)).float()
    out["forward of integers"] = model(x)
    model = parallelize_module(tp_model(False), m, plan)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(3):
        gen = torch.Generator().manual_seed(100 + step)  # the same batch on every rank
        x, y = torch.randn(6, 8, generator=gen), torch.randn(6, 5, generator=gen)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    out["weights after SGD"] = {k: v.full_tensor() for k, v in model.state_dict().items()}
    return out


# ---- FSDP2 ---------------------------------------------------------------------------------

def fsdp_model(m, reshard=True, mp=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 10), nn.Tanh(),
                          nn.Linear(10, 3))
    kw = {"mesh": m, "reshard_after_forward": reshard}
    if mp is not None:
        kw["mp_policy"] = mp
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def fsdp_train(model, steps=4):
    """``steps`` of Adam on this rank's own batches; the optimizer."""
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank + 20)
    for _ in range(steps):
        x, y = torch.randn(4, 6, generator=gen), torch.randint(0, 3, (4,), generator=gen)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return opt


def full(model) -> dict:
    return {k: v.full_tensor().float() for k, v in model.state_dict().items()}


def gradients(model) -> dict:
    """The reduced gradients of one more batch (Adam's steps hardly see a gradient's scale,
    so a reduce-scatter that summed where it should average would pass on weights alone)."""
    gen = torch.Generator().manual_seed(rank + 90)
    x, y = torch.randn(4, 6, generator=gen), torch.randint(0, 3, (4,), generator=gen)
    nn.functional.cross_entropy(model(x), y).backward()
    return {k: p.grad.full_tensor().float() for k, p in model.named_parameters()}


def fsdp(backend):
    m = mesh(backend, (n,), ("dp",))
    m2 = mesh(backend, (n, 1), ("dp", "tp"))  # a sub-mesh of a 2-D mesh
    out = {}
    for what, kw in (("reshard", {"m": m}),
                     ("no reshard, on mesh['dp'] of a 2-D mesh", {"m": m2["dp"],
                                                                  "reshard": False}),
                     ("bf16 params, fp32 reduce", {"m": m, "mp": MixedPrecisionPolicy(
                         param_dtype=torch.bfloat16, reduce_dtype=torch.float32)})):
        model = fsdp_model(**kw)
        fsdp_train(model)
        out[what] = {"weights": full(model), "gradients": gradients(model)}
    return out


# ---- torch.distributed.checkpoint ----------------------------------------------------------

def checkpoint(backend, directory):
    """A trained FSDP2 model and its Adam state saved with DCP over ``backend``'s group into
    ``directory`` and loaded back into a fresh one (``loaded``): the full tensors of both."""
    m = mesh(backend, (n,), ("dp",))
    model = fsdp_model(m)
    opt = fsdp_train(model, steps=2)
    state_model, state_opt = get_state_dict(model, opt)
    dcp.save({"model": state_model, "optim": state_opt}, checkpoint_id=directory,
             process_group=m.get_group())
    return {"model": full(model), "optim": full_optim(model, opt)}, loaded(m, directory)


def loaded(m, directory) -> dict:
    """A fresh FSDP2 model on mesh ``m`` (its optimizer with state of its own, one step's)
    with the state in ``directory`` loaded by DCP: its full tensors."""
    model = fsdp_model(m)
    opt = fsdp_train(model, steps=1)
    state_model, state_opt = get_state_dict(model, opt)
    state = {"model": state_model, "optim": state_opt}
    dcp.load(state, checkpoint_id=directory, process_group=m.get_group())
    set_state_dict(model, opt, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    return {"model": full(model), "optim": full_optim(model, opt)}


def full_optim(model, opt) -> dict:
    _, state = get_state_dict(model, opt)
    return {f"{k}.{s}": v.full_tensor() if isinstance(v, DTensor) else torch.as_tensor(v)
            for k, entry in state["state"].items() for s, v in entry.items()}


def shared_dir(path=None) -> str:
    """``path`` (default: a new temporary folder) made by rank 0, every rank after it."""
    if rank == 0:
        path = path or tempfile.mkdtemp(prefix="mpidp_modern_")
        os.makedirs(path, exist_ok=True)
    box = [path]
    dist.broadcast_object_list(box, 0)
    return box[0]


def main():
    names()
    beyond_gloo()
    work = shared_dir(args.save)
    results = {}
    for b in BACKENDS:
        results[b] = {"mesh": mesh_collectives(b), "dtensor": dtensor(b), "tp": tp(b),
                      "fsdp": fsdp(b), "dcp": checkpoint(b, shared_dir(os.path.join(work, b)))}
    ours, gloo = results["mpidp"], results["gloo"]
    same("mesh and functional collectives", ours["mesh"], gloo["mesh"])
    same("DTensor redistribute", ours["dtensor"], gloo["dtensor"])
    same("TP forward", ours["tp"]["forward of integers"], gloo["tp"]["forward of integers"])
    same("TP training", ours["tp"]["weights after SGD"], gloo["tp"]["weights after SGD"],
         exact=n == 2)  # Note [Tolerance against gloo]
    same("FSDP2", ours["fsdp"], gloo["fsdp"], exact=n == 2)
    for b in BACKENDS:
        trained, back = results[b]["dcp"]
        same(f"DCP on {b}: loaded", back, trained)
    same("DCP: trained", ours["dcp"][0], gloo["dcp"][0], exact=n == 2)
    if args.save and rank == 0:
        torch.save({b: results[b]["dcp"][0] for b in BACKENDS},
                   os.path.join(args.save, "expected.pt"))
    if args.load:  # saved by a launch of another size
        expected = torch.load(os.path.join(args.load, "expected.pt"), weights_only=True)
        for b in BACKENDS:
            same(f"DCP saved at another size, loaded on {b}",
                 loaded(mesh(b, (n,), ("dp",)), os.path.join(args.load, b)), expected[b])
    print(f"rank {rank}: at n = {n} the largest difference from gloo where float sums "
          f"differ in order: {worst[0]:.3g}", flush=True)
    if not args.save:  # a temporary folder of this launch's own
        dist.barrier()
        if rank == 0:
            shutil.rmtree(work)


main()
dist.destroy_process_group()
finish(rank)
