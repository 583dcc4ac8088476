#!/bin/bash
# Host discovery of slurm/elastic.sbatch: the allocation's nodes that Slurm does not report down,
# drained or failing, one "node:tasks" per line (tasks: the job's tasks per node).
set -euo pipefail
: "${SLURM_JOB_NODELIST:?run inside a Slurm allocation}"
per_node="${SLURM_NTASKS_PER_NODE:-}"
if [[ -z "$per_node" ]]; then              # SLURM_TASKS_PER_NODE reads like "2(x3),1": the first count
  per_node="${SLURM_TASKS_PER_NODE:-1}"
  per_node="${per_node%%[(,]*}"
fi
states="$(sinfo -h -N -n "$SLURM_JOB_NODELIST" -o '%N %T' 2>/dev/null || true)"
for node in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do
  state="$(awk -v n="$node" '$1 == n { print $2; exit }' <<<"$states")"
  case "$state" in
    ""|down*|drain*|fail*|unknown*|not_responding*|power*) continue ;;
  esac
  echo "$node:$per_node"
done
