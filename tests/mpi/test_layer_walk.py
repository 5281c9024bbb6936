"""Tier 2: a DDP gradient and a torch.distributed all_reduce reach the C call without a call
back up a layer (tests/mpi/bodies/body_layer_walk.py), on one node (the shared-memory path)
and on emulated nodes of two ranks (the hierarchical path, the header exchange across nodes)."""
import re
from pathlib import Path

import pytest

from mpirun import assert_ok, body

DOCS = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


@pytest.mark.parametrize("n, node_size", [(2, 0), (3, 2)])
def test_no_call_goes_back_up_a_layer(n, node_size):
    proc = body(n, "body_layer_walk.py", env={"MPIDP_EMULATE_NODE_SIZE": str(node_size)},
                timeout_s=180)
    assert_ok(proc, n)
    assert "DDP gradient:" in proc.stdout and "dist.all_reduce:" in proc.stdout, proc.stdout
    if node_size == 0:  # one node: the walks docs/architecture.md lists, module for module
        for what in ("DDP gradient", "dist.all_reduce"):
            ran = re.search(rf"^{re.escape(what)}, the step: (\d+) modules: (.*)$",
                            proc.stdout, re.M)
            assert ran, proc.stdout
            said = re.search(rf"<!-- walk: {re.escape(what)} -->\s*(\d+) Python modules "
                             r"\(([^)]*)\)", DOCS.read_text())
            assert said, f"docs/architecture.md: no count of the {what} walk"
            assert (int(said[1]), sorted(said[2].replace("\n", " ").split(", "))) == \
                (int(ran[1]), sorted(m.removeprefix("mpidp.") for m in ran[2].split(", "))), \
                (what, said[0], ran[0])
