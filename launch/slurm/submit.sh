#!/bin/bash
# sbatch for the scripts beside it: creates the log folder before Slurm opens the job's output file (a
# missing folder makes the job fail with no output at all) and takes the cluster's shape from the environment.
#   launch/slurm/submit.sh [sbatch options] launch/slurm/<stage>.sbatch [stage arguments]
#   GPUS_PER_NODE=0 TASKS_PER_NODE=2 CPUS_PER_TASK=1 NODES=1 MODEL=... OUT=... launch/slurm/submit.sh launch/slurm/hjd.sbatch
# Prints the job id. Each variable left unset keeps the script's #SBATCH line; sbatch options given here win:
#   NODES, GPUS_PER_NODE (0: a CPU-only job, DEVICE=cpu), TASKS_PER_NODE, CPUS_PER_TASK, PARTITION, TIME,
#   LOG_DIR (default <repo>/logs; job output in LOG_DIR/<job name>-<job id>.out).
set -euo pipefail
export FROD_DS_HOME=${FROD_DS_HOME:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
opts=(--parsable)
for pair in NODES:--nodes GPUS_PER_NODE:--gpus-per-node TASKS_PER_NODE:--ntasks-per-node CPUS_PER_TASK:--cpus-per-task; do
  var=${pair%%:*}
  if [ -n "${!var:-}" ]; then
    if ! [[ "${!var}" =~ ^[0-9]+$ ]]; then
      echo "error: $var must be a whole number, got '${!var}'" >&2
      exit 2
    fi
    opts+=("${pair#*:}=${!var}")
  fi
done
if [ -n "${PARTITION:-}" ]; then opts+=(--partition "$PARTITION"); fi
if [ -n "${TIME:-}" ]; then opts+=(--time "$TIME"); fi
if [ "${GPUS_PER_NODE:-}" = 0 ]; then export DEVICE=${DEVICE:-cpu}; fi
LOG_DIR=${LOG_DIR:-$FROD_DS_HOME/logs}
mkdir -p "$LOG_DIR"
id=$(sbatch "${opts[@]}" --output "$(cd "$LOG_DIR" && pwd)/%x-%j.out" "$@")
echo "${id%%;*}"
