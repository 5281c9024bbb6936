"""The collective header: the fixed 8 words (which collective, algorithm, op, dtype, count,
shape, local error, a free word) every rank publishes for every collective, built here and only
here, and what a disagreement of headers means in words (``describe``, ``mismatch_error``).

The check itself — every rank sees every header, and a disagreement is raised on every rank
instead of corrupting data or hanging — is the exchange (mpidp.engine.exchange: on one node
through the shared-memory control block, across nodes by recursive doubling with a small
all-reduce's data in the same messages, Note [Checked in the message] in
mpidp/engine/doubling.py); after a disagreement one MPI_Allgather (``exchange_mpi``, here) names
who called what.

The C side writes headers too (the one-call all-reduce, csrc/small.c and csrc/exchange.c): the
words it needs are in csrc/wire.h, which the extension exports as ``mpidp._ext.WIRE``;
``check_wire`` compares them with the constants here, and mpidp.engine.host_ops does not use
an extension built for another header (a stale build says so, naming the words that differ).

Note [Debug fingerprints]
The header covers what a collective's data depends on: which collective, algorithm, op,
root, dtype, element count and a hash of the shape. Two things escape it: collectives that
look alike but are not the same call (rank 2 skipped the first of two identical
all-reduces, so its second pairs with the others' first and the sums mix), and mpidp's own
object collectives over MPI (the pickled allgather, gather, bcast and barriers of set-up,
checkpoints and the parameter server), which exchange no header and hang when ranks disagree.
With MPIDP_DEBUG=1 every header also carries where the collective was called (the user's
line, file name and line hashed into the algorithm word: the first frame outside mpidp's
collective layers, Horovod's API, the torch.distributed backend and torch itself, whichever
of them the call went through; for an operation the backend runs on its group's thread, the
caller's line taken when it was submitted: ``call_site``),
and every object collective is preceded by a header naming it (kind OTHER, the name's CRC-32
in the shape word): a rank that calls another collective, or the same one from another line,
is named on every rank, with its call site. The cost is a stack walk per collective and one
more exchange per object collective, so it is off by default. A caller that knows what its
collectives are can stamp them with a name in the same place, debug mode or not
(Resources.stamped in mpidp/runtime/resources.py: DistributedOptimizer's buckets, Note
[Gradients during backward] in mpidp/horovod/backward.py). A sequence number would add
nothing here (the k-th collectives of the ranks are the ones paired, so their numbers always
agree); the watchdog's report carries it instead, to name the ranks that are behind."""
from __future__ import annotations

import os
import sys
import zlib
from typing import Optional, Sequence

import numpy as np

from ..algorithms import CODE_NAMES
from .dtypes import DTYPE_NAMES
from ..errors import MismatchError

ALLREDUCE, BROADCAST, ALLGATHER, REDUCE_SCATTER, REDUCE, OTHER, JOIN = 1, 2, 3, 4, 5, 6, 7
KIND_NAMES = {ALLREDUCE: "allreduce", BROADCAST: "broadcast", ALLGATHER: "allgather",
              REDUCE_SCATTER: "reduce_scatter", REDUCE: "reduce", JOIN: "join"}
OP_WORDS = {0: "sum", 1: "min", 2: "max", 4: "avg",  # op_word(op code, average)
            8: "adasum"}  # Horovod's, refused (mpidp.horovod): named in a refusal
