"""Horovod's DistributedOptimizer and the broadcasts a Horovod script makes at start-up
(parameters, optimizer state, objects), on mpidp's fused all-reduce and broadcasts."""
from __future__ import annotations

import contextlib
import functools
import io
import itertools
import warnings

import torch

from .. import config, runtime
from ..comm import collectives, state_broadcast
from .basics import Average, Product, Sum
from . import backward, sparse
from .compression import Compression
from .arguments import resolve_op
from .ops import fused
from .process_sets import ProcessSet, group_of, local_root, on


_made: dict = {}  # process set id -> a count of the DistributedOptimizers made on it


class _DistributedOptimizer:
    """The methods a DistributedOptimizer adds to the user's optimizer class (Note
    [Horovod's optimizer])."""

    def _distribute(self, named_parameters, compression, backward_passes_per_step, op,
                    gradient_predivide_factor, sparse_as_dense, groups):
        params = [p for group in self.param_groups for p in group["params"]]
        if named_parameters is not None:
            named = list(named_parameters)
            if any(not isinstance(item, tuple) or len(item) != 2 for item in named):
                raise ValueError("named_parameters should be a sequence of tuples (name, "
                                 "parameter), usually produced by model.named_parameters()")
            names = [n for n, _ in named]
            if len(set(names)) != len(names):
                raise ValueError(f"parameter names in named_parameters must be unique; "
                                 f"repeated: {sorted({n for n in names if names.count(n) > 1})}")
            known = {id(p) for _, p in named}
            missing = [i for i, p in enumerate(params) if id(p) not in known]
            if missing:
                raise ValueError(f"named_parameters was specified, but {len(missing)} of the "
                                 "optimizer's parameters are not in it")
        if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be a positive int, got "
                             f"{backward_passes_per_step!r}")
        if not gradient_predivide_factor > 0:
            raise ValueError(f"gradient_predivide_factor must be > 0, got "
                             f"{gradient_predivide_factor!r}")
        op = resolve_op(op, None)
        if gradient_predivide_factor != 1.0 and op != Average:
            raise ValueError("gradient_predivide_factor is only valid with op=hvd.Average")
        if op == Product:
            raise ValueError("DistributedOptimizer takes op=hvd.Average, hvd.Sum, hvd.Min or "
                             "hvd.Max, not hvd.Product")
        self._hvd_params = [p for p in params if p.requires_grad and self._hvd_member]
        self._hvd_compression = compression
        self._hvd_passes = backward_passes_per_step
        self._hvd_op = op
        self._hvd_predivide = float(gradient_predivide_factor)
        self._hvd_sparse_as_dense = sparse_as_dense
        self._hvd_counts = {p: 0 for p in self._hvd_params}  # backward passes since the last
        self._hvd_skip = False  # synchronize
        self._hvd_synchronized = False  # since the last step
        buckets = backward.groups_of(self._hvd_params, groups,
                                     config.get().horovod_fusion_bytes)
        # Note [Gradients during backward]: each bucket's all-reduce names its tensors (as
        # Horovod's names them), so that a call in another's place raises on every rank
        self._hvd_buckets = backward.Buckets(self._hvd_params, buckets, self._hvd_task)
        names = {id(p): n for n, p in named} if named_parameters is not None else {}
        # Horovod's names: the given ones, else allreduce.noname.<group>.<index>
        self._parameter_names = {p: n for n, p in named} if named_parameters is not None \
            else {p: f"allreduce.noname.{i}.{j}" for i, group in enumerate(self.param_groups)
                  for j, p in enumerate(group["params"])}
        where = 0 if self._hvd_process_set is None else self._hvd_process_set.process_set_id
        serial = next(_made.setdefault(where, itertools.count()))  # unnamed: the order the
        self._hvd_names = [[  # set's ranks all make them in
            names.get(id(self._hvd_params[i]), f"allreduce.noname.{where}.{serial}.{i}")
            for i in b] for b in buckets]
        self._hvd_tags = [backward.tag(k, len(buckets), b)
                          for k, b in enumerate(self._hvd_names)]
        for i, p in enumerate(self._hvd_params):
            p.register_post_accumulate_grad_hook(functools.partial(self._hvd_accumulated, i))

    def _hvd_accumulated(self, i: int, p) -> None:
        self._hvd_counts[p] += 1
        if self._hvd_counts[p] > self._hvd_passes:
            raise AssertionError(
                "Gradients were computed more than backward_passes_per_step times before "
                "call to step(). Increase backward_passes_per_step to accumulate gradients "
                "locally.")
        if self._hvd_counts[p] == self._hvd_passes:
            self._hvd_buckets.ready(i)

    def synchronize(self) -> None:
        """Waits for every gradient's all-reduce, launching those not launched during
        backward (zeros for a parameter that has no gradient here: another rank may have
        one)."""
        try:
            self._hvd_buckets.finish()
        finally:
            for p in self._hvd_params:
                self._hvd_counts[p] = 0
        self._hvd_synchronized = True

    def _hvd_task(self, params: list, k: int):
        """The all-reduce of bucket ``k``'s gradients (``params``'), to run on the
        communication thread: missing gradients made zeros here first, sparse ones gathered
        or, with sparse_as_dense, reduced dense (Note [Sparse gradients] in
        mpidp/horovod/sparse.py)."""
        g = group_of(self._hvd_process_set)
        dense, as_dense, gathered = [], [], []
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if not p.grad.is_sparse:
                dense.append(p.grad)
            elif g.size == 1:
                continue  # as Horovod, which reduces nothing alone: the gradient as it is
            elif self._hvd_sparse_as_dense:
                as_dense.append((p.grad, p.grad.to_dense()))
                dense.append(as_dense[-1][1])
            else:
                gathered.append(p.grad)
        tag = self._hvd_tags[k] if not gathered else backward.tag(
            k, len(self._hvd_tags), self._hvd_names[k],
            [name for name, p in zip(self._hvd_names[k], params) if p.grad.is_sparse])
        return functools.partial(self._hvd_reduce, g, dense, as_dense, gathered, tag)

    def _hvd_reduce(self, g, dense: list, as_dense: list, gathered: list, tag: int) -> None:
        with runtime.using(g), g.resources.stamped(tag):
            op, pre, post = self._hvd_op, 1.0, 1.0
            if op == Average and self._hvd_predivide != 1.0:
                op, pre, post = Sum, 1.0 / self._hvd_predivide, self._hvd_predivide / g.size
            if dense:
                fused(dense, True, op, pre, post, self._hvd_compression)
            for grad, reduced in as_dense:
                sparse.install(grad, reduced)
            for grad in gathered:
                sparse.gathered(grad, self._hvd_op, g.size, collectives.allgather)

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Within it, ``step`` does not all-reduce (the caller called ``synchronize``)."""
        self._hvd_skip = True
        try:
            yield
        finally:
            self._hvd_skip = False

    def step(self, closure=None):
        if not self._hvd_skip:
            if self._hvd_synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "context after optimizer.synchronize() (Horovod's words): "
                              "mpidp.horovod all-reduces the gradients a second time; call "
                              "step() inside `with optimizer.skip_synchronize():`", stacklevel=2)
            self.synchronize()
        self._hvd_synchronized = False
        return super().step(closure)

    def load_state_dict(self, state_dict):
        """The optimizer's own, after this pass is forgotten (gradients counted, buckets
        launched), as Horovod's clears its handles here: what hvd.elastic's restore relies on
        after a failure that came between a backward and its step."""
        if hasattr(self, "_hvd_buckets"):  # (set up once the class's own init is done)
            self._hvd_buckets.abandon()
            for p in self._hvd_params:
                self._hvd_counts[p] = 0
            self._hvd_synchronized = False
        return super().load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True):
        if any(self._hvd_counts.values()):
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but "
                                 "before optimizer.step() or optimizer.synchronize(). This is "
                                 "prohibited as it can cause a race condition.")
        return super().zero_grad(set_to_none)


# Note [Horovod's optimizer]
# Horovod's DistributedOptimizer is the user's optimizer class with the all-reduce of the
# gradients put before its step: a subclass made on the fly, constructed from the user's
# param_groups (so isinstance and the hyper-parameters hold), with the user's defaults. Each
# gradient is counted as it is accumulated (a hook per parameter: more passes than
# backward_passes_per_step raise as Horovod's do); at the last pass its bucket may launch,
# during the backward pass (Note [Gradients during backward] in mpidp/horovod/backward.py),
# and step (or synchronize) waits for every bucket. The result is Horovod's.
def DistributedOptimizer(  # noqa: N802 - Horovod's name
        optimizer, named_parameters=None, compression=Compression.none,
        backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0, num_groups=0,
        groups=None, sparse_as_dense=False, process_set=None):
    """``optimizer`` (a torch.optim.Optimizer) whose ``step`` first averages (``op``) the
    gradients over every rank, all-reduced in buckets during the backward pass. ``groups``
    (a number of groups, or lists of parameters) fixes the buckets as Horovod's groups do;
    ``num_groups``, its older name, is taken where ``groups`` is not given."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    # Horovod's: on a rank outside the set the optimizer reduces nothing (its step is the
    # plain step); a set not added, or not a set, is the error
    member = not isinstance(process_set, ProcessSet) or process_set.process_set_id is None \
        or process_set.included()
    if process_set is not None and member:
        group_of(process_set)
    cls = type(optimizer.__class__.__name__, (_DistributedOptimizer, optimizer.__class__), {})
    if num_groups and groups is None:
        groups = num_groups
    distributed = cls.__new__(cls)
    optimizer.__class__.__init__(distributed, optimizer.param_groups)
    distributed.defaults = dict(optimizer.defaults)
    distributed._hvd_process_set = process_set
    distributed._hvd_member = member
    distributed._distribute(named_parameters, compression, backward_passes_per_step, op,
                            gradient_predivide_factor, sparse_as_dense, groups)
    return distributed


