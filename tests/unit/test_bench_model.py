"""Tier 1: the scale model (mpidp/bench/costs.py, mpidp/bench/model.py): each formula's small
cases in closed form, the calibration recovering the machine that generated its rows, the DDP
step's schedule, and the command on a synthetic measurement file. Nothing here times anything."""
import json
import math
import re
import subprocess
import sys

import pytest

from mpidp.bench import calibration, costs, loss
from mpidp.bench.__main__ import main as bench_main
from mpidp.bench.costs import Machine, Terms

N = 1 << 20
SIZES = [8 * 4 ** k for k in range(12)]  # 8 B .. 32 MiB, as `allreduce -b 8 -f 4`


def test_ring_on_two_ranks_is_the_closed_form():
    t = costs.ring(N, 2)
    assert t == Terms(messages=2, link_bytes=N, reduced_bytes=N / 2)
    m = Machine(alpha_s=3e-6, beta_s_per_byte=1 / 5e9, gamma_s_per_byte=1 / 2e9)
    assert math.isclose(costs.seconds(t, m), 2 * 3e-6 + N / 5e9 + N / 2 / 2e9, rel_tol=1e-15)


def test_ring_on_p_ranks_and_segments():
    assert costs.ring(N, 4, segments=3) == Terms(messages=3 * 4, link_bytes=2 * 3 / 4 * N,
                                                 reduced_bytes=3 / 4 * N)
    assert costs.ring(N, 1) == Terms()
    assert costs.ring_segments(8 << 20, 2, 1 << 20) == 4
    assert costs.ring_segments(8, 2, 1 << 20) == 1


def test_mpich_algorithms_and_their_switch():
    assert costs.recursive_doubling(N, 8) == Terms(3, 3 * N, 3 * N)
    # p = 6: 4 ranks double, 2 extra ranks hand over first (1 message, n, reduced) and back
    assert costs.recursive_doubling(N, 6) == Terms(2 + 2, (2 + 2) * N, (2 + 1) * N)
    assert costs.rabenseifner(N, 8) == Terms(6, 2 * 7 / 8 * N, 7 / 8 * N)
    assert costs.rabenseifner(N, 5) == Terms(2 * 2 + 2, (2 * 3 / 4 + 2) * N, (3 / 4 + 1) * N)
    assert costs.mpich(2048, 4) == costs.recursive_doubling(2048, 4)  # <= 2 KiB, MPICH's default
    assert costs.mpich(2052, 4) == costs.rabenseifner(2052, 4)
    assert costs.mpich(12, 4, short_bytes=0) == costs.recursive_doubling(12, 4)  # 3 < 4 elements
    assert costs.mpich(N, 1) == Terms()


def test_node_and_cluster_formulas():
    assert costs.shm(N, 4) == Terms(node_messages=1, node_bytes=1.5 * N, reduced_bytes=0.75 * N)
    assert costs.shm(N, 1) == Terms()
    assert costs.node_broadcast(N, 8) == Terms(node_messages=3, node_bytes=2 * 7 / 8 * N)
    # hier = shm within the node + ring among 4 leaders + broadcast within the node
    assert costs.hier(N, 4, 2) == Terms(messages=6, link_bytes=1.5 * N,
                                        reduced_bytes=0.5 * N + 0.75 * N,
                                        node_messages=2, node_bytes=2 * N)
    assert costs.hier(N, 4, 1) == costs.ring(N, 4)
    assert costs.mpi_smp(N, 4, 1) == costs.mpich(N, 4)


def test_flat_ring_charges_the_slowest_hop():
    nvlink_ib = Machine(1.5e-6, 1 / 50e9, 1e-12, node_alpha_s=1e-6, node_beta_s_per_byte=1 / 400e9)
    r = costs.ring(N, 16)
    assert costs.flat_ring(N, 2, 8, 8, nvlink_ib) == Terms(
        messages=r.messages, link_bytes=r.link_bytes / 8, reduced_bytes=r.reduced_bytes)
    assert costs.flat_ring(N, 2, 8, 1, nvlink_ib).link_bytes == r.link_bytes
    fast_nics = nvlink_ib._replace(beta_s_per_byte=1 / 4000e9)
    assert costs.flat_ring(N, 2, 8, 8, fast_nics).node_bytes == r.link_bytes
    slow_memory = Machine(1.5e-6, 1 / 45e9, 1e-9, node_alpha_s=3e-6, node_beta_s_per_byte=1e-9)
    assert costs.flat_ring(N, 4, 1, 1, slow_memory) == costs.ring(N, 4)  # no hop inside a node
    one_node = costs.flat_ring(N, 1, 8, 8, nvlink_ib)
    assert one_node == Terms(node_messages=14, node_bytes=2 * 7 / 8 * N, reduced_bytes=7 / 8 * N)


