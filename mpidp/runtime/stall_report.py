"""The watchdog's reports in words (Note [Watchdog] in mpidp/runtime/watchdog.py): a stall —
who arrived at the collective, who did not, what each rank is in — and a wait for a rank that
has shut down. Pure functions of the states the watchdog gathered."""
from __future__ import annotations

from typing import Optional, Sequence

COLLECTIVE, ONE_SIDED = 0, 1  # the board's lanes: collectives, one-sided waits


def _ranks(rs: list, silent: tuple = ()) -> str:
    """"ranks 0, 2", a rank in ``silent`` marked as not answering."""
    if not rs:
        return "none"
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(
        f"{r} (no answer)" if r in silent else str(r) for r in rs)


def _state_text(s: Optional[dict], grace_s: float) -> str:
    if s is None:
        return (f"no answer within {grace_s:.0f} s: the process has exited, is stopped, or "
                "holds Python's GIL in a long C call (or its node is unreachable)")
    if s["in"]:
        text = f"in collective #{s['seq']}, {s['what']}, for {s['for_s']:.1f} s"
        return text + (f"; in {s['pwhat']} for {s['pfor_s']:.1f} s" if s["pin"] else "")
    if s["pin"]:
        return f"in {s['pwhat']}, for {s['pfor_s']:.1f} s (its last collective: #{s['seq']})"
    return (f"in no mpidp operation for {min(s['for_s'], s['pfor_s']):.1f} s (its last "
            f"collective: #{s['seq']}): in its own code (computing, loading data, or stalled "
            "there)")


def _lost_nodes(silent: tuple, node_of: Sequence[int], hosts: Sequence[str]) -> list:
    """A line for each node none of whose ranks answered (of several nodes)."""
    lines = []
    for k, host in enumerate(hosts if len(hosts) > 1 else ()):
        ranks = [r for r, node in enumerate(node_of) if node == k]
        if ranks and all(r in silent for r in ranks):
            lines.append(f"  node {host}: no answer from any of its {_ranks(ranks)}: the node "
                         "is lost or unreachable (its processes died, or its network)")
    return lines


def _uneven_inputs(answered: dict) -> list:
    """A hint where some ranks wait in an all-reduce (a gradient's) while others have
    finished (in mpidp's shutdown): uneven inputs."""
    reducing = sorted(r for r, s in answered.items()
                      if s["in"] and str(s["what"]).startswith("allreduce"))
    done = sorted(r for r, s in answered.items()
                  if s["in"] and str(s["what"]).startswith("shutdown"))
    if not reducing or not done:
        return []
    return [f"  uneven inputs? in an all-reduce: {_ranks(reducing)}; finished (in mpidp's "
            f"shutdown): {_ranks(done)}. If ranks have different numbers of batches, wrap the "
            "training loop in `with model.join():` (torch's Join, for mpidp's "
            "DistributedDataParallel and torch's on the mpidp backend)"]


def departed_report(me: int, size: int, host: str, seq: int, what: str, gone: dict) -> str:
    """The message of rank ``me`` (on ``host``) ending the job: its collective number ``seq``
    (``what``, in words) waits for the ranks of ``gone`` (rank -> the last collective it
    completed), which have shut down. Pure."""
    ranks = ", ".join(f"rank {r} (after collective #{last})" for r, last in sorted(gone.items()))
    text = (f"mpidp: rank {me} of {size} on {host}: collective #{seq}, {what}, cannot "
            f"complete: {ranks} {'has' if len(gone) == 1 else 'have'} shut down (mpidp.shutdown, "
            "or the end of its script) without reaching it, and never will; aborting the job\n")
    if what.startswith("allreduce"):
        text += ("  uneven inputs? If ranks run different numbers of batches, wrap the "
                 "training loop in `with model.join():` (docs/troubleshooting.md)\n")
    return text


def report(me: int, lane: int, states: dict, size: int, timeout_s: float, grace_s: float,
           asked: bool, node_of: Sequence[int] = (), hosts: Sequence[str] = ()) -> str:
    """The report of rank ``me``, whose lane ``lane`` stalled, from the states of the ranks
    (rank -> ``Watchdog.state`` dict, None where a rank did not answer); ``node_of`` and
    ``hosts``: the node map (Topology), to name a node whose ranks are all silent. Pure."""
    m = states[me]
    where = f"rank {me} of {size} on {m['host']}"
    limit = f"(MPIDP_TIMEOUT_S={timeout_s:g})"
    lines = []
    answered = {r: s for r, s in states.items() if s is not None}
    silent = tuple(sorted(r for r, s in states.items() if s is None))
    if lane == COLLECTIVE:
        seq = m["seq"]
        lines.append(f"mpidp: watchdog: {where}: collective #{seq}, {m['what']}, has not "
                     f"completed after {m['for_s']:.0f} s {limit}; aborting the job")
        arrived = sorted(r for r, s in answered.items()
                         if s["in"] and s["seq"] == seq and s["what"] == m["what"])
        if asked:
            lines.append(f"  arrived at collective #{seq}: {_ranks(arrived)}")
            lines.append(f"  not arrived: "
                         f"{_ranks(sorted(r for r in states if r not in arrived), silent)}")
    else:
        lines.append(f"mpidp: watchdog: {where}: {m['pwhat']} has waited "
                     f"{m['pfor_s']:.0f} s without progress {limit}; aborting the job")
        busy = sorted(r for r, s in answered.items() if s["in"] or s["pin"])
        if asked:
            lines.append(f"  waiting in an mpidp operation: {_ranks(busy)}")
            lines.append(f"  in their own code (computing, or stalled there): "
                         f"{_ranks(sorted(r for r in answered if r not in busy))}")
        if silent:
            lines.append(f"  no answer: {_ranks(list(silent))}")
    lines += _lost_nodes(silent, node_of, hosts)
    lines += _uneven_inputs(answered)
    if not asked:
        lines.append("  other ranks were not asked: MPI runs below MPI_THREAD_MULTIPLE, so the "
                     "watchdog thread cannot query them")
    for r in sorted(states):
        s = states[r]
        who = f"rank {r} (pid {s['pid']} on {s['host']})" if s is not None else \
            f"rank {r} (on {hosts[node_of[r]]})" if node_of else f"rank {r}"
        lines.append(f"  {who}: {_state_text(s, grace_s)}")
    lines.append("  a rank's Python stack: py-spy dump --pid PID; a longer legitimate wait: "
                 "raise MPIDP_TIMEOUT_S (docs/troubleshooting.md)")
    return "\n".join(lines) + "\n"
