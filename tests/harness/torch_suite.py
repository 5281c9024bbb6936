"""torch's own distributed test suite on mpidp against gloo (tests/mpi/bodies/body_torch_suite.py
runs it under mpiexec; Note [torch's suite under mpiexec] there): ``compare(n)`` runs it on
each backend at n ranks and says where mpidp falls short of gloo. EXCLUDED is the one place
that lists the tests gloo passes that mpidp is not held to, each with its reason.

As a script, ``python tests/harness/torch_suite.py [-n 3] [NAME ...]`` prints the comparison
(the suite's tier runs it at n = 2); ``--record`` runs gloo's half at n = 2 and writes it to
GLOO_RECORD, which the tier then reads instead of running it (Note [gloo's results recorded])."""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from importlib import metadata
from pathlib import Path

from mpirun import BODIES, RUN_BODY, run

EXCLUDED = {
    "test_get_backend": "asserts that the default group's backend is named as the suite's "
                        "BACKEND, gloo; mpidp's is named mpidp",
}

# mpiexec's environment for both backends: no MASTER_ADDR (mpidp's groups rendezvous over MPI,
# gloo's over a file); torch's repro hint left out of the failures it prints
ENV = {"MASTER_ADDR": None, "MASTER_PORT": None, "PYTORCH_PRINT_REPRO_ON_FAILURE": "0"}


def suite(backend: str, n: int, folder: Path, names=(), timeout_s: float = 900) -> dict:
    """{test: [outcome, detail, seconds]} of torch's suite on ``backend`` at ``n`` ranks, run
    in ``folder``; AssertionError naming the test a launch ended in where it did not finish."""
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / "results.json"
    proc = run(n, [RUN_BODY, BODIES / "body_torch_suite.py", backend, out, *names],
               env=dict(ENV, TEMP_DIR=str(folder)), timeout_s=timeout_s)
    if proc.returncode != 0 or any(f"ok {r}" not in proc.stdout for r in range(n)):
        progress = folder / "progress-0"
        last = progress.read_text().split()[-1:] if progress.exists() else []
        raise AssertionError(f"torch's suite on {backend} at n = {n} ended (exit "
                             f"{proc.returncode}) in {last or 'its set-up'}:\n"
                             f"{(proc.stdout + proc.stderr)[-4000:]}")
    return json.loads(out.read_text())


def shortfalls(gloo: dict, mpidp: dict) -> list:
    """Lines naming each test gloo passes and mpidp does not (EXCLUDED aside), each excluded
    test mpidp now passes (its exclusion is stale), and each test skipped on one backend only
    (both read the suite's gates as gloo's)."""
    lines = []
    for name, (got, detail, _) in sorted(mpidp.items()):
        want = gloo[name][0]
        if name in EXCLUDED:
            if got == "pass":
                lines.append(f"{name}: excluded ({EXCLUDED[name]}) but passes on mpidp")
        elif want == "pass" and got != "pass":
            lines.append(f"{name}: passes on gloo, {got} on mpidp: {detail[-1500:]}")
        elif (want == "skip") != (got == "skip"):
            lines.append(f"{name}: {want} on gloo, {got} on mpidp: {detail[-300:]}")
    return lines


def table(gloo: dict, mpidp: dict) -> str:
    """How many tests passed, were skipped and failed on each backend."""
    counts = {b: Counter(v[0] for v in r.values()) for b, r in (("gloo", gloo),
                                                                ("mpidp", mpidp))}
    seconds = {b: sum(v[2] for v in r.values()) for b, r in (("gloo", gloo),
                                                             ("mpidp", mpidp))}
    return "\n".join(f"{b:6} pass {c['pass']:3}  skip {c['skip']:3}  fail {c['fail']:3}  "
                     f"({seconds[b]:.0f} s in tests)" for b, c in counts.items())


# Note [gloo's results recorded]
# gloo is the reference that says which of torch's tests apply on a CPU at n ranks; with torch
# pinned (the README's test command), what it passes is a property of that torch build, not of
# mpidp, and running it again in every CI run cost a launch of ~18 s. So its results at n = 2
# are recorded in GLOO_RECORD with the torch version they were made with, and read back only
# for that same version, n and the whole suite; any other torch, n or a selection of tests
# runs gloo as before. `python tests/harness/torch_suite.py --record` writes it again.
GLOO_RECORD = Path(__file__).with_name("torch_suite_gloo.json")


def gloo_results(n: int, folder: Path, names=()) -> dict:
    """gloo's results at ``n`` ranks: GLOO_RECORD's where it holds this torch's at ``n`` and
    the whole suite is asked for, else a run (Note [gloo's results recorded])."""
    if not names and GLOO_RECORD.exists():
        record = json.loads(GLOO_RECORD.read_text())
        if (record["torch"], record["n"]) == (metadata.version("torch"), n):
            return record["results"]
    return suite("gloo", n, folder / "gloo", names)


def compare(n: int, folder: Path, names=()) -> tuple:
    """(gloo's results, mpidp's results, shortfalls) at ``n`` ranks."""
    gloo = gloo_results(n, folder, names)
    mpidp = suite("mpidp", n, folder / "mpidp", names)
    return gloo, mpidp, shortfalls(gloo, mpidp)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=3, help="ranks (default 3)")
    parser.add_argument("names", nargs="*", help="tests to run (default: all)")
    parser.add_argument("--record", action="store_true",
                        help="run gloo's half at n = 2 and write it to " + GLOO_RECORD.name)
    args = parser.parse_args()
    if args.record:
        with tempfile.TemporaryDirectory(prefix="torch-suite-") as folder:
            results = suite("gloo", 2, Path(folder))
        GLOO_RECORD.write_text(json.dumps({"torch": metadata.version("torch"), "n": 2,
                                           "results": results}, indent=0, sort_keys=True))
        print(f"{GLOO_RECORD}: {Counter(v[0] for v in results.values())}")
        return 0
    with tempfile.TemporaryDirectory(prefix="torch-suite-") as folder:
        gloo, mpidp, lines = compare(args.n, Path(folder), args.names)
    print(f"torch's distributed_test.py at n = {args.n}:\n{table(gloo, mpidp)}")
    print(f"excluded on mpidp: {len(EXCLUDED)} (tests/harness/torch_suite.py: EXCLUDED)")
    print("\n".join(lines) or "every test gloo passes passes on mpidp")
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main())
