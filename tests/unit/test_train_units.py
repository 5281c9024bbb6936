"""Tier 1 for the training tool: data sharding, the learning-rate schedule, checkpoint files
(never written or read through a planted link, their digest, a full disk), settings checks,
data and model factories, the command line's help."""
import dataclasses
import math
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from file_faults import flip_bytes_in_a_tensor, small_tmpfs
from mpidp.workloads import data, models
from mpidp.errors import OutputError
from mpidp.train import checkpoint
from mpidp.train.cli import parser
from mpidp.train.settings import TrainSettings, scaled_lr


# ---- sharding (DistributedSampler semantics) -------------------------------------------------

@pytest.mark.parametrize("length,size", [(1, 1), (10, 3), (11, 4), (12, 4), (1437, 2), (5, 5)])
def test_shards_cover_the_epoch_and_have_equal_length(length, size):
    for epoch in (0, 1, 7):
        shards = [data.ShardSampler(length, r, size, seed=3).indices(epoch) for r in range(size)]
        assert len({len(s) for s in shards}) == 1
        assert len(shards[0]) == len(data.ShardSampler(length, 0, size)) == math.ceil(length / size)
        everything = np.concatenate(shards)
        assert set(everything.tolist()) == set(range(length))  # every sample visited
        assert len(everything) - length == (-length) % size    # padding only to a multiple


def test_shards_reshuffle_per_epoch_and_repeat_per_seed():
    a = [data.ShardSampler(100, 0, 2, seed=5).indices(e) for e in range(3)]
    b = [data.ShardSampler(100, 0, 2, seed=5).indices(e) for e in range(3)]
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(a[0], a[1])
    assert not np.array_equal(a[0], data.ShardSampler(100, 0, 2, seed=6).indices(0))
    assert np.array_equal(data.ShardSampler(6, 1, 2, shuffle=False).indices(0), [1, 3, 5])


@pytest.mark.parametrize("length,size,batch", [(46, 2, 4), (1438, 3, 32), (11, 4, 1),
                                               (10, 1, 3)])
def test_a_sample_cursor_continues_the_epoch(length, size, batch):
    """Note [Sample cursor]: after s steps on every rank the rest of each rank's shard is the
    shard from cursor n*s*B (the same padding: a resume on as many ranks is exact); shared
    out over another number of ranks, the rest and what went before are the epoch, each
    sample once (padding apart)."""
    steps = -(-math.ceil(length / size) // batch)
    for s in range(steps):
        cursor = data.ShardSampler(length, 0, size).cursor_after(0, s, batch)
        assert cursor == size * s * batch and cursor < length
        for r in range(size):
            sampler = data.ShardSampler(length, r, size, seed=9)
            assert np.array_equal(sampler.indices(2, cursor), sampler.indices(2)[s * batch:])
        taken = [i for r in range(size)
                 for i in data.ShardSampler(length, r, size, seed=9).indices(2)[:s * batch]]
        for other in (1, 3):
            rest = [data.ShardSampler(length, r, other, seed=9).indices(2, cursor)
                    for r in range(other)]
            both = taken + np.concatenate(rest).tolist()
            padding = len(both) - length
            assert 0 <= padding < other and len({len(x) for x in rest}) == 1
            assert set(both) == set(range(length))
            if padding == 0:
                assert sorted(both) == list(range(length))
    with pytest.raises(ValueError, match="sample cursor 46 outside an epoch of 46"):
        data.ShardSampler(46, 0, 2).indices(0, 46)


def test_unpadded_shards_partition_exactly():
    shards = [data.ShardSampler(10, r, 4, shuffle=False, pad=False).indices(0) for r in range(4)]
    assert sorted(np.concatenate(shards).tolist()) == list(range(10))


def test_more_ranks_than_samples_is_refused():
    with pytest.raises(ValueError, match="3 ranks but only 2 training samples"):
        data.ShardSampler(2, 0, 3)


def test_batches_resume_mid_epoch_and_match_item_access():
    train, _ = data.digits()
    idx = data.ShardSampler(len(train), 0, 2, seed=1).indices(0)
    whole = list(data.batches(train, idx, 32))
    later = list(data.batches(train, idx, 32, start=3))
    assert len(whole) == math.ceil(len(idx) / 32) and len(later) == len(whole) - 3
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
               for a, b in zip(whole[3:], later))
    sys.path.insert(0, str(Path(__file__).parents[1] / "mpi" / "bodies"))
    from user_factories import SlowDataset  # a non-TensorDataset goes item by item
    slow = list(data.batches(SlowDataset(train, 0.0), idx[:40], 32))
    assert torch.equal(slow[1][0], whole[1][0][:8]) and torch.equal(slow[0][1], whole[0][1])


# ---- data sets and models --------------------------------------------------------------------

def test_digits_ship_with_the_package_and_split_fixed():
    sets = data.load("digits")
    assert (len(sets.train), len(sets.test)) == (1438, 359)
    assert sets.input_shape == (1, 8, 8) and sets.num_classes == 10
    x = sets.train.tensors[0]
    assert float(x.min()) == 0.0 and float(x.max()) == 1.0
    assert torch.equal(data.digits()[1].tensors[1], sets.test.tensors[1])


def test_synthetic_has_the_asked_size_and_is_learnable_shape():
    sets = data.load("synthetic", synthetic_samples=100)
    assert (len(sets.train), len(sets.test)) == (100, 12)
    assert sets.input_shape == (1, 28, 28) and sets.num_classes <= 10


@pytest.mark.parametrize("spec,match", [
    ("nope", "expected a built-in name or package.module:factory"),
    ("no_such_module_xyz:f", "cannot import 'no_such_module_xyz'"),
    ("os:no_such_function", "has no 'no_such_function'"),
    ("os:sep", "is not callable"),
])
def test_bad_dataset_factories_are_named(spec, match):
    with pytest.raises(ValueError, match=match):
        data.load(spec)


def test_factories_that_fail_are_named():
    sys.path.insert(0, str(Path(__file__).parents[1] / "mpi" / "bodies"))
    with pytest.raises(ValueError, match=r"model 'torch.nn:Linear': the factory raised TypeError"):
        data.call_factory("torch.nn:Linear", "model")
    with pytest.raises(ValueError, match="the test set is empty"):
        data.load("user_factories:empty_test")
    with pytest.raises(ValueError, match="is not a map-style dataset"):
        data.load("user_factories:not_a_dataset")
    with pytest.raises(ValueError, match="factory raised OSError: the data files are missing"):
        data.load("user_factories:broken")


