#!/usr/bin/env bash
# The one-GPU ZeRO-3 calls, on the GPU machine from the repo root with the wheels in .whl/ (carried, git-ignored).
# Results go straight to $OUT (what a call leaves there comes back even when the call is cut off).
#
#   bash bench/run_one_gpu.sh pair   # full-depth 7B: FRoD plain / zero2.json / zero3.json and LoRA r=16 plain in one
#                                    # group, LoRA zero2 / zero3 in a second, each group's timed windows alternating
#                                    # (bench/zero3_levers.py --interleave; ~5 min with the model and store made)
#   bash bench/run_one_gpu.sh profile   # FRoD plain / zero2 / zero3: phases, cProfile, torch.profiler; then zero3.json
#                                       # beside its host-side variants (interleaved)
#   bash bench/run_one_gpu.sh flat      # one after another: FRoD plain / zero2 / zero3, zero3 with σ and S per FRoD layer,
#                                       # zero3 + prefetch 0, zero3 + 5e8 buckets, LoRA plain / zero2
#   bash bench/run_one_gpu.sh final-a   # the shipped configurations, ZeRO-3's changes undone one at a time, LoRA
#   bash bench/run_one_gpu.sh final-b   # the headline pairs again, a second call
#   bash bench/run_one_gpu.sh final-c   # the headline pairs with LoRA's zero3.json, windows in turn, re-warmed
#   bash bench/run_one_gpu.sh nvtx      # the headline trio beside zero3.json / zero2.json with DeepSpeed's NVTX ranges
#                                       # on, zero3.json + DeepSpeed's fast fetch path, LoRA plain / zero2.json
#   bash bench/run_one_gpu.sh turns     # the headline pairs, windows in turn (FRoD's three at once, then LoRA's
#                                       # two), 6 windows of 8 steps, an untimed step as each turn starts
#   bash bench/run_one_gpu.sh walks     # the headline trio beside zero3.json without FixedParameters, windows in turn,
#                                       # re-warmed; LoRA's plain / zero2.json; then bench/host_calls.py
#   bash bench/run_one_gpu.sh zero2-flat  # the headline trio beside zero2.json with σ and S per FRoD layer (the
#                                       # layout before FRoDTrainables under ZeRO-2), windows in turn, re-warmed; LoRA's
#                                       # plain / zero2.json; then bench/host_calls.py for plain and both ZeRO-2 layouts
#   bash bench/run_one_gpu.sh linear      # the headline trio beside zero3.json with memory_efficient_linear back on
#                                       # (DeepSpeed's default), windows in turn, re-warmed; then bench/host_calls.py
#   bash bench/run_one_gpu.sh flat-u    # zero3.json with a decoder layer's U as one Parameter (shipped) and as one per
#                                       # FRoD layer, beside plain / zero2.json (FRoD and LoRA), one after another
#   bash bench/run_one_gpu.sh 70b-a     # 70B widths, 20 layers, bf16 U_i, checkpointing, 4x256 tokens: generate + HJD,
#                                       # then FRoD plain / zero2.json / zero3.json one after another (bench/seventy_b.py)
#   bash bench/run_one_gpu.sh 70b-b     # the same chain (same warm machine): FRoD NF4 U_i + NF4 base and QLoRA r=16,
#                                       # both zero2.json, then FRoD zero2.json / zero3.json again (a second call)
#   bash bench/run_one_gpu.sh 70b-nf4   # generate + HJD as 70b-a, then FRoD NF4 U_i + NF4 base and QLoRA r=16 under
#                                       # zero2.json, then both under plain PyTorch (each one's fastest), one call
#   bash bench/run_one_gpu.sh host-device  # host vs GPU time of a plain FRoD step, bf16 / NF4 / int8 U_i, with and
#                                          # without the base quantized: 7B widths x 8 layers, 70B widths x 4
#                                          # (bench/host_device.py, ~3 min; nothing to generate)
#   bash bench/run_one_gpu.sh quant-7b     # full-depth 7B under zero2.json: FRoD and LoRA r=16 in bf16, NF4, int8, with
#                                          # and without the base quantized (bench/train_matrix.py, ~7 min with the
#                                          # model and store made); the call of train_matrix_quant_1xh100 again
#   bash bench/run_one_gpu.sh deepcompile  # DeepCompile under zero3.json on a 4-layer (DC_LAYERS) 7B-width model: FRoD as shipped,
#                                          # FRoD with DeepSpeed's own layout (V partitioned, σ/S per FRoD layer,
#                                          # per-module fetch), LoRA r=16; each beside zero3.json without it (~5 min)
set -euo pipefail
STAGES="pair|profile|flat|flat-u|turns|walks|zero2-flat|linear|nvtx|final-a|final-b|final-c|70b-a|70b-b|70b-nf4|host-device|quant-7b|deepcompile"
stage=${1:?usage: bench/run_one_gpu.sh $STAGES}
OUT=${OUT:?set OUT to the results folder}
python3 -c "import deepspeed" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD" PATH="/tmp/site/bin:$PATH" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false \
  HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$OUT/gpus.txt"
