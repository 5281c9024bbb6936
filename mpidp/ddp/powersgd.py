"""PowerSGD (Vogels et al., NeurIPS 2019) as a communication hook of mpidp's
DistributedDataParallel with torch's contract and no torch.distributed: ``PowerSGDState`` and
``powerSGD_hook`` under torch's names and main arguments (Note [PowerSGD]).

Note [PowerSGD]
Per bucket, after ``start_powerSGD_iter`` steps of plain averaging: the rank's error from the
last step is added to its gradients (error feedback); each gradient of two or more dimensions
viewed as an n x m matrix M whose rank-r factors are smaller by ``min_compression_rate`` (n*m
>= rate * (n+m)*r) is compressed — P = M Q, the P's of the bucket summed over the ranks in one
all-reduce and orthonormalised (Gram-Schmidt, column by column), Q = M^T P summed in a second,
and M replaced by P Q^T / N; the rest (vectors, small matrices) is averaged as it is. The error
is what this rank's (error-fed) gradient lost: M - P Q^T / N for compressed matrices, none
elsewhere. With ``warm_start`` each matrix's summed Q is kept for the next step (one power
iteration per step refines it); otherwise, and at the first compressed step, Q is drawn from a
normal generator seeded by (``random_seed``, step, shape), through numpy's SeedSequence — the
same on every rank, and the same after a resume. Errors and Q's are kept per parameter, not per
bucket (torch's are per bucket, and so must wait for DDP's bucket rebuild after the first step;
a resumed DDP's first step has the unrebuilt layout again): ``state_dict(parameters)`` keys
them by position, so a checkpointed run resumes bit for bit. Every rank computes P and Q from
identical summed bits, so the ranks' results stay identical. A gradient with no elements is
averaged as it is. As in torch's hook, a parameter unused on every rank
(find_unused_parameters) still has its zero slot compressed and its error updated, though DDP
leaves its .grad None. The all-reduces use ``auto`` (a hook does not see the DDP's
``algorithm``)."""
from __future__ import annotations

from typing import Any, Iterable

import numpy as np
import torch

from ..comm import collectives
from .. import runtime


class PowerSGDState:
    """torch's ``PowerSGDState`` arguments that mpidp's PowerSGD uses (``process_group``
    must be None: the DDP's ranks)."""

    def __init__(self, process_group: Any = None, matrix_approximation_rank: int = 1,
                 start_powerSGD_iter: int = 1_000, min_compression_rate: float = 2,
                 use_error_feedback: bool = True, warm_start: bool = True,
                 orthogonalization_epsilon: float = 0, random_seed: int = 0):
        if process_group is not None:
            raise TypeError("mpidp's PowerSGDState averages over DistributedDataParallel's "
                            "ranks: process_group must be None, got "
                            f"{type(process_group).__name__}")
        for name, value, least in (("matrix_approximation_rank", matrix_approximation_rank, 1),
                                   ("start_powerSGD_iter", start_powerSGD_iter, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"PowerSGDState: {name} must be an integer >= {least}, "
                                 f"got {value!r}")
        if not isinstance(random_seed, int) or isinstance(random_seed, bool) or random_seed < 0:
            raise ValueError(f"PowerSGDState: random_seed must be an integer >= 0, got "
                             f"{random_seed!r}")
        for name, value in (("min_compression_rate", min_compression_rate),
                            ("orthogonalization_epsilon", orthogonalization_epsilon)):
            if not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"PowerSGDState: {name} must be a number >= 0, got {value!r}")
        self.matrix_approximation_rank = matrix_approximation_rank
        self.start_powerSGD_iter = start_powerSGD_iter
        self.min_compression_rate = float(min_compression_rate)
        self.use_error_feedback = bool(use_error_feedback)
        self.warm_start = bool(warm_start)
        self.orthogonalization_epsilon = float(orthogonalization_epsilon)
        self.random_seed = int(random_seed)
        self.iter = 0
        self.error_dict: dict = {}  # parameter -> the error of its gradient matrix
        self.q_memory_dict: dict = {}  # parameter -> the Q of its gradient matrix

    def state_dict(self, parameters: Iterable[torch.Tensor]) -> dict:
        """What a checkpoint needs for a bit-exact resume, keyed by each parameter's position
        in ``parameters`` (the module's, as DistributedDataParallel holds them)."""
        position = {id(p): k for k, p in enumerate(parameters)}
        return {"iter": self.iter,
                "errors": {position[id(p)]: e.clone() for p, e in self.error_dict.items()},
                "q": {position[id(p)]: q.clone() for p, q in self.q_memory_dict.items()}}

    def load_state_dict(self, state: dict, parameters: Iterable[torch.Tensor]) -> None:
        """The inverse of ``state_dict`` with the same ``parameters``."""
        params = list(parameters)
        try:
            iteration = int(state["iter"])
            errors = {self._owner(params, k, v, False): v.clone()
                      for k, v in state["errors"].items()}
            qs = {self._owner(params, k, v, True): v.clone() for k, v in state["q"].items()}
        except (KeyError, TypeError, AttributeError, IndexError, ValueError) as exc:
            raise ValueError(f"not a PowerSGDState.state_dict() of these parameters: "
                             f"{exc}") from None
        self.iter, self.error_dict, self.q_memory_dict = iteration, errors, qs

    def _owner(self, params: list, key: Any, value: torch.Tensor, is_q: bool) -> torch.Tensor:
        """The parameter at position ``key``, once ``value`` has the shape its error (or Q)
        has under this state's settings; IndexError or ValueError otherwise."""
        k = int(key)
        if not 0 <= k < len(params):
            raise IndexError(f"position {k} is not one of the {len(params)} parameters")
        p = params[k]
        rows = p.shape[0] if p.dim() >= 2 else 0
        cols = p.numel() // rows if rows else 0
        if not rows or not self.compresses(rows, cols):
            raise ValueError(f"parameter {k} (shape {tuple(p.shape)}) is not compressed")
        want = (cols, min(rows, cols, self.matrix_approximation_rank)) if is_q else (rows, cols)
        if tuple(value.shape) != want or value.dtype != p.dtype:
            raise ValueError(f"the {'Q' if is_q else 'error'} of parameter {k} is "
                             f"{value.dtype} {tuple(value.shape)}, not {p.dtype} {want}")
        return p

    def compresses(self, rows: int, cols: int) -> bool:
        r = min(rows, cols, self.matrix_approximation_rank)
        return rows * cols >= self.min_compression_rate * (rows + cols) * r