_OTHER_NAMES: dict = {}  # CRC-32 -> name of an object collective (the same table on every rank)
_SITES: dict = {}        # 24-bit CRC -> call site this process has seen
# frames skipped when looking for a collective's call site (Note [Debug fingerprints]): the
# packages of the collective layers, whatever module of theirs a collective passes through
# (Horovod's API and the torch.distributed backend too: a script's own line is named, not the
# drop-in's), and torch's own modules between them and the script (autograd's Function.apply
# of hvd.allreduce, dist.all_reduce's front)
_LAYER = ("mpidp.comm.", "mpidp.runtime.", "mpidp.engine.", "torch.")  # and the bindings'
# packages, each added where it is imported (``binding``)
_LAYER_MODULES = frozenset(("contextlib", "torch"))
_CODES = {name: code for code, name in CODE_NAMES.items()}  # an algorithm's code by name
# word 1: the algorithm's code (mpidp.algorithms) in bits 0-3; for the shared-memory protocol
# its data mode (none, inline, sliced) in bits 4-5 and peer mode (cma, window) in bit 6, set
# by the C call (csrc/binding.h), so ranks that would move data differently disagree there;
# the call site's hash above bit 8 in debug mode
MODE_SHIFT = 4
STAMP_SHIFT = 8  # word 1: a call site's hash or a name's stamp (Note [Described stamps])
HEADER_WORDS = 8
_DATA_MODES = ("handshake", "inline", "sliced")
_PEER_MODES = ("cma", "window")

# local error codes carried in header word 6; a refusal that shows what it was called with
# (``refusal``) adds ERR_SHOWN
ERR_NONE, ERR_TYPE, ERR_VALUE, ERR_UNSUPPORTED = 0, 1, 2, 3
ERR_SHOWN = 8
_ERR_NAMES = {ERR_TYPE: "TypeError", ERR_VALUE: "ValueError",
              ERR_UNSUPPORTED: "NotImplementedError"}
UNKNOWN = -1  # a word of a refusal its rank could not fill (a dtype of no tensor, ...)
FREE_WORD = 7  # not compared: a value that may differ per rank (allgather's first dimension)


def binding(package: str) -> None:
    """A binding above the collectives (mpidp.horovod, the torch.distributed backend) names its
    package, so that a call site is looked for beyond its frames too (Note [Debug
    fingerprints]): the engine names no layer above it."""
    global _LAYER
    if package + "." not in _LAYER:
        _LAYER = _LAYER + (package + ".",)


def check_wire(wire: dict) -> Optional[str]:
    """What differs between the header the C extension was built for (``mpidp._ext.WIRE``,
    csrc/wire.h) and this one; None where nothing does."""
    mine = {"HEADER_WORDS": HEADER_WORDS, "FREE_WORD": FREE_WORD, "ALLREDUCE": ALLREDUCE,
            "SHM": _CODES["shm"], "DOUBLING": _CODES["doubling"], "MODE_SHIFT": MODE_SHIFT,
            "STAMP_SHIFT": STAMP_SHIFT}
    differ = [f"{k} {wire.get(k)} where mpidp.engine.header has {v}" for k, v in mine.items()
              if wire.get(k) != v]
    if not differ:
        return None
    return ("the C extension was built for another collective header (" + "; ".join(differ) +
            "): rebuild it (pip install -e . in the checkout)")


def op_word(op: int, average: bool) -> int:
    """The header's op word: the kernel op code, plus 4 for an average."""
    return op + 4 * average


def header(kind: int, algorithm: int, op: int, dtype: int, count: int, shape: tuple,
           error: int = ERR_NONE, free: int = 0) -> tuple:
    """The 8 words a rank publishes; words 0-6 must agree on every rank. ``op``: op_word, or
    the root of a broadcast."""
    return (kind, algorithm, op, dtype, count, hash(shape), error, free)


def error_header(kind: int, exc: BaseException) -> tuple:
    """The header of a rank refusing its input to collective ``kind``."""
    return (kind, 0, 0, 0, 0, 0, ERR_TYPE if isinstance(exc, TypeError) else ERR_VALUE, 0)


def error_code(exc: BaseException) -> int:
    """Header word 6 of a rank refusing its input with ``exc``."""
    return ERR_TYPE if isinstance(exc, TypeError) else \
        ERR_UNSUPPORTED if isinstance(exc, NotImplementedError) else ERR_VALUE


