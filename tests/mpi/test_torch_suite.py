"""Tier 2, conformance: torch's own distributed test suite (distributed_test.py, shipped in the
wheel) under mpiexec at n = 2, on gloo as the reference and on mpidp: every test gloo passes
passes on mpidp but those tests/harness/torch_suite.py's EXCLUDED lists with their reasons, and
both skip the same tests (n = 3: ``python tests/harness/torch_suite.py``). gloo's results
for the pinned torch are read from tests/harness/torch_suite_gloo.json (Note [gloo's results
recorded] in tests/harness/torch_suite.py)."""
from torch_suite import EXCLUDED, compare


def test_every_test_gloo_passes_passes_on_mpidp(tmp_path):
    gloo, mpidp, lines = compare(2, tmp_path)
    assert not lines, "\n".join(lines)
    passed = {name for name, v in gloo.items() if v[0] == "pass"}
    assert len(passed) >= 80, f"gloo passed only {len(passed)} of torch's tests: {gloo}"
    assert set(EXCLUDED) <= passed, f"excluded but not passed on gloo: {set(EXCLUDED) - passed}"