def test_parameter_server_is_bound_by_the_servers_links():
    # per direction W n / S bytes through a server's link: 8 workers, 2 servers
    assert costs.parameter_server(N, 8, 2) == Terms(messages=8, link_bytes=2 * 4 * N,
                                                    reduced_bytes=4 * N)
    assert costs.parameter_server(N, 2, 4).link_bytes == 2 * N  # then each worker's own link
    assert costs.parameter_server(N, 8, 8, per_link=4).link_bytes == 2 * 4 * N


def test_more_ranks_are_never_faster_for_the_bandwidth_optimal_algorithms():
    m = Machine(2e-6, 1 / 12e9, 1 / 3e9)
    for n in (8, 64 << 10, 25 << 20):
        ring = [costs.seconds(costs.ring(n, p), m) for p in range(1, 65)]
        assert ring == sorted(ring)
        assert [costs.ring(n, p).link_bytes for p in range(1, 65)] == \
            sorted(costs.ring(n, p).link_bytes for p in range(1, 65))
        pow2 = [1 << i for i in range(11)]
        for f in (lambda p: costs.mpich(n, p), lambda p: costs.hier(n, p, 4)):
            times = [costs.seconds(f(p), m._replace(node_beta_s_per_byte=1 / 20e9)) for p in pow2]
            assert times == sorted(times)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, None])
def test_bad_rank_counts_name_the_value(bad):
    with pytest.raises(ValueError, match=f"ranks must be an integer >= 1, got {bad!r}"):
        costs.ring(N, bad)


def test_bad_sizes_name_the_value():
    with pytest.raises(ValueError, match="nbytes must be a number >= 0, got -1"):
        costs.mpich(-1, 4)
    with pytest.raises(ValueError, match="nodes must be an integer >= 1, got 0"):
        costs.flat_ring(N, 0, 8, 8, Machine(1, 1, 1))


def _times(terms, machine):
    return [costs.seconds(t, machine) for t in terms]


def test_calibration_recovers_the_machine_that_made_the_rows():
    truth = Machine(alpha_s=11e-6, beta_s_per_byte=1 / 7e9, gamma_s_per_byte=1 / 2.5e9)
    terms = [costs.ring(n, 2, costs.ring_segments(n, 2, 1 << 20)) for n in SIZES]
    fit = costs.fit(terms, _times(terms, truth), truth.gamma_s_per_byte)
    assert math.isclose(fit.alpha_s, truth.alpha_s, rel_tol=1e-6)
    assert math.isclose(fit.beta_s_per_byte, truth.beta_s_per_byte, rel_tol=1e-6)
    assert fit.gamma_s_per_byte == truth.gamma_s_per_byte and not fit.gamma_fitted
    assert fit.max_rel_error < 1e-9
    # MPICH's two algorithms move and reduce bytes in different ratios: gamma is identifiable
    terms = [costs.mpich(n, 4) for n in SIZES]
    fit = costs.fit(terms, _times(terms, truth))
    assert fit.gamma_fitted
    for got, want in zip(fit[:3], truth[:3]):
        assert math.isclose(got, want, rel_tol=1e-6)


def test_calibration_refuses_what_it_cannot_tell_apart():
    terms = [costs.ring(n, 2) for n in SIZES]  # bytes moved = 2 x bytes reduced, always
    with pytest.raises(ValueError, match="cannot all be told apart"):
        costs.fit(terms, _times(terms, Machine(1e-6, 1e-10, 1e-10)))
    with pytest.raises(ValueError, match="nothing to fit"):
        costs.fit([costs.ring(8, 1)], [1e-6], 1e-10)
    with pytest.raises(ValueError, match="must be finite and > 0"):
        costs.fit([costs.ring(8, 2)], [0.0], 1e-10)


def test_calibration_keeps_parameters_non_negative():
    terms = [costs.ring(n, 2) for n in SIZES]
    flat = [20e-6] * len(SIZES)  # a time that does not grow with size: beta would go negative
    fit = costs.fit(terms, flat, 1e-15)
    assert fit.beta_s_per_byte == 0 and fit.alpha_s > 0
    assert min(fit.predicted_s) > 0


