"""A/B of two builds of mpidp: each revision built once in a directory of its own, one named
benchmark run in alternating launches (A B, B A, A B, ...), and per figure the medians of A and
B, the ratio B/A of each pair, its median and its spread across pairs. Run from a checkout with
its venv (the builds reuse that venv's torch, mpi4py and MPICH):

    python bench/ab.py guard A B [--pairs 4] [--only NAME,...] [--json FILE]
    python bench/ab.py run A B --bench NAME [--pairs 4]
    python bench/ab.py run A B --command 'TEMPLATE' --figure 'NAME=SPEC' [--better higher]
    python bench/ab.py list

A and B: any commit-ish (main, HEAD~1, a sha) or WORKTREE, this checkout's working tree
(tracked and untracked files that git does not ignore). A commit is built once: ``git
archive`` into ``~/.cache/mpidp-ab/<sha>`` (``MPIDP_AB_CACHE`` moves it), then ``setup.py
build_ext --inplace`` there with this venv's python; WORKTREE is copied and rebuilt on every
run. A launch runs with ``PYTHONPATH`` set to its build, so ``import mpidp`` and its ``_ext``
resolve there (each build is checked for that before it is used; ``MPIDP_REQUIRE_EXTENSION``
is set, so a missing extension fails the launch instead of timing the numpy twin).

A TEMPLATE is one command, split as a shell would, with {python} (this venv's), {mpiexec}
(the one beside it), {tree} (the build's directory: the launch's working directory), {driver}
(this checkout: scripts kept the same for A and B, e.g.
{driver}/bench/collectives/dist_latency.py) and {json} (a fresh file per launch for the command to write). A figure SPEC selects one number
from that JSON: a path such as ``rows[size=8,algorithm=auto].in_place.time_us.avg`` (``[k=v,...]``
picks the one list element with those values, ``[2]`` an index), or ``PATH / PATH`` (a ratio
within one launch, e.g. against MPI_Allreduce in the same launch), or ``re:REGEX``, the first
group of REGEX's first match in the launch's output. The reading rule (what a drop is on a
noisy machine) is in docs/benchmarks.md; the guard set in bench/ab_guard.py.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from ab_figures import MIN_PAIRS, TOLERANCE, Bench, Figure, extract, same, schedule, select, \
    summarize, table  # this script's sibling, as ab_guard

DRIVER = Path(__file__).resolve().parents[1]  # the checkout this script runs from
WORKTREE = "WORKTREE"


class ABError(Exception):
    """A build or a launch that failed; the message names it."""


# -- builds -------------------------------------------------------------------------------------

@dataclass
class Build:
    """One revision built in ``tree``: ``label`` as given, ``sha`` (None for WORKTREE)."""
    label: str
    sha: Optional[str]
    tree: Path
    describe: str = ""
    seconds: float = 0.0


def _git(*args: str, stdout=subprocess.PIPE, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(DRIVER), *args], stdout=stdout, check=True, **kw)


def resolve(rev: str) -> Optional[str]:
    """The commit's full sha, None for WORKTREE; ABError naming an unknown revision."""
    if rev == WORKTREE:
        return None
    got = subprocess.run(["git", "-C", str(DRIVER), "rev-parse", "--verify", "--quiet",
                          f"{rev}^{{commit}}"], capture_output=True, text=True)
    if got.returncode != 0:
        raise ABError(f"{rev!r} is not a commit here (nor {WORKTREE})")
    return got.stdout.strip()


def cache_dir() -> Path:
    return Path(os.environ.get("MPIDP_AB_CACHE", Path.home() / ".cache" / "mpidp-ab"))


def launch_env(tree: Path, python: str) -> dict:
    """This process's environment with ``tree`` as the only PYTHONPATH entry, the venv's bin
    first on PATH and the C extension required."""
    env = dict(os.environ, PYTHONPATH=str(tree), MPIDP_REQUIRE_EXTENSION="1")
    env["PATH"] = os.path.dirname(python) + os.pathsep + env.get("PATH", "")
    return env


def _compile_and_check(tree: Path, python: str) -> None:
    got = subprocess.run([python, "setup.py", "-q", "build_ext", "--inplace"], cwd=tree,
                         capture_output=True, text=True, env=launch_env(tree, python))
    if got.returncode != 0:
        raise ABError(f"building {tree} failed:\n{(got.stdout + got.stderr)[-3000:]}")
    check_import(tree, python)


