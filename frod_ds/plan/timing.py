"""Step-time model: seconds per optimizer step of FRoD training for one set-up, from the shapes and a few measured
constants, so the planner can rank the set-ups that fit by speed instead of by a fixed order.

    step = max(device, host) + zero hooks + ZeRO-3 layer fetches + link + offload + gradient reduce

    device        compute + recompute + dequantization on the GPU:
      compute     T · F / (peak · EFFICIENCY)          T tokens per micro-batch per GPU, F model FLOPs per token
                                                        (``frod_ds.plan.flops``: base forward, backward to inputs,
                                                        FRoD's own work)
      recompute   with gradient checkpointing one more forward: F / 3 of the same
      dequantize  NF4/int8 frozen weights: DEQUANT_DEVICE_S[kind] per quantized element and pass
    host          what Python issues, per decoder layer and pass: HOST_LAYER_PASS_S, plus HOST_DEQUANT_CALL_S for each
                  quantized linear (bitsandbytes' dequantization and its autograd Function); × ``Link.host`` (the
                  host's speed relative to the machine the constants were read on). The GPU runs what the host
                  queued, so the two overlap: a step is the slower of the two. At 7B widths a quantized step is
                  host-bound (the GPU's share of a layer is short); at 70B widths the GPU is the slower and
                  dequantization costs only its device time.
    zero hooks    ZeRO-3, and ZeRO-2 with DeepSpeed's bf16 overflow check: ZERO_TENSOR_S per trainable tensor (σ_i
                  and S_i of every target: gradient hooks, bucketing, the per-gradient check, the partitioned
                  optimizer step; under ZeRO-3 two per decoder layer, ``FRoDTrainables``); ZeRO-2 without the
                  check (the shipped zero2.json): ZERO2_UNCHECKED_TENSOR_S. They synchronize: added, not overlapped;
                  host work, so × ``Link.host`` like the layer fetches.
    layer fetch   ZeRO-3: ZERO3_LAYER_PASS_S per decoder layer and pass (fetch/release of one layer's parameters,
                  the shipped per-layer fetch; passes = 2, 3 with checkpointing), less ZERO3_FROZEN_TENSOR_PASS_S for
                  each U_i beyond the first when a layer's dense U_i are one Parameter (``FRoDFrozen``)
    link          N > 1 under ZeRO-3: LINK_EXPOSED × the bytes of the frozen weights a rank does not hold, gathered
                  once per pass, at the link's all-gather bus bandwidth; ZeRO-2: the trainable gradients'
                  reduce-scatter
    offload       parameter offload: the frozen weights cross PCIe once per pass at OFFLOAD_BYTES_PER_S

Every constant below names the committed measurement it was read from; ``bench/time_model_check.py`` sets the model
against every committed FRoD step measurement (``bench/results/time_model_check.md``), and a test keeps its verdict
honest. The model ranks set-ups; it is not a promise of a step time on another machine.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StepTime", "Link", "step_time", "CHECK_GOAL", "NVLINK"]

# FRoD under plain PyTorch, full-depth 7B, 4×512 tokens, one H200: MFU 49.2% (bench/results/two_gpu_2xh200, matrix);
# 70B widths with checkpointing: 38.8% of model FLOPs = 51.7% with the recomputed forward (zero3_levers/70b_widths).
EFFICIENCY = 0.50
# ZeRO-2 over plain on one H200: 7B 325 − 249 ms over 384 trainable tensors (two_gpu_2xh200 matrix), 70B widths
# × 20 layers 443 − 394 ms over 240 (zero3_levers/70b_widths): 0.20 ms each.
ZERO_TENSOR_S = 2.0e-4
# ZeRO-2 with bf16.check_grad_overflow false over plain, the same call on one H200 (zero3_levers, 2026-11-27T03:33):
# 267 − 266 ms over 384 trainable tensors. The check itself was 359 − 267 ms, the 0.20 ms above; ZeRO-3 checks no
# bf16 gradient, and its per-tensor cost stays the one fitted with ZERO3_LAYER_PASS_S.
ZERO2_UNCHECKED_TENSOR_S = 3e-6
# ZeRO-3 over ZeRO-2 on one H200 (nothing on a link): 7B 435 − 325 ms over 32 layers × 2 passes = 1.7 ms; 70B
# widths × 20 layers with checkpointing 485 − 443 ms over 20 × 3 = 0.7 ms; the mean.
ZERO3_LAYER_PASS_S = 1.2e-3
# ... less this per frozen tensor a decoder layer no longer has once its dense U_i are one Parameter (FRoDFrozen):
# full-depth 7B, one H200, zero3.json with U per FRoD layer 395 ms, per decoder layer 344 ms, same call
# (zero3_levers, 2026-11-27T22:26), over 32 layers × 2 passes × 5 tensors.
ZERO3_FROZEN_TENSOR_PASS_S = 1.6e-4
# Exposed gather time ÷ the link floor on 2 H200s: 7B 74 ms of 51 (1.45), 70B widths × 40 layers 348 ms of 393
# (0.89): DeepSpeed's prefetch hides little of it; the mean.
LINK_EXPOSED = 1.2
# bench/link.py, 2 H200s (NVLink), all-gather of 1 GiB: 268 GB/s bus bandwidth.
NVLINK_BUSBW = 268e9
# Host→GPU copies of the offloaded frozen weights, three passes with checkpointing: read off the one measured
# offload step, 7B zero3_offload.json on one H100, 1.63 s, of which 1.27 s is not the other parts
# (offload_7b_1xh100): 3 × 13.7 GB / 1.27 s. Fitted on that one point, so the check cannot confirm it.
OFFLOAD_BYTES_PER_S = 32e9
# Dequantization on the GPU, seconds per element and pass: a plain step with NF4 / int8 U_i (and base) minus the
# bf16 step, device time with the launch queue kept full, over the quantized elements × passes; 7B widths × 8 layers
# and 70B widths × 4 on one H200 (bench/results/host_device/h200: NF4 1.3, 1.5, 1.25, 1.7 → 1.4e-12; int8 8.1, 7.6,
# 7.4, 8.4 → 7.9e-12).
DEQUANT_DEVICE_S = {"nf4": 1.4e-12, "int8": 7.9e-12}
# The host's time per decoder layer and pass of a bf16 FRoD step: the same step on 1 × 8 tokens, where the GPU's
# share is small and the step is the host's (7B widths × 8 layers × 2 passes, 45.5 ms, same file).
HOST_LAYER_PASS_S = 2.8e-3
# ... and per quantized linear (its dequantization and the autograd Function around it): the 1 × 8-token steps with
# NF4 / NF4+base / int8 / int8+base over bf16 per quantized linear and pass: 0.23, 0.35, 0.47, 0.36 ms.
HOST_DEQUANT_CALL_S = 3.5e-4
CHECK_GOAL = 0.15


@dataclass(frozen=True)
class Link:
    """What the GPUs of one job share: all-gather bus bandwidth (bytes/s), one GPU's dense bf16 peak (FLOP/s), and
    how fast the host issues work."""

    busbw: float = NVLINK_BUSBW
    peak_flops: float = 989.4e12  # H100 / H200 SXM
    host: float = 1.0  # the host's time for the same work relative to the machine HOST_* were read on


NVLINK = Link()


@dataclass
class StepTime:
    parts: dict[str, float]  # seconds per optimizer step (one micro-batch per GPU)

    @property
    def seconds(self) -> float:
        return sum(self.parts.values())


def _config_dict(model) -> dict:
    return {"num_hidden_layers": model.layers, "hidden_size": model.hidden, "intermediate_size": model.intermediate,
            "num_attention_heads": model.heads, "num_key_value_heads": model.kv_heads, "vocab_size": model.vocab,
            "head_dim": model.head_dim}


def step_time(model, train, engine, gpus: int, link: Link = NVLINK, *, plain: bool = False) -> StepTime:
    """Predicted seconds per step of one set-up (``ModelShape``, ``TrainShape``, ``Engine`` from the planner);
    ``plain``: plain PyTorch (no DeepSpeed engine, one GPU), for comparisons."""
    from frod_ds.core.names import LLAMA_LINEARS
    from frod_ds.plan.flops import flops_per_token
    from frod_ds.plan.planner import frozen_tensors, trainable_tensors

    tokens = train.tokens
    flops = flops_per_token(_config_dict(model), train.seq_len, "frod", tokens, targets=train.targets,
                            sparsity=train.sparsity)["total"]
    rate = link.peak_flops * EFFICIENCY
    passes = 3 if train.checkpointing else 2
    parts = {"compute": tokens * flops / rate, "recompute": tokens * flops / 3 / rate if train.checkpointing else 0.0}
    trainable = trainable_tensors(model, train)  # [(numel, count)]
    n_trainable = sum(count for _, count in trainable)
    if engine.stage == 3 and train.zero3_flat_trainables and n_trainable:
        n_trainable = 2 * model.layers  # σ and S of each decoder layer as one Parameter each
    frozen_bytes = sum(b * c for group in frozen_tensors(model, train).values() for b, c, _ in group)
    quantized_linears = 0
    if train.quant != "none":
        names = [t for t in train.targets] + ([n for n in LLAMA_LINEARS if n not in train.targets]
                                              if train.quantize_base else [])
        quantized_linears = len(names)
        elements = model.layers * sum(model.linear(n)[0] * model.linear(n)[1] for n in names)
        parts["dequantize"] = DEQUANT_DEVICE_S[train.quant] * elements * passes
    device = sum(parts.values())
    host = link.host * passes * model.layers * (HOST_LAYER_PASS_S + HOST_DEQUANT_CALL_S * quantized_linears)
    parts["host beyond device"] = max(0.0, host - device)
    if plain:
        return StepTime(parts)
    checked = engine.stage == 3 or (engine.bf16_overflow_check and train.dtype == "bfloat16")
    parts["zero hooks"] = link.host * (ZERO_TENSOR_S if checked else ZERO2_UNCHECKED_TENSOR_S) * n_trainable
    n = gpus
    if engine.stage == 3:
        per_pass = ZERO3_LAYER_PASS_S
        if train.zero3_flat_frozen and train.quant == "none":
            per_pass -= ZERO3_FROZEN_TENSOR_PASS_S * (len(train.targets) - 1)
        parts["layer fetch"] = link.host * per_pass * model.layers * passes
        if engine.offload_param:
            parts["offload"] = passes * frozen_bytes / OFFLOAD_BYTES_PER_S
        elif n > 1:
            parts["link"] = LINK_EXPOSED * passes * frozen_bytes * (n - 1) / n / link.busbw
    if n > 1:
        trainable_bytes = sum(numel * count for numel, count in trainable) * train.e
        parts["gradient reduce"] = trainable_bytes * (n - 1) / n / link.busbw
    return StepTime(parts)
