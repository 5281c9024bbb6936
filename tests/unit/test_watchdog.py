"""Tier 1: the watchdog's board, its sampling clock and its report; the debug fingerprints of
headers; the settings that drive them (MPI runs in tests/mpi/test_faults.py)."""
import inspect
import time

import pytest

from mpidp import config
from mpidp.errors import CommunicationError
from mpidp.engine import header
from mpidp.engine.header import ALLGATHER, ALLREDUCE, BROADCAST
from mpidp.runtime.watchdog import COLLECTIVE, ONE_SIDED, Board, Sampler, describe, report


def test_settings():
    c = config.from_env({})
    assert c.timeout_s == 180 and not c.debug
    assert config.from_env({"MPIDP_DEBUG": "1", "MPIDP_TIMEOUT_S": "3"}).debug
    for bad, match in (("inf", "must be > 0 and finite"), ("nan", "must be > 0"),
                       ("0", "must be > 0")):
        with pytest.raises(ValueError, match=match):
            config.from_env({"MPIDP_TIMEOUT_S": bad})
    with pytest.raises(ValueError, match="MPIDP_DEBUG='verbose'"):
        config.from_env({"MPIDP_DEBUG": "verbose"})


def test_headers_in_words():
    f32 = 2
    assert header.describe(header.header(ALLREDUCE, 3, 1, f32, 10, (10,))) == \
        "allreduce float32[10] op=min algorithm=shm"
    assert header.describe(header.header(ALLREDUCE, 1, 4, f32, 10, (10,))) == \
        "allreduce float32[10] op=avg algorithm=mpi"
    assert header.describe(header.header(BROADCAST, 0, 2, f32, 4, (4,))) == \
        "broadcast float32[4] root=2"
    assert header.describe(header.header(ALLGATHER, 0, 0, f32, 3, (3,))) == \
        "allgather float32[3]"
    assert header.describe(header.other_header("checkpoint: gather")) == \
        "checkpoint: gather"
    sited = header.with_site(header.header(ALLREDUCE, 3, 0, f32, 4, (4,)), "train.py:12")
    assert header.describe(sited) == "allreduce float32[4] op=sum algorithm=shm at train.py:12"
    unknown = (sited[0], (sited[1] & 0xFF) | 0x2BCDEF << 8) + sited[2:]
    assert header.describe(unknown).endswith("at call site 0x2bcdef")
    described = (sited[0], (sited[1] & 0xFF) | 0xABCDEF << 8) + sited[2:]  # bit 23: a stamp
    assert header.describe(described).endswith("at a name or layout 0xabcdef")


def test_board_publishes_and_debug_names_the_call_site():
    b = Board()
    hdr = header.header(ALLREDUCE, 3, 0, 2, 4, (4,))
    assert b.publish(hdr) == hdr and (b.seq, b.done, b.what) == (1, 0, hdr)
    b.done = b.seq
    debug = Board(debug=True)
    sent, line = debug.publish(hdr), inspect.currentframe().f_lineno  # the call site
    assert describe(sent).endswith(f"at test_watchdog.py:{line}")
    assert sent[1] & 0xFF == hdr[1] and sent[:1] + sent[2:] == hdr[:1] + hdr[2:]
    with b.waiting(("ps worker: push {} of this epoch", 3)):
        assert b.pseq != b.pdone and describe(b.pwhat) == "ps worker: push 3 of this epoch"
    assert b.pseq == b.pdone
    b.context = ("DDP gradient bucket {} of {}", 2, 5)
    assert describe(hdr, b.context) == \
        "allreduce float32[4] op=sum algorithm=shm (DDP gradient bucket 2 of 5)"


def test_debug_site_taken_on_the_callers_thread_for_another_thread():
    """The backend's thread runs a collective its caller submitted: the caller's line is
    carried (Note [Debug fingerprints]); outside debug mode nothing is wrapped."""
    import threading
    hdr = header.header(ALLREDUCE, 3, 0, 2, 4, (4,))
    plain = Board()
    fn = lambda: None  # noqa: E731
    assert plain.carry_site(fn) is fn
    debug, sent = Board(debug=True), []
    job = lambda: sent.append(debug.publish(hdr))  # noqa: E731
    run, line = debug.carry_site(job), inspect.currentframe().f_lineno  # the caller's line
    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    assert describe(sent[0]).endswith(f"at test_watchdog.py:{line}") and debug.site is None