def check_import(tree: Path, python: str) -> None:
    """ABError unless ``import mpidp`` and ``mpidp._ext`` resolve inside ``tree`` under
    launch_env (an editable install of another checkout must not win)."""
    probe = ("import json, mpidp, mpidp._ext; "
             "print(json.dumps([mpidp.__file__, mpidp._ext.__file__]))")
    got = subprocess.run([python, "-c", probe], cwd=tree, capture_output=True, text=True,
                         env=launch_env(tree, python))
    if got.returncode != 0:
        raise ABError(f"import mpidp from {tree} failed:\n{got.stderr[-2000:]}")
    for f in json.loads(got.stdout.strip().splitlines()[-1]):
        if not Path(f).resolve().is_relative_to(tree.resolve()):
            raise ABError(f"import mpidp from {tree} found {f} instead")


def build(rev: str, python: str, log=print) -> Build:
    """``rev`` built in a directory of its own (a commit once per sha; WORKTREE every time)."""
    sha = resolve(rev)
    t0 = time.perf_counter()
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    if sha is None:
        tree = root / ("worktree-" + hashlib.sha1(str(DRIVER).encode()).hexdigest()[:10])
        shutil.rmtree(tree, ignore_errors=True)
        names = _git("ls-files", "-z", "-co", "--exclude-standard").stdout.decode().split("\0")
        for name in filter(None, names):
            src = DRIVER / name
            if src.is_file():  # a tracked file deleted in the working tree is left out
                (tree / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, tree / name)
        head = _git("rev-parse", "--short", "HEAD", text=True).stdout.strip()
        dirty = _git("status", "--porcelain", text=True).stdout.strip()
        describe = f"working tree of {DRIVER} (HEAD {head}{', changed' if dirty else ''})"
        log(f"ab: building {rev} in {tree}")
        _compile_and_check(tree, python)
    else:
        tree = root / sha
        describe = _git("log", "-1", "--format=%h %cs %s", sha, text=True).stdout.strip()[:90]
        if not (tree / ".ab-built").exists():
            log(f"ab: building {rev} ({sha[:10]}) in {tree}")
            shutil.rmtree(tree, ignore_errors=True)  # an unfinished build of an earlier run
            work = Path(tempfile.mkdtemp(prefix=f"{sha}.", dir=root))
            try:
                archive = subprocess.Popen(["git", "-C", str(DRIVER), "archive", sha],
                                           stdout=subprocess.PIPE)
                subprocess.run(["tar", "-x", "-C", str(work)], stdin=archive.stdout,
                               check=True)
                if archive.wait() != 0:
                    raise ABError(f"git archive {sha} failed")
                _compile_and_check(work, python)
                (work / ".ab-built").write_text(describe + "\n")
                work.rename(tree)  # complete or absent: a build is used only once stamped
            except OSError:
                if not (tree / ".ab-built").exists():  # else another run finished it first
                    raise
            finally:
                shutil.rmtree(work, ignore_errors=True)
        check_import(tree, python)
    return Build(rev, sha, tree, describe, time.perf_counter() - t0)


# -- launches -----------------------------------------------------------------------------------

def command_for(template: str, build: Build, python: str, json_path: Path) -> list:
    """The template's words with its placeholders filled in for ``build``."""
    mpiexec = os.path.join(os.path.dirname(python), "mpiexec")
    values = {"python": python, "tree": str(build.tree), "driver": str(DRIVER),
              "json": str(json_path),
              "mpiexec": mpiexec if os.path.exists(mpiexec) else "mpiexec"}
    return [word.format(**values) for word in shlex.split(template)]


