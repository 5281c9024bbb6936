"""Tier 1: the collective front door's pure parts — the algorithm table and its choices, the
bucket planner, the cross-memory-attach plan, which peers are watched, the header's words — and the C context type in
one process."""
import os

import numpy as np
import pytest

from mpidp import algorithms, config
from mpidp.engine import header, planner, shm
from mpidp.algorithms import DEVICE, HOST, Facts, choose
from mpidp.engine.dtypes import F32
from mpidp.engine.host_ops import extension

ONE_NODE = Facts(size=4, single_node=True, shm=True, hier_min_bytes=64 << 10, default="auto",
                 inline_bytes=4096, max_segments=256)
TWO_NODES = ONE_NODE._replace(single_node=False)


def test_one_table_names_every_algorithm_once_per_kind_of_array():
    assert algorithms.NAMES[HOST] == ("auto", "shm", "doubling", "hier", "mpi", "ring")
    assert algorithms.NAMES[DEVICE] == ("auto", "ring", "staged", "nccl")
    assert config.ALGORITHMS == algorithms.NAMES[HOST]
    codes = [a.code for a in algorithms.TABLE]
    assert len(set(codes)) == len(codes) and max(codes) < 1 << header.MODE_SHIFT


@pytest.mark.parametrize("facts,nbytes,want", [
    (ONE_NODE, 8, "shm"), (ONE_NODE, 1 << 30, "shm"),
    (TWO_NODES, 8, "doubling"), (TWO_NODES, (64 << 10) - 1, "doubling"),
    (TWO_NODES, 64 << 10, "hier"), (TWO_NODES._replace(one_per_node=True), 64 << 10, "mpi"),
    (TWO_NODES._replace(one_per_node=True, checked_chunks=True), 1 << 30, "doubling"),
    (TWO_NODES._replace(hier_min_bytes=1 << 20), 64 << 10, "mpi"),
    (ONE_NODE._replace(shm=False), 8, "doubling"),
    (ONE_NODE._replace(shm=False), 1 << 20, "mpi"), (TWO_NODES._replace(shm=False), 1 << 20, "mpi"),
    (ONE_NODE._replace(default="ring"), 8, "ring"),
])
def test_auto_takes_the_first_enabled_candidate(facts, nbytes, want):
    assert choose(HOST, "auto", facts, nbytes).name == want


def test_device_auto_and_refusals():
    gpu = ONE_NODE._replace(nccl=True)
    assert choose(DEVICE, "auto", gpu, 8).name == "ring"
    assert choose(DEVICE, "auto", gpu._replace(shares_gpu=True), 8).name == "staged"
    assert choose(DEVICE, "auto", gpu._replace(nccl=False), 8).name == "staged"
    with pytest.raises(ValueError, match="one GPU per rank"):
        choose(DEVICE, "nccl", gpu._replace(shares_gpu=True), 8)
    with pytest.raises(ValueError, match="not installed"):
        choose(DEVICE, "ring", ONE_NODE, 8)
    with pytest.raises(ValueError, match="one node"):
        choose(HOST, "shm", TWO_NODES, 8)
    with pytest.raises(ValueError, match="C extension"):
        choose(HOST, "hier", TWO_NODES._replace(shm=False), 8)
    with pytest.raises(ValueError, match="accepted: auto, shm, doubling, hier, mpi, ring"):
        choose(HOST, "fastest", ONE_NODE, 8)
    with pytest.raises(ValueError, match="for device arrays"):
        algorithms.check_name("shm", DEVICE)


@pytest.mark.parametrize("facts,nbytes,ntensors,in_place,op,want", [
    (ONE_NODE, 1 << 20, 10, True, "avg", ("shm", True, False)),
    (ONE_NODE, 1 << 20, 10, False, "avg", ("shm", False, False)),
    (ONE_NODE, 4096, 10, True, "avg", ("shm", False, False)),      # inline: packed
    (ONE_NODE, 1 << 20, 257, True, "avg", ("shm", False, False)),  # too many segments
    (ONE_NODE._replace(size=1), 1 << 20, 10, True, "avg", ("shm", False, True)),  # / 1
    (TWO_NODES, 1 << 20, 10, True, "avg", ("hier", False, True)),
    (TWO_NODES, 1 << 20, 10, True, "sum", ("hier", False, False)),
])
def test_bucket_plan(facts, nbytes, ntensors, in_place, op, want):
    p = planner.plan_bucket(HOST, "auto", facts, nbytes, ntensors, in_place, op)
    assert (p.algorithm.name, p.zero_copy, p.divide_in_unpack) == want


