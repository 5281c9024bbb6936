"""Tier 2: settings read at init, not at import, under mpiexec -n 1 (their parsing alone:
tests/unit/test_config_launcher.py)."""
from mpirun import run


def test_import_never_reads_a_bad_value_and_init_raises_it():
    """Note [Settings read at init]: every mpidp module imports with a garbage value set (the
    kernels are chosen, and the timeline switched, later); mpidp.init() raises ConfigError."""
    code = ("import importlib, pkgutil, mpidp\n"
            "for m in pkgutil.walk_packages(mpidp.__path__, 'mpidp.'):\n"
            "    if not m.name.endswith('__main__'):\n"
            "        importlib.import_module(m.name)\n"
            "try:\n    mpidp.init()\n"
            "except mpidp.ConfigError as e:\n"
            "    assert isinstance(e, ValueError); print('init:', e)\n")
    proc = run(1, ["-c", code], env={"MPIDP_TIMEOUT_S": "0", "MPIDP_TIMELINE": None},
               timeout_s=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == "init: MPIDP_TIMEOUT_S='0': must be > 0 and finite", \
        proc.stdout + proc.stderr
