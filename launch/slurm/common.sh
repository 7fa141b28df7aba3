# Sourced by the sbatch scripts beside it: rendezvous and thread settings for one task per GPU.
# MASTER_ADDR is the job's first node; MASTER_PORT is derived from the job id unless set.
set -euo pipefail
MASTER_ADDR=$(scontrol show hostnames "${SLURM_JOB_NODELIST:?run this under sbatch}" | head -n 1)
export MASTER_ADDR
export MASTER_PORT=${MASTER_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 20000))}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-8}}
export TOKENIZERS_PARALLELISM=false
cd "${FROD_DS_HOME:-${SLURM_SUBMIT_DIR:-.}}"
mkdir -p logs
echo "job ${SLURM_JOB_ID:-?}: ${SLURM_NTASKS:-?} tasks on ${SLURM_JOB_NODELIST}, rendezvous ${MASTER_ADDR}:${MASTER_PORT}"