def test_builtin_models_fit_the_data():
    assert models.build("mlp", (1, 8, 8), 10)(torch.zeros(2, 1, 8, 8)).shape == (2, 10)
    assert models.build("cnn", (1, 8, 8), 7)(torch.zeros(2, 1, 8, 8)).shape == (2, 7)
    with pytest.raises(ValueError, match="unknown model 'resnet'"):
        models.build("resnet", (1, 8, 8), 10)
    with pytest.raises(ValueError, match="square"):
        models.build("cnn", (64,), 10)


# ---- settings and schedule -------------------------------------------------------------------

@pytest.mark.parametrize("change,match", [
    ({"batch_size": 0}, "--batch-size must be an integer >= 1, got 0"),
    ({"epochs": -1}, "--epochs"), ({"lr": 0.0}, "--lr must be a finite number > 0"),
    ({"lr": float("inf")}, "--lr must be a finite"), ({"seed": -1}, "--seed must be an integer"),
    ({"seed": 1 << 32}, "below 2\\*\\*32"), ({"bucket_mb": 1e-9}, "less than one byte"),
    ({"checkpoint_every": 5}, "--checkpoint-every needs --checkpoint-dir"),
    ({"num_ps": 1}, "--num-ps only apply to --strategy ps"), ({"optimizer": "lbfgs"}, "--optimizer"),
    ({"strategy": "ps", "staleness": -2}, "--staleness must be"),
    ({"straggler": "2:0.5"}, "FACTOR >= 1"),
    ({"resume": True}, "--resume needs --checkpoint-dir"), ({"warmup_epochs": -1}, "warmup"),
    ({"algorithm": "tree"}, "--algorithm"), ({"keep_checkpoints": 0}, "--keep-checkpoints"),
    ({"allow_shared_checkpoint_dir": True}, "--allow-shared-checkpoint-dir needs --checkpoint"),
    ({"checkpoint_on_signal": True}, "--checkpoint-on-signal needs --checkpoint-dir"),
    ({"checkpoint_on_signal": True, "checkpoint_dir": "c", "strategy": "ps"},
     "--checkpoint-on-signal: the parameter server checkpoints at epoch ends only"),
    ({"compression": "zip"}, "--compression 'zip': expected one of none, fp16, bf16"),
    ({"compression": "bf16", "strategy": "central"},
     "--compression bf16 applies to --strategy mirrored, not central"),
    ({"powersgd_rank": 2, "compression": "bf16"},
     "--powersgd-rank applies to --compression powersgd, not bf16"),
    ({"powersgd_start_step": -1, "compression": "powersgd"},
     "--powersgd-start-step must be an integer >= 0, got -1"),
    ({"powersgd_rank": 0, "compression": "powersgd"}, "--powersgd-rank must be an integer >= 1"),
    ({"zero": True, "strategy": "central"}, "--zero applies to --strategy mirrored, not central"),
    ({"zero": True, "compression": "bf16"}, "does not combine with --compression bf16"),
    ({"sync_every": 4}, "--sync-every applies to --strategy localsgd and diloco, not mirrored"),
    ({"strategy": "localsgd", "sync_every": 0}, "--sync-every must be an integer >= 1"),
    ({"strategy": "diloco", "local_sgd_warmup_steps": 3},
     "--local-sgd-warmup-steps applies to --strategy localsgd, not diloco"),
    ({"strategy": "localsgd", "outer_lr": 0.5}, "--outer-lr applies to --strategy diloco"),
    ({"strategy": "diloco", "outer_momentum": 1.0}, "--outer-momentum must be in \\[0, 1\\)"),
    ({"strategy": "diloco", "outer_lr": -1.0}, "--outer-lr must be a finite number > 0"),
])
def test_settings_checks_name_the_flag(change, match):
    with pytest.raises(ValueError, match=match):
        TrainSettings(**change).check()


@pytest.mark.parametrize("argv,match", [
    (["--checkpoint-on-signal"], "--checkpoint-on-signal needs --checkpoint-dir"),
    (["--checkpoint-on-signal", "--checkpoint-dir", "c", "--strategy", "ps"],
     "--checkpoint-on-signal: the parameter server checkpoints at epoch ends only"),
])
def test_checkpoint_on_signal_refusals_are_one_line_and_exit_code_2(argv, match, capsys):
    from mpidp.train import cli
    with pytest.raises(SystemExit) as ended:
        cli.main(argv)  # refused before MPI starts
    assert ended.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("mpidp.train: error: ") and match in err[0], err


def test_recorded_signals_only_while_recording():
    """Note [Checkpoint on signal]: SIGUSR1 and SIGTERM are recorded (the first wins), and
    the previous handlers come back afterwards; nested uses share the record."""
    import os
    import signal
    from mpidp.train import on_signal
    before = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)
    with on_signal.recording_signals() as record:
        with on_signal.recording_signals() as inner:
            assert inner is record
        assert record.signum == 0
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)
        assert record.signum == signal.SIGUSR1
    assert (signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)) == before


def test_lr_scaling_and_warmup():
    s = TrainSettings(lr=0.1, lr_scaling="linear", warmup_epochs=2)
    assert scaled_lr(s, 4, 0.0) == pytest.approx(0.1)
    assert scaled_lr(s, 4, 1.0) == pytest.approx(0.25)
    assert scaled_lr(s, 4, 2.0) == scaled_lr(s, 4, 9.0) == pytest.approx(0.4)
    assert scaled_lr(TrainSettings(lr=0.1, lr_scaling="sqrt"), 4, 0) == pytest.approx(0.2)
    assert scaled_lr(TrainSettings(lr=0.1, lr_scaling="none"), 4, 0) == pytest.approx(0.1)


def test_help_documents_every_setting_with_its_default():
    text = " ".join(parser().format_help().split())
    for name, value in vars(TrainSettings()).items():
        assert "--" + name.replace("_", "-") in text
    assert "(default: 32)" in text and "(default: mirrored)" in text
    assert "(default: None)" not in text and "95% held-out" in text
    assert "(default: none written)" in text and "the machine's cores / the job's ranks on it" in text


# ---- checkpoint files ------------------------------------------------------------------------

