"""``--compression`` of the mirrored strategy: the hook it registers on DistributedDataParallel
(mpidp.ddp.compression, mpidp.ddp.powersgd), the choice of ``auto`` from a measured all-reduce
(Note [Compression auto]), and PowerSGD's state in checkpoints (every rank's error, the
shared Q's: Note [Compression state in checkpoints])."""
from __future__ import annotations

import time
from typing import Any, Optional

import numpy as np
import torch

from ..comm import collectives
from ..engine import host_ops
from .. import runtime
from ..ddp.compression import bf16_compress_hook, fp16_compress_hook
from ..engine.dtypes import BF16, F32, flat_host_array
from ..ddp.powersgd import PowerSGDState, powerSGD_hook
from ..comm.state_broadcast import gather_bytes
from ..comm import objects

POWERSGD_RANK = 1          # torch's default matrix_approximation_rank
POWERSGD_START_STEP = 10   # plain averaging first: the gradients' early steps are the largest
AUTO_GAIN = 0.9            # auto takes bf16 when it costs at most this much of float32's time
_REPEATS = 3

# Note [Compression auto]
# Compression pays only where the network bounds the step (Agarwal et al., MLSys 2022), so
# ``auto`` measures rather than guesses: on one rank or one node it stays ``none`` (nothing,
# or shared memory, to cross); across nodes every rank times the all-reduce of a buffer the
# size of the model's gradients as float32 and as bfloat16 with both casts (the fused path's
# whole cost), median of three after one warm-up, the slowest rank's figure counting; bf16
# wins when it takes at most AUTO_GAIN of float32's time. PowerSGD trades accuracy for bytes,
# so auto never picks it. The choice and its figures are one log line and in the summary.


def make_hook(kind: str, settings: Any) -> tuple:
    """(state, hook) to register for ``kind`` (not none or auto)."""
    if kind == "fp16":
        return None, fp16_compress_hook
    if kind == "bf16":
        return None, bf16_compress_hook
    return (PowerSGDState(matrix_approximation_rank=settings.powersgd_rank or POWERSGD_RANK,
                          start_powerSGD_iter=POWERSGD_START_STEP
                          if settings.powersgd_start_step is None
                          else settings.powersgd_start_step, random_seed=settings.seed),
            powerSGD_hook)


def choose(parameters: list, algorithm: str = "auto") -> tuple:
    """Note [Compression auto]: (the choice, why), the same on every rank, timing the
    all-reduce ``algorithm`` DDP will run. Collective."""
    g = runtime.group()
    if g.size == 1:
        return "none", "one rank: nothing to communicate"
    if runtime.node_count() == 1:
        return "none", "one node: gradients cross shared memory, where casting costs more " \
                       "than it saves"
    count = sum(p.numel() for p in parameters if p.requires_grad)
    grads, wire = np.ones(count, np.float32), np.zeros(count, np.uint16)

    def float32():
        collectives.allreduce_(grads, "sum", algorithm)

    def bf16():
        host_ops.cast_segments(wire, [grads], BF16, F32, 1, False)
        collectives.allreduce_(flat_host_array(wire, BF16), "sum", algorithm)
        host_ops.cast_segments(wire, [grads], BF16, F32, g.size, True)
    times = np.array([_median_s(float32), _median_s(bf16)])
    collectives.allreduce_(times, "max")
    choice = "bf16" if times[1] <= AUTO_GAIN * times[0] else "none"
    return choice, (f"the gradients' all-reduce ({count * 4 / 1e6:.1f} MB) across "
                    f"{runtime.node_count()} nodes took {times[0] * 1e3:.1f} ms as float32, "
                    f"{times[1] * 1e3:.1f} ms as bfloat16 with its casts")


def _median_s(fn) -> float:
    fn()
    spans = []
    for _ in range(_REPEATS):
        t0 = time.perf_counter()
        fn()
        spans.append(time.perf_counter() - t0)
    return float(np.median(spans))