def test_max_tensors_only_limits_buckets_that_can_go_zero_copy():
    assert planner.max_tensors(HOST, "auto", ONE_NODE, 1 << 20, True) == 256
    assert planner.max_tensors(HOST, "auto", ONE_NODE, 1 << 20, False) is None
    assert planner.max_tensors(HOST, "auto", TWO_NODES, 1 << 20, True) is None


@pytest.mark.parametrize("wanted,scope,parents,want", [
    ("auto", 0, [7, 7], ("cma", 0)),
    ("cma", 0, [7, 8], ("cma", 0)),
    ("auto", 1, [7, 7, 7], ("cma", 7)),
    ("auto", 1, [7, 8], ("window", "Yama ptrace_scope is 1 and the local ranks have no common parent")),
    ("auto", 2, [7, 7], ("window", "Yama ptrace_scope is 2")),
    ("auto", 3, [7, 7], ("window", "Yama ptrace_scope is 3")),
    ("window", 0, [7, 7], ("window", "MPIDP_SHM_PEERS=window")),
])
def test_cross_memory_attach_is_declared_as_narrowly_as_yama_allows(wanted, scope, parents, want):
    assert shm.plan_peers(wanted, scope, parents) == want


def test_a_lost_peer_is_watched_only_in_this_ranks_pid_namespace():
    """Note [A lost peer] in csrc/shm.c: (pid, parent, namespace, start) of each local rank;
    a rank of another namespace, or one that could not say when it started, is not watched;
    without a namespace of its own to compare, none is."""
    procs = [(10, 1, 77, 500), (11, 1, 77, 501), (10, 1, 88, 900), (12, 1, 77, None)]
    assert shm.watched(procs, 0) == ((10, 11, 0, 0), (500, 501, 0, 0))
    assert shm.watched(procs, 2) == ((0, 0, 10, 0), (0, 0, 900, 0))
    assert shm.watched([(10, 1, None, 5), (11, 1, None, 6)], 1) == ((0, 0), (0, 0))
    pid, parent, namespace, start = shm.identity(extension())
    assert (pid, parent) == (os.getpid(), os.getppid()) and namespace and start > 0
    state, threads, again = extension().ShmContext.process_stat(pid)
    assert state == "R" and threads >= 1 and again == start


def test_yama_scope_reads_the_file(tmp_path):
    assert shm.yama_scope(str(tmp_path / "absent")) == 0
    (tmp_path / "scope").write_text("1\n")
    assert shm.yama_scope(str(tmp_path / "scope")) == 1


def test_header_words_name_the_shared_memory_modes():
    hdr = header.header(header.ALLREDUCE, 3, header.op_word(0, True), F32, 10, (10,))
    inline_cma = (hdr[0], hdr[1] | 1 << header.MODE_SHIFT) + hdr[2:]
    sliced_window = (hdr[0], hdr[1] | (2 | 1 << 2) << header.MODE_SHIFT) + hdr[2:]
    assert header.describe(hdr) == "allreduce float32[10] op=avg algorithm=shm"
    assert header.describe(inline_cma) == "allreduce float32[10] op=avg algorithm=shm"
    assert header.describe(inline_cma, modes=True).endswith("(shared memory: inline, cma)")
    text = str(header.mismatch_error("allreduce", [inline_cma, sliced_window], 0))
    assert "sliced, window" in text and "different MPIDP_SHM_* settings" in text
    assert header.check_wire(extension().WIRE) is None  # csrc/wire.h: the same header


STALE = """
import os, sys, warnings
import mpidp._ext as ext
ext.WIRE = dict(ext.WIRE, STAMP_SHIFT=9)  # as a build from other sources would say
os.environ["MPIDP_REQUIRE_EXTENSION"] = sys.argv[1]
from mpidp.engine import host_ops
from mpidp.errors import BackendUnavailableError
try:
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        print(host_ops.IMPLEMENTATION, *[str(w.message) for w in said])
except BackendUnavailableError as exc:
    print("refused", exc)
"""


@pytest.mark.parametrize("required", ["0", "1"])
def test_an_extension_built_for_another_header_is_never_used(required):
    import subprocess
    import sys
    extension()  # the extension itself, built for this header
    out = subprocess.run([sys.executable, "-c", STALE, required], capture_output=True,
                         text=True, timeout=120, env=dict(__import__("os").environ, CI=""))
    assert out.returncode == 0, out.stderr
    said = out.stdout
    assert "STAMP_SHIFT 9 where mpidp.engine.header has 8" in said and "rebuild" in said, said
    assert said.startswith("refused" if required == "1" else "numpy"), said


