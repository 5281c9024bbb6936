"""The collective frame, written once (Note [The collective frame]): every blocking operation
on a group — mpidp's collectives, its object collectives, the torch.distributed backend's
operations — runs inside one."""
from __future__ import annotations

import sys
from typing import Optional

from ..engine import header

# Note [The collective frame]
# A collective on a group is four steps, in this order on every rank:
#   1. its input is checked on this rank (shapes, dtypes, roots, writability: anything that
#      can fail here alone);
#   2. its header is published on the group's board (Note [Watchdog] in watchdog.py), which
#      makes it the group's next collective, numbered alike on every rank;
#   3. the header is exchanged (mpidp.engine.exchange), or, where step 1 failed, an error
#      header is: every rank then raises (the error here, a MismatchError elsewhere) and none
#      waits for a rank that will not come;
#   4. the data moves (an engine executor, or MPI's own object collectives), and whatever
#      happens the board marks the collective done.
# ``Frame`` is steps 2-4's bookkeeping; its users write step 1 and the data's move. The C
# fast path (csrc/small.c, csrc/exchange.c: Note [Small all-reduce in one call]) keeps its own
# protocol for speed, and is the same frame: it publishes the header on the same board,
# carries a refused input as an error header, and marks the collective done.


class Frame:
    """One collective of group ``g`` (a ``with`` block): ``refuse`` joins the header exchange
    with an error, ``check`` publishes a header and exchanges it; the board marks the
    collective done when the block ends, whatever the outcome. ``kind``: the header's
    collective code (mpidp.engine.header), ``name``: the operation in messages."""

    __slots__ = ("g", "board", "kind", "name")

    def __init__(self, g, kind: int, name: Optional[str] = None):
        self.g, self.board, self.kind = g, g.board, kind
        self.name = name if name is not None else header.KIND_NAMES[kind]

    def __enter__(self) -> "Frame":
        return self

    def __exit__(self, *exc_info) -> bool:
        self.board.done = self.board.seq
        if exc_info and exc_info[0] is not None:
            self.board.failed += 1
        return False

    def publish(self, hdr: tuple) -> tuple:
        """Step 2: ``hdr`` on the board as the group's next collective; returns the header to
        exchange (with its call site in debug mode)."""
        return self.board.publish(hdr)

    def check(self, hdr: tuple, data=None, dtype: int = 0, op: int = 0):
        """Steps 2 and 3: publishes ``hdr`` and exchanges it (with ``data``: a small
        all-reduce in the same messages); every rank's free word, or raises on every rank.
        Alone: returns None."""
        hdr = self.board.publish(hdr)
        if self.g.size > 1:
            return self.g.resources.exchange(hdr, self.name, None, data, dtype, op)
        return None

    def refuse(self, exc: BaseException, hdr: Optional[tuple] = None) -> None:
        """Step 3 for a bad input (``exc``): joins the exchange with an error header
        (``hdr``, else the collective's own), which raises on every rank — here ``exc`` is
        re-raised by the caller, elsewhere a MismatchError. Alone: returns."""
        if self.g.size > 1:
            hdr = self.board.publish(hdr if hdr is not None else
                                     header.error_header(self.kind, exc))
            self.g.resources.exchange(hdr, self.name, exc)

    def links(self):
        """What the engine's executors take for this group (Note [Handed down] in
        mpidp/engine/links.py), ready."""
        return self.g.resources.links_ready()


class _Unwatched:
    """The frame of communication outside any mpidp group: nothing to publish or mark."""

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> bool:
        return False


_UNWATCHED = _Unwatched()


def collective(g, name: str, check: bool = True):
    """The frame of an object collective or a barrier on the group's communicator named
    ``name`` (mpidp.comm.objects), which every rank of ``g`` enters in the same order: the
    group's next collective under the watchdog; in debug mode with ``check`` a header naming
    it is exchanged first (Note [Debug fingerprints] in mpidp/engine/header.py). ``g`` None:
    communication outside any mpidp group, unwatched."""
    if g is None:
        return _UNWATCHED
    f = Frame(g, header.OTHER, name)
    hdr = f.publish(header.other_header(name))
    if check and f.board.debug and g.size > 1:
        try:
            g.resources.exchange(hdr, name)
        except BaseException:
            f.__exit__(*sys.exc_info())
            raise
    return f