def refusal(kind: int, exc: BaseException, op: int = UNKNOWN, dtype: int = UNKNOWN,
            count: int = UNKNOWN) -> tuple:
    """The header of a rank refusing its input to collective ``kind`` with ``exc``, showing
    what it was called with (``op``: op_word or a broadcast's root; ``dtype``: a dtype code;
    ``count``: elements; UNKNOWN where it has none), so that every other rank's MismatchError
    names that rank's value (Note [Agreement before refusal] in mpidp/comm/agreement.py)."""
    return (kind, 0, op, dtype, count, 0, error_code(exc) | ERR_SHOWN, 0)


# Note [Described stamps]
# A stamp (Resources.stamped) is 23 bits of a CRC where it names a call site or a bucket;
# with bit 23 set (``described_stamp``) it stands for a text every rank holding it can say —
# a Horovod name, the layout of a group of tensors (mpidp.comm.agreement) — and where every
# rank's header of a disagreement carries one, without an error, every rank is in such a
# block and can exchange the texts once more to name them all.
DESCRIBED = 1 << 23


def described_stamp(text: str) -> int:
    """The stamp of ``text`` with the DESCRIBED bit (Note [Described stamps]), remembered so
    that a report names it."""
    crc = zlib.crc32(text.encode()) & (DESCRIBED - 1) | DESCRIBED
    _SITES[crc] = text
    return crc


def stamp_of(h: Sequence[int]) -> int:
    """The stamp (or call site's hash) header ``h`` carries; 0 for none."""
    return int(h[1]) >> STAMP_SHIFT


# element types of the torch.distributed backend's operations (mpidp.backend), by name: word 3
# of an OTHER header holds 1 + an index into this table, 0 for none
OTHER_DTYPES = ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16",
                "float32", "float64", "complex64", "complex128", "uint16", "uint32", "uint64",
                "complex32", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                "float8_e5m2fnuz", "float8_e8m0fnu")


def other_dtype(name: str) -> int:
    """An OTHER header's dtype word for element type ``name`` ("float32", torch's without
    "torch."): 1 + its index in OTHER_DTYPES, 0 for one not there."""
    return OTHER_DTYPES.index(name) + 1 if name in OTHER_DTYPES else 0


def other_header(name: str, op: int = 0, dtype: int = 0, count: int = 0,
                 error: int = ERR_NONE) -> tuple:
    """The header of an object collective called ``name`` (Note [Debug fingerprints]), or of
    an operation of the torch.distributed backend: ``op`` (0, or 1 + its root: the name says
    which reduction), ``dtype`` (0 or 1 + an index into OTHER_DTYPES) and element ``count`` must
    agree too."""
    crc = zlib.crc32(name.encode())
    _OTHER_NAMES[crc] = name
    return (OTHER, 0, op, dtype, count, crc, error, 0)


def call_site() -> str:
    """``file.py:line`` of the first caller outside mpidp's collective layers and torch
    (``_LAYER``): the user's line, whichever entry point it called. A collective that runs on
    another thread than its caller's (the backend's: Note [One communication thread per
    group] in mpidp/comm/scheduler.py) takes its caller's, captured at submission
    (Board.carry_site in mpidp/runtime/watchdog.py). Debug mode only: a stack walk."""
    f = sys._getframe(1)
    while f.f_back is not None:
        name = f.f_globals.get("__name__", "")
        if not (name.startswith(_LAYER) or name in _LAYER_MODULES):
            break
        f = f.f_back
    return f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno}"


def site_hash(site: str) -> int:
    """The 24-bit hash a header carries for call site (or name) ``site``, remembered so that
    a report names it."""
    crc = zlib.crc32(site.encode()) & (DESCRIBED - 1)  # Note [Described stamps]
    _SITES[crc] = site
    return crc


def site_text(crc: int) -> str:
    """What stamp or call-site hash ``crc`` stands for, where this process made it."""
    if crc in _SITES:
        return _SITES[crc]
    return f"a name or layout {crc:#08x}" if crc & DESCRIBED else f"call site {crc:#08x}"