def test_sampler_never_fires_early_and_restarts_on_change():
    b = Board()
    s = Sampler(b, timeout_s=10, now=0.0)
    assert s.sample(5.0) is None
    b.publish(header.header(ALLREDUCE, 3, 0, 2, 4, (4,)))
    assert s.sample(6.0) is None           # first seen at 6: under way for at most 1 s more
    assert s.sample(15.9) is None
    assert s.sample(16.0) == COLLECTIVE    # seen under way for the whole timeout
    b.done = b.seq
    assert s.sample(30.0) is None          # done: computing for any time is no stall
    with b.waiting(("ps server: waiting",)):
        assert s.sample(31.0) is None
        b.progress()                      # a push applied: the clock starts again
        assert s.sample(40.0) is None
        assert s.sample(49.0) is None
        assert s.sample(50.0) == ONE_SIDED
    assert s.sample(70.0) is None


def state(rank, seq, in_op, what=None, for_s=4.0, pwhat=None, pfor_s=4.0):
    return {"rank": rank, "host": "node7", "pid": 100 + rank, "seq": seq, "in": in_op,
            "for_s": for_s, "what": what, "pin": pwhat is not None, "pfor_s": pfor_s,
            "pwhat": pwhat}


def test_report_names_who_arrived_and_who_did_not():
    what = "allreduce float32[650] op=avg algorithm=shm (DDP gradient bucket 1 of 1)"
    states = {0: state(0, 42, True, what), 1: state(1, 41, False, for_s=5.5),
              2: state(2, 42, True, what), 3: None}
    text = report(0, COLLECTIVE, states, 4, timeout_s=3, grace_s=3, asked=True)
    lines = text.splitlines()
    assert lines[0] == (f"mpidp: watchdog: rank 0 of 4 on node7: collective #42, {what}, has "
                        "not completed after 4 s (MPIDP_TIMEOUT_S=3); aborting the job")
    assert lines[1] == "  arrived at collective #42: ranks 0, 2"
    assert lines[2] == "  not arrived: ranks 1, 3 (no answer)"
    assert lines[4] == ("  rank 1 (pid 101 on node7): in no mpidp operation for 4.0 s (its "
                        "last collective: #41): in its own code (computing, loading data, or "
                        "stalled there)")
    assert lines[6].startswith("  rank 3: no answer within 3 s: the process has exited")
    assert "MPIDP_TIMEOUT_S" in lines[-1] and text.endswith("\n")


def test_report_of_a_parameter_server_wait_and_of_a_rank_that_cannot_ask():
    pull = "ps worker: pull, waiting until every worker has at least 2 pushes applied"
    states = {0: state(0, 16, False), 1: state(1, 16, False, pwhat=pull),
              2: state(2, 16, False, pwhat="ps server: waiting for a push")}
    lines = report(1, ONE_SIDED, states, 3, 3, 3, True).splitlines()
    assert lines[0].startswith(f"mpidp: watchdog: rank 1 of 3 on node7: {pull} has waited 4 s")
    assert lines[1:3] == ["  waiting in an mpidp operation: ranks 1, 2",
                          "  in their own code (computing, or stalled there): rank 0"]
    assert lines[4] == f"  rank 1 (pid 101 on node7): in {pull}, for 4.0 s (its last " \
        "collective: #16)"
    alone = report(0, COLLECTIVE, {0: state(0, 7, True, "broadcast float32[4] root=0")}, 3, 3,
                   3, asked=False).splitlines()
    assert "arrived" not in "\n".join(alone[1:])
    assert alone[1].startswith("  other ranks were not asked: MPI runs below "
                               "MPI_THREAD_MULTIPLE")