# Note [Compression state in checkpoints]
# PowerSGD's state is the step count, one Q per compressed matrix (the same on every rank)
# and one error per compressed matrix and rank. A checkpoint keeps {"iter", "q": {position:
# Q}, "errors": {position: every rank's error stacked}} (positions in the module's parameter
# order). Which matrices have a Q or an error is the same on every rank, so saving gathers
# each error in a fixed order with mpidp's allgather, and resuming broadcasts rank 0's header
# (the step, the positions) and then each tensor, every rank keeping its own error: tensors
# travel as buffers, never pickled.

def gather_state(state: PowerSGDState, params: list) -> Optional[dict]:
    """The checkpoint's PowerSGD entry (rank 0; None elsewhere). Collective."""
    g = runtime.group()
    saved = state.state_dict(params)
    mine = sorted(saved["errors"].items())
    every = gather_bytes([e for _, e in mine], "checkpoint: gathering PowerSGD's errors")
    if g.rank != 0:
        return None
    errors, offset = {}, 0
    for k, e in mine:  # each rank's row holds its errors back to back
        n = e.numel() * e.element_size()
        errors[k] = torch.from_numpy(every[:, offset:offset + n].copy()).view(e.dtype) \
            .reshape(g.size, *e.shape)
        offset += n
    return {"kind": "powersgd", "iter": saved["iter"],
            "q": {k: q.detach().cpu() for k, q in saved["q"].items()}, "errors": errors}


def scatter_state(saved: Optional[dict], state: PowerSGDState, params: list) -> Optional[str]:
    """Loads the entry ``gather_state`` made (on rank 0; None elsewhere, or on rank 0 when
    the checkpoint has none) into every rank's ``state``. Returns what could not be taken up
    (the same on every rank), None when all was. Collective."""
    g = runtime.group()
    header = None
    if saved is not None:
        header = (int(saved["iter"]), {int(k): tuple(v.shape) for k, v in saved["q"].items()},
                  {int(k): tuple(v.shape) for k, v in saved["errors"].items()})
    header = objects.bcast(g, header, "resume: PowerSGD's state header")  # integers only
    if header is None:
        return "the checkpoint holds no PowerSGD state: its errors and Q's start afresh"
    iteration, q_shapes, error_shapes = header
    expected = {k: _shape(params[k], state) for k in {*q_shapes, *error_shapes}
                if 0 <= k < len(params)}
    fit_q = sorted(k for k, s in q_shapes.items() if expected.get(k) and expected[k][1] == s)
    fit_errors = sorted(k for k, s in error_shapes.items()
                        if expected.get(k) and (g.size,) + expected[k][0] == s)
    qs, errors = {}, {}
    for k in fit_q:
        qs[k] = _broadcast(saved["q"][k] if saved is not None else None, q_shapes[k],
                           params[k].dtype)
    for k in fit_errors:
        every = _broadcast(saved["errors"][k] if saved is not None else None,
                           error_shapes[k], params[k].dtype)
        errors[k] = every[g.rank].clone()
    state.load_state_dict({"iter": iteration, "q": qs, "errors": errors}, params)
    if len(qs) < len(q_shapes) or len(errors) < len(error_shapes):
        return ("the checkpoint's PowerSGD state does not fit these settings (another "
                "--powersgd-rank or number of ranks): what does not fit starts afresh")
    return None


def _shape(p: torch.Tensor, state: PowerSGDState) -> Optional[tuple]:
    """((rows, cols), (cols, r)): the shapes of ``p``'s error and Q, None where ``p`` is not
    compressed."""
    if p.dim() < 2 or not p.numel():
        return None
    rows, cols = p.shape[0], p.numel() // p.shape[0]
    if not state.compresses(rows, cols):
        return None
    return (rows, cols), (cols, min(rows, cols, state.matrix_approximation_rank))


def _broadcast(tensor: Optional[torch.Tensor], shape: tuple, dtype) -> torch.Tensor:
    """Rank 0's ``tensor`` (None elsewhere) of ``shape`` on every rank, as ``dtype``."""
    t = tensor.to(dtype).contiguous() if tensor is not None else torch.empty(shape, dtype=dtype)
    if runtime.size() > 1:
        collectives.broadcast_(t, 0)
    return t
