# Shared by the hpctrain sbatch scripts (sourced, not run): environment and launcher choice.

hpctrain_setup() {
  : "${SLURM_JOB_ID:?run this inside a Slurm allocation (sbatch)}"
  HPCTRAIN_VENV="${HPCTRAIN_VENV:-$HPCTRAIN_HOME/.venv}"
  if [[ ! -x "$HPCTRAIN_VENV/bin/python" ]]; then
    echo "hpctrain: no virtual environment at $HPCTRAIN_VENV (run 'make setup' or set HPCTRAIN_VENV)" >&2
    exit 2
  fi
  export PATH="$HPCTRAIN_VENV/bin:$PATH"
  export OMP_NUM_THREADS="${SLURM_CPUS_PER_TASK:-${OMP_NUM_THREADS:-1}}"
  export PMIX_MCA_psec="${PMIX_MCA_psec:-native}"        # silences a munge psec message of pmix
  if [[ "$(id -u)" == 0 ]]; then                          # containers and test machines run as root
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  fi
  if [[ -z "${HPCTRAIN_LAUNCHER:-}" ]]; then
    if srun --mpi=list 2>&1 | grep -qw "${HPCTRAIN_SRUN_MPI:-pmix}" \
        && mpirun --version 2>/dev/null | grep -q "Open MPI"; then
      HPCTRAIN_LAUNCHER=srun
    else
      HPCTRAIN_LAUNCHER=mpirun
    fi
  fi
  export HPCTRAIN_LAUNCHER
  echo "hpctrain: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}): ${SLURM_NTASKS} tasks on" \
       "${SLURM_JOB_NUM_NODES} node(s), $OMP_NUM_THREADS thread(s) each, launcher $HPCTRAIN_LAUNCHER" >&2
}

# Run the command on every task; with HPCTRAIN_FORWARD_SIGNALS, forward USR1/USR2/TERM from the batch
# shell to the job step (needed for sbatch --signal=B:...), and return the step's exit status.
hpctrain_launch() {
  local pid rc
  hpctrain launch -n "$SLURM_NTASKS" "$@" &
  pid=$!
  if [[ -n "${HPCTRAIN_FORWARD_SIGNALS:-}" ]]; then
    for sig in USR1 USR2 TERM; do
      # shellcheck disable=SC2064
      trap "echo 'hpctrain: batch shell got SIG$sig, forwarding it to the job step' >&2; kill -$sig $pid 2>/dev/null || true" "$sig"
    done
  fi
  while true; do
    set +e
    wait "$pid"
    rc=$?
    set -e
    if kill -0 "$pid" 2>/dev/null; then continue; fi   # wait was interrupted by a trapped signal
    return "$rc"
  done
}
