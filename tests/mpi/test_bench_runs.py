"""The benchmark under mpiexec: small real sweeps of each command (not timed); its pure helpers:
tests/unit/test_bench.py."""
import json
import subprocess
from pathlib import Path

import pytest

from mpirun import ROOT, run
from mpidp.runtime.launcher import mpiexec


def test_allreduce_sweep_runs_and_counts_no_wrong(tmp_path):
    out = tmp_path / "r.json"
    plot = tmp_path / "r.png"
    proc = run(2, ["-m", "mpidp.bench", "allreduce", "-b", "8", "-e", "64K", "-f", "64",
                   "-n", "3", "-w", "1", "--algorithms", "auto,shm,ring,hier,mpi,gloo",
                   "--buffers", "2", "--json", out, "--plot", plot], timeout_s=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    # the regime in every table: here 2 buffer sets, data in cache (the default rotates 64)
    assert data["regime"].startswith("buffers rotated through 2 set(s)"), data["regime"]
    assert "; buffers rotated through 2 set(s) (data in cache" in proc.stdout, proc.stdout
    rows = data["rows"]
    assert {r["algorithm"] for r in rows} == {"auto", "shm", "ring", "hier", "mpi", "gloo"}
    assert {r["size"] for r in rows} == {8, 512, 32768}
    for r in rows:
        for mode in ("out_of_place", "in_place"):
            if r[mode] is not None:
                assert r[mode]["wrong"] == 0 and r[mode]["time_us"]["avg"] > 0
    assert data["ceiling"]["copy_GBps"] > 0
    assert plot.stat().st_size > 1000
    assert "busbw" in proc.stdout and "#wrong" in proc.stdout


def test_a_bad_setting_is_one_line_and_exit_code_2():
    """Note [Settings read at init] in mpidp/config.py: mpidp.init raises it on every rank."""
    proc = run(2, ["-m", "mpidp.bench", "allreduce", "-b", "8", "-e", "8"],
               env={"MPIDP_ABORT_ON_EXCEPTION": "maybe"}, timeout_s=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.splitlines() == ["python -m mpidp.bench: error: "
                                        "MPIDP_ABORT_ON_EXCEPTION='maybe': expected one of 1, 0, "
                                        "true, false, yes, no, on, off"], proc.stderr


def test_bench_help_lists_nccl_tests_flags():
    proc = run(1, ["-m", "mpidp.bench", "allreduce", "--help"], timeout_s=60)
    for flag in ("-b", "-e", "-f", "-n", "-w", "--dtype", "--op", "--algorithms", "--buffers",
                 "--json", "--plot"):
        assert flag in proc.stdout
    text = " ".join(proc.stdout.split())  # each default said once, none said as None
    assert "smallest size (default 8)" in text and "(default 8) (default: 8)" not in text
    assert "(default: None)" not in text and "(default: 64M)" not in text


def test_train_bench_runs_every_mode(tmp_path):
    out = tmp_path / "t.json"
    proc = run(2, ["-m", "mpidp.bench", "train", "--models", "mlp,cnn", "--steps", "1",
                   "--warmup", "1", "--repeats", "1", "--bucket-mb", "1,25", "--json", out],
               timeout_s=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["rows"]
    got = {(r["model"], r["mode"], r["bucket_mb"]) for r in rows}
    for model in ("mlp", "cnn"):
        assert {(model, "none", None), (model, "mpidp", 1.0), (model, "mpidp", 25.0),
                (model, "mpidp-view", 1.0), (model, "torch", 25.0)} <= got
    assert all(r["samples_per_s"] > 0 and r["ranks"] == 2 for r in rows)
    assert "vs torch" in proc.stdout and "of bound" in proc.stdout


def test_fusion_bench_runs(tmp_path):
    out = tmp_path / "f.json"
    proc = run(2, ["-m", "mpidp.bench", "fusion", "--tensors", "10x4K,2x1M", "--count", "50",
                   "-n", "2", "-w", "1", "-r", "1", "--json", out], timeout_s=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert [r["tensors"] for r in data["pack_unpack"]] == [10, 2]
    assert all(v > 0 for r in data["pack_unpack"] for v in r["GBps"].values())
    assert data["allreduce"]["tensors"] == 50 and data["allreduce"]["speedup"] > 0


def test_link_floor_sums_exactly_and_times_every_kind(tmp_path):
    """bench/collectives/link_floor.c (the floor of an all-reduce between two nodes:
    bench/RESULTS.md, issue 32 item 1), built with the MPI's own compiler wrapper, at its
    three smallest sizes on 2 ranks of one node: each kind checks its sum of small integers before it is timed
    (a wrong one ends the run with exit code 1), and every kind gets a time."""
    mpicc = Path(mpiexec()).with_name("mpicc")
    if not mpicc.exists():
        pytest.skip(f"no MPI compiler wrapper beside {mpiexec()}")
    exe = tmp_path / "link_floor"
    subprocess.run([mpicc, "-O2", "-Wall", "-Werror", "-o", exe,
                    ROOT / "bench" / "collectives" / "link_floor.c"],
                   check=True, capture_output=True, timeout=120)
    proc = subprocess.run([mpiexec(), "-n", "2", exe, "32", str(64 << 10)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if line[:1] != "#"]
    assert rows[0] == ["bytes", "mpi", "halves", "swap", "checked"], proc.stdout
    assert [int(r[0]) for r in rows[1:]] == [8, 32 << 10, 64 << 10], proc.stdout
    assert all(len(r) == 5 and min(map(float, r[1:])) > 0 for r in rows[1:]), proc.stdout