def test_report_counts_a_rank_in_another_collective_of_the_same_number_as_not_arrived():
    mine = "allreduce float32[16] op=avg algorithm=shm"
    other = "checkpoint: gathering every rank's RNG state"
    states = {0: state(0, 27, True, mine), 1: state(1, 27, True, other)}
    lines = report(0, COLLECTIVE, states, 2, 3, 3, True).splitlines()
    assert lines[1:3] == ["  arrived at collective #27: rank 0", "  not arrived: rank 1"]
    assert lines[4] == f"  rank 1 (pid 101 on node7): in collective #27, {other}, for 4.0 s"


def test_report_names_a_node_none_of_whose_ranks_answer():
    what = "allreduce float32[650] op=avg algorithm=hier"
    states = {0: state(0, 9, True, what), 1: state(1, 9, True, what), 2: None, 3: None,
              4: state(4, 9, True, what), 5: None}
    lines = report(0, COLLECTIVE, states, 6, 3, 3, True, node_of=(0, 0, 1, 1, 2, 2),
                   hosts=("node7", "node8", "node9")).splitlines()
    assert lines[2] == "  not arrived: ranks 2 (no answer), 3 (no answer), 5 (no answer)"
    assert lines[3] == ("  node node8: no answer from any of its ranks 2, 3: the node is lost "
                        "or unreachable (its processes died, or its network)")
    assert not any("node node9" in l for l in lines)  # rank 4 of node9 answered
    assert lines[6].startswith("  rank 2 (on node8): no answer within 3 s")


def test_replica_audit_message_and_settings():
    import numpy as np
    from mpidp.ddp.audit import divergence
    table = np.array([[1, 2, 3], [1, 2, 3], [1, 9, 4]])
    assert divergence(table[:2], ["a", "b", "c"], 4) is None
    assert divergence(table, ["a", "b", "c"], 4) == (
        "mpidp: replica audit at synchronised step 4: the ranks' models differ; first "
        "differing tensor 'b': ranks 0, 1 hold version 1; rank 2 holds version 2 (1 more "
        "tensor differs)")
    assert config.from_env({"MPIDP_AUDIT_EVERY": "50"}).audit_every == 50
    with pytest.raises(ValueError, match="MPIDP_AUDIT_ACTION='stop'"):
        config.from_env({"MPIDP_AUDIT_ACTION": "stop"})


# ---- a rank that has shut down (Note [A rank that has shut down] in csrc/shm.c) -------------

def test_a_wait_for_a_rank_that_shut_down_ends_naming_it():
    """Two local ranks' contexts in one process: rank 1 arrives at call 2 and shuts down
    there; rank 0's call 2 completes (rank 1's record is in place), its call 3 ends at once
    with SHM_DEPARTED naming rank 1 (the backstop is 60 s), and raises naming the group's
    rank."""
    import threading

    import numpy as np

    from mpidp.engine import host_ops, shm
    ext = host_ops.EXTENSION
    if ext is None:
        pytest.skip("no C extension")
    ctrl = np.zeros(2 * ext.SHM_SLOT_BYTES, np.uint8)
    ranks = [ext.ShmContext(ctrl.ctypes.data, 2, r, shm.PEERS_WINDOW, 4096, 1 << 16, 60.0)
             for r in (0, 1)]
    hdr = header.header(ALLREDUCE, 3, 0, 2, 4, (4,))
    answers = {}

    def call(r):
        answers[r] = ranks[r].exchange(hdr)

    first = threading.Thread(target=call, args=(1,))
    first.start()
    call(0)
    first.join()
    assert answers[0][0] == answers[1][0] == shm.SHM_OK
    second = threading.Thread(target=call, args=(1,))
    second.start()
    arrive1 = ctrl[ext.SHM_SLOT_BYTES:].view(np.uint64)
    while arrive1[0] < 2:  # rank 1 has arrived at call 2 ...
        time.sleep(0.001)
    ranks[1].close()  # ... and shuts down there: its own wait ends
    second.join()
    assert answers[1] == (shm.SHM_INTERRUPTED, None) and arrive1[1] == 1  # departed word
    assert ranks[0].exchange(hdr)[0] == shm.SHM_OK  # it arrived: call 2 completes
    assert ranks[0].exchange(hdr) == (shm.SHM_DEPARTED, [1])
    shm_context = object.__new__(shm.ShmContext)
    shm_context.rank, shm_context.ranks = 0, (4, 6)
    with pytest.raises(CommunicationError, match=r"^rank 4: allreduce failed: rank 6 has shut "
                       r"down \(mpidp.shutdown, or the end of its script\) without reaching "
                       r"this collective, and never will; .*with model.join\(\)"):
        shm_context.check(shm.SHM_DEPARTED, [1], "allreduce")


