"""Tier 1: mpidp.horovod in one process, without MPI — its import, Horovod's op rules, the
compressors, what the optimizer wrapper refuses and what is refused in one line (the
collectives and training under mpiexec: tests/mpi/bodies/body_horovod.py, run by
tests/mpi/test_together.py at n = 1, 2, 3)."""
import subprocess
import sys

import pytest
import torch

import mpidp.horovod as hvd
from mpidp.horovod import backward, ops, run
from mpidp.runtime.launcher import Mpiexec


def test_import_starts_no_mpi_and_exports_horovods_names():
    code = ("import sys, mpidp.horovod as hvd; print('mpi4py.MPI' in sys.modules, "
            "hvd.is_initialized())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["False", "False"], out.stderr
    for name in ("init", "allreduce", "allreduce_async_", "allgather", "broadcast_",
                 "reducescatter", "grouped_allreduce", "DistributedOptimizer",
                 "broadcast_parameters", "broadcast_optimizer_state", "broadcast_object",
                 "Compression", "SyncBatchNorm", "Average", "Sum", "Adasum", "Product"):
        assert name in hvd.__all__ and hasattr(hvd, name), name
    assert sorted(hvd.__all__) == hvd.__all__ == sorted(set(hvd.__all__))


def test_ops_follow_horovods_rules():
    assert ops.resolve_op(None, None) == hvd.Average
    assert ops.resolve_op(None, False) == hvd.Sum and ops.resolve_op(None, True) == hvd.Average
    assert ops.resolve_op(hvd.Max, None) == hvd.Max
    with pytest.raises(ValueError, match="op and average cannot both be given"):
        ops.resolve_op(hvd.Sum, True)
    with pytest.raises(NotImplementedError, match="hvd.Adasum is not supported"):
        ops.resolve_op(hvd.Adasum, None)
    with pytest.raises(ValueError, match="unknown op 42"):
        ops.resolve_op(42, None)


def test_a_refusal_names_the_values_its_rank_was_called_with():
    """Note [Agreement before refusal]: what another rank's MismatchError says of a rank that
    refused its input; and the stamps a disagreement can name in words."""
    from mpidp.engine import header
    from mpidp.horovod import arguments
    root = header.refusal(header.BROADCAST, ValueError("bad root"), 99, 2, 3)
    assert header.describe(root) == "broadcast float32[3] root=99, refused there (ValueError)"
    adasum = header.refusal(header.ALLREDUCE, NotImplementedError("no"),
                            arguments.op_word(hvd.Adasum), 5, 3)
    assert header.describe(adasum) == \
        "allreduce int64[3] op=adasum, refused there (NotImplementedError)"
    assert header.describe(header.refusal(header.ALLGATHER, TypeError("a list"))) == \
        "allgather, refused there (TypeError)"
    assert (arguments.op_word(None), arguments.op_word(None, False), arguments.op_word(hvd.Max),
            arguments.op_word([1])) == (4, 0, 2, header.UNKNOWN)
    good = header.header(header.BROADCAST, 0, 0, 2, 3, (3,))
    text = str(header.mismatch_error("broadcast", [root, good], 1))
    assert "rank 0: broadcast float32[3] root=99, refused there (ValueError)" in text and \
        "same count" not in text
    stamp = header.described_stamp("name 'a'")
    assert stamp & header.DESCRIBED and header.site_text(stamp) == "name 'a'"
    assert not any(header.site_hash(f"train.py:{i}") & header.DESCRIBED for i in range(500))


def test_a_groups_layout_is_said_in_words():
    from mpidp.comm import fusion
    from mpidp.engine.dtypes import as_host_array
    arrays = [as_host_array(torch.ones(4)), as_host_array(torch.ones(2, 3, dtype=torch.float64))]
    assert fusion._layout(arrays, 1024) == \
        "a group of [float32[4], float64[2, 3]] in buckets of 1024 bytes"
    many = fusion._layout([as_host_array(torch.ones(k + 1)) for k in range(6)], 8)
    assert many.startswith("a group of [float32[1], float32[2], float32[3], float32[4], ... "
                           "(6 tensors, layout 0x")


def test_fp16_compression_round_trip():
    t = torch.tensor([1.5, -2.0, 3.25])
    sent, ctx = hvd.Compression.fp16.compress(t)
    assert sent.dtype == torch.float16 and ctx == torch.float32
    assert torch.equal(hvd.Compression.fp16.decompress(sent, ctx), t)
    ints = torch.arange(3)
    assert hvd.Compression.fp16.compress(ints) == (ints, None)
    assert hvd.Compression.none.compress(t) == (t, None)


def test_distributed_optimizer_refuses_bad_arguments_naming_them():
    model = torch.nn.Linear(3, 2)
    sgd = lambda: torch.optim.SGD(model.parameters(), lr=0.1)  # noqa: E731
    with pytest.raises(ValueError, match="named_parameters should be a sequence of tuples"):
        hvd.DistributedOptimizer(sgd(), named_parameters=[model.weight])
    with pytest.raises(ValueError, match="must be unique; repeated: \\['w'\\]"):
        hvd.DistributedOptimizer(sgd(), named_parameters=[("w", model.weight),
                                                          ("w", model.bias)])
    with pytest.raises(ValueError, match="1 of the optimizer's parameters are not in it"):
        hvd.DistributedOptimizer(sgd(), named_parameters=[("weight", model.weight)])
    with pytest.raises(ValueError, match="backward_passes_per_step must be a positive int"):
        hvd.DistributedOptimizer(sgd(), backward_passes_per_step=0)
    with pytest.raises(ValueError, match="only valid with op=hvd.Average"):
        hvd.DistributedOptimizer(sgd(), op=hvd.Sum, gradient_predivide_factor=2.0)
    with pytest.raises(TypeError, match="must be a torch.optim.Optimizer, got Linear"):
        hvd.DistributedOptimizer(model)
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01,
                                                    betas=(0.8, 0.9)),
                                   named_parameters=model.named_parameters())
    assert isinstance(opt, torch.optim.Adam) and type(opt).__name__ == "Adam"
    assert opt.defaults["betas"] == (0.8, 0.9) and opt.param_groups[0]["lr"] == 0.01