def broadcast_parameters(params, root_rank, process_set=None) -> None:
    """Every rank's parameters (a state_dict, named_parameters() or tensors) set to root's."""
    with on(process_set):
        state_broadcast.broadcast_parameters(params, local_root(process_set, root_rank))


def broadcast_optimizer_state(optimizer, root_rank, model=None, process_set=None) -> None:
    """Every rank's optimizer state (moments, steps, hyper-parameters) set to root's. An
    optimizer without state is first given one as Horovod gives it: each parameter that
    requires a gradient gets a zero gradient (kept afterwards), and the optimizer's own step
    (not DistributedOptimizer's all-reduce) runs once."""
    if isinstance(optimizer, torch.optim.Optimizer) and not optimizer.state_dict()["state"]:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
        if isinstance(optimizer, _DistributedOptimizer):
            super(_DistributedOptimizer, optimizer).step()
        else:
            optimizer.step()
    with on(process_set):
        state_broadcast.broadcast_optimizer_state(optimizer, local_root(process_set, root_rank))


# Note [Objects without pickle]
# Horovod sends objects pickled; an unpickler runs what the bytes say, so mpidp sends what
# torch.save writes and reads it back with torch.load(weights_only=True): tensors, numbers,
# strings, and lists, tuples and dicts of them — what a script broadcasts (an epoch, a
# learning rate, a metric). Anything else is refused on the sending rank.
def _to_bytes(obj):
    """(``obj`` as bytes in a uint8 tensor, None) or (None, why it cannot travel)."""
    buf = io.BytesIO()
    try:
        torch.save(obj, buf)
        torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - reported on every rank
        return None, f"{type(obj).__name__} cannot be sent without pickle ({exc})".split("\n")[0]
    raw = buf.getvalue()
    padded = bytearray(raw) + bytearray(-len(raw) % 8)  # in int64 words: mpidp has no uint8
    return torch.frombuffer(padded, dtype=torch.int64), None