def test_the_watchdog_ends_a_wait_for_a_rank_that_shut_down(monkeypatch):
    """After a whole interval in a collective beyond the last one a rank that shut down
    completed, not before, and never for a collective of a shutdown; in a group with a timeout
    of its own, not before the timeout and the grace have passed."""
    from types import SimpleNamespace

    from mpidp.runtime import watchdog
    ended = []
    monkeypatch.setattr(watchdog, "abort_job", lambda text, code: ended.append((text, code)))
    b = Board()
    dog = SimpleNamespace(board=b, sampler=Sampler(b, 120, 0.0), interval_s=1.0, grace_s=3.0,
                          waits_bounded_s=None, departed={2: 5},
                          g=SimpleNamespace(rank=0, size=3), host="node7")
    check = watchdog.Watchdog._check_departed

    def sample_and_check(now):
        dog.sampler.sample(now)
        check(dog, now)

    for _ in range(5):
        b.publish(header.header(ALLREDUCE, 3, 0, 2, 4, (4,)))
        b.done = b.seq
    b.publish(header.header(ALLREDUCE, 3, 0, 2, 4, (4,)))  # #6: rank 2 completed #5 only
    sample_and_check(10.0)
    sample_and_check(10.9)
    assert not ended  # under way for less than an interval
    dog.departed = {2: 6}
    sample_and_check(12.0)
    assert not ended  # rank 2 reached #6: the others' wait is not for it
    dog.departed = {2: 5}
    sample_and_check(12.0)
    assert ended == [(watchdog.departed_report(0, 3, "node7", 6, describe(b.what), {2: 5}), 1)]
    assert ended[0][0] == (
        "mpidp: rank 0 of 3 on node7: collective #6, allreduce float32[4] op=sum "
        "algorithm=shm, cannot complete: rank 2 (after collective #5) has shut down "
        "(mpidp.shutdown, or the end of its script) without reaching it, and never will; "
        "aborting the job\n  uneven inputs? If ranks run different numbers of batches, wrap "
        "the training loop in `with model.join():` (docs/troubleshooting.md)\n")
    ended.clear()
    b.done = b.seq
    b.publish(header.other_header("shutdown: freeing the shared-memory windows"))
    sample_and_check(20.0)
    sample_and_check(30.0)
    assert not ended  # its own shutdown waits for the others' shutdowns
    b.done = b.seq
    dog.departed = {2: b.done}
    dog.waits_bounded_s = 1.0  # a torch group's timeout: its wait raises by itself
    b.publish(header.header(ALLREDUCE, 3, 0, 2, 4, (4,)))
    sample_and_check(40.0)
    sample_and_check(43.9)
    assert not ended  # left to the wait for its timeout and the grace
    sample_and_check(44.1)
    assert len(ended) == 1  # a wait the timeout did not end: the backstop


def test_a_stamped_block_keeps_the_one_call_carrying_the_stamp_of_its_innermost_block():
    """Resources.stamped: the one C call stays, and carries the board's stamp as it is when
    called — an inner block's inside it, the outer one's again after — or a stamp given; the
    board and the call are as before once the block ends (Note [Described stamps])."""
    from types import SimpleNamespace
    from mpidp.runtime.resources import Resources
    calls = []
    fast = lambda x, op, stamp=0: calls.append(stamp)  # noqa: E731 - the C call's stand-in
    res = SimpleNamespace(board=Board(), fast_allreduce=fast, _closed=False,
                          links_ready=lambda: None)
    with Resources.stamped(res, 0x800001):
        res.fast_allreduce(None, "sum")
        with Resources.stamped(res, 0x800002):
            res.fast_allreduce(None, "sum")
            res.fast_allreduce(None, "sum", 0x800003)
        res.fast_allreduce(None, "sum")
    assert calls == [0x800001, 0x800002, 0x800003, 0x800001]
    assert res.fast_allreduce is fast and res.board.site is None