def test_a_disagreement_says_when_only_joined_ranks_differ():
    """Note [Joined ranks]: the all-reduce runs again only where every rank that did not join
    called the same one; the message names the joined ranks, the error carries the headers."""
    avg = header.header(header.ALLREDUCE, 3, header.op_word(0, True), F32, 10, (10,), free=5)
    joined, first = header.join_header(False), header.join_header(True)
    assert header.for_joined([avg, joined, avg[:7] + (9,)]) == avg[:7] + (0,)
    assert header.for_joined([first, avg]) == avg[:7] + (0,)
    other = header.header(header.ALLREDUCE, 3, header.op_word(0, False), F32, 10, (10,))
    bcast = header.header(header.BROADCAST, 0, 0, F32, 10, (10,))
    refused = header.error_header(header.ALLREDUCE, ValueError("bad"))
    for headers in ([avg, other, joined], [bcast, joined], [refused, joined], [avg, other],
                    [joined, first]):
        assert header.for_joined(headers) is None
    exc = header.mismatch_error("broadcast", [bcast, joined, first], 0)
    assert exc.headers == [bcast, joined, first]
    assert "rank 1: join (out of data" in str(exc) and "rank(s) 1, 2 have joined" in str(exc)
    assert "have joined" not in str(header.mismatch_error("allreduce", [avg, other], 0))


def test_settings_that_must_agree_are_named_with_their_variables():
    cfg = config.from_env({"MPIDP_SHM_INLINE_BYTES": "0"})
    assert dict(zip(config.AGREED, config.agreed(cfg)))["shm_inline_bytes"] == 0
    assert config.env_name("shm_inline_bytes") == "MPIDP_SHM_INLINE_BYTES"
    assert "timeout_s" not in config.AGREED  # may differ: each rank's own patience
    assert config.from_env({"MPIDP_EXTENSION": "0"}).extension is False


def _context(inline_bytes=4096, peers=shm.PEERS_CMA):
    ext = extension()
    ctrl = np.zeros(ext.SHM_SLOT_BYTES, np.uint8)
    return ctrl, ext.ShmContext(ctrl.ctypes.data, 1, 0, peers, inline_bytes, 1 << 16, 5.0)


def test_the_context_puts_its_data_and_peer_mode_in_the_header():
    hdr = header.header(header.ALLREDUCE, 3, 0, F32, 4, (4,))
    for peers in (shm.PEERS_CMA, shm.PEERS_WINDOW):
        ctrl, c = _context(peers=peers)
        status, free = c.exchange(hdr)
        assert status == shm.SHM_OK
        # slot 0: two counters on their own 128-byte lines, then record[call & 1] of 4224 bytes
        word = int(ctrl[256 + (128 + 4096):].view(np.int64)[1])  # call 1's header word 1
        assert word >> header.MODE_SHIFT == peers << 2, (peers, word)  # data mode 0


def test_the_context_counts_only_calls_that_entered_the_protocol():
    ctrl, c = _context()
    x = np.arange(8, dtype=np.float32)
    hdr = header.header(header.ALLREDUCE, 3, 0, F32, 8, (8,))
    assert c.allreduce(hdr, x, x, F32, 0, 1) is None and c.seq == 1
    with pytest.raises(TypeError):
        c.allreduce("not a header", x, x, F32, 0, 1)  # not even a header: no turn taken
    assert c.seq == 1
    read_only = np.frombuffer(x.tobytes(), np.float32)
    with pytest.raises((TypeError, ValueError)):  # refused, but it took its turn
        c.allreduce(hdr, read_only, read_only, F32, 0, 1)
    assert c.seq == 2
    status, info = c.exchange(hdr)
    assert status == shm.SHM_OK and c.seq == 3


@pytest.mark.parametrize("inline_bytes,count", [(4096, 100), (0, 100), (4096, 5000)])
def test_the_context_reduces_inline_and_sliced(inline_bytes, count):
    ctrl, c = _context(inline_bytes)
    x = np.arange(count, dtype=np.float64)
    out = np.empty_like(x)
    hdr = header.header(header.ALLREDUCE, 3, 4, 3, count, (count,))
    assert c.allreduce(hdr, x, out, 3, 0, 1) is None
    assert np.array_equal(out, x)
