"""The operations of the torch.distributed backend with torch's semantics, on one mpidp group:
all-reduce, reduce-scatter and reduce through mpidp's collectives where they have the op and
the dtype; the rest — every other op and dtype, broadcast, the all-gathers, gather, scatter,
the all-to-alls, barrier — as MPI calls on the tensors' bytes after the same header check
(Note [Operations beyond mpidp's collectives]). Each function is one collective: every rank of
the group calls it, in the same order (mpidp.backend.group's communication thread does).

Note [Operations beyond mpidp's collectives]
A reduction mpidp's kernels do not have (PRODUCT, the bitwise ops, the dtypes other than
float16, bfloat16, float32, float64, int32 and int64, AVG of an integer tensor — the sum
divided with truncation, as NCCL does — or of a complex one) gathers every
rank's tensor and reduces the stack in rank order on each rank with torch: the same bits on
every rank, exact for integers, at the cost of n copies of the tensor in memory — these are
small, rare tensors (flags, counters, masks) in data-parallel training. Every operation first
exchanges a header (mpidp.engine.header.other_header: the operation's name with its reduction,
root, dtype and element count), so ranks that call different operations, or the same one with
different sizes, raise a MismatchError on every rank instead of moving wrong bytes or hanging;
a rank whose own input is bad joins that exchange with an error code (as
mpidp.comm.collectives.refuse does). The frame and the all-to-all's agreement on split sizes
are mpidp.comm.operations'; the bytes move in MPI's own calls (mpidp.runtime.mpi)."""
from __future__ import annotations

import functools

import numpy as np
import torch

from ..comm import collectives, operations
from ..comm.tensor_views import host_format, tensor_bytes as _bytes
from ..engine import header, host_ops
from ..runtime import mpi

header.binding(__package__)  # a call site is the script's line, not this package's

RED = torch.distributed.ReduceOp.RedOpType
_NAMES = {RED.SUM: "SUM", RED.AVG: "AVG", RED.PRODUCT: "PRODUCT", RED.MIN: "MIN",
          RED.MAX: "MAX", RED.BAND: "BAND", RED.BOR: "BOR", RED.BXOR: "BXOR",
          RED.PREMUL_SUM: "PREMUL_SUM"}
_MPIDP_OPS = {RED.SUM: "sum", RED.AVG: "avg", RED.MIN: "min", RED.MAX: "max"}
_FAST_OPS = {kind.value: name for kind, name in _MPIDP_OPS.items()}
_MPIDP_DTYPES = frozenset((torch.float16, torch.bfloat16, torch.float32, torch.float64,
                           torch.int32, torch.int64))
_BITWISE = frozenset((RED.BAND, RED.BOR, RED.BXOR))
OPERATIONS = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor",
              "all_gather_coalesced",
              "reduce_scatter", "reduce_scatter_tensor", "reduce", "gather", "scatter",
              "all_to_all", "all_to_all_single", "barrier")
for _name in OPERATIONS:  # every rank can name what another rank called (header.describe)
    header.other_header(_name)
    for _op in _NAMES.values():
        header.other_header(f"{_name} {_op}")


def reduce_name(op) -> str:
    """The name of torch ReduceOp ``op`` (a ReduceOp or its RedOpType); ValueError for one the
    backend does not have."""
    kind = getattr(op, "op", op)
    if kind not in _NAMES:
        raise ValueError(f"the mpidp backend has no reduction {kind!r}; it has "
                         + ", ".join(_NAMES.values()))
    return _NAMES[kind]


def _reduction(op) -> tuple:
    """(RedOpType, name) of ``op``, without raising: an op the backend lacks is refused
    inside the operation's check (``reduce_name`` in its validate), on every rank."""
    kind = getattr(op, "op", op)
    return kind, _NAMES.get(kind, "unsupported")


def _dtype_word(t: torch.Tensor) -> int:
    return header.other_dtype(str(t.dtype).removeprefix("torch."))