def _from_bytes(words: torch.Tensor):
    return torch.load(io.BytesIO(words.numpy().tobytes()), weights_only=True)


def _refused(what: str, ranks: list, why) -> ValueError:
    return ValueError(f"mpidp.horovod: {what}: the object of rank(s) "
                      f"{', '.join(map(str, ranks))} is not tensors, numbers, strings or "
                      f"lists, tuples and dicts of them" + (f": {why}" if why else "") +
                      " (Note [Objects without pickle])")


def broadcast_object(obj, root_rank=0, name=None, process_set=None):
    """Root's ``obj`` on every rank (Note [Objects without pickle]); an object that cannot
    travel raises on every rank."""
    with on(process_set) as g:
        root = local_root(process_set, root_rank)
        data, why = _to_bytes(obj) if g.rank == root else (None, None)
        n = -1 if g.rank == root and data is None else (0 if data is None else data.numel())
        words = int(collectives.broadcast(torch.tensor([n], dtype=torch.int64), root)[0])
        if words < 0:
            raise _refused("broadcast_object", [root_rank], why)
        if g.rank != root:
            data = torch.zeros(words, dtype=torch.int64)
        return _from_bytes(collectives.broadcast(data, root))


def allgather_object(obj, name=None, process_set=None) -> list:
    """Every rank's ``obj``, in rank order (Note [Objects without pickle]); an object that
    cannot travel raises on every rank."""
    data, why = _to_bytes(obj)
    n = -1 if data is None else data.numel()
    with on(process_set):
        lengths = collectives.allgather(torch.tensor([n], dtype=torch.int64)).tolist()
        bad = [r for r, k in enumerate(lengths) if k < 0]
        if bad:
            raise _refused("allgather_object", bad, why)  # ranks of the set
        every = collectives.allgather(data)
    out, start = [], 0
    for k in lengths:
        out.append(_from_bytes(every[start:start + k]))
        start += k
    return out