def launch(bench: Bench, build: Build, python: str, timeout_s: float) -> tuple:
    """Runs ``bench`` once on ``build``: (its figures in order, seconds)."""
    with tempfile.TemporaryDirectory(prefix="mpidp-ab-") as scratch:
        out = Path(scratch) / "figures.json"
        argv = command_for(bench.command, build, python, out)
        t0 = time.perf_counter()
        try:
            got = subprocess.run(argv, cwd=build.tree, env=launch_env(build.tree, python),
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise ABError(f"{bench.name} on {build.label}: no end after {timeout_s:.0f} s: "
                          f"{shlex.join(argv)}") from None
        seconds = time.perf_counter() - t0
        if got.returncode != 0:
            raise ABError(f"{bench.name} on {build.label}: exit {got.returncode}: "
                          f"{shlex.join(argv)}\n{got.stdout[-3000:]}")
        doc = json.loads(out.read_text()) if out.exists() else None
    try:
        for path, want in bench.expect:
            have = select(doc, path) if doc is not None else None
            if not same(have, str(want)):
                raise ValueError(f"{path} is {have!r}, expected {want!r}")
        return [extract(f.spec, doc, got.stdout) for f in bench.figures], seconds
    except ValueError as exc:
        raise ABError(f"{bench.name} on {build.label}: {exc}") from None


def unmet(bench: Bench) -> Optional[str]:
    """Why ``bench`` cannot run here (the emulated cluster's own check), or None."""
    if bench.needs != "root":
        return None
    sys.path.insert(0, str(DRIVER / "tests" / "harness"))
    try:
        from multinode_cluster import unavailable  # the cluster's own check
    finally:
        sys.path.pop(0)
    return unavailable()


@dataclass
class Run:
    """What a run gathered: per bench, per build label, one list of figures per pair."""
    values: dict = field(default_factory=dict)
    failed: dict = field(default_factory=dict)
    skipped: dict = field(default_factory=dict)
    launches: list = field(default_factory=list)


def run_pairs(benches: Sequence[Bench], builds: dict, pairs: int, python: str,
              timeout_s: float, log=print) -> Run:
    """Every bench in every pair, each pair's two launches in schedule's order; a bench that
    fails once is dropped from the rest of the run (and reported)."""
    run = Run()
    for bench in benches:
        reason = unmet(bench)
        if reason:
            run.skipped[bench.name] = reason
            log(f"ab: skipping {bench.name}: {reason}")
        else:
            run.values[bench.name] = {"A": [], "B": []}
    for i, order in enumerate(schedule(pairs)):
        for bench in benches:
            if bench.name not in run.values:
                continue
            for side in order:
                b = builds[side]
                try:
                    figures, seconds = launch(bench, b, python, timeout_s)
                except ABError as exc:
                    run.failed[bench.name] = str(exc)
                    del run.values[bench.name]
                    log(f"ab: {exc}")
                    break
                run.values[bench.name][side].append(figures)
                run.launches.append({"pair": i, "bench": bench.name, "build": side,
                                     "seconds": seconds, "figures": figures})
                log(f"ab: pair {i + 1}/{pairs} {bench.name} {side} ({b.label}): {seconds:.1f} s")
    return run


def results(benches: Sequence[Bench], run: Run, tolerance: float) -> list:
    rows = []
    for bench in benches:
        got = run.values.get(bench.name)
        if not got:
            continue
        for k, fig in enumerate(bench.figures):
            rows.append(summarize(fig, [v[k] for v in got["A"]], [v[k] for v in got["B"]],
                                  tolerance))
    return rows


def header(builds: dict, pairs: int, load: tuple) -> str:
    order = " ".join("".join(o) for o in schedule(pairs))
    return (f"# A = {builds['A'].label}: {builds['A'].describe}\n"
            f"# B = {builds['B'].label}: {builds['B'].describe}\n"
            f"# {pairs} pairs of launches, order {order}; {socket.gethostname()}, "
            f"{os.cpu_count()} CPUs, load average {load[0]:.1f} at start, {load[1]:.1f} at end; "
            f"{time.strftime('%Y-%m-%d %H:%M')}\n"
            "# ratio = B/A per pair (time: < 1 is B faster; rate: > 1 is B faster); verdict "
            f"'B worse'/'B better': median beyond ±{{tol}}, every pair on that side of 1 and "
            f"{MIN_PAIRS} pairs or more; with '?': the pairs disagree or are too few")


def main(argv: Optional[Sequence[str]] = None) -> int:
    import ab_guard  # the named benchmarks (this script's sibling)
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python bench/ab.py",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    sub.add_parser("list", help="the named benchmarks and the guard set")
    for name in ("guard", "run"):
        s = sub.add_parser(name, help="the guard figures, A/B" if name == "guard" else
                           "one benchmark, A/B")
        s.add_argument("a", metavar="A", help=f"commit-ish or {WORKTREE}")
        s.add_argument("b", metavar="B", help=f"commit-ish or {WORKTREE}")
        s.add_argument("--pairs", type=int, default=ab_guard.PAIRS,
                       help=f"pairs of launches (default {ab_guard.PAIRS})")
        s.add_argument("--json", metavar="FILE", help="write every value and summary as JSON")
        s.add_argument("--tolerance", type=float, default=TOLERANCE,
                       help=f"median ratio counted level within this (default {TOLERANCE})")
        s.add_argument("--timeout", type=float, default=600, help="seconds per launch")
        s.add_argument("--python", default=sys.executable,
                       help="the venv python the builds and launches use (default this one)")
    guard, one = sub.choices["guard"], sub.choices["run"]
    guard.add_argument("--only", help="comma-separated benchmark names instead of the guard "
                       "set (python bench/ab.py list), e.g. one figure's bench to confirm it")
    one.add_argument("--bench", help="a named benchmark (python bench/ab.py list)")
    one.add_argument("--command", help="a launch TEMPLATE (see above) instead of --bench")
    one.add_argument("--figure", action="append", default=[], metavar="NAME=SPEC",
                     help="with --command: a figure to read (repeatable)")
    one.add_argument("--better", default="lower", choices=("lower", "higher"),
                     help="with --command: which way the figures are better")
    args = p.parse_args(argv)
    named = {b.name: b for b in ab_guard.BENCHES}
    if args.what == "list":
        for b in ab_guard.BENCHES:
            mark = "guard" if b.name in ab_guard.GUARD else "     "
            print(f"{mark} {b.name:18s} {b.about}\n{'':24s}{b.command}")
            for f in b.figures:
                print(f"{'':26s}{f.name} [{f.unit}, {f.better}]: {f.spec}")
        return 0
    if args.what == "guard":
        wanted = args.only.split(",") if args.only else list(ab_guard.GUARD)
        unknown = [w for w in wanted if w not in named]
        if unknown:
            p.error(f"--only {','.join(unknown)}: accepted {','.join(named)}")
        benches = [named[w] for w in wanted]
    elif args.bench:
        if args.bench not in named:
            p.error(f"--bench {args.bench}: accepted {', '.join(named)}")
        benches = [named[args.bench]]
    elif args.command and args.figure:
        try:
            figures = tuple(Figure(*f.split("=", 1), better=args.better) for f in args.figure)
        except TypeError:
            p.error("--figure takes NAME=SPEC")
        benches = [Bench("command", args.command, figures)]
    else:
        p.error("run needs --bench NAME, or --command TEMPLATE with one or more --figure")
    if args.pairs < 1:
        p.error(f"--pairs {args.pairs}: expected 1 or more")
    log = lambda line: print(line, file=sys.stderr, flush=True)
    try:
        builds = {"A": build(args.a, args.python, log), "B": build(args.b, args.python, log)}
    except (ABError, subprocess.CalledProcessError) as exc:
        print(f"ab: {exc}", file=sys.stderr)
        return 2
    load0 = os.getloadavg()[0]
    run = run_pairs(benches, builds, args.pairs, args.python, args.timeout, log)
    rows = results(benches, run, args.tolerance)
    text = header(builds, args.pairs, (load0, os.getloadavg()[0])).replace(
        "{tol}", f"{args.tolerance:.0%}")
    print(text + "\n\n" + table(rows))
    for name, why in list(run.skipped.items()) + list(run.failed.items()):
        print(f"\n{name}: not measured: {why.splitlines()[0]}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "header": text, "builds": {k: {"label": v.label, "sha": v.sha, "tree": str(v.tree),
                                           "describe": v.describe} for k, v in builds.items()},
            "pairs": args.pairs, "summary": rows, "launches": run.launches,
            "skipped": run.skipped, "failed": run.failed}, indent=1) + "\n")
    return 1 if run.failed else 0


if __name__ == "__main__":
    sys.modules.setdefault("ab", sys.modules[__name__])  # one copy for ab_guard's import
    sys.exit(main())