def _state(v):
    return {"model": {"w": torch.full((3,), float(v))}, "epoch": v}


def test_checkpoints_rotate_and_load_newest(tmp_path):
    for step in (5, 10, 15, 20):
        checkpoint.save(tmp_path, _state(step), step, keep=2)
    assert [p.name for p in checkpoint.existing(tmp_path)] == ["ckpt-000000020.pt",
                                                                "ckpt-000000015.pt"]
    path, state, digest = checkpoint.load_latest(tmp_path, pytest.fail)
    assert path.name == "ckpt-000000020.pt" and state["epoch"] == 20 and len(digest) == 64
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # no temporaries left


def test_corrupt_checkpoint_is_named_and_the_previous_used(tmp_path):
    checkpoint.save(tmp_path, _state(1), 1, keep=3)
    newest = checkpoint.save(tmp_path, _state(2), 2, keep=3)
    newest.write_bytes(newest.read_bytes()[:100])  # truncated
    warnings = []
    path, state, _ = checkpoint.load_latest(tmp_path, warnings.append)
    assert state["epoch"] == 1 and path.name == "ckpt-000000001.pt"
    assert len(warnings) == 1 and str(newest) in warnings[0] and "corrupt" in warnings[0]
    (tmp_path / "ckpt-000000003.pt").write_bytes(b"not a checkpoint")
    assert checkpoint.load_latest(tmp_path, warnings.append)[1]["epoch"] == 1
    assert checkpoint.load_latest(tmp_path / "empty", pytest.fail) is None


def _training_state(model, settings, **changes):
    """A checkpoint's state as the training loop writes it (every key of checkpoint.KEYS)."""
    return dict({"model": model.state_dict(), "optimizer": {}, "epoch": 2, "step_in_epoch": 0,
                 "global_step": 10, "world_size": 2, "train_samples": 100, "data_order": {},
                 "rng": [], "settings": dataclasses.asdict(settings)}, **changes)


