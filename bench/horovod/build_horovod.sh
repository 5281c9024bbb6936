#!/usr/bin/env bash
# Builds Horovod 0.28.1 (PyTorch, MPI only) into its own venv, so that bench/horovod/horovod_compare.py
# can time Horovod against mpidp in one launch. The project's .venv is left untouched: the new
# venv is made from the same interpreter and gets the same torch, numpy, mpi4py and mpich wheel
# (so one libmpi serves both libraries), plus mpidp itself (on the path by a .pth file; the C
# extension is the one built in place). Idempotent: does nothing where `import horovod.torch` works.
#
#   bench/horovod/build_horovod.sh [VENV_DIR]   (relative to the repository root; default
#                                        bench/out/horovod-venv; ~9 min on 2 cores)
#
# Patch: horovod/torch/CMakeLists.txt forces C++14, which torch >= 2.1's headers refuse; it is
# made to ask for C++17 there (for torch >= 2.1 only). Nothing from Horovod is kept in the repo.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
VENV=${1:-bench/out/horovod-venv}
PROJECT_PY=${PYTHON:-$ROOT/.venv/bin/python}
HOROVOD_VERSION=0.28.1
say() { echo "[build_horovod] $*"; }

if [ -x "$VENV/bin/python" ] &&
   "$VENV/bin/python" -c 'import horovod.torch, mpidp.horovod' 2>/dev/null; then
  say "$VENV already imports horovod.torch and mpidp.horovod: nothing to do"
  exit 0
fi
start=$(date +%s)

# the same versions as the project's venv (torch must be pinned exactly: 2.13.0 is the local
# CPU wheel, anything else downloads a CUDA build)
version() { "$PROJECT_PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
TORCH=$(version torch); TORCH=${TORCH%%+*}
PINS=("torch==$TORCH" "numpy==$(version numpy)" "mpi4py==$(version mpi4py)"
      "mpich==$(version mpich)")

say "venv $VENV from $("$PROJECT_PY" -c 'import sys; print(sys._base_executable)')"
"$PROJECT_PY" -m venv "$VENV"
VENV=$(cd "$VENV" && pwd)
PIP=("$VENV/bin/python" -m pip install --quiet)
say "pip install ${PINS[*]} setuptools wheel packaging cloudpickle psutil pyyaml"
"${PIP[@]}" "${PINS[@]}" setuptools wheel packaging cloudpickle psutil pyyaml
command -v cmake >/dev/null || { say "pip install cmake"; "${PIP[@]}" cmake; }

SRC=$VENV/src
mkdir -p "$SRC"
if [ ! -d "$SRC/horovod-$HOROVOD_VERSION" ]; then
  say "pip download horovod==$HOROVOD_VERSION (sdist) into $SRC"
  "$VENV/bin/python" -m pip download --quiet --no-deps --no-binary :all: \
    "horovod==$HOROVOD_VERSION" -d "$SRC"
  tar -xzf "$SRC/horovod-$HOROVOD_VERSION.tar.gz" -C "$SRC"
fi
HVD=$SRC/horovod-$HOROVOD_VERSION

say "patch $HVD/horovod/torch/CMakeLists.txt: C++17 for torch >= 2.1 (it forces C++14)"
CML=$HVD/horovod/torch/CMakeLists.txt
if ! grep -q 'CMAKE_CXX_STANDARD 17' "$CML"; then
  "$VENV/bin/python" - "$CML" <<'EOF'
import sys
path = sys.argv[1]
text = open(path).read()
old = '    set(CMAKE_CXX_STANDARD 14)\n'
assert text.count(old) == 1, "horovod/torch/CMakeLists.txt: the C++14 line moved"
new = ('    if(NOT Pytorch_VERSION VERSION_LESS "2.1.0")\n'
       '        set(CMAKE_CXX_STANDARD 17)\n'
       '    else()\n'
       '        set(CMAKE_CXX_STANDARD 14)\n'
       '    endif()\n')
open(path, "w").write(text.replace(old, new))
EOF
fi

# MPI: the mpich wheel's wrappers (mpicc, mpicxx) and headers in $VENV/bin and $VENV/include;
# first on PATH, CMake's FindMPI takes them, and they add an rpath to $VENV/lib
say "MPI: $("$VENV/bin/mpicxx" -show)"
say "build: HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 HOROVOD_WITHOUT_{TENSORFLOW,MXNET,GLOO}=1"
say "       pip install --no-build-isolation $HVD"
t0=$(date +%s)
env PATH="$VENV/bin:$PATH" MPI_HOME="$VENV" MAKEFLAGS="-j$(nproc)" \
  HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 HOROVOD_WITHOUT_TENSORFLOW=1 \
  HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITHOUT_GLOO=1 HOROVOD_CPU_OPERATIONS=MPI \
  "$VENV/bin/python" -m pip install -v --no-cache-dir --no-build-isolation --no-deps "$HVD" \
  > "$VENV/horovod-build.log" 2>&1 || { tail -40 "$VENV/horovod-build.log"; exit 1; }
say "horovod built in $(( $(date +%s) - t0 )) s (log: $VENV/horovod-build.log)"

# mpidp by a .pth line, not `pip install -e` (which would rebuild the C extension in the tree)
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
say "mpidp from $ROOT (its C extension as built in place): $SITE/mpidp-src.pth"
echo "$ROOT" > "$SITE/mpidp-src.pth"

say "verify: mpiexec -n 2 python -c 'hvd.init(); hvd.allreduce(torch.ones(2))'"
"$VENV/bin/mpiexec" -n 2 "$VENV/bin/python" -c \
  'import horovod.torch as hvd; hvd.init(); import torch
print(hvd.rank(), hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist(), flush=True)'
"$VENV/bin/python" -c 'import horovod.torch, mpidp.horovod
print("horovod", horovod.__version__, "and mpidp.horovod import together")'
say "done in $(( $(date +%s) - start )) s: $VENV"
