"""The benchmark's pure helpers (sizes, sweeps, rotation); the real sweeps under mpiexec:
tests/mpi/test_bench_runs.py."""
import pytest

from mpidp.bench.harness import format_size, parse_size, rotation, sweep


def test_sizes():
    assert parse_size("8") == 8 and parse_size("4K") == 4096 and parse_size("64M") == 64 << 20
    assert format_size(256 << 20) == "256M"
    with pytest.raises(ValueError, match="suffix"):
        parse_size("12Q")
    assert sweep(8, 64, 2, 4) == [8, 16, 32, 64]
    assert sweep(1, 8, 4, 4) == [4, 4]  # rounded up to one whole element
    with pytest.raises(ValueError):
        sweep(64, 8, 2, 4)
    assert rotation(8) == 64 and rotation(256 << 20) == 1