def operation(g, name: str, t=None, count: int = 0, root=None, validate=None):
    """The body of operation ``name`` on tensor ``t`` (its dtype in the header) as the group's
    next collective under the watchdog, after the header check (Note [Operations beyond
    mpidp's collectives]; mpidp.comm.operations.operation); ``t`` dense, then ``validate()``,
    are checked first, and an exception raised there is raised on this rank, a
    MismatchError on the others."""
    shown = isinstance(t, torch.Tensor) and t.layout == torch.strided

    def check():
        _dense(name, t)
        if validate is not None:
            validate()
    return operations.operation(g, name, count, root, _dtype_word(t) if shown else 0, check)


def _dense(what: str, *tensors) -> None:
    """TypeError naming ``what`` unless every tensor (None aside) is dense: the backend moves
    a tensor's bytes, and a sparse or other layout has none of its own (torch's gloo sends
    sparse tensors' indices and values; mpidp does not)."""
    for t in tensors:
        if t is not None and t.layout != torch.strided:
            raise TypeError(f"{what}: {t.layout} tensors are not supported by the mpidp "
                            "backend; pass dense tensors (tensor.to_dense())")


def _view(t: torch.Tensor, fmt: str):
    """A buffer over contiguous CPU tensor ``t``'s memory with struct format ``fmt`` (Note
    [Host views] in csrc/view.c: torch's ``.numpy()`` would make the tensor's storage
    unresizable for good, which torch's backends never do and hooks such as batched PowerSGD
    rely on; DLPack costs more than a small collective)."""
    return host_ops.host_view(t.data_ptr(), t.nbytes, fmt, t.shape, t)


class Staged:
    """A contiguous CPU tensor standing for ``t`` (``t`` itself where it is one); ``done()``
    copies it back into ``t`` after an operation wrote it."""

    def __init__(self, t: torch.Tensor, read: bool = True):
        self.t = t
        plain = t.device.type == "cpu" and t.is_contiguous()
        self.host = t if plain else (t.detach().to("cpu").contiguous() if read else
                                     torch.empty(t.shape, dtype=t.dtype))
        self.bytes = _bytes(self.host.detach())

    def done(self) -> None:
        if self.host is not self.t:
            with torch.no_grad():
                self.t.copy_(self.host)


def _stacked_reduce(stack: torch.Tensor, kind) -> torch.Tensor:
    """Reduces ``stack`` (rank, ...) along dimension 0 in rank order with op ``kind``."""
    if stack.dtype == torch.bool:  # as torch's backends: sum and max are or, product and min and
        kind = {RED.SUM: RED.BOR, RED.MAX: RED.BOR, RED.PRODUCT: RED.BAND,
                RED.MIN: RED.BAND}.get(kind, kind)
    if kind in _BITWISE:
        fn = {RED.BAND: torch.bitwise_and, RED.BOR: torch.bitwise_or,
              RED.BXOR: torch.bitwise_xor}[kind]
        return functools.reduce(fn, stack.unbind(0))
    if kind == RED.MIN:
        return functools.reduce(torch.minimum, stack.unbind(0))
    if kind == RED.MAX:
        return functools.reduce(torch.maximum, stack.unbind(0))
    if kind == RED.PRODUCT:
        return functools.reduce(torch.mul, stack.unbind(0))
    total = functools.reduce(torch.add, stack.unbind(0))
    if kind != RED.AVG:
        return total
    if total.is_floating_point() or total.is_complex():
        return total / stack.shape[0]
    return torch.div(total, stack.shape[0], rounding_mode="trunc")  # NCCL's integer AVG


def _premultiplied(kind, op, t: torch.Tensor):
    """(kind, op, tensor) to reduce: for PREMUL_SUM of a floating-point tensor, SUM of a new
    tensor, ``t`` times the op's factor (a number or a tensor: torch's
    ``_make_nccl_premul_sum``), as NCCL multiplies before it sums (FSDP2's
    ``set_gradient_divide_factor`` asks for it); otherwise ``kind``, ``op`` and ``t`` (a
    PREMUL_SUM of another dtype is refused in the operation's check)."""
    if kind != RED.PREMUL_SUM or not (t.is_floating_point() or t.is_complex()):
        return kind, op, t
    with torch.no_grad():
        return RED.SUM, RED.SUM, t.detach() * op.factor


