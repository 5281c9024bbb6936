"""bench/ab.py's pure parts (bench/ab_figures.py): reading a figure from a launch's JSON or
output, the order of launches, per-pair ratios with their medians and spread, the verdict,
the table; the guard set's specs against documents shaped like the benches' JSON; a launch
command's placeholders. No build, no launch, no timing."""
import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name: str):
    if name not in sys.modules:  # as bench/ab.py imports its siblings: by name
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


fig = _load("ab_figures")
guard = _load("ab_guard")
ab = _load("ab")


def _row(size, algorithm, us):
    return {"size": size, "count": size // 4, "algorithm": algorithm, "nranks": 2,
            "out_of_place": {"time_us": {"min": us, "avg": us + 1, "max": us + 2}},
            "in_place": {"time_us": {"min": us - 1, "avg": us, "max": us + 1}}}


DOC = {"nranks": 2, "nodes": 1, "rows": [_row(8, "auto", 3.0), _row(8, "mpi", 6.0),
                                         _row(65536, "auto", 20.0), _row(65536, "mpi", 25.0)]}


def test_select_paths():
    assert fig.select(DOC, "rows[size=8,algorithm=mpi].in_place.time_us.avg") == 6.0
    assert fig.select(DOC, "rows[size=65536.0, algorithm=auto].count") == 16384  # 8 == 8.0
    assert fig.select(DOC, "rows[1].algorithm") == "mpi"
    assert fig.select(DOC, "rows[-1].size") == 65536
    assert fig.select({"avg_us": [[1, 2], [3, 4]]}, "avg_us[1][0]") == 3
    assert fig.select(DOC, "nodes") == 1