def share_sites(comm, headers: Sequence[Sequence[int]]) -> None:
    """After a disagreement that every rank of ``comm`` saw in ``headers`` (or each its own),
    the call sites they carry named on every rank (a rank knows only the lines it called
    from: Note [Debug fingerprints]), so that each rank's error names them all. Collective
    over ``comm``: one allgather, on the error path only."""
    mine = {crc: _SITES[crc] for crc in {int(h[1]) >> STAMP_SHIFT for h in headers}
            if crc in _SITES}
    for known in comm.allgather(mine):
        _SITES.update(known)


def with_site(hdr: tuple, site: str) -> tuple:
    """``hdr`` carrying a hash of its call site ``site`` above the algorithm byte."""
    return (hdr[0], hdr[1] | site_hash(site) << STAMP_SHIFT) + tuple(hdr[2:])


def with_site_hash(hdr: tuple, crc: int) -> tuple:
    """``hdr`` carrying call-site hash ``crc`` (another rank's, from its header)."""
    return (hdr[0], hdr[1] & (1 << STAMP_SHIFT) - 1 | crc << STAMP_SHIFT) + tuple(hdr[2:])


def describe(h: Sequence[int], modes: bool = False) -> str:
    """A header in words: "allreduce float32[650] op=avg algorithm=shm", with its call site
    where it carries one, and with ``modes`` its shared-memory data and peer mode."""
    kind, algorithm, op, dtype, count, shape, error, _ = h
    site, mode = algorithm >> STAMP_SHIFT, (algorithm >> MODE_SHIFT) & 0xF
    algorithm &= 0xF
    name = KIND_NAMES.get(kind, f"collective kind {kind}")
    if kind == JOIN:
        what = "join (out of data: adds zeros to the others' all-reduces)"
    elif kind == OTHER:
        what = _OTHER_NAMES.get(shape, f"object collective {shape:#x}")
        if 0 < dtype <= len(OTHER_DTYPES):
            what += f" {OTHER_DTYPES[dtype - 1]}[{count}]"
        if op:
            what += f" root={op - 1}"
        if error:
            what += f", refused there ({_ERR_NAMES.get(error & ~ERR_SHOWN, 'error')})"
    elif error & ERR_SHOWN:
        what = name + (f" {DTYPE_NAMES[dtype]}" if 0 <= dtype < len(DTYPE_NAMES) else "") + \
            (f"[{count}]" if count >= 0 else "")
        if op != UNKNOWN:
            what += f" root={op}" if kind == BROADCAST else f" op={OP_WORDS.get(op, op)}"
        what += f", refused there ({_ERR_NAMES.get(error & ~ERR_SHOWN, 'error')})"
    elif error:
        what = f"{name} with an input it rejected"
    else:
        what = f"{name} {DTYPE_NAMES[dtype]}[{count}]" if 0 <= dtype < len(DTYPE_NAMES) \
            else name
        if kind == BROADCAST:
            what += f" root={op}"
        elif op in OP_WORDS and kind != ALLGATHER:
            what += f" op={OP_WORDS[op]}"
        if algorithm in CODE_NAMES:
            what += f" algorithm={CODE_NAMES[algorithm]}"
        if mode and modes:
            what += f" (shared memory: {_DATA_MODES[min(mode & 3, 2)]}, {_PEER_MODES[mode >> 2 & 1]})"
    if site:
        what += f" at {site_text(site)}"
    return what


