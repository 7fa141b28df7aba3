#!/usr/bin/env bash
# GPU check of the training stage, run on the GPU machine from the repo root with the wheels in .whl/:
# the demo (NCCL, bf16) on 1 and 2 GPUs, then FRoD vs LoRA step time on a 7B-wide 8-layer model, 1 and 2 GPUs.
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 PYTHONPATH="/tmp/site:$PWD" PATH="/tmp/site/bin:$PATH"
OUT=${OUT:-bench/results}
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
W=/tmp/frodbench
mkdir -p "$W" "$OUT"
python3 -c "import transformers, peft; print(\"transformers\", transformers.__version__, \"peft\", peft.__version__)"
[ -n "${SKIP_DEMO:-}" ] || (python3 -m launch.demo --ranks "$NGPU" --out runs/demo_gpu 2>&1 || true) | tail -12 | tee "$OUT/demo_gpu${NGPU}.txt"
[ -n "${SKIP_DEMO:-}" ] || (python3 -m launch.demo --ranks 1 --out runs/demo_gpu1 2>&1 || true) | tail -12 | tee "$OUT/demo_gpu1.txt"
python3 bench/train_step.py make-model --out $W/m --layers 8
python3 -m torch.distributed.run --standalone --nproc_per_node "$NGPU" launch/hjd.py --model $W/m --out $W/f 2>&1 | tail -12
for n in $(printf "%s\n" 1 "$NGPU" | sort -un); do
  for method in frod lora; do
    deepspeed --num_gpus "$n" --master_port $((29600 + n)) bench/train_step.py run --method $method --model $W/m \
      --factors $W/f --config ds_configs/zero3.json --out "$OUT" 2>&1 | grep -vi warn | tail -3
  done
done
python3 bench/train_step.py combine "$OUT"/train_step_*gpu.json
