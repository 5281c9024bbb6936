"""ZeRO stage 1: ``ZeroRedundancyOptimizer`` with torch's constructor and methods — each rank
holds the optimizer state of one slice of the parameters — and ``reduce_scatter_hook``, which
makes mpidp's DistributedDataParallel reduce-scatter the gradients to their owners instead of
all-reducing them (Note [ZeRO]).

Note [ZeRO]
The parameters are laid out as segments, each one dtype's tensors back to back: without DDP,
every dtype's parameters in order; attached to a DDP (``ddp.register_comm_hook(zero,
reduce_scatter_hook)``), DDP's own buckets. Each segment is split into one block per rank as
numpy.array_split splits (reduce_scatter's blocks), and a rank owns its block of every segment:
the pieces where its blocks meet the parameters, each a 1-D view of a parameter. The wrapped
optimizer (``optimizer_class``) is built on those views alone, so it steps only what this rank
owns, in place, and its state (momentum, Adam's moments) is about 1/N of the unsharded
optimizer's; an element-wise optimizer (SGD, Adam, AdamW, ...) computes what the unsharded one
computes, element for element. After the step each segment's blocks are all-gathered into every
rank's parameters. The pieces' gradients are views of the parameters' .grad. Attached, each
bucket (from the second backward, once DDP has fixed its buckets: the first is all-reduced as
usual) is reduce-scattered, and the averaged block is written back into the bucket and the
.grad it came from: .grad holds the average on the slices this rank owns and its own gradient
elsewhere, so what is done to .grad before ``step`` (scaling, unscaling) acts on what is
stepped — but a norm over the whole .grad (clip_grad_norm_) would mix the two. Beside DDP's
all-reduce, or on one rank (nothing reduced), .grad is the average. The layout is fixed at the
first ``step`` (``add_param_group`` only before it). Every rank must pass the same parameters
(dtypes and shapes, in order) in the same groups with the same hyper-parameters — each shard is
stepped with its owner's — so the constructor and ``add_param_group`` compare them across
ranks (fingerprint.check_same): a MismatchError on every rank names the first difference, and
an input one rank refuses is refused on every rank. A ``load_state_dict`` before it waits for
it, and ``consolidate_state_dict`` before it gives what was loaded. Refused under Join: a joined
rank does not step, and every step all-gathers. ``consolidate_state_dict(to)`` gathers every
rank's slices (as bytes, not pickled) into one state_dict in torch's format for the parameters
as given — the unsharded optimizer's, so either loads the other's; a piece's per-element
entries are those of its 1-D shape (Adam's ``step`` has none), and loading slices every entry
of a parameter's shape, cast to the parameter's dtype and device as torch's load does (for a
parameter of no dimensions a two-element probe of the wrapped optimizer tells which)."""
from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np
import torch

from ..comm import collectives
from .. import runtime
from ..runtime import mpi
from ..comm import objects
from ..comm.fingerprint import check_same
from ..engine.blocks import partition

WHAT = "the parameters or their groups"  # what check_same compares (Note [ZeRO])


