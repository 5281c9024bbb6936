"""``python -m mpidp.bench {allreduce,train,fusion,kernels,model}``: mpidp's benchmarks (run
under mpiexec), and the scale model calibrated from them (runs alone: no MPI)."""
from __future__ import annotations

import argparse

from ..errors import ConfigError
from ..runtime.helpformat import DefaultsHelpFormatter, Parser


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m mpidp.bench",
                                description="mpidp benchmarks; launch with mpiexec -n N "
                                            "(model: no mpiexec)",
                                formatter_class=DefaultsHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    from . import allreduce, fusion, kernels, model, train
    for name, module, text in (
            ("allreduce", allreduce, "all-reduce sweep with nccl-tests' columns"),
            ("train", train, "DDP training samples/s: mpidp vs torch DDP (gloo)"),
            ("fusion", fusion, "bucket pack/unpack GB/s; fused vs separate all-reduces"),
            ("kernels", kernels, "GPU kernel GB/s against a device-to-device copy"),
            ("model", model, "alpha-beta-gamma scale model: calibrate, predict 1..1024 nodes")):
        sub_parser = sub.add_parser(name, help=text,
                                    formatter_class=DefaultsHelpFormatter)
        module.add_arguments(sub_parser)
        sub_parser.set_defaults(run=module.main)
    return p


def main(argv=None) -> int:
    """Runs the benchmark the command line names; a bad MPIDP_* value (mpidp.init raises it
    on every rank: Note [Settings read at init] in mpidp/config.py) is one line from rank 0
    and exit code 2."""
    p = parser()
    args = p.parse_args(argv)
    try:
        return args.run(args)
    except ConfigError as exc:
        p.exit(2, f"{p.prog}: error: {exc}\n")


if __name__ == "__main__":
    from ..runtime.exit import exit_now
    exit_now(main())  # Note [Ending without the interpreter's teardown] in mpidp/runtime/exit.py
