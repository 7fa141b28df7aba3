# Sourced by the sbatch scripts beside it: rendezvous and thread settings for one task per GPU (or per CPU
# slot with DEVICE=cpu). MASTER_ADDR is the job's first node; MASTER_PORT is derived from the job id unless set.
set -euo pipefail
MASTER_ADDR=$(scontrol show hostnames "${SLURM_JOB_NODELIST:?run this under sbatch}" | head -n 1)
export MASTER_ADDR
export MASTER_PORT=${MASTER_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 20000))}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-8}}
export TOKENIZERS_PARALLELISM=false
# DEVICE=cpu (submit.sh sets it for GPUS_PER_NODE=0): no GPU visible to the stages, gloo, DeepSpeed's CPU
# accelerator; auto: the task's GPU if CUDA is available.
export DEVICE=${DEVICE:-auto}
case "$DEVICE" in
  cpu) export DS_ACCELERATOR=cpu CUDA_VISIBLE_DEVICES= ;;
  auto | cuda) ;;
  *) echo "error: DEVICE must be auto, cpu or cuda, got '$DEVICE'" >&2; exit 2 ;;
esac
cd "${FROD_DS_HOME:-${SLURM_SUBMIT_DIR:-.}}"
echo "job ${SLURM_JOB_ID:-?}: ${SLURM_NTASKS:-?} tasks on ${SLURM_JOB_NODELIST}, device ${DEVICE}, rendezvous ${MASTER_ADDR}:${MASTER_PORT}"
