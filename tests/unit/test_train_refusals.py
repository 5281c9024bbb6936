"""Tier 1: every bad input of ``python -m mpidp.train`` that is refused before the first
training collective, checked in one process: one line on stderr, exit code 2, nothing
created. ``cli.main`` itself parses and checks; what ``cli._run`` and ``Trainer.fit`` then
check on every rank (setup.agree) runs here for n virtual ranks without MPI. A few of these
run under ``mpiexec`` too, the whole path (tests/mpi/test_train.py
``test_bad_input_is_one_line_and_exit_code_2``)."""
from pathlib import Path

import pytest

from mpidp import config
from mpidp.train import checkpoint, cli, devices, setup
from mpidp.train.loop import _warn
from mpidp.train.metrics import emit
from mpidp.train.settings import check_world
from mpidp.train.setup import SetupError
from mpidp.workloads.data import ShardSampler

BODIES = Path(__file__).parents[1] / "mpi" / "bodies"  # user_factories.py


def _agreed(n: int, check, name_rank: bool = True):
    """setup.agree on n virtual ranks: ``check(r)`` on each rank r; a ValueError on any
    becomes one SetupError, the first failing rank's message (with its rank where not every
    rank failed, unless ``name_rank`` is False); else rank 0's result."""
    results, failed = [], []
    for r in range(n):
        try:
            results.append(check(r))
        except ValueError as exc:
            failed.append((r, str(exc)))
    if failed:
        r, m = failed[0]
        raise SetupError(m if len(failed) == n or not name_rank else f"rank {r}: {m}")
    return results[0]


def _set_up_on(n: int):
    """A stand-in for ``cli._run`` on n ranks that stops where training would start: the
    checks of cli._run (the number of ranks, model and data, then the banner) and of
    Trainer.fit's set-up (the settings again, the shards, the device on ranks that see no
    GPU, rank 0's outputs, rank 0's resume point), in their order, each agreed as by
    setup.agree; a SetupError ends the job as cli._run does (cli.fail)."""
    def run(s, argv):
        try:
            _agreed(n, lambda r: check_world(s, n))
            model, sets = _agreed(n, lambda r: cli.build(s))
            servers = s.num_ps or 1
            ranks = f"{n} ranks ({n - servers} worker(s), {servers} server(s))" \
                if s.strategy == "ps" else f"{n} rank(s)"
            emit(f"{cli.PROG}: {s.strategy} on {ranks}")  # cli._run's banner
            _agreed(n, lambda r: (s.check(), check_world(s, n)))
            _agreed(n, lambda r: ShardSampler(len(sets.train), r, n, s.seed))
            _agreed(n, lambda r: devices.decide(s.device, s.strategy, [(0, None)] * n))
            _agreed(n, lambda r: setup.check_outputs(s) if r == 0 else None, name_rank=False)
            if s.resume:
                _agreed(n, lambda r: setup.find_resume_point(
                    s, n, model, len(sets.train), _warn) if r == 0 else None, name_rank=False)
        except SetupError as exc:
            cli.fail(str(exc), 0)
        return 0  # set up: the first training collective would come next
    return run


def refused(n: int, argv: list, monkeypatch, capsys) -> tuple:
    """(exit code, stdout, the non-empty lines of stderr) of ``python -m mpidp.train argv``
    on n ranks, which must end before training."""
    monkeypatch.setattr(cli, "_run", _set_up_on(n))
    with pytest.raises(SystemExit) as ended:
        cli.main(argv)
    out, err = capsys.readouterr()
    return ended.value.code, out, [l for l in err.splitlines() if l.strip()]