def test_planted_symlinks_are_never_written_through(tmp_path):
    """Another user's links at the temporary name the writer used to take (``.NAME.tmp-PID``)
    and at the final name: the linked file is untouched, and the checkpoint is a regular file
    of ours, readable by us only."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"the owner's secret")
    victim.chmod(0o600)
    ckpts = tmp_path / "ckpt"
    ckpts.mkdir(mode=0o700)
    final = checkpoint.path_for(ckpts, 1)
    (ckpts / f".{final.name}.tmp-{os.getpid()}").symlink_to(victim)
    final.symlink_to(victim)
    assert checkpoint.save(ckpts, _state(1), 1, keep=3) == final
    assert victim.read_bytes() == b"the owner's secret"
    st = os.lstat(final)
    assert final.is_file() and not final.is_symlink() and st.st_uid == os.geteuid()
    assert st.st_mode & 0o777 == 0o600 and checkpoint.load(final)["epoch"] == 1


def test_a_symlink_at_a_checkpoint_name_is_not_loaded(tmp_path):
    good = checkpoint.save(tmp_path / "ckpt", _state(1), 1, keep=3)
    forged = checkpoint.save(tmp_path / "elsewhere", _state(666), 9, keep=3)
    checkpoint.path_for(tmp_path / "ckpt", 9).symlink_to(forged)
    warnings = []
    path, state = checkpoint.load_latest(tmp_path / "ckpt", warnings.append)[:2]
    assert (path, state["epoch"]) == (good, 1)
    assert len(warnings) == 1 and "ckpt-000000009.pt is a symbolic link: not followed" in \
        warnings[0]


def test_retention_plan_counts_only_this_run_s_usable_checkpoints():
    """Note [Checkpoint retention] as a pure rule: a run resumed from step 46 has written 61;
    files ahead of it (69, 999) and a damaged one (40) are left and named, never counted; of
    the usable ones the newest K are kept, and the one resumed from besides."""
    p = {s: checkpoint.path_for(Path("ck"), s) for s in (999, 69, 61, 53, 46, 40, 23)}
    listing = [(s, p[s], "checkpoint ck/ckpt-000000040.pt is corrupt" if s == 40 else None)
               for s in p]
    protected = {p[61], p[46]}
    delete, left = checkpoint.retention_plan(listing, 1, 61, protected)
    assert delete == [p[53], p[23]]
    assert left == [(p[999], "checkpoint ck/ckpt-000000999.pt is ahead of this run (step 999; "
                              "this run has written step 61)"),
                    (p[69], "checkpoint ck/ckpt-000000069.pt is ahead of this run (step 69; "
                             "this run has written step 61)"),
                    (p[40], "checkpoint ck/ckpt-000000040.pt is corrupt")]
    assert checkpoint.retention_plan(listing, 2, 61, protected)[0] == [p[23]]
    assert checkpoint.retention_plan(listing, 3, 61, protected)[0] == [p[23]]
    assert checkpoint.retention_plan(listing, 4, 61, protected)[0] == []
    # the reported case: the damaged newest was passed over, the run takes fewer steps
    bad = [(69, p[69], "corrupt"), (61, p[61], None), (46, p[46], None)]
    assert checkpoint.retention_plan(bad, 1, 61, protected)[0] == []
    assert checkpoint.retention_plan(bad, 1, 61, {p[61]})[0] == [p[46]]


def test_save_keeps_the_run_s_checkpoints_past_damaged_planted_and_ahead_files(tmp_path,
                                                                                monkeypatch):
    """Note [Checkpoint retention]: a run resumed from 46 (69 damaged, a symlink planted at
    999, junk at 30) saves 53 and 61 keeping 1: its own usable checkpoints rotate, the one
    resumed from stays, every other file is left and named once; each file is hashed once
    (the one resumed from by the resume's read only, those written never) until it changes:
    junk replaced by a good checkpoint then counts."""
    d = tmp_path / "ck"
    for step in (23, 46, 69):
        checkpoint.save(d, _state(step), step, keep=3)
    damaged = checkpoint.path_for(d, 69)
    damaged.write_bytes(damaged.read_bytes()[:-1])
    elsewhere = checkpoint.save(tmp_path / "elsewhere", _state(999), 999, keep=1)
    checkpoint.path_for(d, 999).symlink_to(elsewhere)
    checkpoint.path_for(d, 30).write_bytes(b"not a checkpoint")
    hashed, verify = [], checkpoint._verify
    monkeypatch.setattr(checkpoint, "_verify",
                        lambda f, path: hashed.append(path.name[5:14]) or verify(f, path))
    notes = []
    retention = checkpoint.Retention(notes.append)
    resumed = str(checkpoint.read(checkpoint.path_for(d, 46)).path)  # as a resume reads it
    retention.verified(checkpoint.path_for(d, 46))
    for step in (53, 61):
        checkpoint.save(d, _state(step), step, 1, retention, (resumed,))
    assert sorted(p.name[5:14] for p in d.iterdir()) == \
        ["000000030", "000000046", "000000061", "000000069", "000000999"]
    assert hashed == ["000000046", "000000030", "000000023"]  # 46 once: by the resume's read
    end = "; left in place, not counted toward --keep-checkpoints"
    assert notes == [
        f"checkpoint {d}/ckpt-000000999.pt is ahead of this run (step 999; this run has "
        f"written step 53){end}",
        f"checkpoint {d}/ckpt-000000069.pt is ahead of this run (step 69; this run has "
        f"written step 53){end}",
        f"checkpoint {d}/ckpt-000000030.pt is corrupt or truncated: too short for an mpidp "
        f"digest{end}"]
    warnings = []
    assert checkpoint.load_latest(d, warnings.append, ())[1]["epoch"] == 61
    assert len(warnings) == 2  # 999 (a link), 69 (truncated): a resume still finds 61
    os.replace(checkpoint.save(tmp_path / "other", _state(30), 30, keep=1),
               checkpoint.path_for(d, 30))
    del hashed[:]
    checkpoint.save(d, _state(65), 65, 1, retention, (resumed,))
    assert hashed == ["000000030"] and len(notes) == 3
    assert sorted(p.name[5:14] for p in d.iterdir()) == \
        ["000000046", "000000065", "000000069", "000000999"]


def test_an_async_writer_prints_retention_lines_in_the_training_thread(tmp_path):
    """Note [Asynchronous checkpoints]: the background write keeps the checkpoint resumed from
    and leaves a planted symlink, whose line waits for the training thread's next wait."""
    from mpidp.train.async_checkpoint import Writer
    resumed = checkpoint.save(tmp_path, _state(1), 1, keep=1)
    checkpoint.path_for(tmp_path, 999).symlink_to(resumed)
    notes = []
    writer = Writer(str(tmp_path), keep=1, note=notes.append)
    for step in (2, 3):
        writer.submit(_state(step), step, (str(resumed),))
        assert notes == [] or step == 3
        writer.wait()
    assert notes == [f"checkpoint {tmp_path}/ckpt-000000999.pt is ahead of this run (step "
                     "999; this run has written step 2); left in place, not counted toward "
                     "--keep-checkpoints"]
    assert [p.name for p in checkpoint.existing(tmp_path)] == \
        ["ckpt-000000999.pt", "ckpt-000000003.pt", "ckpt-000000001.pt"]


def test_the_json_log_is_never_written_through_a_link(tmp_path):
    from mpidp.train.metrics import Report
    victim, log = tmp_path / "victim", tmp_path / "log.jsonl"
    victim.write_text("untouched\n")
    log.symlink_to(victim)
    report = Report(0, 1, progress=False, verbose=False, log_json=str(log))
    report.record({"event": "epoch"})
    report.close()
    assert victim.read_text() == "untouched\n" and not log.is_symlink()
    report = Report(0, 1, progress=False, verbose=False, log_json=str(log))  # appends
    report.record({"event": "summary"})
    report.close()
    assert log.read_text() == '{"event": "epoch"}\n{"event": "summary"}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.jsonl", "victim"]


def test_a_checkpoint_directory_others_can_write_is_refused_unless_allowed(tmp_path):
    from mpidp.train.setup import check_outputs
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o770)
    with pytest.raises(ValueError, match=r"--checkpoint-dir .*shared is writable by other "
                       r"users \(mode 0770\).*--allow-shared-checkpoint-dir"):
        check_outputs(TrainSettings(checkpoint_dir=str(shared)))
    check_outputs(TrainSettings(checkpoint_dir=str(shared), allow_shared_checkpoint_dir=True))
    shared.chmod(0o1777)  # a sticky bit does not stop others adding files
    with pytest.raises(ValueError, match="mode 1777"):
        check_outputs(TrainSettings(checkpoint_dir=str(shared)))
    if os.geteuid() == 0:
        shared.chmod(0o700)
        os.chown(shared, 4242, -1)
        with pytest.raises(ValueError, match=r"owned by another user \(uid 4242\)"):
            check_outputs(TrainSettings(checkpoint_dir=str(shared)))
    check_outputs(TrainSettings(checkpoint_dir=str(tmp_path / "new")))  # created 0700
    assert (tmp_path / "new").stat().st_mode & 0o777 == 0o700


def _two_checkpoints(directory, model, settings):
    """The checkpoints of steps 5 and 10 of a training run; returns their paths."""
    return [checkpoint.save(directory, _training_state(model, settings, global_step=step),
                            step, keep=3) for step in (5, 10)]


def test_flipped_bytes_in_a_tensor_fail_the_digest(tmp_path):
    """8 bytes inverted inside a stored tensor (torch.load would take them): that checkpoint
    is named in one warning and the previous one used; with none good, one line."""
    from mpidp.train.setup import find_resume_point
    model = models.build("mlp", (1, 8, 8), 10)
    s = _resume_settings(tmp_path, epochs=3)
    older, newer = _two_checkpoints(tmp_path, model, s)
    flip_bytes_in_a_tensor(newer)
    warnings = []
    found = find_resume_point(s, 2, model, 100, warnings.append)
    assert found[0] == older and found.sha256 == checkpoint.read(older).sha256
    assert len(warnings) == 1 and f"checkpoint {newer} is corrupt: its SHA-256 is" in \
        warnings[0]
    flip_bytes_in_a_tensor(older)
    with pytest.raises(ValueError) as no_good:
        find_resume_point(s, 2, model, 100, pytest.fail)
    message = str(no_good.value)
    assert message.startswith(f"--resume: no usable checkpoint in {tmp_path} (")
    assert str(newer) in message and str(older) in message and "\n" not in message