def test_buckets_of_horovods_groups_launch_last_parameters_first():
    """Note [Gradients during backward]: groups= as a number cuts the parameters into
    contiguous runs, as lists makes a bucket of each list (every other parameter alone); the
    bucket whose first parameter comes last launches first; mpidp's own buckets otherwise."""
    ps = [torch.zeros(4, requires_grad=True) for _ in range(5)]
    assert backward.groups_of(ps, 2, 1 << 20) == ((3, 4), (0, 1, 2))
    assert backward.groups_of(ps, 7, 1 << 20) == ((4,), (3,), (2,), (1,), (0,))
    assert backward.groups_of(ps, [[ps[4], ps[0]], [ps[2]]], 1 << 20) == \
        ((3,), (2,), (1,), (0, 4))
    assert backward.groups_of(ps, None, 1 << 20) == ((4, 3, 2, 1, 0),)  # 80 B: one bucket
    assert backward.groups_of(ps, None, 32) == ((4, 3), (2, 1), (0,))  # 16 B each, 32 B cap
    with pytest.raises(ValueError, match="groups\\[1\\] holds a tensor that is not one of"):
        backward.groups_of(ps, [[ps[0]], [torch.ones(1, requires_grad=True)]], 1 << 20)


@pytest.mark.parametrize("call", [lambda: hvd.start_timeline("t.json"),
                                  lambda: hvd.start_timeline("t.json", mark_cycles=True),
                                  lambda: hvd.stop_timeline()])
def test_the_timeline_calls_before_init_raise_horovods_error(call, monkeypatch):
    monkeypatch.setenv("HOROVOD_TIMELINE", "DYNAMIC")
    with pytest.raises(ValueError, match=r"^Horovod has not been initialized; use "
                                         r"hvd\.init\(\)\.$"):
        call()


def test_process_sets_are_checked_as_horovod_checks_them():
    ps = hvd.ProcessSet([2, 0])
    assert ps.ranks == [0, 2] and ps.process_set_id is None and ps.size() is None
    assert hvd.global_process_set.process_set_id == 0
    with pytest.raises(ValueError, match="a list of process ranks"):
        hvd.ProcessSet([0, "1"])
    with pytest.raises(NotImplementedError, match="of an MPI communicator is not supported"):
        hvd.ProcessSet(object())
    with pytest.raises(ValueError, match="has not been added"):
        hvd.allreduce(torch.ones(2), process_set=ps)
    with pytest.raises(TypeError, match="must be an hvd.ProcessSet, got list"):
        hvd.broadcast_(torch.ones(2), 0, process_set=[0, 1])
    with pytest.raises(ValueError, match="must be a list of hvd.ProcessSet or 'dynamic'"):
        hvd.init(process_sets=ps)
    assert hvd.remove_process_set(ps) is False and \
        hvd.remove_process_set(hvd.global_process_set) is False


