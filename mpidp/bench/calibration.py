"""Calibrating the scale model (mpidp/bench/costs.py) from the JSON that ``python -m
mpidp.bench allreduce --json`` writes: one alpha-beta-gamma fit per algorithm, its error, and
what the CPU-host systems of the predictions take from it."""
from __future__ import annotations

import json
import math
from pathlib import Path

from . import costs

FITTED = ("ring", "mpi", "shm", "hier", "doubling", "nccl")
# Without --calibrate: this machine's figures from bench/RESULTS.md (2 ranks, 2026-11-21)
DEFAULT_HOST = {"gamma_s_per_byte": 1 / 6.17e9, "ring_alpha_s": 11e-6, "node_alpha_s": 3e-6,
                "node_beta_s_per_byte": 1 / 11.53e9, "source": "bench/RESULTS.md"}


def load_measurements(path) -> dict:
    """The JSON that `mpidp.bench allreduce --json` wrote, checked; ValueError naming the file."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"calibration file {str(path)!r}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"calibration file {str(path)!r}: cannot read it ({exc})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"calibration file {str(path)!r}: not JSON ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list) or not data["rows"]:
        raise ValueError(f"calibration file {str(path)!r}: no 'rows' (write one with "
                         "`python -m mpidp.bench allreduce --json FILE`)")
    n, k = data.get("nranks"), data.get("nodes", 1)
    if not isinstance(n, int) or not isinstance(k, int) or n < 1 or k < 1 or n % k:
        raise ValueError(f"calibration file {str(path)!r}: nranks {n!r} and nodes {k!r} must be "
                         "integers >= 1, nranks a multiple of nodes")
    return data


def calibration_terms(algorithm: str, nbytes: int, nranks: int, nodes: int,
                      piece_bytes: int, short_bytes: int) -> costs.Terms:
    """The formula of one measured row (one machine: MPICH sees emulated nodes as one)."""
    if algorithm == "nccl":
        return costs.ring(nbytes, nranks)
    if algorithm == "ring":
        return costs.ring(nbytes, nranks, costs.ring_segments(nbytes, nranks, piece_bytes))
    if algorithm == "mpi":
        return costs.mpich(nbytes, nranks, short_bytes)
    if algorithm == "shm":
        return costs.shm(nbytes, nranks)
    if algorithm == "doubling":  # shm in each node, doubling among the leaders, node broadcast
        per_node = nranks // nodes
        if per_node == 1:
            return costs.recursive_doubling(nbytes, nranks)
        return costs.total(costs.shm(nbytes, per_node), costs.recursive_doubling(nbytes, nodes),
                           costs.node_broadcast(nbytes, per_node))
    assert algorithm == "hier", algorithm
    return costs.hier(nbytes, nodes, nranks // nodes,
                      costs.ring_segments(nbytes, nodes, piece_bytes))


def calibrate(data: dict, label: str, args) -> list:
    """One fit per algorithm of ``data``'s rows: a list of dicts for the table and the JSON."""
    n, k = data["nranks"], data.get("nodes", 1)
    add = (data.get("ceiling") or {}).get("add_GBps")
    if not isinstance(add, (int, float)) or add <= 0:
        raise ValueError(f"calibration {label!r}: no memory ceiling (ceiling.add_GBps), which "
                         "gamma comes from")
    ceiling_gamma = 1 / (add * 1e9)
    found = list(dict.fromkeys(r.get("algorithm") for r in data["rows"]))
    out = []
    for algo in (a for a in found if a in FITTED and not (a == "shm" and k > 1)):
        rows = [r for r in data["rows"] if r.get("algorithm") == algo and r.get(args.mode)]
        if not rows:
            continue
        terms = [calibration_terms(algo, _size(r, label), n, k, args.piece_bytes,
                                   args.short_bytes) for r in rows]
        times = [_seconds(r, args.mode, label) for r in rows]
        fit, source = None, "ceiling"
        if args.gamma == "fit":
            try:
                fit, source = costs.fit(terms, times), "fit"
            except ValueError:
                pass
        fit = fit or costs.fit(terms, times, ceiling_gamma)
        out.append({"label": label, "nranks": n, "nodes": k, "algorithm": algo,
                    "alpha_s": fit.alpha_s, "beta_s_per_byte": fit.beta_s_per_byte,
                    "gamma_s_per_byte": fit.gamma_s_per_byte, "gamma_from": source,
                    "ceiling_gamma_s_per_byte": ceiling_gamma,
                    "copy_GBps": data["ceiling"].get("copy_GBps"),
                    "median_rel_error": fit.median_rel_error, "max_rel_error": fit.max_rel_error,
                    "points": [{"size": r["size"], "measured_s": t, "predicted_s": p}
                               for r, t, p in zip(rows, times, fit.predicted_s)]})
    if not out:
        raise ValueError(f"calibration {label!r}: no rows of {', '.join(FITTED)} in {args.mode} "
                         f"(found {', '.join(map(str, found))})")
    return out


def _size(row: dict, label: str) -> int:
    size = row.get("size")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"calibration {label!r}: a row's size {size!r} is not a byte count")
    return size


def _seconds(row: dict, mode: str, label: str) -> float:
    t = (row[mode].get("time_us") or {}).get("avg") if isinstance(row[mode], dict) else None
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < math.inf:
        raise ValueError(f"calibration {label!r}: row {row.get('algorithm')} {row.get('size')} "
                         f"has no {mode} time_us.avg > 0 (got {t!r})")
    return t * 1e-6


def host_costs(fits: list) -> dict:
    """What the CPU-host systems take from the calibration: gamma, mpidp's ring software
    latency, and the node link (shm); the first fit of each wins, RESULTS.md's else."""
    host = dict(DEFAULT_HOST)
    first = {f["algorithm"]: f for f in reversed(fits)}
    if fits:
        host["gamma_s_per_byte"] = fits[0]["ceiling_gamma_s_per_byte"]
        host["source"] = fits[0]["label"]
    if "ring" in first:
        host["ring_alpha_s"] = first["ring"]["alpha_s"]
    if "shm" in first:
        shm = first["shm"]
        host["node_alpha_s"] = shm["alpha_s"]
        copy = shm["copy_GBps"] or 1 / DEFAULT_HOST["node_beta_s_per_byte"] / 1e9
        host["node_beta_s_per_byte"] = shm["beta_s_per_byte"] or 1 / (copy * 1e9)
    return host