def test_a_checkpoint_missing_a_key_is_passed_over(tmp_path):
    from mpidp.train.setup import find_resume_point
    model = models.build("mlp", (1, 8, 8), 10)
    s = _resume_settings(tmp_path, epochs=3)
    older, _ = _two_checkpoints(tmp_path, model, s)
    state = _training_state(model, s, global_step=15)
    del state["world_size"]
    incomplete = checkpoint.save(tmp_path, state, 15, keep=3)  # with mpidp's format tag
    warnings = []
    assert find_resume_point(s, 2, model, 100, warnings.append).path.name == \
        "ckpt-000000010.pt"
    assert len(warnings) == 1 and f"checkpoint {incomplete} is incomplete: no 'world_size'" \
        in warnings[0]
    only = tmp_path / "only"
    checkpoint.save(only, state, 15, keep=3)
    with pytest.raises(ValueError, match=r"^--resume: no usable checkpoint in .*only \(checkpoint "
                       r".*ckpt-000000015.pt is incomplete: no 'world_size'\)$"):
        find_resume_point(_resume_settings(only, epochs=3), 2, model, 100, pytest.fail)


def test_a_checkpoint_of_another_format_is_passed_over(tmp_path, monkeypatch):
    """A whole archive, its digest right, written by another program (or a later mpidp) under
    another format tag: named in one warning and passed over for the previous good one."""
    from mpidp.train.setup import find_resume_point
    model = models.build("mlp", (1, 8, 8), 10)
    s = _resume_settings(tmp_path, epochs=3)
    _two_checkpoints(tmp_path, model, s)
    with monkeypatch.context() as m:
        m.setattr(checkpoint, "FORMAT", "someone-elses-format-7")
        foreign = checkpoint.save(tmp_path, _training_state(model, s, global_step=15), 15,
                                  keep=3)
    assert checkpoint.read(foreign.parent / "ckpt-000000010.pt").state["epoch"] is not None
    warnings = []
    assert find_resume_point(s, 2, model, 100, warnings.append).path.name == \
        "ckpt-000000010.pt"
    assert warnings == [f"checkpoint {foreign} is not an mpidp checkpoint "
                        f"({checkpoint.FORMAT}); passed over"], warnings


def test_a_full_disk_is_named_and_loses_nothing(tmp_path):
    with small_tmpfs(tmp_path / "small") as small:
        good = checkpoint.save(small, _state(1), 1, keep=3)
        big = {"model": {"w": torch.rand(64 * 1024)}, "epoch": 2}  # 256 KiB: does not fit
        with pytest.raises(OutputError) as full:
            checkpoint.save(small, big, 2, keep=3)
        assert str(full.value) == (f"cannot write checkpoint {checkpoint.path_for(small, 2)}: "
                                   "No space left on device")
        assert os.listdir(small) == [good.name]  # the temporary removed
        assert checkpoint.load(good)["epoch"] == 1


def test_failed_write_keeps_earlier_checkpoints(tmp_path):
    good = checkpoint.save(tmp_path, _state(1), 1, keep=3)
    with pytest.raises(Exception):
        checkpoint.save(tmp_path, {"model": lambda: 0}, 2, keep=3)  # cannot be pickled
    assert checkpoint.existing(tmp_path) == [good]
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]
    # a temporary left by a writer that was killed is removed by the next save
    (tmp_path / ".ckpt-000000009.pt.tmp-999999999").write_bytes(b"partial")
    checkpoint.save(tmp_path, _state(3), 3, keep=3)
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]


# ---- random streams and set-up checks --------------------------------------------------------

def test_rng_streams_per_rank_and_state_round_trip(tmp_path):
    import random
    from mpidp.train.checkpoint import rng_state, seed_rng, set_rng_state
    seed_rng(3, 0)
    a = (torch.rand(2), np.random.rand(), random.random())
    seed_rng(3, 1)
    assert torch.rand(2).tolist() != a[0].tolist()
    np.random.normal()  # leaves a cached Gaussian in numpy's state
    state = rng_state()
    checkpoint.save(tmp_path, {"rng": [state]}, 1, keep=1)  # weights_only must accept it
    saved = checkpoint.load(checkpoint.existing(tmp_path)[0])["rng"][0]
    want = (torch.rand(3), np.random.normal(), random.random())
    set_rng_state(saved)
    assert torch.equal(torch.rand(3), want[0]) and np.random.normal() == want[1] \
        and random.random() == want[2]


def _resume_settings(tmp_path, **kw):
    return TrainSettings(checkpoint_dir=str(tmp_path), resume=True, **kw)


