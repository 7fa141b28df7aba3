#!/usr/bin/env bash
# GPU check of the training stage, run on the GPU machine from the repo root with the wheels in .whl/:
# the demo (NCCL, bf16) on 1 and N GPUs, then the training-step matrix (full-depth 7B shape, FRoD vs LoRA under
# plain PyTorch, ZeRO-2 and ZeRO-3; bench/train_matrix.py), results and table under $OUT.
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 PYTHONPATH="/tmp/site:$PWD" PATH="/tmp/site/bin:$PATH"
OUT=${OUT:-bench/results}
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
mkdir -p "$OUT"
python3 -c "import deepspeed" 2>/dev/null || pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
python3 -c "import transformers, peft; print(\"transformers\", transformers.__version__, \"peft\", peft.__version__)"
[ -n "${SKIP_DEMO:-}" ] || (python3 -m frod_ds demo --ranks "$NGPU" --out runs/demo_gpu 2>&1 || true) | tail -12 | tee "$OUT/demo_gpu${NGPU}.txt"
[ -n "${SKIP_DEMO:-}" ] || (python3 -m frod_ds demo --ranks 1 --out runs/demo_gpu1 2>&1 || true) | tail -12 | tee "$OUT/demo_gpu1.txt"
python3 bench/train_matrix.py --work /tmp/frodbench --out "$OUT" --gpus "$NGPU" "$@"