def test_ddp_step_schedule():
    per_byte = lambda b: b * 1e-3  # noqa: E731 (seconds per bucket)
    assert costs.buckets(100, 30) == (30, 30, 30, 10)
    # full overlap, fast communication: only the last bucket (ready at the end) is exposed
    step = costs.ddp_step_s(100, 1.0, per_byte, bucket_bytes=30, backward_fraction=0.5)
    assert math.isclose(step, 1.0 + 10e-3, rel_tol=1e-12)
    # no overlap: every bucket after the compute
    step = costs.ddp_step_s(100, 1.0, per_byte, bucket_bytes=30, backward_fraction=0.5, overlap=0)
    assert math.isclose(step, 1.0 + 100e-3, rel_tol=1e-12)
    # communication slower than backward: buckets queue back to back from the first one
    step = costs.ddp_step_s(100, 1.0, lambda b: b * 1e-2, bucket_bytes=30, backward_fraction=0.5)
    assert math.isclose(step, 0.65 + 1.0, rel_tol=1e-12)
    assert costs.ddp_step_s(4 * 25_557_032, 0.3, lambda b: 0.0) == 0.3  # nothing to wait for
    with pytest.raises(ValueError, match="overlap must be in"):
        costs.ddp_step_s(100, 1.0, per_byte, overlap=2)


def _write_measurements(path, truth, nranks=2, nodes=1):
    """An `allreduce --json` file whose times the model itself made."""
    rows = []
    for algo in ("ring", "mpi", "shm", "hier", "gloo"):
        for n in SIZES:
            t = 1e-3 if algo == "gloo" else costs.seconds(calibration.calibration_terms(
                algo, n, nranks, nodes, 1 << 20, 2048), truth)
            cell = {"time_us": {"min": t * 1e6, "avg": t * 1e6, "max": t * 1e6}, "wrong": 0}
            rows.append({"size": n, "algorithm": algo, "nranks": nranks, "in_place": cell,
                         "out_of_place": None if algo == "gloo" else cell})
    ceiling = {"bytes": 1 << 28, "copy_GBps": 9.0, "add_GBps": 1 / truth.gamma_s_per_byte / 1e9}
    path.write_text(json.dumps({"nranks": nranks, "nodes": nodes, "ceiling": ceiling,
                                "rows": rows, "argv": []}))