# (ranks, flags, what the one line says): "{tmp}" is the test's directory, holding "a-file",
# "shared" (mode 0775) and "used" (a checkpoint); "{file}" is its a-file
BAD = [
    (2, ("--batch-size", 0), "--batch-size must be an integer >= 1, got 0"),
    (2, ("--model", "resnet"), "unknown model 'resnet'"),
    (2, ("--model", "no_such_pkg.models:net"), "cannot import 'no_such_pkg.models'"),
    (2, ("--model", "user_factories:not_a_model"), "returned str, not a torch.nn.Module"),
    (2, ("--dataset", "user_factories:nothing"), "has no 'nothing'"),
    (2, ("--resume", "--checkpoint-dir", "{tmp}"), "--resume: no usable checkpoint in"),
    (2, ("--resume",), "--resume needs --checkpoint-dir"),
    (3, ("--dataset", "synthetic", "--synthetic-samples", 2), "3 ranks but only 2 training"),
    (2, ("--strategy", "ps", "--num-ps", 2), "--num-ps 2 needs at least 3 ranks"),
    (1, ("--strategy", "ps", "--checkpoint-dir", "{tmp}/used", "--resume"),
     "--num-ps 1 needs at least 2 ranks"),
    (3, ("--strategy", "ps", "--staleness", -1), "--staleness must be an integer >= 0"),
    (2, ("--num-ps", 1), "--num-ps only apply to --strategy ps, not mirrored"),
    (2, ("--device", "cuda", "--checkpoint-dir", "{tmp}/new"), "--device cuda: rank 0 sees no "
     "GPU (2 of 2 ranks see none)"),
    (2, ("--resume", "--checkpoint-dir", "{tmp}/new"), "--checkpoint-dir {tmp}/new does not "
     "exist, so there is nothing to continue"),
    (2, ("--strategy", "central", "--staleness", 2, "--staleness-lr"),
     "--staleness, --staleness-lr only apply to --strategy ps"),
    (3, ("--strategy", "ps", "--checkpoint-dir", "{tmp}/c", "--checkpoint-every", 3),
     "checkpoints at epoch ends only"),
    (2, ("--straggler", "1x2"), "--straggler '1x2': expected RANK:FACTOR"),
    (2, ("--straggler", "5:2"), "--straggler 5:2: no rank 5 in a job of 2"),
    (2, ("--epochs", "many"), "argument --epochs: invalid int value: 'many'"),
    (2, ("--seed", -1), "--seed must be an integer >= 0, got -1"),
    (2, ("--log-json", "{tmp}/no/such/dir/log.jsonl"), "--log-json"),
    (2, ("--checkpoint-dir", "{tmp}/used"), "holds checkpoints of an earlier run"),
    (2, ("--checkpoint-dir", "{file}"), "cannot create"),
    (1, ("--checkpoint-dir", "{tmp}/shared"), "shared is writable by other users (mode 0775)"),
    (2, ("--checkpoint-every", 5), "--checkpoint-every needs --checkpoint-dir"),
    (2, ("--checkpoint-on-signal",), "--checkpoint-on-signal needs --checkpoint-dir"),
    (3, ("--strategy", "ps", "--checkpoint-dir", "{tmp}/c", "--checkpoint-on-signal"),
     "--checkpoint-on-signal: the parameter server checkpoints at epoch ends only"),
    (2, ("--dataset", "user_factories:broken"), "the factory raised OSError"),
    (2, ("--model", "torch.nn:Linear"), "the factory raised TypeError"),
    (2, ("--algorithm", "tree"), "argument --algorithm: invalid choice: 'tree'"),
    (2, ("--compression", "int8"), "argument --compression: invalid choice: 'int8'"),
    (1, ("--no-such-flag",), "unrecognized arguments: --no-such-flag"),
]


def bad_input_files(tmp_path: Path) -> None:
    """What BAD's {tmp} holds."""
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared").chmod(0o775)
    checkpoint.save(tmp_path / "used", {"model": {}}, 1, keep=1)


def bad_flags(flags, tmp_path: Path) -> list:
    return [str(f).replace("{tmp}", str(tmp_path)).replace("{file}", str(tmp_path / "a-file"))
            for f in flags]


@pytest.mark.parametrize("n,flags,message", BAD, ids=[" ".join(map(str, b[1])) for b in BAD])
def test_bad_input_is_one_line_and_exit_code_2(n, flags, message, tmp_path, monkeypatch,
                                              capsys):
    monkeypatch.syspath_prepend(str(BODIES))
    bad_input_files(tmp_path)
    code, out, errors = refused(n, bad_flags(flags, tmp_path), monkeypatch, capsys)
    assert code == 2, (out, errors)
    assert len(errors) == 1, errors  # one line
    assert errors[0].startswith("mpidp.train: error: ") and \
        message.replace("{tmp}", str(tmp_path)) in errors[0], errors[0]
    assert "Traceback" not in out + "\n".join(errors)
    assert not (tmp_path / "new").exists()  # nothing created by a command that fails
    assert "worker(s)" not in out  # a ps job is refused before its banner counts them


@pytest.mark.parametrize("variable,value,message", [
    ("MPIDP_TIMEOUT_S", "0", "must be > 0 and finite"),
    ("MPIDP_SHM_INLINE_BYTES", "99999", "must be from 0 to 4096"),
    ("MPIDP_EMULATE_NODE_SIZE", "7", "more than the 2 rank(s) of the group"),
])
def test_a_bad_setting_is_one_line_and_exit_code_2(variable, value, message, monkeypatch,
                                                  capsys):
    """Note [Settings read at init] in mpidp/config.py: mpidp.init reads them (its
    _agreed_settings, here on a group of 2: the variable parsed, then the group's size
    checked) and the tool ends with one line (every variable's parsing:
    tests/unit/test_config_launcher.py; one under mpiexec: tests/mpi/test_train.py)."""
    def init():
        config.check_group_size(config.from_env({variable: value}), 2)
        raise AssertionError(f"{variable}={value!r} accepted")

    monkeypatch.setattr(cli.runtime, "init", init)
    with pytest.raises(SystemExit) as ended:
        cli.main(["--epochs", "1"])
    out, err = capsys.readouterr()
    errors = [l for l in err.splitlines() if l.strip()]
    assert ended.value.code == 2, (out, err)
    assert len(errors) == 1, err  # one line
    assert errors[0].startswith(f"mpidp.train: error: {variable}={value!r}: ") and \
        message in errors[0], errors[0]
    assert "Traceback" not in out + err
