"""The timeline (MPIDP_TIMELINE) of real runs of the training tool (mirrored on 2 ranks,
parameter server on 3): the merged trace must hold every rank's spans (the recorder, clock
alignment and merge alone: tests/unit/test_timeline.py)."""
import json
from pathlib import Path

from mpidp.train import setup
from mpirun import run


# ---- real runs ------------------------------------------------------------------------------

def trace_of(path: Path) -> tuple:
    trace = json.loads(path.read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] != "M"]
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
               if e["ph"] == "M" and e["name"] == "thread_name"}
    for e in events:
        assert e["ts"] >= 0 and (e["ph"] != "X" or e["dur"] >= 0)
        assert (e["pid"], e["tid"]) in threads
    return trace, events, threads


def names_by_rank(events) -> dict:
    out: dict = {}
    for e in events:
        out.setdefault(e["pid"], set()).add(e["name"])
    return out


def train(n, tmp_path, *flags, env=None):
    path = tmp_path / "timeline.json"
    proc = run(n, ["-m", "mpidp.train", "--epochs", 1, "--no-progress", *flags],
               env={"MPIDP_TIMELINE": str(path), **(env or {})}, timeout_s=180)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert [p.name for p in tmp_path.iterdir()] == ["timeline.json"]  # no temporary left
    assert f"mpidp: timeline of {n} rank(s) written to {path} (open it in" in proc.stderr
    # the machine's cores shared among its ranks, emulated nodes or not (the launcher binds
    # no rank here: the ranks are allowed what this process is)
    threads = setup.default_threads(n)
    assert f", {threads} torch thread(s) per rank" in proc.stdout + proc.stderr, proc.stdout
    return trace_of(path)


def test_mirrored_training_timeline_has_every_rank_and_span(tmp_path):
    # two emulated nodes: buckets are packed (hier), so pack and unpack appear too
    trace, events, threads = train(2, tmp_path, env={"MPIDP_EMULATE_NODE_SIZE": "1"})
    by_rank = names_by_rank(events)
    assert sorted(by_rank) == [0, 1]
    for names in by_rank.values():
        assert {"forward", "backward", "bucket ready", "pack", "allreduce", "unpack",
                "wait for buckets", "optimizer step", "evaluate"} <= names
    comm = [e for e in events if threads[(e["pid"], e["tid"])] == "mpidp-ddp-comm"]
    assert {e["name"] for e in comm} >= {"pack", "allreduce", "unpack"}
    assert {e["pid"] for e in comm} == {0, 1}
    steps = [e for e in events if e["name"] == "optimizer step" and e["pid"] == 0]
    assert len(steps) == -(-1438 // 2 // 32)  # one per step of the epoch
    assert trace["otherData"]["ranks"] == 2 and "1" in trace["otherData"]["clock_sync"]


def test_parameter_server_timeline_has_pull_push_and_apply(tmp_path):
    _, events, _ = train(3, tmp_path, "--strategy", "ps", "--num-ps", "1")
    by_rank = names_by_rank(events)
    assert sorted(by_rank) == [0, 1, 2]
    for worker in (0, 1):
        assert {"pull", "forward", "backward", "push"} <= by_rank[worker]
    assert "apply" in by_rank[2] and "push" not in by_rank[2]
    pushes = sum(1 for e in events if e["name"] == "push")
    applied = sum(e["args"]["pushes"] for e in events if e["name"] == "apply")
    assert pushes == applied == -(-1438 // 32)  # every batch pushed once and applied once
