"""Builds mpidp's C extension from csrc/ (and nothing else); a failed build fails the install."""
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "mpidp._ext",
            sources=["csrc/module.c", "csrc/binding.c", "csrc/context_type.c", "csrc/small.c",
                     "csrc/exchange.c", "csrc/context.c", "csrc/kernels.c", "csrc/fusion.c",
                     "csrc/shm.c", "csrc/view.c", "csrc/heap.c", "csrc/cma.c",
                     "csrc/atomics.c"],
            depends=["csrc/kernels.h", "csrc/fusion.h", "csrc/shm.h", "csrc/binding.h",
                     "csrc/context.h", "csrc/small.h", "csrc/heap.h",
                     "csrc/cma.h", "csrc/wire.h"],
            extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra", "-Werror",
                                "-Wno-unused-parameter", "-Wno-missing-field-initializers"],
        )
    ],
)
