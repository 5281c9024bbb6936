"""What the doctor reports: findings (OK, WARN, FAIL or SKIP, each problem with its fix), the
rule that turns every rank's probe value into a check's findings, and the one-screen report.
Pure: nothing here communicates or reads the environment."""
from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

OK, WARN, FAIL, SKIP, INFO = "OK", "WARN", "FAIL", "SKIP", ""


class Finding(NamedTuple):
    status: str   # OK, WARN, FAIL, SKIP, or INFO ("") for a plain line
    text: str
    fix: str = ""


class Raised(NamedTuple):
    """A probe raised on a rank (the doctor goes on: every rank still runs every check)."""
    error: str


class Skipped(NamedTuple):
    """A probe that does not apply (say, mpidp.init failed before it)."""
    reason: str


def rank_list(ranks: Sequence[int]) -> str:
    """'rank 3' or 'ranks 0-2, 5' (sorted, consecutive runs joined)."""
    rs = sorted(set(ranks))
    runs, start = [], None
    for i, r in enumerate(rs):
        if start is None:
            start = r
        if i + 1 == len(rs) or rs[i + 1] != r + 1:
            runs.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(runs)


def by_value(values: Sequence, key: Callable = lambda v: v) -> dict:
    """{key(value): [ranks with it]}, in order of first appearance."""
    out: dict = {}
    for r, v in enumerate(values):
        out.setdefault(key(v), []).append(r)
    return out


def judge(verdict: Callable[[list], list], values: list) -> list:
    """The findings of one check from every rank's value: a FAIL per distinct exception text
    (naming the ranks) if any rank raised, a SKIP if every rank skipped, else ``verdict``'s
    (and a verdict that itself raises is a FAIL, never the doctor's end)."""
    raised = by_value([v.error if isinstance(v, Raised) else None for v in values])
    raised.pop(None, None)
    if raised:
        return [Finding(FAIL, f"{rank_list(rs)}: {err}", "an unexpected error in this check: "
                        "if the message does not point at the cause, report it with this "
                        "output")
                for err, rs in raised.items()]
    skipped = [v for v in values if isinstance(v, Skipped)]
    if skipped:
        return [Finding(SKIP, skipped[0].reason)]
    try:
        return verdict(values)
    except Exception as exc:  # a bug in a verdict must not hide the other checks
        return [Finding(FAIL, f"the doctor could not judge this check: "
                              f"{type(exc).__name__}: {exc}")]


# ---- the report -----------------------------------------------------------------------------

def format_report(title: str, sections: Sequence[tuple]) -> str:
    """The report: ``title``, then each (section, findings) with a status column and each
    fix on the next line, then the totals."""
    lines = [title]
    for name, findings in sections:
        lines.append(name)
        lines.extend(format_findings(findings))
    lines.append(summary_line(sections))
    return "\n".join(lines)


def format_findings(findings: Sequence[Finding]) -> list:
    lines = []
    for f in findings:
        lines.append(f"  {f.status:<5} {f.text}")
        if f.fix:
            lines.append(f"        fix: {f.fix}")
    return lines


def summary_line(sections: Sequence[tuple]) -> str:
    counts = {s: 0 for s in (OK, WARN, FAIL, SKIP)}
    for _, findings in sections:
        for f in findings:
            if f.status in counts:
                counts[f.status] += 1
    verdict = "problems found" if counts[FAIL] else "ready"
    return (f"{verdict}: {counts[OK]} OK, {counts[WARN]} WARN, {counts[FAIL]} FAIL, "
            f"{counts[SKIP]} SKIP")


def exit_code(sections: Sequence[tuple]) -> int:
    """0 when nothing failed, 1 otherwise."""
    return int(any(f.status == FAIL for _, findings in sections for f in findings))
