"""What the timeline costs per call site, off and on (Note [Timeline cost] in
mpidp/runtime/timeline.py): ``python bench/overhead/timeline_overhead.py`` (one process, no
MPI). Prints ns per call, the median of ``--repeats`` runs of ``--calls`` calls each, minus an empty loop's time."""
from __future__ import annotations

import argparse
import statistics
import time

from mpidp.runtime import timeline


def per_call_ns(body, calls: int, repeats: int) -> float:
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        body(calls)
        runs.append((time.perf_counter_ns() - t0) / calls)
    return statistics.median(runs)


def loop_empty(n):
    for _ in range(n):
        pass


def loop_span(n):
    span = timeline.span
    for _ in range(n):
        with span("allreduce"):
            pass


def loop_instant(n):
    instant = timeline.instant
    for _ in range(n):
        instant("bucket ready")


def loop_guarded_instant(n):
    for _ in range(n):
        if timeline.ON:
            timeline.instant("bucket ready", {"bucket": 0, "bytes": 4096})


def work():
    return None


def loop_call(fn):
    def run(n):
        for _ in range(n):
            fn()
    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--calls", type=int, default=200_000)
    p.add_argument("--repeats", type=int, default=7)
    a = p.parse_args()
    rows = []
    for state in (False, True):
        timeline.ON = state
        traced = timeline.traced("allreduce")(work)  # decided at decoration, as at import
        empty = per_call_ns(loop_empty, a.calls, a.repeats)
        plain = per_call_ns(loop_call(work), a.calls, a.repeats) - empty
        for name, body in (("with span(...)", loop_span), ("instant(...)", loop_instant),
                           ("if ON: instant(..., args)", loop_guarded_instant),
                           ("@traced function call", loop_call(traced))):
            cost = per_call_ns(body, a.calls, a.repeats) - empty
            if name.startswith("@traced"):
                cost -= plain  # the call itself is not the timeline's
            rows.append(("on" if state else "off", name, cost))
            timeline._events.clear()
    print(f"# timeline cost per call, ns (median of {a.repeats} x {a.calls:,} calls, "
          "an empty loop subtracted)")
    print(f"{'timeline':<9} {'call site':<28} {'ns/call':>8}")
    for state, name, cost in rows:
        print(f"{state:<9} {name:<28} {cost:8.0f}")


if __name__ == "__main__":
    main()
