"""What every rank must agree on beyond what a collective's header holds — the layout of a group
of tensors fused into one buffer, the name of a Horovod operation — checked in that header all
the same (``agreed``). Note [Agreement before refusal]."""
from __future__ import annotations

import contextlib
from typing import Optional

from ..engine import header
from ..errors import MismatchError
from ..runtime.frame import Frame
from . import collectives, objects

# Note [Agreement before refusal]
# Every argument that must agree across ranks is checked together, in the one frame (Note [The
# collective frame] in mpidp/runtime/frame.py), so that a bad value on one rank raises on
# every rank, each naming the rank and the value, and the next collective works:
# - what a header holds (collective, op, root, dtype, count, shape) by the header;
# - what it cannot hold — the shapes and dtypes of a group of tensors fused into a few
#   buckets (grouped_allreduce: a bucket's header holds its total count only), the name of a
#   Horovod operation — by a described stamp of a text saying it (Note [Described stamps] in
#   mpidp/engine/header.py), carried by the block's collectives (``agreed``). Where every
#   rank's header of a disagreement carries one, every rank is in such a block, so each
#   exchanges its text once more and every rank's MismatchError names every rank's;
# - a rank whose local check fails (an op it does not have, a root outside the group, an
#   average of integers, not a tensor) does not raise first: it joins the exchange with a
#   refusal (mpidp.comm.collectives.refuse with header.refusal: the values it was called
#   with), raises its own
#   error there, and every other rank a MismatchError naming it and those values;
# - a process set's ranks by one exchange of every rank's list where it is made
#   (mpidp.horovod.process_sets.add_process_set, fingerprint.check_same);
# - an operation that is no collective of data but must be called by every rank at the same
#   point (hvd.start_timeline, hvd.stop_timeline; fingerprint.check_same before its exchange)
#   by the header of an object collective naming it (``called``), exchanged before it acts,
#   so a rank still in another collective — a test that failed on some ranks only and left
#   its loop of calls — raises there on every rank instead of waiting.
# The common call pays nothing: an unnamed all-reduce carries no stamp and keeps its one C
# call; a grouped one stamps its first bucket only, and only where its layout changed (Note
# [A group's layout] in mpidp/comm/fusion.py).


_TEXTS: dict = {}  # described stamp -> its text, on this rank
_STAMPS: dict = {}  # text -> its described stamp, on this rank


def stamp_of(text: str) -> int:
    """The described stamp of ``text`` (Note [Described stamps] in mpidp/engine/header.py),
    made once per text."""
    stamp = _STAMPS.get(text)
    if stamp is None:
        stamp = _STAMPS[text] = header.described_stamp(text)
        _TEXTS[stamp] = text
    return stamp


@contextlib.contextmanager
def agreed(g, text: str):
    """The block's collectives on group ``g`` carry a described stamp of ``text``: where it
    differs on some rank, every rank raises a MismatchError naming every rank's ``text``
    (Note [Agreement before refusal]). Inside another stamp, the two together. The block's
    one C calls carry the stamp too. Every rank of ``g`` enters it at the same call."""
    if g.size == 1:
        yield
        return
    outer = g.board.site
    if outer is not None:  # a stamp already: one of both texts
        text = f"{_TEXTS.get(outer) or header.site_text(outer)}; {text}"
    stamp = stamp_of(text)
    try:
        if outer is None:
            with g.resources.stamped(stamp):
                yield
        else:  # the one C call reads the board's stamp
            g.board.site = stamp
            try:
                yield
            finally:
                g.board.site = outer
    except MismatchError as exc:
        _name_every_text(g, exc, text)


def allreduce_tensor_(g, x, op: str, stamp: int) -> bool:
    """``collectives.allreduce_tensor_`` (the in-place all-reduce of CPU tensor ``x`` as one C
    call) as inside ``agreed(g, text)``, ``stamp`` being ``stamp_of(text)`` (a named Horovod
    all-reduce: Note [Names] in mpidp/horovod/arguments.py): its header carries the stamp, so
    the name costs no exchange of its own. True when done, False when it declined (nothing
    done: the caller takes its ``agreed`` block); where the ranks' stamps or inputs differ,
    every rank raises as ``agreed`` makes it. Every rank of ``g`` calls it."""
    if g.board.site is not None:  # inside another stamp: the caller's block
        return False
    try:
        return collectives.allreduce_tensor_(g, x, op, stamp)
    except MismatchError as exc:
        _name_every_text(g, exc, _TEXTS[stamp])


def _name_every_text(g, exc: MismatchError, text: str) -> None:
    """Raises ``exc``, or where every rank's header of it carries a described stamp and no
    error (every rank is in an ``agreed`` block: Note [Described stamps]), a MismatchError
    naming every rank's text — after one more exchange, of the texts."""
    headers = getattr(exc, "headers", None)
    if not headers or any(h[6] or not header.stamp_of(h) & header.DESCRIBED for h in headers):
        raise exc
    said = getattr(exc, "said", None)  # what an inner block without a stamp added
    texts = objects.allgather(g, text if said is None or said in text else f"{text}; {said}",
                              "the texts of a disagreement")
    mine = headers[g.rank]
    lines = []
    for r, (h, t) in enumerate(zip(headers, texts)):
        plain = header.with_site_hash(h, 0)
        line = f"  rank {r}: {header.describe(plain)} at {t}"
        if t != texts[0] or tuple(plain[:header.FREE_WORD]) != \
                tuple(header.with_site_hash(headers[0], 0)[:header.FREE_WORD]):
            line += "  <- differs from rank 0"
        lines.append(line)
    what = header.KIND_NAMES.get(mine[0], "collective")
    raise MismatchError(f"rank {g.rank}: {what}: ranks called it with inputs that do not "
                        "agree; every rank raises this error:\n" + "\n".join(lines)) from None


def called(g, name: str, failed: Optional[BaseException] = None) -> None:
    """Every rank of group ``g`` calls operation ``name`` here (Note [Agreement before
    refusal]): one header exchange, of an object collective's header naming it, as the
    group's next collective. Where some rank called another collective, a MismatchError on
    every rank naming each rank's; where this rank refused its call (``failed``), ``failed``
    here and a MismatchError naming this rank elsewhere. Every rank of ``g`` calls it."""
    with Frame(g, header.OTHER, name) as f:
        if failed is not None:
            f.refuse(failed, header.other_header(name, error=header.error_code(failed)))
            raise failed
        f.check(header.other_header(name))