def test_resume_checks_the_checkpoint_fits_this_run(tmp_path):
    from mpidp.train.setup import find_resume_point
    model = models.build("mlp", (1, 8, 8), 10)
    s = TrainSettings(checkpoint_dir=str(tmp_path), epochs=3)
    state = _training_state(model, s)
    checkpoint.save(tmp_path, state, 10, keep=3)
    fail = pytest.fail
    assert find_resume_point(_resume_settings(tmp_path, epochs=3), 2, model, 100, fail).state[
        "epoch"] == 2
    for kw, n, samples, match in [({"batch_size": 7}, 2, 100, "batch_size=32, this run has "
                                   "batch_size=7"),
                                  ({"seed": 1}, 2, 100, "seed"), ({}, 2, 99, "train_samples"),
                                  ({"optimizer": "adam"}, 2, 100, "optimizer"),
                                  ({"epochs": 1}, 2, 100, "beyond --epochs 1")]:
        with pytest.raises(ValueError, match=match):
            find_resume_point(_resume_settings(tmp_path, **{"epochs": 3, **kw}), n, model,
                              samples, fail)
    ps = TrainSettings(checkpoint_dir=str(tmp_path / "ps"), epochs=3, strategy="ps")
    total = sum(p.numel() for p in model.parameters())
    servers = _server_states(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), total, 1, [1])
    checkpoint.save(tmp_path / "ps", dict(state, settings=dataclasses.asdict(ps),
                                          optimizer=[None] + servers), 10, keep=3)
    assert find_resume_point(_resume_settings(tmp_path / "ps", epochs=3, strategy="ps",
                                              num_ps=1), 2, model, 100, fail)
    # Note [Resuming on another number of ranks]: other numbers of ranks and servers move
    assert find_resume_point(_resume_settings(tmp_path, epochs=3), 3, model, 100, fail)
    assert find_resume_point(_resume_settings(tmp_path / "ps", epochs=3, strategy="ps",
                                              num_ps=2), 3, model, 100, fail)
    # a servers' state that cannot be re-cut is refused here, before any rank commits
    bad = TrainSettings(checkpoint_dir=str(tmp_path / "bad"), epochs=3, strategy="ps")
    checkpoint.save(tmp_path / "bad", dict(state, settings=dataclasses.asdict(bad)), 10, keep=3)
    with pytest.raises(ValueError, match=r"^--resume: the servers' optimizer state in .* cannot "
                       r"be re-cut from 1 to 2 servers: not a parameter server's optimizer"):
        find_resume_point(_resume_settings(tmp_path / "bad", epochs=3, strategy="ps",
                                           num_ps=2), 3, model, 100, fail)
    # but not local models between meetings: passed over for the newest meeting's, if any
    local = TrainSettings(checkpoint_dir=str(tmp_path / "local"), epochs=3, strategy="localsgd")
    local_state = dict(state, settings=dataclasses.asdict(local))
    checkpoint.save(tmp_path / "local", dict(local_state, comm_hook={"kind": "localsgd",
                                                                     "since": 3}), 10, keep=3)
    settings = _resume_settings(tmp_path / "local", epochs=3, strategy="localsgd")
    assert find_resume_point(settings, 2, model, 100, fail).path.name == "ckpt-000000010.pt"
    diverged = f"{tmp_path / 'local' / 'ckpt-000000010.pt'} holds 2 ranks' own localsgd " \
        "models between meetings, which cannot move to 3 ranks"
    with pytest.raises(ValueError, match=re.escape(f"--resume: no usable checkpoint in "
                                                   f"{tmp_path / 'local'} ({diverged})")):
        find_resume_point(settings, 3, model, 100, fail)
    checkpoint.save(tmp_path / "local", dict(local_state, comm_hook={"kind": "localsgd",
                                                                     "since": 0}), 5, keep=3)
    passed = []
    assert find_resume_point(settings, 3, model, 100, passed.append).path.name == \
        "ckpt-000000005.pt"
    assert passed == [f"{diverged}; passed over"]
    with pytest.raises(ValueError, match="other parameters"):
        find_resume_point(_resume_settings(tmp_path, epochs=3), 2,
                          models.build("mlp", (1, 4, 4), 10), 100, fail)
    with pytest.raises(ValueError, match="no usable checkpoint"):
        find_resume_point(_resume_settings(tmp_path / "none"), 2, model, 100, fail)


def test_every_setting_has_one_rule_on_resume():
    """Note [What a resume may change]: a new setting must be given a rule."""
    from mpidp.train import setup
    fields = [f.name for f in dataclasses.fields(TrainSettings)]
    assert sorted(setup.RESUME_RULES) == sorted(fields)
    assert set(setup.RESUME_RULES.values()) == {setup.MUST_MATCH, setup.REPORTED,
                                                setup.RESHAPED, setup.QUIET}
    assert setup.RESUME_MUST_MATCH == ("strategy", "batch_size", "seed", "dataset",
                                       "synthetic_samples", "model", "optimizer")


def test_a_resume_says_each_changed_setting_in_one_line():
    """Note [What a resume may change]: one line per REPORTED setting that differs, in the
    order of TrainSettings; unset values count as their defaults; QUIET ones say nothing."""
    from mpidp.train.setup import changed_settings, resume_lines
    saved = dataclasses.asdict(TrainSettings(lr=0.01).check())
    assert changed_settings(saved, TrainSettings(lr=0.01).check()) == []
    quiet = dict(checkpoint_dir="/elsewhere", checkpoint_every=5, keep_checkpoints=9,
                 resume=True, device="cpu", algorithm="ring", bucket_mb=1.0, eval_every=3,
                 log_json="/tmp/x.jsonl", progress=False, verbose=True, threads_per_rank=1,
                 straggler="1:2", async_checkpoint=True, checkpoint_on_signal=True)
    assert changed_settings(saved, TrainSettings(lr=0.01, **quiet).check()) == []
    now = TrainSettings(lr=0.05, lr_scaling="sqrt", warmup_epochs=1.5, epochs=22, zero=True,
                        amp="bf16").check()
    assert changed_settings(saved, now) == [
        "resuming with --epochs 22 (the checkpoint was trained with 20)",
        "resuming with --lr 0.05 (the checkpoint was trained with 0.01)",
        "resuming with --lr-scaling sqrt (the checkpoint was trained with linear)",
        "resuming with --warmup-epochs 1.5 (the checkpoint was trained with 0.0)",
        "resuming with --zero (the checkpoint was trained without it)",
        "resuming with --amp bf16 (the checkpoint was trained with off)"]
    assert changed_settings(dataclasses.asdict(now), TrainSettings(
        lr=0.05, lr_scaling="sqrt", warmup_epochs=1.5, epochs=22, amp="bf16").check()) == [
        "resuming without --zero (the checkpoint was trained with it)"]
    del saved["lr"]  # a setting the checkpoint does not record is passed over
    assert changed_settings(saved, TrainSettings(lr=0.02).check()) == []
    # PowerSGD's own settings count where both runs use it; unset is the default rank 1
    power = dataclasses.asdict(TrainSettings(compression="powersgd", powersgd_rank=2).check())
    assert changed_settings(power, TrainSettings(compression="powersgd",
                                                 powersgd_rank=2).check()) == []
    assert changed_settings(power, TrainSettings(compression="powersgd").check()) == [
        "resuming with --powersgd-rank 1 (the checkpoint was trained with 2)"]
    assert changed_settings(power, TrainSettings().check()) == [
        "resuming with --compression none (the checkpoint was trained with powersgd)"]
    # a parameter server's: unset staleness (asynchronous), the lookahead on unless turned off
    ps = dataclasses.asdict(TrainSettings(strategy="ps", staleness=2).check())
    assert changed_settings(ps, TrainSettings(strategy="ps", staleness=2,
                                              ps_lookahead=True).check()) == []
    assert changed_settings(ps, TrainSettings(strategy="ps", ps_lookahead=False,
                                              staleness_lr=True, num_ps=2).check()) == [
        "resuming without --staleness (the checkpoint was trained with 2)",
        "resuming with --staleness-lr (the checkpoint was trained without it)",
        "resuming without --ps-lookahead (the checkpoint was trained with it)"]
    diloco = dataclasses.asdict(TrainSettings(strategy="diloco").check())
    assert changed_settings(diloco, TrainSettings(strategy="diloco", sync_every=4,
                                                  outer_momentum=0.0).check()) == [
        "resuming with --sync-every 4 (the checkpoint was trained with 8)",
        "resuming with --outer-momentum 0.0 (the checkpoint was trained with 0.5)"]
    # then the line of another number of ranks, in one list
    state = {"settings": dataclasses.asdict(TrainSettings(lr=0.01).check()), "world_size": 2,
             "step_in_epoch": 0, "data_order": {"cursor": 0}}
    assert resume_lines(state, TrainSettings(lr=0.02).check(), 2, 2, 100) == [
        "resuming with --lr 0.02 (the checkpoint was trained with 0.01)"]
    assert resume_lines(state, TrainSettings(lr=0.02).check(), 3, 3, 100) == [
        "resuming with --lr 0.02 (the checkpoint was trained with 0.01)",
        "the checkpoint was written by 2 ranks, this run has 3: epochs sharded over 3; "
        "--lr-scaling linear now counts 3 ranks; rank 2 starts its generator from --seed"]


