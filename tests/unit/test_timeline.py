"""The timeline (MPIDP_TIMELINE): the recorder, clock alignment and the merged Chrome trace as
pure functions (real runs of the training tool: tests/mpi/test_timeline_runs.py)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mpidp import config
from mpidp.runtime import timeline


@pytest.fixture
def recording(monkeypatch):
    """The recorder switched on for one test, with empty buffers."""
    monkeypatch.setattr(timeline, "ON", True)
    monkeypatch.setattr(timeline, "_events", [])
    monkeypatch.setattr(timeline, "_threads", {})
    return timeline._events


def test_config_reads_mpidp_timeline():
    assert config.from_env({}).timeline == ""
    assert config.from_env({"MPIDP_TIMELINE": " /tmp/t.json "}).timeline == "/tmp/t.json"


def test_off_records_nothing_and_traced_returns_the_function(monkeypatch):
    monkeypatch.setattr(timeline, "ON", False)
    monkeypatch.setattr(timeline, "_events", [])

    def f(x):
        return x + 1
    assert timeline.traced("f")(f) is f
    with timeline.span("backward") as s:
        timeline.instant("bucket ready")
        timeline.complete("pack", timeline.now())
    assert s is timeline.span("other")  # one shared no-op
    assert timeline._events == []


def test_on_records_spans_instants_and_threads(recording):
    import threading

    @timeline.traced("allreduce")
    def reduce_twice(x):
        return 2 * x
    with timeline.span("backward", {"step": 1}):
        timeline.instant("bucket ready", {"bucket": 0})
        assert reduce_twice(3) == 6
    worker = threading.Thread(target=lambda: timeline.instant("from a thread"), name="comm")
    worker.start()
    worker.join()
    names = [(e[0], e[1]) for e in recording]
    assert names == [("i", "bucket ready"), ("X", "allreduce"), ("X", "backward"),
                     ("i", "from a thread")]
    backward, reduced = recording[2], recording[1]
    assert backward[2] <= reduced[2] and reduced[2] + reduced[3] <= backward[2] + backward[3]
    assert backward[5] == {"step": 1} and timeline._threads[recording[3][4]] == "comm"


def test_init_switches_recording_and_traced_follows_it(monkeypatch):
    """Note [Timeline cost]: ON is mpidp.init's to set; a function traced where the timeline
    was asked for at import records only while ON; asked for only later, init warns."""
    monkeypatch.setattr(timeline, "_events", [])
    monkeypatch.setattr(timeline, "_threads", {})
    monkeypatch.setattr(timeline, "ON", False)
    monkeypatch.setattr(timeline, "_WRAP", True)
    double = timeline.traced("double")(lambda x: 2 * x)
    assert double(1) == 2 and timeline._events == []
    timeline.switch(True)
    assert double(2) == 4 and [e[1] for e in timeline._events] == ["double"]
    monkeypatch.setattr(timeline, "_WRAP", False)
    with pytest.warns(RuntimeWarning, match="MPIDP_TIMELINE was set after"):
        timeline.switch(True)
    # hvd.start_timeline's: HOROVOD_TIMELINE=DYNAMIC set after the import (Note [A timeline
    # started while running])
    with pytest.warns(RuntimeWarning, match="HOROVOD_TIMELINE was set after"):
        timeline.switch(True, "HOROVOD_TIMELINE")
    timeline.switch(False)
    assert not timeline.ON and timeline.started_path() is None


def test_estimate_offset_takes_the_shortest_round_trip():
    # remote clock = local + 1000 ns; the slow round trip would suggest another offset
    samples = [(0, 1900, 2000), (5000, 6000 + 1000, 5100), (10_000, 12_500, 14_000)]
    samples[1] = (5000, 5050 + 1000, 5100)
    assert timeline.estimate_offset(samples) == (1000, 100)


def test_aligner_interpolates_drift():
    # a rank 500 ns ahead at t=1,000,000 and 1,500 ns ahead at t=2,000,000 of its own clock
    to0 = timeline.aligner((1_000_000, 500, 40), (2_000_000, 1500, 40))
    assert to0(1_000_000) == 999_500 and to0(2_000_000) == 1_998_500
    assert to0(1_500_000) == 1_499_000
    assert timeline.aligner((10, 7))(100) == 93


def test_chrome_trace_merges_ranks_onto_rank_0s_clock():
    main0, comm0, main1 = 11, 12, 21
    r0 = {"rank": 0, "host": "a", "main": main0, "threads": {main0: "MainThread",
                                                           comm0: "mpidp-ddp-comm"},
          "events": [("X", "backward", 10_000, 5_000, main0, None),
                     ("i", "bucket ready", 12_000, 0, main0, {"bucket": 0}),
                     ("X", "allreduce", 12_500, 2_000, comm0, None)],
          "dropped": 0}
    # rank 1's clock reads 1,000,000 ns more than rank 0's
    r1 = {"rank": 1, "host": "b", "main": main1, "threads": {main1: "MainThread"},
          "events": [("X", "backward", 1_009_000, 6_000, main1, None)], "dropped": 3,
          "sync": ((1_000_000, 1_000_000, 4_000), (1_020_000, 1_000_000, 4_000))}
    trace = timeline.chrome_trace([r0, r1])
    json.dumps(trace)  # serialisable as is
    events = trace["traceEvents"]
    meta = [(e["pid"], e["name"], e["args"]) for e in events if e["ph"] == "M"]
    assert (0, "process_name", {"name": "rank 0"}) in meta
    assert (1, "process_name", {"name": "rank 1"}) in meta
    assert (0, "thread_name", {"name": "main"}) in meta
    assert (0, "thread_name", {"name": "mpidp-ddp-comm"}) in meta
    assert (1, "process_labels", {"labels": "b"}) in meta
    spans = {(e["pid"], e["name"]): e for e in events if e["ph"] != "M"}
    assert spans[(1, "backward")]["ts"] == 0.0  # the earliest event, on rank 0's clock
    assert spans[(0, "backward")] == {"name": "backward", "ph": "X", "ts": 1.0, "dur": 5.0,
                                      "pid": 0, "tid": 0}
    assert spans[(0, "allreduce")]["tid"] == 1 and spans[(0, "allreduce")]["ts"] == 3.5
    ready = spans[(0, "bucket ready")]
    assert ready["s"] == "t" and ready["args"] == {"bucket": 0} and "dur" not in ready
    assert trace["otherData"]["dropped_events"] == {"1": 3}
    assert trace["otherData"]["clock_sync"]["1"][0] == {"offset_us": 1000.0,
                                                        "round_trip_us": 4.0}


def test_write_atomically_leaves_only_the_file(tmp_path):
    path = tmp_path / "t.json"
    timeline.write_atomically(str(path), {"traceEvents": []})
    assert json.loads(path.read_text()) == {"traceEvents": []}
    assert [p.name for p in tmp_path.iterdir()] == ["t.json"]


def test_write_atomically_never_writes_through_a_link(tmp_path):
    """Links planted at the temporary name the writer used to take and at the final name:
    the linked file is untouched, the trace a regular file (Note [Writing a file])."""
    victim, path = tmp_path / "victim", tmp_path / "t.json"
    victim.write_text("untouched")
    Path(f"{path}.tmp.{os.getpid()}").symlink_to(victim)
    path.symlink_to(victim)
    timeline.write_atomically(str(path), {"traceEvents": []})
    assert victim.read_text() == "untouched" and not path.is_symlink()
    assert json.loads(path.read_text()) == {"traceEvents": []}


def test_an_unwritable_timeline_is_an_error_at_init(tmp_path):
    """...and where the group cannot be built, init leaves the timeline off (in the same
    process, first: a group that fails to build, then the unwritable file)."""
    code = ("import mpidp\nfrom mpidp.runtime import timeline, world as runtime\n"
            "real, runtime.Group = runtime.Group, lambda *a: 1 / 0\n"
            "try:\n    mpidp.init()\nexcept ZeroDivisionError:\n"
            "    print('no group; timeline on:', timeline.ON)\n"
            "runtime.Group = real\n"
            "try:\n    mpidp.init()\nexcept ValueError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env={"MPIDP_TIMELINE": str(tmp_path / "no" / "t.json"),
                                          "PATH": "/usr/bin:/bin",
                                          "PYTHONPATH": os.environ.get("PYTHONPATH", "")})
    assert "no group; timeline on: False" in out.stdout, out.stdout + out.stderr
    assert "MPIDP_TIMELINE=" in out.stdout and "cannot write" in out.stdout, out.stderr
