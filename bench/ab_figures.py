"""The pure parts of bench/ab.py: what a benchmark and a figure are, reading a figure from a
launch's JSON or output, the order of launches, and the per-pair ratios, their medians and
spread, the verdict and the table. No git, no builds, no launches (tests/unit/test_ab.py)."""
from __future__ import annotations

import re
import statistics
from dataclasses import dataclass
from typing import Sequence

TOLERANCE = 0.05  # a median ratio within 5% of 1 is "level" (docs/benchmarks.md)
MIN_PAIRS = 4  # fewer pairs give no firm verdict: 2 of 2 agree by chance half the time


@dataclass(frozen=True)
class Figure:
    """One number per launch: ``spec`` (bench/ab.py's doc) selects it; ``better`` says which
    way is better ("lower" for times, "higher" for rates); ``unit`` is for the table."""
    name: str
    spec: str
    better: str = "lower"
    unit: str = ""

    def __post_init__(self):
        if self.better not in ("lower", "higher"):
            raise ValueError(f"figure {self.name!r}: better={self.better!r}; accepted: lower, "
                             "higher")


@dataclass(frozen=True)
class Bench:
    """One launch command and the figures read from each launch; ``expect``: (path, value)
    pairs every launch's JSON must hold (e.g. that it ran on 2 nodes); ``needs``: "root" for
    the emulated cluster."""
    name: str
    command: str
    figures: tuple
    expect: tuple = ()
    needs: str = ""
    about: str = ""


_SEGMENT = re.compile(r"([^.\[\]]*)((?:\[[^\]]*\])*)")


def _split_path(path: str) -> list:
    """'rows[size=8].in_place.time_us' -> [('rows', ['size=8']), ('in_place', []), ...]."""
    out, at = [], 0
    text = path.strip()
    while True:
        m = _SEGMENT.match(text, at)
        key, brackets = m.group(1), re.findall(r"\[([^\]]*)\]", m.group(2))
        if not key and not brackets:
            raise ValueError(f"figure path {path!r}: empty segment at character {at}")
        out.append((key, brackets))
        at = m.end()
        if at == len(text):
            return out
        if text[at] != ".":
            raise ValueError(f"figure path {path!r}: unexpected {text[at]!r} at character {at}")
        at += 1


def same(value, text: str) -> bool:
    """Whether a JSON value equals ``text`` as written in a path (8 matches 8.0)."""
    if str(value) == text:
        return True
    try:
        return float(value) == float(text)
    except (TypeError, ValueError):
        return False


def select(doc, path: str):
    """The value at ``path`` in a JSON document (bench/ab.py's doc); ValueError naming the
    path and what was there when nothing, or more than one element, matches."""
    node = doc
    for key, brackets in _split_path(path):
        if key:
            if not isinstance(node, dict) or key not in node:
                have = ", ".join(map(str, node)) if isinstance(node, dict) else type(node).__name__
                raise ValueError(f"figure path {path!r}: no key {key!r} (there: {have})")
            node = node[key]
        for b in brackets:
            if not isinstance(node, list):
                raise ValueError(f"figure path {path!r}: [{b}] on a {type(node).__name__}")
            if re.fullmatch(r"-?\d+", b.strip()):
                i = int(b)
                if not -len(node) <= i < len(node):
                    raise ValueError(f"figure path {path!r}: index {i} of {len(node)} elements")
                node = node[i]
                continue
            terms = [t.split("=", 1) for t in b.split(",")]
            if any(len(t) != 2 for t in terms):
                raise ValueError(f"figure path {path!r}: [{b}]: expected an index or k=v,...")
            hits = [e for e in node if isinstance(e, dict)
                    and all(k.strip() in e and same(e[k.strip()], v.strip()) for k, v in terms)]
            if len(hits) != 1:
                raise ValueError(f"figure path {path!r}: [{b}] matches {len(hits)} of "
                                 f"{len(node)} elements (expected one)")
            node = hits[0]
    return node


def extract(spec: str, doc, output: str) -> float:
    """The figure ``spec`` names, from a launch's JSON ``doc`` (None if it wrote none) and its
    text ``output``."""
    if spec.startswith("re:"):
        m = re.search(spec[3:], output, re.MULTILINE)
        if not m:
            raise ValueError(f"figure {spec!r}: no match in the launch's output")
        return float(m.group(1) if m.groups() else m.group(0))
    if doc is None:
        raise ValueError(f"figure {spec!r}: the launch wrote no JSON (does the command use "
                         "{json}?)")
    parts = spec.split(" / ")
    if len(parts) > 2:
        raise ValueError(f"figure {spec!r}: at most one ' / '")
    values = [float(select(doc, p)) for p in parts]
    return values[0] / values[1] if len(values) == 2 else values[0]


def schedule(pairs: int) -> list:
    """The order of each pair's two launches: A B, then B A, alternately (A B B A A B ...), so
    that a drift over the run and whatever the first launch of a pair pays fall on both
    builds alike."""
    if pairs < 1:
        raise ValueError(f"pairs={pairs}: expected 1 or more")
    return [("A", "B") if i % 2 == 0 else ("B", "A") for i in range(pairs)]


def verdict(ratios: Sequence[float], better: str, tolerance: float = TOLERANCE,
            min_pairs: int = MIN_PAIRS) -> str:
    """'B worse' or 'B better': the median ratio beyond ``tolerance``, every pair on that side
    of 1, and at least ``min_pairs`` pairs; the same with '?' where the median is beyond it but
    the pairs disagree or are too few (rerun with more pairs); else 'level'."""
    worse = [r if better == "lower" else 1 / r for r in ratios]  # > 1: B worse
    med = statistics.median(worse)
    enough = len(worse) >= min_pairs
    if med > 1 + tolerance:
        return "B worse" if enough and min(worse) > 1 else "B worse?"
    if med < 1 / (1 + tolerance):
        return "B better" if enough and max(worse) < 1 else "B better?"
    return "level"


def summarize(figure: Figure, a: Sequence[float], b: Sequence[float],
              tolerance: float = TOLERANCE) -> dict:
    """Medians of A and B, the per-pair ratios B/A, their median, min and max, and the
    verdict; ``a`` and ``b`` hold one value per pair, in pair order."""
    if len(a) != len(b) or not a:
        raise ValueError(f"figure {figure.name!r}: {len(a)} A and {len(b)} B values")
    ratios = [y / x for x, y in zip(a, b)]
    return {"figure": figure.name, "unit": figure.unit, "better": figure.better,
            "a": list(a), "b": list(b), "a_median": statistics.median(a),
            "b_median": statistics.median(b), "ratios": ratios,
            "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
            "ratio_max": max(ratios), "verdict": verdict(ratios, figure.better, tolerance)}


def _num(x: float) -> str:
    ax = abs(x)
    return f"{x:.0f}" if ax >= 100 else f"{x:.1f}" if ax >= 10 else f"{x:.2f}" if ax >= 0.1 \
        else f"{x:.3g}"


def table(rows: Sequence[dict]) -> str:
    """A Markdown table, one line per figure (summarize's dicts)."""
    lines = ["| figure | A | B | B/A median | B/A min–max | pairs | verdict |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        unit = f"{r['unit']}, " if r["unit"] else ""
        lines.append(f"| {r['figure']} ({unit}{r['better']} is better) | {_num(r['a_median'])} "
                     f"| {_num(r['b_median'])} | {r['ratio_median']:.2f} | "
                     f"{r['ratio_min']:.2f}–{r['ratio_max']:.2f} | {len(r['ratios'])} | "
                     f"{r['verdict']} |")
    return "\n".join(lines)
