"""``python -m mpidp.bench {allreduce,train,fusion,kernels}``: mpidp's benchmarks (run under mpiexec)."""
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
    from . import train
    tr = sub.add_parser("train", help="DDP training samples/s: mpidp vs torch DDP (gloo)",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    train.add_arguments(tr)
    tr.set_defaults(run=train.main)
    from . import fusion
    fu = sub.add_parser("fusion", help="bucket pack/unpack GB/s; fused vs separate all-reduces",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    fusion.add_arguments(fu)
    fu.set_defaults(run=fusion.main)
    from . import kernels
    ke = sub.add_parser("kernels", help="GPU kernel GB/s against a device-to-device copy",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    kernels.add_arguments(ke)
    ke.set_defaults(run=kernels.main)
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