def _check_op_dtype(kind, t: torch.Tensor) -> None:
    if kind == RED.PREMUL_SUM:
        raise TypeError(f"PREMUL_SUM needs a floating-point tensor, got {t.dtype}")
    if kind in _BITWISE and (t.is_floating_point() or t.is_complex()):
        raise TypeError(f"{_NAMES[kind]} needs an integer or bool tensor, got {t.dtype}")
    if kind == RED.AVG and t.dtype == torch.bool:
        raise TypeError("AVG has no meaning for bool tensors")
    if t.is_complex() and kind in (RED.MIN, RED.MAX):
        raise TypeError(f"{_NAMES[kind]} has no meaning for complex tensors ({t.dtype})")


def _native(kind, t: torch.Tensor) -> bool:
    return t.layout == torch.strided and kind in _MPIDP_OPS and t.dtype in _MPIDP_DTYPES and not (
        kind == RED.AVG and not t.is_floating_point())


def _gathered(g, staged: Staged) -> torch.Tensor:
    """Every rank's tensor (the same shape everywhere), stacked in rank order."""
    out = torch.empty((g.size,) + tuple(staged.host.shape), dtype=staged.host.dtype)
    mpi.allgather_bytes(g.comm, staged.bytes, _bytes(out))
    return out


def all_reduce(g, t: torch.Tensor, op) -> None:
    """torch.distributed.all_reduce of ``t`` in place with ReduceOp ``op``."""
    # the common case first, cheaply (pybind's enums hash slowly): a contiguous CPU tensor
    # of a dtype and op mpidp reduces, as a view of its memory (Note [Host views] in
    # csrc/view.c), in one C call where it is small (Note [Small all-reduce in one call])
    name = "sum" if op == RED.SUM else \
        _FAST_OPS.get(getattr(getattr(op, "op", op), "value", None))
    fmt = host_format(t.dtype)
    if name is not None and fmt is not None and t.is_cpu and t.layout is torch.strided \
            and t.is_contiguous() and not (name == "avg" and fmt in "iq"):
        collectives.allreduce_view_(g, _view(t, fmt), name)  # Note [One call or the general path]
        return
    kind, name = _reduction(op)
    kind, op, scaled = _premultiplied(kind, op, t)
    if scaled is not t:
        with torch.no_grad():
            t.copy_(scaled)
    if _native(kind, t):
        fmt = host_format(t.dtype) if t.device.type == "cpu" and t.is_contiguous() else None
        collectives.allreduce_in(g, np.asarray(_view(t, fmt)) if fmt else
                                 t.detach(), _MPIDP_OPS[kind], "auto", True)
        return
    with operation(g, f"all_reduce {name}", t, t.numel(),
                 validate=lambda: (reduce_name(op), _check_op_dtype(kind, t))):
        staged = Staged(t)
        result = _stacked_reduce(_gathered(g, staged), kind) if g.size > 1 else staged.host
        with torch.no_grad():
            staged.host.copy_(result)
        staged.done()


def reduce(g, t: torch.Tensor, root: int, op) -> None:
    """torch.distributed.reduce: ``t`` at ``root`` holds the reduction afterwards."""
    kind, name = _reduction(op)
    kind, op, scaled = _premultiplied(kind, op, t)
    if scaled is not t:
        reduce(g, scaled, root, op)
        if g.rank == root:
            with torch.no_grad():
                t.copy_(scaled)
        return
    if _native(kind, t):
        collectives.reduce_in(g, t.detach(), root, _MPIDP_OPS[kind])
        return
    with operation(g, f"reduce {name}", t, t.numel(), root,
                 validate=lambda: (reduce_name(op), collectives.check_root(root, g.size),
                                   _check_op_dtype(kind, t))):
        staged = Staged(t)
        if g.size == 1:
            return
        everyone = torch.empty((g.size,) + tuple(t.shape), dtype=t.dtype) if g.rank == root \
            else None
        mpi.gather_bytes(g.comm, staged.bytes, None if everyone is None else _bytes(everyone),
                         root)
        if everyone is not None:
            with torch.no_grad():
                staged.host.copy_(_stacked_reduce(everyone, kind))
            staged.done()