@pytest.mark.parametrize("path, message", [
    ("rows[size=16].count", "matches 0 of 4"),
    ("rows[size=8].count", "matches 2 of 4"),
    ("rows[size=8,algorithm=auto].in_place.time_us.median", "no key 'median'"),
    ("rows[9]", "index 9 of 4"),
    ("nodes[0]", "on a int"),
    ("rows[size].count", "expected an index or k=v"),
    ("rows..size", "empty segment"),
    ("rows[0]x", "unexpected 'x'"),
])
def test_select_refuses(path, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        fig.select(DOC, path)


def test_extract():
    assert fig.extract("rows[size=8,algorithm=auto].in_place.time_us.avg", DOC, "") == 3.0
    assert fig.extract("rows[size=8,algorithm=auto].in_place.time_us.avg / "
                       "rows[size=8,algorithm=mpi].in_place.time_us.avg", DOC, "") == 0.5
    assert fig.extract(r"re:samples/s (\d+\.?\d*)", None, "x\nsamples/s 3247.5\n") == 3247.5
    with pytest.raises(ValueError, match="no match"):
        fig.extract(r"re:samples/s (\d+)", None, "nothing here")
    with pytest.raises(ValueError, match="wrote no JSON"):
        fig.extract("rows[0].size", None, "")
    with pytest.raises(ValueError, match="at most one"):
        fig.extract("nodes / nodes / nodes", DOC, "")


def test_schedule_alternates_the_first_of_each_pair():
    assert fig.schedule(4) == [("A", "B"), ("B", "A"), ("A", "B"), ("B", "A")]
    assert fig.schedule(1) == [("A", "B")]
    with pytest.raises(ValueError, match="pairs=0"):
        fig.schedule(0)


@pytest.mark.parametrize("ratios, better, expected", [
    ([1.30, 1.27, 1.33, 1.29], "lower", "B worse"),      # every pair slower, median 1.3
    ([1.30, 0.98, 1.33, 1.29], "lower", "B worse?"),     # one pair disagrees
    ([1.30, 1.27], "lower", "B worse?"),                 # too few pairs for a firm verdict
    ([0.80, 0.85, 0.90, 0.70], "lower", "B better"),
    ([0.80, 0.85, 1.02, 0.70], "lower", "B better?"),
    ([1.02, 0.97, 1.04, 0.99], "lower", "level"),        # within the 5% tolerance
    ([0.80, 0.85, 0.90, 0.70], "higher", "B worse"),     # a rate that fell
    ([1.25, 1.20, 1.30, 1.10], "higher", "B better"),
    ([1.04, 1.04, 1.04, 1.04], "lower", "level"),
])
def test_verdict(ratios, better, expected):
    assert fig.verdict(ratios, better) == expected


def test_verdict_tolerance_and_pairs_are_parameters():
    assert fig.verdict([1.04] * 4, "lower", tolerance=0.02) == "B worse"
    assert fig.verdict([1.3] * 2, "lower", min_pairs=2) == "B worse"


def test_summarize_pairs_ratios():
    f = fig.Figure("t", "x", "lower", "µs")
    s = fig.summarize(f, [10.0, 12.0, 9.0, 11.0], [13.0, 15.0, 12.0, 12.1])
    assert s["a_median"] == 10.5 and s["b_median"] == 12.55
    assert s["ratios"] == [1.3, 1.25, 12.0 / 9.0, 12.1 / 11.0]
    assert s["ratio_min"] == 12.1 / 11.0 and s["ratio_max"] == 12.0 / 9.0
    assert s["ratio_median"] == pytest.approx((1.25 + 1.3) / 2)
    assert s["verdict"] == "B worse"
    with pytest.raises(ValueError, match="3 A and 2 B"):
        fig.summarize(f, [1, 2, 3], [1, 2])
    with pytest.raises(ValueError, match="better='faster'"):
        fig.Figure("t", "x", "faster")


def test_table_lines():
    rows = [fig.summarize(fig.Figure("allreduce_ 64 MiB", "x", "lower", "µs"),
                          [9020.0, 9250.0, 9100.0, 9200.0], [11300.0, 12200.0, 11800.0, 12000.0]),
            fig.summarize(fig.Figure("DDP MLP samples/s", "x", "higher", ""),
                          [3247.0, 3200.0, 3300.0, 3250.0], [3250.0, 3190.0, 3310.0, 3240.0])]
    lines = fig.table(rows).splitlines()
    assert lines[0].startswith("| figure | A | B | B/A median | B/A min–max | pairs | verdict")
    assert lines[2] == ("| allreduce_ 64 MiB (µs, lower is better) | 9150 | 11900 | 1.30 | "
                        "1.25–1.32 | 4 | B worse |")
    assert lines[3] == ("| DDP MLP samples/s (higher is better) | 3248 | 3245 | 1.00 | "
                        "1.00–1.00 | 4 | level |")


def _train_doc():
    return {"rows": [{"model": "mlp", "mode": m, "samples_per_s": v}
                     for m, v in (("none", 4000.0), ("mpidp", 3200.0))]}


def _dist_doc():
    return {"nranks": 2, "rows": [{"size": 8, "avg_us": [1.2, 0.8, 2.4, 560.0],
                                   "ratio_avg": [1.0, 0.7, 2.0, 470.0]}]}


def _allreduce_doc(nodes):
    sizes = (8, 65536, 1 << 20, 16 << 20, 64 << 20)
    return {"nranks": 2, "nodes": nodes,
            "rows": [_row(s, a, float(s + 1)) for s in sizes for a in ("auto", "mpi")]}


def test_guard_specs_read_the_benches_json():
    """Every named bench's figures and expectations read a document shaped like its
    benchmark's --json (mpidp.bench allreduce / train, bench/collectives/dist_latency.py)."""
    named = {b.name: b for b in guard.BENCHES}
    assert set(guard.GUARD) <= set(named) and len(named) == len(guard.BENCHES)
    for b in guard.BENCHES:
        doc = (_train_doc() if "train" in b.command else _dist_doc() if "dist_latency" in
               b.command else _allreduce_doc(2 if "multinode" in b.command else 1))
        for path, want in b.expect:
            assert fig.same(fig.select(doc, path), str(want)), (b.name, path)
        for f in b.figures:
            assert fig.extract(f.spec, doc, "") > 0, (b.name, f.name)
        assert "{json}" in b.command
    train = named["train-mlp"].figures
    assert [fig.extract(f.spec, _train_doc(), "") for f in train] == [3200.0, 0.8]


def test_command_for_fills_placeholders(tmp_path):
    build = ab.Build("main", "0" * 40, tmp_path / "a tree")
    argv = ab.command_for("{mpiexec} -n 2 {python} {driver}/bench/x.py --json {json} "
                          "--dir {tree}", build, "/venv/bin/python", tmp_path / "o.json")
    assert argv[1:3] == ["-n", "2"] and argv[3] == "/venv/bin/python"
    assert argv[4] == f"{ab.DRIVER}/bench/x.py" and argv[6] == str(tmp_path / "o.json")
    assert argv[-1] == str(tmp_path / "a tree")  # one word, its space kept
    env = ab.launch_env(tmp_path, "/venv/bin/python")
    assert env["PYTHONPATH"] == str(tmp_path) and env["PATH"].startswith("/venv/bin:")
    assert env["MPIDP_REQUIRE_EXTENSION"] == "1"