def test_the_command_calibrates_predicts_and_writes_json(tmp_path, capsys):
    # one machine: its ranks talk over one medium, so the node link is the link
    truth = Machine(4e-6, 1 / 6e9, 1 / 2e9, node_alpha_s=4e-6, node_beta_s_per_byte=1 / 6e9)
    cal, out = tmp_path / "n2.json", tmp_path / "model.json"
    _write_measurements(cal, truth)
    rc = bench_main(["model", "--calibrate", str(cal), "--label", "synthetic", "--nodes-max", "4",
                     "--systems", "25gbe,nvlink8", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    data = json.loads(out.read_text())
    fits = {f["algorithm"]: f for f in data["calibration"]}
    assert set(fits) == {"ring", "mpi", "shm", "hier"}  # gloo has no formula: left out
    for f in fits.values():
        assert f["label"] == "synthetic" and f["max_rel_error"] < 1e-9
        assert math.isclose(f["alpha_s"], truth.alpha_s, rel_tol=1e-6)
        assert math.isclose(f["beta_s_per_byte"], truth.beta_s_per_byte, rel_tol=1e-6)
    assert data["host"]["ring_alpha_s"] == fits["ring"]["alpha_s"]
    ddp = data["predictions"]["ddp"]
    assert {(r["system"], r["nodes"]) for r in ddp} == {(s, k) for s in ("25gbe", "nvlink8")
                                                        for k in (1, 2, 4)}
    for r in ddp:
        if r["nodes"] == 1:
            assert r["efficiency_vs_node"] == 1.0
            assert r["efficiency"] == 1.0 or r["system"] == "nvlink8"  # 8 GPUs talk inside it
    assert len(data["published"]) == 8 and all(r["source"] for r in data["published"])
    lost = data["predictions"]["lost_node"]  # a node lost: on 2 and 4 nodes, not on 1
    assert [(r["system"], r["nodes"]) for r in lost] == [(s, k) for s in ("25gbe", "nvlink8")
                                                         for k in (2, 4)]
    for r in lost:
        assert r["state_bytes"] == costs.MODELS["resnet50"].params * 4 * 3  # Adam's 2 slots
        assert r["total_s"] == {w: sum(p.values()) for w, p in r["phases_s"].items()}
        assert r["phases_s"]["relaunch"]["redo_s"] == r["step_s"] + 300  # half of 600 s
    for title in ("## calibration", "## all-reduce of", "## DDP scaling", "## a lost node",
                  "## model vs published"):
        assert title in text


def test_a_lost_nodes_phases_in_closed_form():
    assert [loss.levels(k) for k in (0, 1, 2, 8, 9)] == [1, 1, 1, 3, 4]
    assert costs.broadcast(N, 4) == Terms(messages=2 + 3, link_bytes=1.5 * N)
    assert costs.broadcast(N, 1) == Terms()
    assert loss.shrink(8) == Terms(messages=12)
    m = Machine(alpha_s=1e-6, beta_s_per_byte=1e-9, gamma_s_per_byte=1e-12)
    ph = loss.Phases(spawn_s=2, group_s=0.5, handover_s=0.25, first_step_s=1, end_job_s=3,
                     launch_s=0.125, imports_s=4)
    # 16 ranks, a node of 4 lost: 4 tree levels over 16, 4 over the 12 left
    shrunk = loss.in_job_s(16, 4, N, 0.75, m, ph, respawn=False)
    assert shrunk == {"shrink_s": pytest.approx(16e-6), "group_s": pytest.approx(0.5 + 8e-6),
                      "redo_s": 0.75}
    respawned = loss.in_job_s(16, 4, N, 0.75, m, ph)
    assert respawned == {"shrink_s": pytest.approx(16e-6), "spawn_s": pytest.approx(2 + 8e-6),
                         "group_s": pytest.approx(0.5 + 8e-6),
                         "state_s": pytest.approx(0.25 + (4 + 15) * 1e-6 + 2 * 15 / 16 * N * 1e-9),
                         "first_step_s": 1, "redo_s": 0.75}
    again = loss.relaunch_s(16, 4, N, 0.75, m, read_bytes_per_s=1e9, checkpoint_every_s=60,
                            phases=ph)
    assert again == {"end_s": 3, "launch_s": 0.25, "start_s": pytest.approx(4 + 4e-6),
                     "load_s": pytest.approx(N / 1e9 + (4 + 15) * 1e-6 + 2 * 15 / 16 * N * 1e-9),
                     "first_step_s": 1, "redo_s": 30.75}
    for lost in (0, 16):
        with pytest.raises(ValueError, match=f"lost {lost} of 16 ranks"):
            loss.in_job_s(16, lost, N, 0.75, m)


def test_the_command_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "model.png"
    assert bench_main(["model", "--nodes-max", "4", "--systems", "ib100", "--models", "vgg16",
                       "--plot", str(png)]) == 0
    assert png.stat().st_size > 1000


@pytest.mark.parametrize("argv, message", [
    (["--calibrate", "{tmp}/absent.json"], "absent.json'?: no such file"),
    (["--calibrate", "{tmp}/norows.json"], "no 'rows'"),
    (["--nodes-max", "0"], "--nodes-max 0 is out of range"),
    (["--systems", "25gbe,dialup"], "--systems '25gbe,dialup': accepted"),
    (["--label", "x"], "1 --label for 0 --calibrate files"),
    (["--loss-model", "gpt5"], "--loss-model 'gpt5': accepted"),
    (["--read-GBps", "0"], "--read-GBps 0.0 is out of range"),
    (["--loss-model", "resnet50,vgg16"], "--loss-model 'resnet50,vgg16': one of"),
])
def test_bad_input_is_one_line_naming_it(tmp_path, capsys, argv, message):
    (tmp_path / "norows.json").write_text(json.dumps({"nranks": 2, "rows": []}))
    rc = bench_main(["model"] + [a.replace("{tmp}", str(tmp_path)) for a in argv])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    assert err.startswith("python -m mpidp.bench model: error: ")
    assert re.search(message, err), err


def test_load_measurements_raises_value_error_naming_the_file(tmp_path):
    with pytest.raises(ValueError, match="nowhere.json'?: no such file"):
        calibration.load_measurements(tmp_path / "nowhere.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"nranks": 0, "rows": [{"size": 8}]}))
    with pytest.raises(ValueError, match="nranks 0"):
        calibration.load_measurements(bad)


def test_the_command_needs_neither_mpi_nor_torch():
    code = ("import sys, io, contextlib\n"
            "from mpidp.bench.__main__ import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    rc = main(['model', '--nodes-max', '2', '--systems', '25gbe'])\n"
            "assert rc == 0, rc\n"
            "print(sorted(m for m in sys.modules if m.startswith(('mpi4py', 'torch'))))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
