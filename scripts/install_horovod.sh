#!/usr/bin/env bash
# Build and install Horovod 0.28.1 into the active virtual environment.
#
# Horovod 0.28.1 (the last release) does not build as published against
# PyTorch >= 2.1.  Two fixes make it build here:
#   1. the C++ standard in CMakeLists.txt and horovod/torch/CMakeLists.txt
#      is raised from 14 to 17 (PyTorch's headers need C++17);
#   2. the build uses a cmake older than 4, because the bundled third_party
#      CMake files declare minimum versions that cmake 4 refuses.
# The built wheel is kept in a cache folder keyed by the Horovod version, the
# torch version and this script's contents, so later runs install in seconds.
#
# Usage: scripts/install_horovod.sh PYTHON   (PYTHON: the venv's interpreter)
set -euo pipefail

PY=${1:?usage: install_horovod.sh PYTHON}
PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")"   # absolute, symlink kept
HVD_VERSION=0.28.1
BIN=$(dirname "$PY")
export PATH="$BIN:$PATH"

if "$PY" -c "import horovod.torch" 2>/dev/null; then
    exit 0
fi

TORCH_VERSION=$("$PY" -c "import torch; print(torch.__version__)")
SCRIPT_HASH=$(sha256sum "$0" | cut -c1-12)
CACHE=${HPCTRAIN_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hpctrain/wheels}/horovod-$HVD_VERSION-torch-$TORCH_VERSION-$SCRIPT_HASH
mkdir -p "$CACHE"

if ! ls "$CACHE"/horovod-*.whl >/dev/null 2>&1; then
    echo "hpctrain: building Horovod $HVD_VERSION against torch $TORCH_VERSION (about 4 minutes, once)"
    WORK=$(mktemp -d)
    trap 'rm -rf "$WORK"' EXIT
    "$PY" -m pip download -q --no-deps --no-binary :all: "horovod==$HVD_VERSION" -d "$WORK"
    tar -xzf "$WORK/horovod-$HVD_VERSION.tar.gz" -C "$WORK"
    SRC="$WORK/horovod-$HVD_VERSION"
    # Fix 1: C++17 for the core and the torch extension.
    sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
        "$SRC/CMakeLists.txt" "$SRC/horovod/torch/CMakeLists.txt"
    grep -q 'set(CMAKE_CXX_STANDARD 17)' "$SRC/horovod/torch/CMakeLists.txt" || {
        echo "hpctrain: the C++17 patch did not apply to Horovod's sources" >&2; exit 1; }
    # Fix 2: a cmake older than 4, from PyPI, inside the venv.
    "$PY" -m pip install -q 'cmake>=3.13,<4'
    CMAKE="$BIN/cmake"
    "$CMAKE" --version | head -n1
    (
        cd "$SRC"
        HOROVOD_CMAKE="$CMAKE" HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1 \
        HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=MPI \
        MAKEFLAGS="-j$(nproc)" \
            "$PY" -m pip wheel -q --no-build-isolation --no-deps -w "$CACHE" .
    ) > "$WORK/build.log" 2>&1 || {
        echo "hpctrain: the Horovod build FAILED; the last lines of its log:" >&2
        tail -n 40 "$WORK/build.log" >&2
        exit 1
    }
fi

"$PY" -m pip install -q --no-deps "$CACHE"/horovod-*.whl
# Horovod's own run-time needs (its launcher), without touching torch.
"$PY" -m pip install -q cloudpickle psutil pyyaml packaging
"$PY" -c "import horovod.torch"