def _check_state(state: Any) -> None:
    if not isinstance(state, PowerSGDState):
        raise TypeError("mpidp's powerSGD_hook takes mpidp.ddp.powersgd.PowerSGDState as its "
                        f"state; got {type(state).__name__}")


def powerSGD_hook(state: PowerSGDState, bucket) -> torch.futures.Future:
    """The bucket averaged with PowerSGD compression (Note [PowerSGD])."""
    _check_state(state)
    buffer = bucket.buffer()
    if state.iter < state.start_powerSGD_iter:
        collectives.allreduce_(buffer, "avg")
    else:
        _compress(state, buffer, bucket.gradients(), bucket.parameters())
    if bucket.is_last():
        state.iter += 1
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(buffer)
    return future


def _describe_state(state: PowerSGDState) -> list:
    """The settings and step every rank's state must share (compared at the first
    synchronised backward: Note [Communication hooks] in mpidp/ddp/hooks.py): with another
    rank, seed or schedule the ranks' P and Q would differ, or pair different all-reduces."""
    return [(name, getattr(state, name)) for name in (
        "matrix_approximation_rank", "start_powerSGD_iter", "min_compression_rate",
        "use_error_feedback", "warm_start", "orthogonalization_epsilon", "random_seed",
        "iter")]


powerSGD_hook.mpidp_check_state = _check_state  # type: ignore[attr-defined]
powerSGD_hook.mpidp_describe_state = _describe_state  # type: ignore[attr-defined]


def _compress(state: PowerSGDState, buffer: torch.Tensor, grads: list, params: list) -> None:
    """Note [PowerSGD] on one bucket, in place in ``buffer`` (``grads``: views of it, of
    ``params``)."""
    size = runtime.size()
    matrices, plain, owners = [], [], []
    for g, p in zip(grads, params):  # views of the buffer
        m = g.reshape(g.shape[0], -1) if g.dim() >= 2 and g.numel() else None
        if m is not None and state.compresses(*m.shape):
            error = state.error_dict.get(p) if state.use_error_feedback else None
            if error is not None:
                m.add_(error.to(m.device))
            matrices.append(m)
            owners.append(p)
        else:
            plain.append(g.reshape(-1))
    if plain:
        flat = torch.cat(plain)
        collectives.allreduce_(flat, "avg")
        _scatter(flat, plain)
    if not matrices:
        return
    qs = [_initial_q(state, p, m) for p, m in zip(owners, matrices)]
    ps = [m @ q for m, q in zip(matrices, qs)]
    flat_p = torch.cat([p.reshape(-1) for p in ps])
    collectives.allreduce_(flat_p, "sum")
    _scatter(flat_p, ps)
    for p in ps:
        _orthonormalise(p, state.orthogonalization_epsilon)
    qs = [m.t() @ p for m, p in zip(matrices, ps)]
    flat_q = torch.cat([q.reshape(-1) for q in qs])
    collectives.allreduce_(flat_q, "sum")
    _scatter(flat_q, qs)
    for owner, m, p, q in zip(owners, matrices, ps, qs):
        if state.warm_start:
            state.q_memory_dict[owner] = q
        before = m.clone() if state.use_error_feedback else None
        torch.matmul(p, q.t(), out=m)
        m.div_(size)
        if before is not None:
            state.error_dict[owner] = before.sub_(m)


def _initial_q(state: PowerSGDState, owner: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The Q of matrix ``m`` (parameter ``owner``'s gradient): the kept one (warm start), or
    drawn (Note [PowerSGD])."""
    shape = (m.shape[1], min(*m.shape, state.matrix_approximation_rank))
    kept = state.q_memory_dict.get(owner) if state.warm_start else None
    if kept is not None and kept.shape == shape:
        return kept.to(m.device)
    words = np.random.SeedSequence([state.random_seed, state.iter, *m.shape]).generate_state(2)
    generator = torch.Generator().manual_seed(int(words[0]) << 31 | int(words[1]) >> 1)
    return torch.randn(shape, generator=generator, dtype=torch.float32).to(m.device, m.dtype)


def _scatter(flat: torch.Tensor, parts: list) -> None:
    """Copies consecutive pieces of ``flat`` into ``parts``."""
    offset = 0
    for part in parts:
        n = part.numel()
        part.copy_(flat[offset:offset + n].view(part.shape))
        offset += n


def _orthonormalise(p: torch.Tensor, epsilon: float) -> None:
    """Gram-Schmidt on the columns of ``p``, in place (a zero column stays zero)."""
    for i in range(p.shape[1]):
        col = p[:, i]
        if i:
            col.sub_(p[:, :i] @ (p[:, :i].t() @ col))
        norm = torch.linalg.vector_norm(col)
        if epsilon or norm > 0:
            col.div_(norm + epsilon)