def test_a_resume_between_meetings_meets_where_counting_on_would_not():
    """Note [Local steps]: a smaller --sync-every, or a larger --local-sgd-warmup-steps that
    makes the next steps synchronous again while the ranks' models differ, meets at once."""
    from mpidp.train.local_strategies import meeting_on_resume
    assert meeting_on_resume("localsgd", 7, 4, 7, 0) == (
        "--strategy localsgd: the checkpoint is 7 steps past the ranks' last meeting and "
        "--sync-every is 4: they meet now")
    assert meeting_on_resume("localsgd", 3, 8, 13, 20) == (
        "--strategy localsgd: the checkpoint is 3 steps past the ranks' last meeting and "
        "--local-sgd-warmup-steps is 20: steps 14 to 20 are synchronous again, so they meet now")
    assert meeting_on_resume("localsgd", 0, 8, 13, 20) is None  # met already
    assert meeting_on_resume("localsgd", 3, 8, 13, 13) is None  # the next step is local
    assert meeting_on_resume("diloco", 3, 8, 13, 0) is None


def test_outputs_are_checked_before_training(tmp_path):
    from mpidp.train.setup import check_outputs
    with pytest.raises(ValueError, match="--resume: --checkpoint-dir .*typo does not exist"):
        check_outputs(TrainSettings(checkpoint_dir=str(tmp_path / "typo"), resume=True))
    assert not (tmp_path / "typo").exists()  # nothing created by a command that fails
    check_outputs(TrainSettings(checkpoint_dir=str(tmp_path / "new" / "dir"),
                                log_json=str(tmp_path / "log.jsonl")))
    assert (tmp_path / "new" / "dir").is_dir()
    with pytest.raises(ValueError, match="--log-json .*cannot write"):
        check_outputs(TrainSettings(log_json=str(tmp_path / "missing" / "log.jsonl")))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="--checkpoint-dir .*cannot create"):
        check_outputs(TrainSettings(checkpoint_dir=str(tmp_path / "file")))
    checkpoint.save(tmp_path / "used", _state(1), 1, keep=1)
    with pytest.raises(ValueError, match="holds checkpoints of an earlier run"):
        check_outputs(TrainSettings(checkpoint_dir=str(tmp_path / "used")))
    check_outputs(_resume_settings(tmp_path / "used"))


def test_outputs_in_use_by_another_run_are_refused_and_a_supervisors_are_shared(
        tmp_path, monkeypatch):
    """Note [One run per directory]: rank 0's check takes the directory's and the log's
    locks; a second run is refused naming the first; a run whose supervisor holds them (its
    token in MPIDP_RUN_LOCK) goes on without its own; a refused run holds nothing."""
    from mpidp.files import run_lock
    from mpidp.train.setup import check_outputs, release
    s = TrainSettings(checkpoint_dir=str(tmp_path / "ck"), log_json=str(tmp_path / "log"))
    first = check_outputs(s)
    assert [lock.held for lock in first] == [True, True]
    with pytest.raises(ValueError, match=rf"^--checkpoint-dir {tmp_path}/ck is in use by "
                       rf"another run \(pid {os.getpid()} on .*\): wait for it to end, or "
                       "choose another$"):
        check_outputs(dataclasses.replace(s, seed=7))
    with pytest.raises(ValueError, match=rf"^--log-json {tmp_path}/log is in use by another "
                       "run"):  # another directory, the same log: the directory's lock let go
        check_outputs(dataclasses.replace(s, checkpoint_dir=str(tmp_path / "other")))
    assert run_lock.lock_run(tmp_path / "other", "x", directory=True).held
    monkeypatch.setenv(run_lock.LOCK_VARIABLE, run_lock.run_token())  # as under the supervisor
    shared = check_outputs(s)
    assert [lock.held for lock in shared] == [False, False]
    release(shared)
    monkeypatch.delenv(run_lock.LOCK_VARIABLE)
    release(first)
    assert sorted(os.listdir(tmp_path / "ck")) == [] and not (tmp_path / ".log.lock").exists()
    again = check_outputs(s)
    assert all(lock.held for lock in again)
    release(again)


def test_straggler_detection_is_per_sample_and_needs_a_clear_margin():
    from mpidp.train import stragglers
    hosts = ["a", "b", "c"]
    assert stragglers.straggler([1.0, 1.3, 1.1], [10, 10, 10], hosts, 1, 5) is None
    event = stragglers.straggler([1.0, 3.0, 1.2], [10, 10, 10], hosts, 2, 9)
    assert (event["rank"], event["host"], event["epoch"]) == (1, "b", 2)
    assert event["slowdown"] == pytest.approx(3.0 / 1.1)
    assert stragglers.describe(event).startswith(
        "straggler: rank 1 on b computes 2.7x as long per sample as the median")
    # a parameter server's worker that took fewer batches is judged per sample; servers
    # (no samples) are left out
    assert stragglers.straggler([1.0, 1.0, 5.0], [10, 4, 0], hosts, 1, 1)["rank"] == 1
    assert stragglers.straggler([1.0, 9.0], [10, 0], hosts[:2], 1, 1) is None


# ---- resuming the parameter server on another number of servers ------------------------------