case "$stage" in
  host-device)
    python3 bench/host_device.py --out "$OUT/host_device"
    ;;
  deepcompile)
    export TORCH_CUDA_ARCH_LIST=9.0  # DeepCompile builds its op for the card
    layers=${DC_LAYERS:-4}; w=/tmp/dc$layers; o="$OUT/deepcompile"; mkdir -p "$o"
    [ -f "$w/model/MADE" ] || { python3 bench/train_step.py make-model --out "$w/model" --layers "$layers" > "$o/make.log" 2>&1 \
      && touch "$w/model/MADE"; }
    [ -f "$w/factors/manifest.json" ] || python3 launch/hjd.py --model "$w/model" --out "$w/factors" > "$o/hjd.log" 2>&1
    dc="--ds-set=compile.deepcompile=true --compile"
    own="--v-partitioned --per-member-trainables --per-module-fetch"
    # ONLY="name ...": a subset; the last three put back one of the shipped layout's choices each; DC_LAYERS: depth
    for v in "frod:zero2:--config ds_configs/zero2.json" "frod:zero3:" "frod:zero3_dc:$dc" "frod:zero3_own:$own" "frod:zero3_own_dc:$own $dc" "lora:zero3:" \
             "lora:zero3_dc:$dc" "frod:zero3_dc_v_replicated:--per-member-trainables --per-module-fetch $dc" \
             "frod:zero3_dc_layer_trainables:--v-partitioned --per-module-fetch $dc" \
             "frod:zero3_dc_layer_fetch:--v-partitioned --per-member-trainables $dc"; do
      IFS=: read -r method name flags <<< "$v"
      [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" ${method}_$name "* ]] || continue
      rc=0
      # shellcheck disable=SC2086
      timeout "${DC_TIMEOUT:-200}" python3 bench/train_step.py run --method "$method" --model "$w/model" --factors "$w/factors" \
        --config ds_configs/zero3.json --out "$o" --name "${method}_$name" --warmup 2 --steps 5 --repeats 2 $flags \
        > "$o/${method}_$name.log" 2>&1 || rc=$?
      echo "${method}_$name: exit $rc"
    done
    tar -C "$OUT" -czf "$OUT/deepcompile.tgz" deepcompile && rm -rf "$o"  # one file back, whatever the count
    ;;
  quant-7b)
    python3 bench/train_matrix.py --work /tmp/frodbench --out "$OUT/quant_7b" --engines zero2 \
      --extras nf4,int8,nf4-base,int8-base --no-profile --steps 5 --repeats 2 --warmup 2 --budget-s "${BUDGET_S:-400}" \
      --config-timeout-s 90 --deadline-s "${DEADLINE_S:-450}"
    ;;
  pair)
    # four processes of ~26 GiB at once need an H200; on an 80-GB card two at a time (zero2.json beside zero3.json)
    mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
    if [ "$mib" -gt 100000 ]; then k=4; only=frod_plain,frod_zero2,frod_zero3,lora_plain,lora_zero2,lora_zero3
    else k=2; only=frod_zero2,frod_zero3,frod_plain,lora_plain,lora_zero2,lora_zero3; fi
    python3 bench/zero3_levers.py --work /tmp/frodbench --out "$OUT" --set main --interleave "$k" --repeats 3 \
      --only "$only" --budget-s "${BUDGET_S:-450}" --deadline-s "${DEADLINE_S:-560}"
    ;;
  profile)  # where ZeRO-3's extra time goes: phases, cProfile and torch.profiler of plain / zero2 / zero3 one after
            # another; then zero3.json beside its host-side variants, interleaved
    python3 bench/zero3_levers.py --work /tmp/frodbench --out "$OUT/profile" --set main --phases --pyprofile --profile \
      --only frod_plain,frod_zero2,frod_zero3 --budget-s 300 --deadline-s 330
    python3 bench/zero3_levers.py --work /tmp/frodbench --out "$OUT/zero3plus" --set zero3plus --interleave 4 \
      --repeats 3 --budget-s 200 --deadline-s 220
    ;;
  flat)  # one after another: the headline configurations, ZeRO-3 with σ and S per FRoD layer (the previous build)
         # and two host-side zero3.json settings beside the shipped one
    python3 bench/zero3_levers.py --work /tmp/frodbench --out "$OUT" --set main,ablations,zero3plus \
      --only frod_plain,frod_zero2,frod_zero3,frod_zero3_per-member,frod_zero3_prefetch-0,frod_zero3_bucket-5e8,lora_plain,lora_zero2 \
      --budget-s "${BUDGET_S:-470}" --deadline-s "${DEADLINE_S:-560}"
    rm -rf "$OUT/gates"
    ;;
  final-a)  # the shipped JSONs and build one after another, each ZeRO-3 change of this round undone beside them
    python3 bench/zero3_levers.py --work /tmp/frodbench --out "$OUT" --set main,ablations \
      --only frod_plain,frod_zero2,frod_zero3,frod_zero3_per-member,frod_zero3_bucket-5e7,lora_plain,lora_zero2,lora_zero3 \
      --budget-s "${BUDGET_S:-470}" --deadline-s "${DEADLINE_S:-560}"
    rm -rf "$OUT/gates" "$OUT/logs" "$OUT/configs"  # the call's JSON holds every result
    ;;
  walks)  # FRoD plain / zero2.json / zero3.json and zero3.json with DeepSpeed walking the modules again (no
          # FixedParameters), windows in turn, re-warmed; LoRA plain / zero2.json; then Python calls per step
    python3 bench/zero3_levers.py --work /tmp/frodbench --out "$OUT" --set main,ablations --interleave 4 \
      --only frod_plain,frod_zero2,frod_zero3,frod_zero3_walk-parameters,lora_plain,lora_zero2 --steps 8 --repeats 6 \
      --budget-s "${BUDGET_S:-420}" --deadline-s "${DEADLINE_S:-470}"
    python3 bench/host_calls.py --work /tmp/hostcalls --out "$OUT"
    rm -rf "$OUT/gates" "$OUT/logs" "$OUT/configs"
    ;;
  zero2-flat)  # FRoD plain / zero2.json / zero2.json with σ and S per FRoD layer / zero3.json, windows in turn,
               # re-warmed; LoRA plain / zero2.json; then Python calls per step of plain and both ZeRO-2 layouts
    python3 bench/zero3_levers.py --work /tmp/frodbench --out "$OUT" --set main,ablations --interleave 4 \
      --only frod_plain,frod_zero2,frod_zero2_per-member,frod_zero3,lora_plain,lora_zero2 --steps 8 --repeats 6 \
      --budget-s "${BUDGET_S:-420}" --deadline-s "${DEADLINE_S:-470}"
    python3 bench/host_calls.py --work /tmp/hostcalls --out "$OUT" --only plain,zero2,zero2-per-member,zero3
    rm -rf "$OUT/gates" "$OUT/logs" "$OUT/configs"
    ;;
  linear)  # FRoD plain / zero2.json / zero3.json / zero3.json with memory_efficient_linear true, windows in turn,
           # re-warmed; then Python calls per step of zero3.json with and without it
    python3 bench/zero3_levers.py --work /tmp/frodbench --out "$OUT" --set main,ablations --interleave 4 \
      --only frod_plain,frod_zero2,frod_zero3,frod_zero3_linear-replaced --steps 8 --repeats 6 \
      --budget-s "${BUDGET_S:-300}" --deadline-s "${DEADLINE_S:-340}"
    python3 bench/host_calls.py --work /tmp/hostcalls --out "$OUT" --only zero3,zero3-linear-replaced
    rm -rf "$OUT/gates" "$OUT/logs" "$OUT/configs"
    ;;
  nvtx)  # FRoD plain / zero2.json / zero3.json / zero3.json with DeepSpeed's NVTX ranges back on, windows in turn,
        # re-warmed; then zero2.json with them on, zero3.json + stage3_module_granularity_threshold 1 (DeepSpeed's fast
        # fetch path) and LoRA plain / zero2.json, in turn; then Python calls per step of zero3.json
    python3 bench/zero3_levers.py --work /tmp/frodbench --out "$OUT" --set main,ablations,zero3plus --interleave 4 \
      --only frod_plain,frod_zero2,frod_zero3,frod_zero3_nvtx-on,frod_zero2_nvtx-on,frod_zero3_fast-sharding,lora_plain,lora_zero2 \
      --steps 8 --repeats 6 --budget-s "${BUDGET_S:-420}" --deadline-s "${DEADLINE_S:-480}"
    python3 bench/host_calls.py --work /tmp/hostcalls --out "$OUT" --only zero3,zero3-nvtx-on
    rm -rf "$OUT/gates" "$OUT/logs" "$OUT/configs"
    ;;
  flat-u)  # U of a decoder layer as one frozen Parameter (FRoDFrozen, shipped) against one per FRoD layer, beside
           # plain / zero2.json and LoRA's plain / zero2.json, one configuration after another
    python3 bench/zero3_levers.py --work /tmp/frodbench --out "$OUT" --set main,ablations \
      --only frod_plain,frod_zero2,frod_zero3,frod_zero3_per-member-u,lora_plain,lora_zero2 --steps 16 --repeats 3 \
      --budget-s "${BUDGET_S:-470}" --deadline-s "${DEADLINE_S:-560}"
    rm -rf "$OUT/gates" "$OUT/logs" "$OUT/configs"
    ;;
  turns | final-c)  # the headline pairs with their windows taken in turn (FRoD plain / zero2.json / zero3.json at
                    # once, then LoRA plain / zero2.json, final-c: and LoRA's zero3.json), 6 windows of 8 steps, one
                    # untimed step after each turn starts
    only=frod_plain,frod_zero2,frod_zero3,lora_plain,lora_zero2
    [ "$stage" = turns ] || only+=,lora_zero3
    python3 bench/zero3_levers.py --work /tmp/frodbench --out "$OUT" --set main --interleave 3 \
      --only "$only" --steps 8 --repeats 6 --budget-s "${BUDGET_S:-470}" --deadline-s "${DEADLINE_S:-560}"
    rm -rf "$OUT/gates" "$OUT/logs" "$OUT/configs"
    ;;
  final-b)  # the headline pairs again (a second call)
    python3 bench/zero3_levers.py --work /tmp/frodbench --out "$OUT" --set main \
      --only frod_plain,frod_zero2,frod_zero3,lora_plain,lora_zero2 --steps 16 --repeats 3 --budget-s "${BUDGET_S:-470}" \
      --deadline-s "${DEADLINE_S:-560}"
    rm -rf "$OUT/gates" "$OUT/logs" "$OUT/configs"
    ;;
  70b-a | 70b-b | 70b-nf4)  # results tarred into $OUT/<stage>.tgz just before the call's 600 s end (or at exit)
    W=/tmp/one_gpu/w70; R=/tmp/one_gpu/$stage
    C=(--work "$W" --out "$R" --shape 70b --layers 20 --gpus 1 --step-steps 5 --timeout-s 240)
    L=(python3 -m torch.distributed.run --standalone --nproc_per_node 1 bench/seventy_b.py)
    mkdir -p "$R"; t0=$SECONDS
    pack() { tar czf "$OUT/$stage.tgz.tmp" -C "$R" . && mv "$OUT/$stage.tgz.tmp" "$OUT/$stage.tgz" \
      && echo "packed $R into $OUT/$stage.tgz ($((SECONDS - t0)) s)"; }
    (sleep "${PACK_AT_S:-575}"; pack) & watcher=$!; trap 'pkill -P $watcher 2>/dev/null; kill $watcher 2>/dev/null; pack' EXIT
    if [ "$stage" != 70b-b ]; then
      rm -rf /tmp/frodbench /tmp/hostcalls  # this script's 7B work folders: the 70B store needs the disk
      df -h /tmp /dev/shm | tee -a "$OUT/gpus.txt"
      # DATA_DIR: LLM-Adapters' task folders (the tokenizer's text; the timed steps use random tokens)
      "${L[@]}" gen-untargeted "${C[@]}" --quant none --data "${DATA_DIR:-.gpu/llm_adapters}"
      "${L[@]}" category q_proj k_proj v_proj o_proj gate_proj up_proj "${C[@]}" --quant none
    fi
    if [ "$stage" = 70b-nf4 ]; then  # like for like and each method's fastest, in one call
      for cfg in ds_configs/zero2.json plain; do
        python3 bench/seventy_b.py step "${C[@]}" --quant nf4 --config "$cfg" --quantize-base
        python3 bench/seventy_b.py qlora "${C[@]}" --quant nf4 --config "$cfg" --shm /dev/shm/one_gpu_qlora
      done
    elif [ "$stage" = 70b-a ]; then
      for cfg in plain ds_configs/zero2.json ds_configs/zero3.json; do
        python3 bench/seventy_b.py step "${C[@]}" --quant none --config "$cfg"
      done
    else
      python3 bench/seventy_b.py step "${C[@]}" --quant nf4 --config ds_configs/zero2.json --quantize-base
      python3 bench/seventy_b.py qlora "${C[@]}" --quant nf4 --config ds_configs/zero2.json --shm /dev/shm/one_gpu_qlora
      for cfg in ds_configs/zero2.json ds_configs/zero3.json; do
        python3 bench/seventy_b.py step "${C[@]}" --quant none --config "$cfg"
      done
    fi
    ;;
  *) echo "error: unknown stage $stage (one of $STAGES)" >&2; exit 2 ;;
esac