def reduce_scatter_tensor(g, out: torch.Tensor, x: torch.Tensor, op) -> None:
    """torch.distributed.reduce_scatter_tensor: ``out`` gets this rank's block (``x``'s
    numel / size elements, in rank order) of the reduction of ``x``."""
    kind, name = _reduction(op)
    kind, op, x = _premultiplied(kind, op, x)

    def validate():
        reduce_name(op)
        _dense("reduce_scatter_tensor", x, out)
        if x.dtype != out.dtype:
            raise TypeError(f"reduce_scatter_tensor: input dtype {x.dtype} and output dtype "
                            f"{out.dtype} differ")
        if x.numel() != out.numel() * g.size:
            raise ValueError(f"reduce_scatter_tensor: the input has {x.numel()} elements; it "
                             f"needs the output's {out.numel()} times the group's {g.size}")
        _check_op_dtype(kind, x)

    if _native(kind, x) and out.device == x.device and out.layout == torch.strided:
        try:
            validate()
        except Exception as exc:
            collectives.refuse(g, header.REDUCE_SCATTER, exc)
            raise
        block = collectives.reduce_scatter_in(g, x.detach().reshape(g.size, -1),
                                             _MPIDP_OPS[kind])
        with torch.no_grad():
            out.copy_(block.reshape(out.shape))
        return
    with operation(g, f"reduce_scatter_tensor {name}", x, x.numel(), validate=validate):
        staged = Staged(x)
        stack = _gathered(g, staged).reshape(g.size, g.size, -1)[:, g.rank]
        with torch.no_grad():
            out.copy_(_stacked_reduce(stack, kind).reshape(out.shape))


def broadcast(g, t: torch.Tensor, root: int) -> None:
    """torch.distributed.broadcast: every rank's ``t`` holds root's afterwards."""
    with operation(g, "broadcast", t, t.numel(), root,
                 validate=lambda: collectives.check_root(root, g.size)):
        staged = Staged(t, read=g.rank == root)
        mpi.bcast_bytes(g.comm, staged.bytes, root)
        staged.done()


def all_gather_into_tensor(g, out: torch.Tensor, x: torch.Tensor) -> None:
    """torch.distributed.all_gather_into_tensor: ``out`` holds every rank's ``x`` back to
    back in rank order."""
    def validate():
        _dense("all_gather_into_tensor", out)
        if x.dtype != out.dtype or out.numel() != x.numel() * g.size:
            raise ValueError(f"all_gather_into_tensor: the output ({out.dtype}, {out.numel()} "
                             f"elements) must hold the group's {g.size} inputs of {x.dtype}, "
                             f"{x.numel()} elements")

    with operation(g, "all_gather_into_tensor", x, x.numel(), validate=validate):
        src, dst = Staged(x), Staged(out, read=False)
        send = _send_buffer(src.bytes, dst.bytes, g.rank)
        mpi.allgather_bytes(g.comm, send, dst.bytes, in_place=send is None)
        dst.done()


def _send_buffer(send: np.ndarray, recv: np.ndarray, rank: int):
    """What to pass MPI as the send buffer of an all-gather of ``send`` into ``recv``: None
    (in place) where ``send`` is this rank's block of ``recv`` (FSDP gathers in place), a
    copy where it overlaps ``recv`` elsewhere (MPI refuses aliased buffers), else itself."""
    start, end = send.ctypes.data, send.ctypes.data + send.nbytes
    r_start = recv.ctypes.data
    if send.nbytes == 0 or end <= r_start or start >= r_start + recv.nbytes:
        return send
    if start == r_start + rank * send.nbytes:
        return None
    return send.copy()


