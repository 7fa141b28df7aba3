# Sourced by the sbatch scripts beside it: interpreter, rendezvous and thread settings for one task per GPU (or
# per CPU slot with DEVICE=cpu). MASTER_ADDR is the job's first node (where the batch script and rank 0 run);
# MASTER_PORT, unless set, is the first port free there from 20000 + job id % 20000 on.
set -euo pipefail
cd "${FROD_DS_HOME:-${SLURM_SUBMIT_DIR:-.}}"
# PYTHON: the interpreter of every task. Default: the repository's .venv (what `make` builds) if there, else
# python3; never a bare `python`, which many nodes lack or point at an interpreter without the project.
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=$PWD/.venv/bin/python; else PYTHON=python3; fi
fi
if ! command -v "$PYTHON" > /dev/null; then
  echo "error: no Python interpreter '$PYTHON'; set PYTHON to the project environment's python (e.g. .venv/bin/python)" >&2
  exit 2
fi
PYTHON=$(command -v "$PYTHON")  # a path, the same on every node of the shared filesystem
if ! "$PYTHON" -c 'import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in ("torch", "deepspeed", "frod_ds")))' 2> /dev/null; then
  echo "error: PYTHON=$PYTHON cannot import torch, deepspeed and frod_ds; set PYTHON to the project environment's python (make venv builds .venv)" >&2
  exit 2
fi
export PYTHON
MASTER_ADDR=$(scontrol show hostnames "${SLURM_JOB_NODELIST:?run this under sbatch}" | head -n 1)
export MASTER_ADDR
# A port derived from the job id alone collides when two jobs share a first node and their ids are 20000 apart,
# or when anything else holds it; the batch script runs on that node, so look for a free one here. A requeued job
# looks again (its old ranks are gone).
if [ -z "${MASTER_PORT:-}" ]; then
  MASTER_PORT=$("$PYTHON" - "$((20000 + ${SLURM_JOB_ID:-0} % 20000))" <<'PY'
import socket, sys
start = int(sys.argv[1])
for port in [*range(start, 40000), *range(20000, start)]:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the TCP store binds: TIME_WAIT is no owner
        try:
            s.bind(("", port))
        except OSError:
            continue
        print(port)
        break
PY
)
fi
export MASTER_PORT
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
echo "job ${SLURM_JOB_ID:-?}: ${SLURM_NTASKS:-?} tasks on ${SLURM_JOB_NODELIST}, device ${DEVICE}, python ${PYTHON}, rendezvous ${MASTER_ADDR}:${MASTER_PORT}"
