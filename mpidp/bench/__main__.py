"""``python -m mpidp.bench {allreduce}``: mpidp's benchmarks (run under mpiexec)."""
from __future__ import annotations

import argparse
import sys


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mpidp.bench",
                                description="mpidp benchmarks; launch with mpiexec -n N",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    from . import allreduce
    ar = sub.add_parser("allreduce", help="all-reduce sweep with nccl-tests' columns",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    allreduce.add_arguments(ar)
    ar.set_defaults(run=allreduce.main)
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
