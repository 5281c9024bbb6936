"""A rank out of data joins (Horovod's ``hvd.join``): it adds zeros to the all-reduces the
other ranks still make, until every rank has joined (Note [Joined ranks] in
mpidp/engine/header.py; the others' side is ``allreduce_in``'s second try in
mpidp.comm.collectives)."""
from __future__ import annotations

from typing import Optional

import numpy as np

from ..algorithms import DEVICE, TABLE, choose
from ..engine import header
from ..engine.dtypes import BF16, DTYPE_NAMES, ITEMSIZE, NUMPY_STORAGE, flat_host_array
from ..errors import MismatchError
from ..runtime.frame import Frame
from . import collectives, fusion

_ROWS = {a.code: a for a in TABLE}


def join(g, device: Optional[int] = None) -> int:
    """Waits until every rank of group ``g`` has joined, adding zeros meanwhile to each
    all-reduce the others make (on CUDA device ``device``, else the current one, where theirs
    run on a GPU); any other collective of theirs raises on their ranks and this one goes on
    waiting. Returns the highest rank among those that joined last (Horovod's "last joined
    rank"). Collective: every rank calls it once it is out of data."""
    if g.size == 1:
        return g.rank
    first = True
    while True:
        with Frame(g, header.JOIN) as f:
            try:
                free = f.check(header.join_header(first))
            except MismatchError as exc:
                headers = getattr(exc, "headers", None)
                if not headers:
                    raise
                # every rank joined, from other lines (call sites differ in debug mode)
                done = all(h[0] == header.JOIN for h in headers)
                free = [h[header.FREE_WORD] for h in headers] if done else None
                wanted = header.for_joined(headers)
            if free is not None:
                fusion.forget(g)  # Note [A group's layout] in mpidp/comm/fusion.py
                return max((r for r, w in enumerate(free) if w), default=g.size - 1)
        first = False
        if wanted is not None:
            _add_zeros(g, wanted, device)


def _add_zeros(g, hdr: tuple, device: Optional[int]) -> None:
    """This rank's part in the all-reduce the others called (header ``hdr``): zeros of its
    dtype and count, by the algorithm their header names, stamped in debug mode with their
    call site (Note [Debug fingerprints] in mpidp/engine/header.py). Where it cannot make
    them, it refuses: the others raise rather than wait."""
    try:
        zeros, algorithm = _zeros(g, hdr, device)
    except BaseException as exc:  # any failure, an interrupt too: the others must hear of it
        collectives.refuse(g, header.ALLREDUCE, exc)
        raise
    with g.resources.stamped((hdr[1] >> 8) or None):  # their call site, or their name
        collectives.allreduce_in(g, zeros, header.OP_WORDS[hdr[2]], algorithm, True)


def _zeros(g, hdr: tuple, device: Optional[int]) -> tuple:
    """Zeros of ``hdr``'s dtype and count where its algorithm runs, and that algorithm's
    name (or auto where auto chooses it)."""
    code, dtype, count = hdr[1] & 0xF, hdr[3], hdr[4]
    row = _ROWS[code]
    if row.where == DEVICE:
        import torch  # only here: a joined rank of a GPU job (hvd.join is torch's API)
        zeros = torch.zeros(count, dtype=getattr(torch, DTYPE_NAMES[dtype]), device=torch.device(
            "cuda", torch.cuda.current_device() if device is None else device))
    elif dtype == BF16:  # numpy has no bfloat16: its bits, zero, as mpidp's own buffer
        zeros = flat_host_array(np.zeros(count, NUMPY_STORAGE[dtype]), dtype)
    else:
        zeros = np.zeros(count, NUMPY_STORAGE[dtype])
    auto = choose(row.where, "auto", collectives.facts(g, row.where == DEVICE),
                  count * ITEMSIZE[dtype])
    return zeros, "auto" if auto.code == row.code else row.name