def gather_all(g, outs, x: torch.Tensor) -> None:
    """torch.distributed.all_gather: ``outs[r]`` holds rank r's ``x``."""
    with operation(g, "all_gather", x, x.numel(),
                 validate=lambda: _check_list("all_gather", outs, x, g.size)):
        everyone = _gathered(g, Staged(x))
        with torch.no_grad():
            for o, row in zip(outs, everyone):
                o.copy_(row.reshape(o.shape))


def all_gather_coalesced(g, output_lists, inputs) -> None:
    """torch.distributed.all_gather_coalesced: ``output_lists[r][k]`` holds rank r's
    ``inputs[k]``; one header for all of them (their total element count)."""
    def validate():
        if len(output_lists) != g.size:
            raise ValueError(f"all_gather_coalesced: {len(output_lists)} output lists; the "
                             f"group has {g.size} ranks (one list per rank)")
        for r, outs in enumerate(output_lists):
            if len(outs) != len(inputs):
                raise ValueError(f"all_gather_coalesced: output list {r} has {len(outs)} "
                                 f"tensors for {len(inputs)} inputs")
        for k, x in enumerate(inputs):
            _check_list("all_gather_coalesced", [outs[k] for outs in output_lists], x, g.size)

    count = sum(x.numel() for x in inputs)
    with operation(g, "all_gather_coalesced", inputs[0] if len(inputs) else None, count,
                   validate=validate):
        for k, x in enumerate(inputs):
            everyone = _gathered(g, Staged(x))
            with torch.no_grad():
                for outs, row in zip(output_lists, everyone):
                    outs[k].copy_(row.reshape(outs[k].shape))


def reduce_scatter_list(g, out: torch.Tensor, ins, op) -> None:
    """torch.distributed.reduce_scatter: ``out`` gets the reduction of every rank's
    ``ins[rank]``."""
    try:
        _check_list("reduce_scatter", ins, out, g.size)
    except Exception as exc:
        with operation(g, "reduce_scatter", out, validate=functools.partial(_raise, exc)):
            pass
    reduce_scatter_tensor(g, out, torch.stack([i.detach().reshape(out.shape) for i in ins]),
                          op)


def _raise(exc: BaseException) -> None:
    raise exc


def gather(g, outs, x: torch.Tensor, root: int) -> None:
    """torch.distributed.gather: at ``root``, ``outs[r]`` holds rank r's ``x``."""
    def validate():
        collectives.check_root(root, g.size)
        if g.rank == root:
            _check_list("gather", outs, x, g.size)

    with operation(g, "gather", x, x.numel(), root, validate=validate):
        src = Staged(x)
        everyone = torch.empty((g.size,) + tuple(src.host.shape), dtype=x.dtype) \
            if g.rank == root else None
        mpi.gather_bytes(g.comm, src.bytes, None if everyone is None else _bytes(everyone),
                         root)
        if everyone is not None:
            with torch.no_grad():
                for o, row in zip(outs, everyone):
                    o.copy_(row.reshape(o.shape))


def scatter(g, out: torch.Tensor, ins, root: int) -> None:
    """torch.distributed.scatter: ``out`` gets root's ``ins[rank]``."""
    def validate():
        collectives.check_root(root, g.size)
        if g.rank == root:
            _check_list("scatter", ins, out, g.size)

    with operation(g, "scatter", out, out.numel(), root, validate=validate):
        dst = Staged(out, read=False)
        send = torch.stack([i.detach().to("cpu").reshape(-1) for i in ins]) \
            if g.rank == root else None
        mpi.scatter_bytes(g.comm, None if send is None else _bytes(send.contiguous()),
                          dst.bytes, root)
        dst.done()