def _server_states(make, total, servers, pushes):
    """Each server's optimizer state after ``pushes[k]`` steps of its shard of a flat vector of
    ``total`` (the gradient: the flat index + 1), as ps.shard_map cuts it."""
    from mpidp.engine.ring import partition
    states, grad = [], torch.arange(1.0, total + 1)
    for (lo, n), k in zip(partition(total, servers), pushes):
        p = torch.nn.Parameter(torch.zeros(n))
        opt = make([p])
        for _ in range(k):
            p.grad = grad[lo:lo + n].clone()
            opt.step()
        states.append(opt.state_dict())
    return states


@pytest.mark.parametrize("kind", ["momentum", "adam"])
def test_servers_optimizer_states_are_recut_for_another_number_of_servers(kind):
    """Note [Resuming on another number of ranks]: per-element state (momentum, Adam's
    moments) joined and split at the new shards' bounds, exactly; Adam's step, where servers
    differ, their largest; the workers' None entries ignored; each result loads."""
    from mpidp.train.ps_state import reshard_optimizer_states
    make = {"momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
            "adam": lambda p: torch.optim.Adam(p, lr=0.1)}[kind]
    total = 11
    whole = _server_states(make, total, 1, [2])[0]["state"][0]
    two = _server_states(make, total, 2, [2, 2])
    for servers in (1, 3, 2):
        cut = reshard_optimizer_states([None, None] + two, servers, total)
        assert len(cut) == servers
        for key, value in whole.items():
            if value.dim():
                assert torch.equal(torch.cat([c["state"][0][key] for c in cut]), value)
            else:
                assert all(torch.equal(c["state"][0][key], value) for c in cut)
        vector = next(k for k, v in whole.items() if v.dim())
        for c in cut:
            make([torch.nn.Parameter(torch.zeros(len(c["state"][0][vector])))]).load_state_dict(c)
    if kind == "adam":
        uneven = reshard_optimizer_states(_server_states(make, total, 2, [2, 5]), 3, total)
        assert [float(c["state"][0]["step"]) for c in uneven] == [5.0] * 3
    with pytest.raises(ValueError, match="different entries; resume with --num-ps 2"):
        reshard_optimizer_states(_server_states(make, total, 2, [1, 0]), 3, total)


# ---- the training device and precision (Note [Training device]) ------------------------------

def test_the_device_auto_picks_and_what_cuda_insists_on():
    """Note [Training device]: each rank's (GPUs it sees, the UUID of the one it is bound
    to); ranks bound to one GPU share it."""
    from mpidp.train.devices import decide
    two = [(2, "GPU-a"), (2, "GPU-b")]  # one node, two GPUs, a rank on each
    assert decide("cpu", "mirrored", two) == ("cpu", "--device cpu")
    assert decide("auto", "mirrored", [(0, None)] * 2) == ("cpu", "auto: no GPU visible")
    assert decide("auto", "mirrored", [(2, "GPU-a"), (0, None)]) == (
        "cpu", "auto: rank 1 sees no GPU")
    assert decide("auto", "mirrored", [(1, "GPU-a")] * 2) == (
        "cpu", "auto: ranks 0 and 1 would share a GPU")
    assert decide("auto", "mirrored", two) == ("cuda", "auto: a GPU for every rank")
    # srun --gpus-per-task=1: each rank sees one GPU, its own
    assert decide("auto", "localsgd", [(1, "GPU-a"), (1, "GPU-b"), (1, "GPU-c")])[0] == "cuda"
    assert decide("auto", "ps", two) == ("cpu", "auto: --strategy ps trains on the CPU")
    assert decide("cuda", "diloco", [(1, "GPU-a")] * 2) == (
        "cuda", "--device cuda; ranks 0 and 1 share a GPU (more ranks than GPUs)")
    with pytest.raises(ValueError, match=r"^--device cuda: rank 1 sees no GPU \(1 of 3 ranks"):
        decide("cuda", "mirrored", [(1, "GPU-a"), (0, None), (1, "GPU-b")])
    with pytest.raises(ValueError, match="--strategy central keeps its parameters in host"):
        decide("cuda", "central", two)


def test_the_default_lr_is_the_data_sets():
    assert TrainSettings(dataset="synthetic").check().lr == 0.01
    assert TrainSettings().check().lr == 0.05
    assert TrainSettings(dataset="pkg.mod:factory").check().lr == 0.05
    assert TrainSettings(dataset="synthetic", lr=0.2).check().lr == 0.2


@pytest.mark.parametrize("kw,match", [
    ({"amp": "fp32"}, "--amp 'fp32': expected one of off, bf16, fp16"),
    ({"device": "gpu"}, "--device 'gpu': expected one of auto, cpu, cuda"),
    ({"amp": "fp16", "strategy": "ps"}, "--amp fp16 scales the loss"),
    ({"amp": "fp16", "zero": True}, "needs --strategy mirrored without --zero"),
    ({"async_checkpoint": True}, "--async-checkpoint needs --checkpoint-dir"),
    ({"ps_lookahead": False}, "--[no-]ps-lookahead only apply to --strategy ps, not mirrored")])
def test_device_amp_and_async_settings_are_checked(kw, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        TrainSettings(**kw).check()
    TrainSettings(amp="bf16", strategy="ps").check()


def test_an_async_writer_copies_the_state_then_writes_it_as_save_does(tmp_path):
    """Note [Asynchronous checkpoints]: the state is copied before submit returns (the live
    tensors may change at once), the write is checkpoint.save's, a failed write is raised
    by the next wait."""
    from mpidp.train.async_checkpoint import Writer
    live = torch.arange(4.0)
    writer = Writer(str(tmp_path), keep=2)
    path = writer.submit({"model": {"w": live}, "epoch": 1}, 7)
    live.add_(100)  # the next step
    writer.wait()
    assert path == checkpoint.path_for(tmp_path, 7)
    assert torch.equal(checkpoint.read(path).state["model"]["w"], torch.arange(4.0))
    for step in (8, 9):
        writer.submit({"model": {"w": live}, "epoch": 1}, step)
    writer.wait()
    assert [p.name for p in checkpoint.existing(tmp_path)] == ["ckpt-000000009.pt",
                                                               "ckpt-000000008.pt"]
    assert writer.write_s > 0
    (tmp_path / "a-file").write_text("")
    gone = Writer(str(tmp_path / "a-file" / "dir"), keep=2)
    gone.submit({"epoch": 1}, 1)
    with pytest.raises(OutputError):
        gone.wait()
    gone.wait()  # the error is raised once