def mismatch_error(operation: str, headers: Sequence[Sequence[int]], mine: int) -> MismatchError:
    """A MismatchError listing what every rank called, marking those that differ from rank 0."""
    ref = tuple(headers[0][:FREE_WORD])
    # the shared-memory modes are named where they are all that differs
    strip = ~(0xF << MODE_SHIFT)
    modes = len({h[1] >> MODE_SHIFT & 0xF for h in headers}) > 1 and len(
        {(h[0], h[1] & strip) + tuple(h[2:FREE_WORD]) for h in headers}) == 1
    lines = []
    for r, h in enumerate(headers):
        text = describe(h, modes)
        if tuple(h[:FREE_WORD]) != ref:
            text += "  <- differs from rank 0"
            if h[4] == ref[4] and h[5] != ref[5] and h[3] == ref[3] and not h[6] | ref[6]:
                text += " (same count, different shape)"
            elif tuple(h[2:FREE_WORD]) == ref[2:] and (h[1] ^ ref[1]) >> MODE_SHIFT & 0xF:
                text += " (ranks started with different MPIDP_SHM_* settings?)"
        lines.append(f"  rank {r}: {text}")
    joined = [r for r, h in enumerate(headers) if h[0] == JOIN]
    if joined and any(h[0] not in (JOIN, ALLREDUCE) for h in headers):
        lines.append(f"  while rank(s) {', '.join(map(str, joined))} have joined, the others "
                     "may call all-reduces only (Note [Joined ranks] in mpidp/engine/header.py)")
    exc = MismatchError(f"rank {mine}: {operation}: ranks called it with inputs that do not "
                        "agree; every rank raises this error:\n" + "\n".join(lines))
    exc.headers = [tuple(int(w) for w in h) for h in headers]
    return exc


# Note [Joined ranks]
# A rank out of data may join (mpidp.comm.joined.join, Horovod's hvd.join): it enters the
# header exchange with a JOIN header, again and again, until every rank has. A rank that
# calls an all-reduce meanwhile finds the headers disagree, as every rank does; when the only
# difference is ranks that joined, and every other rank called the same all-reduce
# (``for_joined``), the all-reduce runs once more at once on every rank, the joined ones
# adding zeros: the others on their data viewed flat, the joined ones on zeros of the same
# dtype and count, so the headers of that second try agree (a header holds a hash of the
# shape, which a joined rank cannot know). An average stays over the whole group, as in
# Horovod. Any other collective raises on the ranks that called it (Horovod: "not supported
# with Join"), and the joined ones go on waiting. A JOIN header's free word is 1 on the
# joined rank's first exchange: once every rank has joined, the highest rank among those that
# joined last is the answer (Horovod's "last joined rank"). In debug mode (Note [Debug
# fingerprints]) a joined rank's zeros carry the call site of the others' header (the board's
# ``site``), and JOIN headers from different lines still end the join. A joined rank that
# cannot make its zeros refuses the second try, so the others raise rather than wait.


def join_header(first: bool) -> tuple:
    """The header of a rank that has joined (Note [Joined ranks])."""
    return (JOIN, 0, 0, 0, 0, 0, ERR_NONE, int(first))


def for_joined(headers: Sequence[Sequence[int]]) -> Optional[tuple]:
    """Where some ranks joined and every other rank sent one and the same all-reduce header
    without an error: that header (Note [Joined ranks]); else None."""
    others = {tuple(h[:FREE_WORD]) for h in headers if h[0] != JOIN}
    if len(others) != 1 or all(h[0] != JOIN for h in headers):
        return None
    (h,) = others
    return h + (0,) if h[0] == ALLREDUCE and h[6] == ERR_NONE else None


def check(operation: str, status_ok: bool, headers: Optional[Sequence], rank: int,
          local_error: Optional[BaseException]) -> None:
    """Raises on every rank after an exchange: the rank's own input error if it has one, else
    a MismatchError when the headers disagree."""
    if local_error is not None:
        raise local_error
    if not status_ok:
        raise mismatch_error(operation, headers, rank)


def exchange_mpi(comm, hdr: tuple, operation: str, local_error) -> np.ndarray:
    """Exchanges headers with MPI_Allgather; returns every rank's free word or raises."""
    mine = np.array(hdr, dtype=np.int64)
    table = np.empty((comm.Get_size(), len(hdr)), dtype=np.int64)
    comm.Allgather(mine, table)
    agree = bool((table[:, :FREE_WORD] == mine[:FREE_WORD]).all())
    check(operation, agree, table.tolist(), comm.Get_rank(), local_error)
    return table[:, FREE_WORD]
