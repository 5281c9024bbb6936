"""Parameter server: the shard map and the window layout alone (tier 1); the windows under
mpiexec: tests/mpi/test_ps_runs.py."""
import numpy as np
import pytest

from mpidp.modes.ps import Layout, shard_map


@pytest.mark.parametrize("counts,servers", [([5, 1, 7, 3, 11], 1), ([5, 1, 7, 3, 11], 2),
                                            ([5, 1, 7, 3, 11], 4), ([3], 5), ([2, 1], 7),
                                            ([1000, 1, 999, 17], 3), ([0, 4, 0], 2)])
def test_shard_map_covers_every_element_once_balanced(counts, servers):
    shards = shard_map(counts, servers)
    assert len(shards) == servers
    seen = [np.zeros(c, np.int64) for c in counts]
    sizes = []
    for pieces in shards:
        at = 0
        for t, offset, n, shard_offset in pieces:
            assert n > 0 and shard_offset == at  # pieces back to back in the shard
            seen[t][offset:offset + n] += 1
            at += n
        sizes.append(at)
    assert all((s == 1).all() for s in seen)
    assert max(sizes) - min(sizes) <= 1  # balanced by bytes (one dtype: by elements)


def test_shard_map_rejects_no_servers():
    with pytest.raises(ValueError, match="servers must be >= 1"):
        shard_map([3], 0)


def test_window_layout_is_aligned():
    lay = Layout(count=7, workers=3)
    assert lay.control.offset == 0 and lay.params.offset % 8 == 0 and lay.grads.offset % 8 == 0
    assert lay.grads.offset >= lay.params.offset + 7 * 4 and lay.nbytes >= lay.grads.offset + 28
    assert len({lay.pending(2), lay.applied(0), lay.done(1)}) == 3