def test_horovodrun_maps_its_timeline_and_fusion_flags_to_horovods_variables():
    assert run.variables("t.json", 64) == {"HOROVOD_TIMELINE": "t.json",
                                           "HOROVOD_FUSION_THRESHOLD": str(64 << 20)}
    assert run.variables(None, None) == {}
    with pytest.raises(ValueError, match="--fusion-threshold-mb -1"):
        run.variables(None, -1)


HYDRA = Mpiexec("mpiexec", "MPICH (Hydra 5.0.2)", False, False)
OPEN_MPI = Mpiexec("mpirun", "Open MPI 5.0.11", True, True)


def test_horovodrun_maps_onto_mpiexec():
    assert run.command(HYDRA, 4, ["python", "train.py"], "a:2,b:2") == \
        ["mpiexec", "-n", "4", "-hosts", "a:2,b:2", "python", "train.py"]
    assert run.command(HYDRA, 2, ["python", "t.py"], None, 2222, "/tmp/x/ssh",
                       ["HOROVOD_TIMELINE"]) == \
        ["mpiexec", "-n", "2", "-launcher", "ssh", "-launcher-exec", "/tmp/x/ssh", "python", "t.py"]
    text = "# the cluster\nnode1 slots=4\n\nnode2   slots=2  # the small one\nnode3\n"
    assert run.hosts_of_file(text) == "node1:4,node2:2,node3:1"
    with pytest.raises(ValueError, match="hf:1: expected 'host slots=N' or 'host:N', got 'n1 slots=x'"):
        run.hosts_of_file("n1 slots=x\n", "hf")
    with pytest.raises(ValueError, match="expected host:slots"):
        run.command(HYDRA, 2, ["python"], "a:0")
    with pytest.raises(ValueError, match="no command to run"):
        run.command(HYDRA, 2, [])


def test_horovodrun_maps_onto_open_mpis_mpiexec():
    """Open MPI's host list, its slots on this machine, horovodrun's own placement, ssh-port
    and root options, and the variables named with -x: with hosts, the whole environment
    but a shell's own (Note [horovodrun on mpiexec])."""
    extra = {"HOROVOD_TIMELINE": "t.json"}
    passed = run.exported({"PATH": "/bin", "OLDPWD": "/", "BASH_FUNC_f%%": "() {}",
                           "MPIDP_TIMEOUT_S": "30"}, extra, "a:2,b:2")
    assert passed == ["HOROVOD_TIMELINE", "MPIDP_TIMEOUT_S", "PATH"]
    assert run.exported({"PATH": "/bin"}, extra, None) == ["HOROVOD_TIMELINE"]
    assert run.command(OPEN_MPI, 4, ["python", "train.py"], "a:2,b:2", 2222, passed=passed,
                       as_root=True) == \
        ["mpirun", "-n", "4", "--host", "a:2,b:2", "--bind-to", "none", "--map-by", "slot",
         "--allow-run-as-root", "--mca", "plm_rsh_args", "-p 2222", "-x", "HOROVOD_TIMELINE",
         "-x", "MPIDP_TIMEOUT_S", "-x", "PATH", "python", "train.py"]
    assert run.command(OPEN_MPI, 3, ["python", "t.py"]) == \
        ["mpirun", "-n", "3", "--oversubscribe", "--bind-to", "none", "--map-by", "slot",
         "python", "t.py"]
    with pytest.raises(ValueError, match="-p 0: expected a port, 1 to 65535"):
        run.command(HYDRA, 2, ["python"], ssh_port=0)


@pytest.mark.parametrize("flag,words", [("--gloo", "mpidp runs on MPI only"),
                                        ("--min-np", "mpidp has no elastic driver")])
