#!/usr/bin/env bash
# The 2-GPU runs, on the GPU machine from the repo root, wheels in .whl/ and LLM-Adapters' files in .gpu/llm_adapters
# (both carried, git-ignored). One stage per device call; results (JSON, logs, plots) tarred into $OUT/<stage>.tgz.
#
#   bash bench/run_two_gpu.sh matrix     # full-depth 7B, FRoD and LoRA: plain on 1 GPU, zero2/zero3 on 1 and 2 GPUs,
#                                        # bench/link.py first (bench/train_matrix.py; ~9 min)
#   bash bench/run_two_gpu.sh 70b-bf16-a # 70B widths, bf16 U_i, LAYERS (default 40) layers: generate + HJD, then the
#                                        # zero3.json training run killed after its checkpoint and resumed
#   bash bench/run_two_gpu.sh 70b-bf16-b # the same chain (same warm machine): FRoD step, LoRA r=16 bf16 step under
#                                        # the same zero3.json, the report
#   bash bench/run_two_gpu.sh host       # full-depth 7B on ONE of the GPUs: DeepSpeed's host-side levers beside the
#                                        # shipped zero2.json / zero3.json and plain (bench/zero3_levers.py --set host)
#   bash bench/run_two_gpu.sh 70b-nf4-a  # LLaMA-2-70B, 80 layers, NF4 U_i: generate + HJD, FRoD step under zero2.json
#                                        # with the NF4 base (quantize_base), checkpointing, 4x256 tokens per GPU
#   bash bench/run_two_gpu.sh 70b-nf4-b  # the same chain: QLoRA r=16 under zero2.json in the same harness (targeted
#                                        # weights regenerated into /dev/shm), the chain's report
set -euo pipefail
stage=${1:?usage: bench/run_two_gpu.sh matrix|70b-bf16-a|70b-bf16-b|host|70b-nf4-a|70b-nf4-b}
OUT=${OUT:?set OUT to the results folder}
python3 -c "import deepspeed" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD" PATH="/tmp/site/bin:$PATH" NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
t0=$SECONDS
pack() { mkdir -p "$1" && tar czf "$OUT/$stage.tgz.tmp" -C "$1" . && mv "$OUT/$stage.tgz.tmp" "$OUT/$stage.tgz" \
  && echo "packed $1 into $OUT/$stage.tgz ($((SECONDS - t0)) s)"; }
# the device call ends at 600 s with SIGKILL, before an EXIT trap could run: pack what is there just before
watch_and_pack() { (sleep "${PACK_AT_S:-580}"; pack "$1") & watcher=$!; trap 'kill $watcher 2>/dev/null; pack '"$1" EXIT; }

case "$stage" in
  matrix)
    R=/tmp/two_gpu/matrix
    watch_and_pack "$R"
    python3 bench/train_matrix.py --work /tmp/two_gpu/fb --out "$R" --no-profile --link \
      --plan "1:plain,zero2,zero3;2:zero2,zero3" --steps 12 --repeats 2 --warmup 3 --budget-s 470 --deadline-s 530
    ;;
  70b-bf16-a | 70b-bf16-b)
    W=/tmp/two_gpu/w70; R=/tmp/two_gpu/r70
    C=(--work "$W" --out "$R" --shape 70b --layers "${LAYERS:-40}" --quant none --gpus 2 --steps 24 --save-at 12
       --kill-at 18 --step-steps 5 --timeout-s 420)
    L=(python3 -m torch.distributed.run --standalone --nproc_per_node 2 bench/seventy_b.py)
    watch_and_pack "$R"
    if [ "$stage" = 70b-bf16-a ]; then
      df -h /tmp /dev/shm | tee -a "$OUT/gpus.txt"
      "${L[@]}" gen-untargeted "${C[@]}" --data .gpu/llm_adapters
      "${L[@]}" category q_proj k_proj v_proj o_proj gate_proj up_proj "${C[@]}"
      python3 bench/seventy_b.py train "${C[@]}"
      python3 bench/seventy_b.py train-resume "${C[@]}"
    else
      python3 bench/seventy_b.py step "${C[@]}"
      python3 bench/seventy_b.py lora "${C[@]}" --shm /dev/shm/two_gpu_lora
      python3 bench/seventy_b.py report "${C[@]}"
    fi
    ;;
  host)
    R=/tmp/two_gpu/host
    watch_and_pack "$R"
    CUDA_VISIBLE_DEVICES=0 python3 bench/zero3_levers.py --work /tmp/two_gpu/fb1 --out "$R" --set host --budget-s 500 \
      --deadline-s 565
    ;;
  70b-nf4-a | 70b-nf4-b)
    W=/tmp/two_gpu/w70nf4; R=/tmp/two_gpu/r70nf4
    C=(--work "$W" --out "$R" --shape 70b --layers 80 --quant nf4 --gpus 2 --config ds_configs/zero2.json
       --step-steps 5 --timeout-s 500)
    L=(python3 -m torch.distributed.run --standalone --nproc_per_node 2 bench/seventy_b.py)
    watch_and_pack "$R"
    if [ "$stage" = 70b-nf4-a ]; then
      df -h /tmp /dev/shm | tee -a "$OUT/gpus.txt"
      "${L[@]}" gen-untargeted "${C[@]}" --data .gpu/llm_adapters
      "${L[@]}" category q_proj k_proj v_proj o_proj gate_proj up_proj "${C[@]}"
      python3 bench/seventy_b.py step "${C[@]}" --quantize-base
    else
      [ -f "$W/results/seventy_b_step_frod_zero2_base.json" ] || python3 bench/seventy_b.py step "${C[@]}" --quantize-base
      python3 bench/seventy_b.py qlora "${C[@]}" --shm /dev/shm/two_gpu_qlora
      python3 bench/seventy_b.py report "${C[@]}" || true
    fi
    ;;
  pair)  # after host and 70b-nf4-a/b on the same warm machine: the 7B main ratios with the shipped JSONs (a second
         # call), then FRoD and QLoRA on the 80-layer chain timed again inside this one call
    R=/tmp/two_gpu/pair; W=/tmp/two_gpu/w70nf4
    watch_and_pack "$R"
    CUDA_VISIBLE_DEVICES=0 python3 bench/zero3_levers.py --work /tmp/two_gpu/fb1 --out "$R/host" --set main \
      --only frod_plain,frod_zero2,frod_zero3,lora_plain,lora_zero2 --budget-s 240 --deadline-s 290
    rm -f "$W/results/seventy_b_step_frod_zero2_base.json" "$W/results/seventy_b_step_lora_zero2.json"
    C=(--work "$W" --out "$R/70b" --shape 70b --layers 80 --quant nf4 --gpus 2 --config ds_configs/zero2.json
       --step-steps 5 --timeout-s 280)
    python3 bench/seventy_b.py step "${C[@]}" --quantize-base
    python3 bench/seventy_b.py qlora "${C[@]}" --shm /dev/shm/two_gpu_qlora
    python3 bench/seventy_b.py report "${C[@]}" || true
    ;;
  *) echo "error: unknown stage $stage (matrix, 70b-bf16-a, 70b-bf16-b, host, 70b-nf4-a, 70b-nf4-b)" >&2; exit 2 ;;
esac