class ZeroRedundancyOptimizer(torch.optim.Optimizer):
    """torch's ``ZeroRedundancyOptimizer(params, optimizer_class, **defaults)`` on mpidp's
    ranks (Note [ZeRO]); ``process_group`` must be None, ``parameters_as_bucket_view`` and
    ``overlap_with_ddp`` are not offered (overlap: ``reduce_scatter_hook``). Collective:
    every rank constructs it with the same parameters and groups (Note [ZeRO])."""

    def __init__(self, params: Any, optimizer_class: type, process_group: Any = None,
                 parameters_as_bucket_view: bool = False, overlap_with_ddp: bool = False,
                 **defaults: Any):
        g = runtime.group()
        try:
            self._setup(params, optimizer_class, process_group, parameters_as_bucket_view,
                        overlap_with_ddp, defaults)
            mine, failed = self._description(), None
        except (TypeError, ValueError) as exc:  # refused on every rank: none waits
            mine, failed = [], exc
        check_same(g, mine, "ZeroRedundancyOptimizer", WHAT, failed)

    def _setup(self, params: Any, optimizer_class: type, process_group: Any,
               parameters_as_bucket_view: bool, overlap_with_ddp: bool, defaults: dict) -> None:
        if not (isinstance(optimizer_class, type) and
                issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(f"optimizer_class must be a torch.optim.Optimizer class, got "
                            f"{optimizer_class!r}")
        if process_group is not None or parameters_as_bucket_view or overlap_with_ddp:
            raise ValueError("mpidp's ZeroRedundancyOptimizer shards over every rank: "
                             "process_group must be None, and parameters_as_bucket_view and "
                             "overlap_with_ddp are not offered (with mpidp's "
                             "DistributedDataParallel, register reduce_scatter_hook)")
        # the class's whole set of defaults (dampening, weight_decay, ...) in param_groups,
        # as the unsharded optimizer's
        full = optimizer_class([torch.zeros(1, requires_grad=True)], **defaults).defaults
        super().__init__(params, dict(full))
        self._collect()
        self.optimizer_class, self._defaults = optimizer_class, dict(defaults)
        self._ddp: Any = None
        self._local: Optional[torch.optim.Optimizer] = None
        self._pieces: list = []      # per segment: [(param position, start, stop, view)]
        self._segments: list = []    # per segment: [param positions in order]
        self._pending: Optional[dict] = None  # a state_dict loaded before the first step
        self._consolidated: Optional[dict] = None
        self._per_element: dict = {}  # param group -> keys of its per-element state

    def add_param_group(self, param_group: dict) -> None:
        """torch's, before the first step (the layout is fixed then); RuntimeError after.
        Collective: the groups are compared across ranks as the constructor's are, and a
        group refused (on any rank) is added on none."""
        if not hasattr(self, "_all"):  # from torch's __init__, which checks them after
            super().add_param_group(param_group)
            return
        before = len(self.param_groups)
        try:
            if self._local is not None or self._ddp is not None:
                raise RuntimeError("ZeroRedundancyOptimizer.add_param_group after the first "
                                   "step or once attached to a DistributedDataParallel: the "
                                   "parameters are already partitioned")
            super().add_param_group(param_group)
            self._collect()
            mine, failed = self._description(), None
        except (TypeError, ValueError, RuntimeError) as exc:
            mine, failed = [], exc
        try:
            check_same(runtime.group(), mine, "ZeroRedundancyOptimizer.add_param_group", WHAT,
                       failed)
        except BaseException:
            del self.param_groups[before:]
            self._all = [p for group in self.param_groups for p in group["params"]]
            raise

    def _collect(self) -> None:
        """Every parameter in group order; ValueError for one that is not contiguous."""
        self._all = [p for group in self.param_groups for p in group["params"]]
        for k, p in enumerate(self._all):
            if not p.is_contiguous():
                raise ValueError(f"ZeroRedundancyOptimizer: parameter {k} is not contiguous")

    def _description(self) -> list:
        """What every rank must hold alike (Note [ZeRO]), for fingerprint.check_same: the
        number of groups, then each group's parameters (dtype and shape, numbered in group
        order) and its other entries."""
        out, k = [("param groups", len(self.param_groups))], 0
        for i, group in enumerate(self.param_groups):
            out.append((f"param group {i}: parameters", len(group["params"])))
            for p in group["params"]:
                out.append((f"param group {i}: parameter {k}", f"{p.dtype}{list(p.shape)}"))
                k += 1
            out += [(f"param group {i}: {key}", value) for key, value in
                    sorted(group.items()) if key != "params"]
        return out

    # ---- the layout ----------------------------------------------------------------------

    def attach(self, ddp: Any) -> None:
        """Called by DistributedDataParallel.register_comm_hook(self, reduce_scatter_hook)."""
        theirs = {id(p) for p in ddp._params}
        left = [p for p in self._all if id(p) not in theirs]
        if self._local is not None or not theirs <= {id(p) for p in self._all} or \
                any(p.requires_grad for p in left):
            raise ValueError("reduce_scatter_hook: the ZeroRedundancyOptimizer must hold the "
                             "DistributedDataParallel's parameters (and no other trainable "
                             "one), and be attached before its first step")
        self._ddp = ddp

    def _fix_layout(self) -> None:
        position = {id(p): k for k, p in enumerate(self._all)}
        if self._ddp is not None:
            if not self._ddp._rebuilt:
                raise RuntimeError("ZeroRedundancyOptimizer.step before the first backward of "
                                   "the DistributedDataParallel it is attached to")
            self._segments = [[position[id(self._ddp._params[i])] for i in b.indices]
                              for b in self._ddp._buckets]
        else:
            by_dtype: dict = {}
            for k, p in enumerate(self._all):
                by_dtype.setdefault(p.dtype, []).append(k)
            self._segments = list(by_dtype.values())
        g = runtime.group()
        for seg in self._segments:
            counts = [self._all[k].numel() for k in seg]
            lo, n = partition(sum(counts), g.size)[g.rank]
            pieces, offset = [], 0
            for k, c in zip(seg, counts):
                a, b = max(lo, offset), min(lo + n, offset + c)
                if a < b:
                    view = self._all[k].detach().view(-1)[a - offset:b - offset]
                    pieces.append((k, a - offset, b - offset, view))
                offset += c
            self._pieces.append(pieces)
        groups = []
        for group in self.param_groups:
            mine = {id(p) for p in group["params"]}
            views = [v for seg in self._pieces for k, _, _, v in seg if id(self._all[k]) in mine]
            groups.append({**{o: v for o, v in group.items() if o != "params"},
                           "params": views})
        self._local = self.optimizer_class(groups, **self._defaults)
        if self._pending is not None:
            self._load_local(self._pending)
            self._pending = None

    # ---- stepping ------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Optional[Callable] = None):
        """The wrapped optimizer's step on this rank's slices, then every rank's slices
        all-gathered into the parameters (collective)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._local is None:
            self._fix_layout()
        for group, local in zip(self.param_groups, self._local.param_groups):
            local.update({o: v for o, v in group.items() if o != "params"})
        for pieces in self._pieces:
            for k, a, b, view in pieces:
                grad = self._all[k].grad  # None: unused on every rank, skipped as unsharded
                view.grad = None if grad is None else grad.detach().reshape(-1)[a:b]
        self._local.step()
        for pieces in self._pieces:
            for _, _, _, view in pieces:
                view.grad = None
        self._gather_parameters()
        return loss

    def _gather_parameters(self) -> None:
        """Every rank's blocks into every rank's parameters (this rank's are there already:
        its pieces are views of them)."""
        g = runtime.group()
        if g.size == 1:
            return
        for seg, pieces in zip(self._segments, self._pieces):
            params = [self._all[k] for k in seg]
            mine = torch.cat([v for _, _, _, v in pieces]) if pieces else \
                params[0].detach().new_empty(0)
            full = collectives.allgather(mine)
            lo, n = partition(len(full), g.size)[g.rank]
            offset = 0
            for p in params:
                flat, end = p.detach().view(-1), offset + p.numel()
                for a, b in ((offset, min(end, lo)), (max(offset, lo + n), end)):
                    if a < b:  # the parts of p outside this rank's block
                        flat[a - offset:b - offset].copy_(full[a:b])
                offset = end

    def local_state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (0 before the first step)."""
        if self._local is None:
            return 0
        return sum(v.numel() * v.element_size() for s in self._local.state.values()
                   for v in s.values() if isinstance(v, torch.Tensor))

    # ---- state ---------------------------------------------------------------------------

    def _per_element_keys(self, k: int) -> set:
        """The state entries the wrapped optimizer keeps per element for parameter ``k``'s
        group, learnt by stepping it on a two-element probe (Note [ZeRO]); only a parameter
        of no dimensions needs it (elsewhere the shapes tell)."""
        group = next(i for i, gr in enumerate(self.param_groups)
                     if any(p is self._all[k] for p in gr["params"]))
        if group not in self._per_element:
            x = torch.zeros(2, requires_grad=True)
            opt = self.optimizer_class([x], **self._defaults)
            opt.param_groups[0].update({o: v for o, v in self.param_groups[group].items()
                                        if o != "params"})
            x.grad = torch.ones(2)
            opt.step()
            self._per_element[group] = {key for key, v in opt.state[x].items()
                                        if isinstance(v, torch.Tensor) and v.shape == (2,)}
        return self._per_element[group]

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gathers the whole optimizer state on rank ``to`` (collective)."""
        g = runtime.group()
        collectives.check_root(to, g.size)
        if self._local is None:  # no layout yet: what was loaded (the same on every rank)
            self._consolidated = None if g.rank != to else \
                {"state": dict(self._pending or {}), "param_groups": self._group_entries()}
            return
        entries, chunks = [], []  # this rank's pieces with state, and their slices' bytes
        for pieces in self._pieces:
            for k, a, b, view in pieces:
                state = self._local.state.get(view)
                if not state:
                    continue
                keys = sorted(key for key, v in state.items() if _sliced(v, b - a))
                rest = {key: v for key, v in state.items() if key not in keys}
                entries.append((k, a, b, [(key, str(state[key].dtype)) for key in keys],
                                _portable(rest)))
                chunks += [state[key].detach().cpu().contiguous().view(torch.uint8).numpy()
                           for key in keys]
        mine = np.concatenate(chunks) if chunks else np.zeros(0, np.uint8)
        gathered = objects.gather(g, (entries, len(mine)),  # metadata; None off the root
                                  "ZeRO: consolidating the state's metadata", to)
        everyone = [e for e, _ in gathered] if g.rank == to else None
        counts = [c for _, c in gathered] if g.rank == to else None
        data = np.empty(sum(counts), np.uint8) if g.rank == to else None
        if g.size > 1:
            mpi.gatherv_bytes(g.comm, mine, data, counts, to)
        else:
            data = mine
        self._consolidated = None
        if g.rank == to:
            self._consolidated = self._assemble(everyone, counts, data)

    def _assemble(self, everyone: list, counts: list, data: np.ndarray) -> dict:
        state: dict = {}
        sliced: dict = {}  # parameter -> its per-element keys
        offset = 0
        for entries, count in zip(everyone, counts):
            for k, a, b, keys, rest in entries:
                p = self._all[k]
                out = state.setdefault(k, {})
                sliced.setdefault(k, set()).update(key for key, _ in keys)
                for key, value in rest.items():
                    out.setdefault(key, _restore(value))
                for key, dtype in keys:
                    dt = getattr(torch, dtype.split(".")[-1])
                    nbytes = (b - a) * torch.empty(0, dtype=dt).element_size()
                    piece = torch.from_numpy(data[offset:offset + nbytes].copy()).view(dt)
                    full = out.setdefault(key, torch.zeros(p.numel(), dtype=dt))
                    full[a:b] = piece
                    offset += nbytes
        for k, out in state.items():
            for key, v in out.items():
                if isinstance(v, torch.Tensor) and key in sliced.get(k, ()):
                    out[key] = v.view(self._all[k].shape)
        return {"state": {k: state[k] for k in sorted(state)},
                "param_groups": self._group_entries()}

    def _group_entries(self) -> list:
        position = {id(p): k for k, p in enumerate(self._all)}
        return [{**{o: v for o, v in group.items() if o != "params"},
                 "params": [position[id(p)] for p in group["params"]]}
                for group in self.param_groups]

    def state_dict(self) -> dict:
        """The whole state, in the unsharded optimizer's format, on the rank
        ``consolidate_state_dict`` gathered it to; RuntimeError elsewhere."""
        if self._consolidated is None:
            raise RuntimeError("ZeroRedundancyOptimizer.state_dict: call "
                               "consolidate_state_dict(to=...) on every rank first; the state "
                               "is on the rank it was gathered to")
        return self._consolidated

    def load_state_dict(self, state_dict: dict) -> None:
        """Every rank passes the whole state (the unsharded optimizer's format, or
        ``state_dict``'s); each keeps its slices."""
        try:
            groups = state_dict["param_groups"]
            if len(groups) != len(self.param_groups) or any(
                    len(a["params"]) != len(b["params"])
                    for a, b in zip(groups, self.param_groups)):
                raise ValueError("its parameter groups differ from this optimizer's")
            state = {int(k): v for k, v in state_dict["state"].items()}
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"not an optimizer state_dict: {exc!r}") from None
        for saved, group in zip(groups, self.param_groups):
            group.update({o: v for o, v in saved.items() if o != "params"})
        if self._local is None:
            self._pending = state
        else:
            self._load_local(state)

    def _load_local(self, state: dict) -> None:
        self._local.state.clear()
        for pieces in self._pieces:
            for k, a, b, view in pieces:
                if k not in state:
                    continue
                p, mine = self._all[k], {}
                for key, v in state[k].items():
                    if isinstance(v, torch.Tensor) and v.shape == p.shape and (
                            p.dim() > 0 or key in self._per_element_keys(k)):
                        v = v.detach().reshape(-1)[a:b]  # as torch's load: the view's
                        mine[key] = v.to(view.device, view.dtype if v.is_floating_point()
                                         else v.dtype, copy=True)
                    else:
                        mine[key] = v.clone() if isinstance(v, torch.Tensor) else v
                self._local.state[view] = mine


def _sliced(value: Any, count: int) -> bool:
    """Whether a piece's state entry is per element (a piece is 1-D: its per-element state
    is too; Adam's step has no dimensions)."""
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == count


def _portable(values: dict) -> dict:
    """A piece's scalar state (Adam's step) as plain values (the metadata gathered)."""
    return {key: ("tensor", v.item(), str(v.dtype)) if isinstance(v, torch.Tensor) and
            v.numel() == 1 else v for key, v in values.items()}


def _restore(value: Any) -> Any:
    if isinstance(value, tuple) and len(value) == 3 and value[0] == "tensor":
        return torch.tensor(value[1], dtype=getattr(torch, value[2].split(".")[-1]))
    return value


def reduce_scatter_hook(state: ZeroRedundancyOptimizer, bucket) -> torch.futures.Future:
    """Registered with ``ddp.register_comm_hook(zero, reduce_scatter_hook)``: DDP
    reduce-scatters each bucket to the ranks owning it (Note [ZeRO]); DDP runs it itself, so
    it is never called as a function."""
    raise RuntimeError("reduce_scatter_hook runs inside mpidp's DistributedDataParallel only")


def _check_state(state: Any) -> None:
    if not isinstance(state, ZeroRedundancyOptimizer):
        raise TypeError("reduce_scatter_hook takes the mpidp.ZeroRedundancyOptimizer of the "
                        f"model's parameters as its state; got {type(state).__name__}")


# Note [Hook capabilities] in mpidp/ddp/hooks.py: how DistributedDataParallel knows this hook
reduce_scatter_hook.mpidp_check_state = _check_state  # type: ignore[attr-defined]
reduce_scatter_hook.mpidp_reduce_scatter = True  # type: ignore[attr-defined]
reduce_scatter_hook.mpidp_attach = \
    lambda state, ddp: state.attach(ddp)  # type: ignore[attr-defined]