def test_horovodrun_refuses_what_mpidp_does_not_do_in_one_line(flag, words):
    proc = subprocess.run([sys.executable, "-m", "mpidp.horovod.run", "-np", "2", flag, "1",
                           "python", "train.py"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.splitlines()[-1] == \
        f"python -m mpidp.horovod.run: error: {flag} is not supported: {run.REFUSED[flag]}"
    assert words in proc.stderr


def test_horovod_variables_map_to_mpidp_settings_or_are_refused_in_one_line():
    from mpidp import config
    from mpidp.horovod import settings
    assert settings.mapped({"HOROVOD_FUSION_THRESHOLD": "1048576", "HOROVOD_TIMELINE": "t.json",
                            "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "30",
                            "HOROVOD_HIERARCHICAL_ALLREDUCE": "1", "PATH": "/bin"}) == {
        "MPIDP_HOROVOD_FUSION_BYTES": "1048576", "MPIDP_TIMELINE": "t.json",
        "MPIDP_TIMEOUT_S": "30"}  # hierarchical: auto takes it where it pays
    assert settings.mapped({"HOROVOD_FUSION_THRESHOLD": "0",
                            "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "0"}) == \
        {"MPIDP_HOROVOD_FUSION_BYTES": "1"}  # Horovod's "no fusion": a bucket per tensor;
    # its "never shut down": the watchdog as it is
    # left in a profile by Horovod's build, or changing nothing mpidp does: nothing
    assert settings.mapped({"HOROVOD_WITH_PYTORCH": "1", "HOROVOD_GPU_OPERATIONS": "NCCL",
                            "HOROVOD_WITHOUT_GLOO": "1", "HOROVOD_LOG_LEVEL": "debug",
                            "HOROVOD_THREAD_AFFINITY": "0,1"}) == {}
    refusals = {"HOROVOD_CYCLE_TIME": "no background cycle",
                "HOROVOD_STALL_CHECK_TIME_SECONDS": "MPIDP_TIMEOUT_S",
                "HOROVOD_TORUS_ALLREDUCE": "MPIDP_\\* variables",
                "HOROVOD_FUSION_THRESHOLD": "integer >= 0",
                "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "seconds >= 0"}
    # DYNAMIC: no timeline until hvd.start_timeline (Horovod's), so nothing set at init
    assert settings.mapped({"HOROVOD_TIMELINE": "DYNAMIC"}) == {}
    assert settings.mapped({"HOROVOD_TIMELINE": "dynamic"}) == {}
    values = {"HOROVOD_FUSION_THRESHOLD": "-1",
              "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "-1"}
    for name, why in refusals.items():
        with pytest.raises(ValueError, match=f"^{name}=.*{why}") as caught:
            settings.mapped({name: values.get(name, "1")})
        assert "\n" not in str(caught.value)
    # mapped values are read as mpidp's own; an MPIDP_* variable of the user's wins
    cfg = config.from_env({**settings.mapped({"HOROVOD_FUSION_THRESHOLD": "4096"})})
    assert cfg.horovod_fusion_bytes == 4096 and config.Config().horovod_fusion_bytes == 128 << 20
    with pytest.raises(ValueError, match="MPIDP_HOROVOD_FUSION_BYTES='0'"):
        config.from_env({"MPIDP_HOROVOD_FUSION_BYTES": "0"})


def test_adopt_lets_the_users_own_mpidp_variables_win_and_refuses_at_the_next_read(
        monkeypatch):
    from mpidp import config
    from mpidp.horovod import settings
    monkeypatch.setattr(config, "_current", None)
    monkeypatch.setattr(config, "_overrides", None)
    monkeypatch.setenv("MPIDP_TIMEOUT_S", "7")
    config.adopt(lambda: {"MPIDP_TIMEOUT_S": "30", "MPIDP_HOROVOD_FUSION_BYTES": "2048"})
    cfg = config.get()
    assert (cfg.timeout_s, cfg.horovod_fusion_bytes) == (7.0, 2048) and config.get() is cfg
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "5")
    config.adopt(settings.mapped)  # nothing raised yet: mpidp.init's read reports it
    with pytest.raises(ValueError, match="HOROVOD_CYCLE_TIME='5': not supported"):
        config.get()


def test_elastic_run_refuses_what_is_not_a_function():
    with pytest.raises(TypeError, match="hvd.elastic.run decorates a function of the state, "
                                        "got int"):
        hvd.elastic.run(3)