def _check_list(what: str, tensors, like: torch.Tensor, size: int) -> None:
    _dense(what, *tensors)
    if len(tensors) != size:
        raise ValueError(f"{what}: the list has {len(tensors)} tensors; the group has {size} "
                         "ranks")
    for i, t in enumerate(tensors):
        if t.dtype != like.dtype or t.numel() != like.numel():
            raise ValueError(f"{what}: tensor {i} ({t.dtype}, {t.numel()} elements) differs "
                             f"from this rank's ({like.dtype}, {like.numel()} elements)")


def all_to_all_single(g, out: torch.Tensor, x: torch.Tensor, out_splits, in_splits) -> None:
    """torch.distributed.all_to_all_single: rank r's block j of ``x`` (rows ``in_splits[j]``
    of dimension 0, equal blocks without splits) becomes rank j's block r of ``out``."""
    row_bytes = [0]

    def validate():
        _dense("all_to_all_single", out)
        if x.dtype != out.dtype:
            raise TypeError(f"all_to_all_single: input dtype {x.dtype} and output dtype "
                            f"{out.dtype} differ")
        rows = x.shape[0] if x.dim() else 1
        row_bytes[0] = x.numel() // max(rows, 1) * x.element_size()
        out_rows = out.shape[0] if out.dim() else 1
        if out.numel() // max(out_rows, 1) * out.element_size() != row_bytes[0] and \
                out.numel() and x.numel():
            raise ValueError(f"all_to_all_single: the input's rows {tuple(x.shape[1:])} and "
                             f"the output's {tuple(out.shape[1:])} differ")
        for t, splits, what in ((x, in_splits, "input"), (out, out_splits, "output")):
            n = t.shape[0] if t.dim() else 1
            if splits and (len(splits) != g.size or sum(splits) != n or min(splits) < 0):
                raise ValueError(f"all_to_all_single: {what} split sizes {list(splits)} do "
                                 f"not split its {n} rows among {g.size} ranks")
            if not splits and n % g.size:
                raise ValueError(f"all_to_all_single: the {what}'s {n} rows do not split "
                                 f"evenly among {g.size} ranks; pass split sizes")

    with operation(g, "all_to_all_single", x, validate=validate):
        def counts(t, splits):
            n = t.shape[0] if t.dim() else 1
            rows = list(splits) if splits else [n // g.size] * g.size
            return [r * row_bytes[0] for r in rows]
        send, recv = counts(x, in_splits), counts(out, out_splits)
        dst = Staged(out, read=False)
        operations.alltoallv_agreed(g, "all_to_all", Staged(x).bytes, send, dst.bytes, recv)
        dst.done()


def all_to_all(g, outs, ins) -> None:
    """torch.distributed.all_to_all: ``ins[j]`` goes to rank j's ``outs[rank]``."""
    def validate():
        if len(outs) != g.size or len(ins) != g.size:
            raise ValueError(f"all_to_all: {len(ins)} inputs and {len(outs)} outputs; the "
                             f"group has {g.size} ranks")
        _dense("all_to_all", *outs, *ins)
        if len({t.dtype for t in list(outs) + list(ins)}) > 1:
            raise TypeError("all_to_all: the tensors' dtypes differ")

    with operation(g, "all_to_all", ins[0] if len(ins) else None, validate=validate):
        src = Staged(torch.cat([t.detach().to("cpu").reshape(-1) for t in ins]))
        dst = Staged(torch.empty(sum(t.numel() for t in outs), dtype=outs[0].dtype),
                      read=False)
        operations.alltoallv_agreed(g, "all_to_all", src.bytes,
                                    [t.numel() * t.element_size() for t in ins], dst.bytes,
                                    [t.numel() * t.element_size() for t in outs])
        offset = 0
        with torch.no_grad():
            for o in outs:
                o.copy_(dst.host[offset:offset + o.numel()].reshape(o.shape))
                offset += o.numel()


def barrier(g) -> None:
    """torch.distributed.barrier: the header exchange is itself a barrier (every rank hears
    every rank's header before any leaves)."""
    with operation(g, "barrier"):
        pass
