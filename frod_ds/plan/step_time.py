"""Step-time model: seconds per optimizer step of FRoD training for one set-up, from the shapes and a few measured
constants, so the planner can rank the set-ups that fit by speed instead of by a fixed order.

    step = max(device, host) + overflow check + link + offload + gradient reduce

    device        compute + recompute + dequantization on the GPU:
      compute     T · F / (peak · EFFICIENCY)          T tokens per micro-batch per GPU, F model FLOPs per token
                                                        (``frod_ds.plan.flops``: base forward, backward to inputs,
                                                        FRoD's own work)
      recompute   with gradient checkpointing one more forward: F / 3 of the same
      dequantize  NF4/int8 frozen weights: DEQUANT_DEVICE_S[kind] per quantized element and pass
    host          what Python issues, × ``Link.host`` (the host's speed relative to the machine the constants were read
                  on). The GPU runs what the host queued, so the two overlap: a step is the slower of the two. At 7B
                  widths the host is close to the GPU already, and DeepSpeed's work makes ZeRO-3 steps host-bound
                  (ZeRO-2's too while σ and S were 384 tensors); at 70B widths the GPU is the slower and hides it.
      layers      per decoder layer and pass: HOST_LAYER_PASS_S, plus HOST_DEQUANT_CALL_S for each quantized linear
                  (bitsandbytes' dequantization and its autograd Function)
      DeepSpeed   under a ZeRO engine: ZERO_STEP_HOST_S per step (the engine's forward, backward and step wrappers,
                  the partitioned optimizer step), ZERO_TENSOR_HOST_S per trainable tensor (gradient hooks,
                  bucketing, copies into the partition: σ and S of each decoder layer, ``FRoDTrainables``, two per
                  layer; one per FRoD layer where built so), and under ZeRO-3 ZERO3_LAYER_PASS_S per decoder layer
                  and pass (fetch and release of one layer's parameters, the shipped per-layer fetch; passes = 2, 3
                  with checkpointing), less ZERO3_FROZEN_TENSOR_PASS_S for each U_i beyond the first when a layer's
                  dense U_i are one Parameter (``FRoDFrozen``), less ZERO3_NVTX_LAYER_PASS_S with DeepSpeed's
                  NVTX ranges off (frod-ds's default)
    overflow check ZeRO-2 with DeepSpeed's bf16 per-gradient check (off in the shipped zero2.json): ZERO_CHECK_TENSOR_S
                  per trainable tensor, × ``Link.host``; it ends in a host sync, so it adds instead of overlapping
    link          N > 1 under ZeRO-3: LINK_EXPOSED × the bytes of the frozen weights a rank does not hold, gathered
                  once per pass, at the link's all-gather bus bandwidth; ZeRO-2: the trainable gradients'
                  reduce-scatter
    offload       parameter offload: the frozen weights cross PCIe once per pass at OFFLOAD_BYTES_PER_S

Every constant below names the committed measurement it was read from; ``bench/time_model_check.py`` sets the model
against every committed FRoD step measurement (``bench/results/time_model_check.md``), and a test keeps its verdict
honest. The model ranks set-ups; it is not a promise of a step time on another machine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["StepTime", "Link", "step_time", "CHECK_GOAL", "NVLINK"]

# FRoD under plain PyTorch, full-depth 7B, 4×512 tokens, one H200: MFU 49.2% (bench/results/two_gpu_2xh200, matrix);
# 70B widths with checkpointing: 38.8% of model FLOPs = 51.7% with the recomputed forward (zero3_levers/70b_widths).
EFFICIENCY = 0.50
# DeepSpeed's host work on the H200 machine's host (the module's docstring says what each covers). Read off
# host-bound steps, where step = host: the layers' share there is 2 × 32 × HOST_LAYER_PASS_S = 179 ms at full-depth 7B.
# Per step: FRoD zero3.json on 4 layers of 7B widths, U per FRoD layer (deepcompile_4_layers, 78 ms: 78 − 22 layers
# − 1 tensors − 18 fetches = 36 ms) and zero2.json with σ and S per FRoD layer, unchecked, full depth (zero3_levers
# 2026-11-27T03:33, 282 ms median of 11 calls: 282 − 179 − 58 for 384 tensors = 45 ms); about their mean.
ZERO_STEP_HOST_S = 40e-3
# Per trainable tensor: σ and S per FRoD layer against per decoder layer, same call, full-depth 7B on one H200 —
# zero2.json 305 − 270 ms (2026-11-28T02:33) and zero3.json 443 − 386 ms (2026-11-27T10:47) over the 320 tensors
# fewer: 0.11 and 0.18 ms.
ZERO_TENSOR_HOST_S = 1.5e-4
# Per decoder layer and pass under ZeRO-3, with a layer's U_i as six Parameters: zero3.json at full-depth 7B with U
# one Parameter per layer and DeepSpeed's F.linear replacement on (2026-11-27T22:31, 322 ms, the median of its three
# calls): (322 − 179 − 40 − 10 for 64 tensors) / 64 = 1.5 ms, plus the five U tensors below. The shipped zero3.json
# since turns that replacement off (memory_efficient_linear): 311 and 312 ms in two calls (2026-11-28T03:16, 03:21,
# windows in turn), against 325 predicted with DeepSpeed's NVTX ranges on, as they were.
ZERO3_LAYER_PASS_S = 2.3e-3
# ... less this per frozen tensor a decoder layer no longer has once its dense U_i are one Parameter (FRoDFrozen):
# full-depth 7B, one H200, zero3.json with U per FRoD layer 395 ms, per decoder layer 344 ms, same call
# (zero3_levers, 2026-11-27T22:26), over 32 layers × 2 passes × 5 tensors.
ZERO3_FROZEN_TENSOR_PASS_S = 1.6e-4
# ... less this with DeepSpeed's NVTX ranges off (frod_ds.runtime.distributed; every point above ran with them on):
# zero3.json at full-depth 7B on one H200 with them on 307 ms, off 297 ms, same call, windows in turn (zero3_levers
# 2026-11-28T04:31, a noisy call: slower with them on in 4 of its 6 rounds), over 32 layers × 2 passes. The shipped
# build is predicted at 315 ms.
ZERO3_NVTX_LAYER_PASS_S = 1.6e-4
# DeepSpeed 0.19.8's bf16 per-gradient overflow check, per trainable tensor (ZeRO-2; off in the shipped zero2.json).
# Alone it was 92 ms over 384 tensors in one call (zero3_levers 2026-11-27T03:33: 0.24 ms); set against every
# committed step with the check on (7B and 70B widths, H200 and H100 machines, 1 and 2 GPUs) that overstates it, part
# of it overlapping the device: 0.1 ms keeps all of them within the check's goal.
ZERO_CHECK_TENSOR_S = 1.0e-4
# Exposed gather time ÷ the link floor on 2 H200s: 7B 74 ms of 51 (1.45), 70B widths × 40 layers 348 ms of 393
# (0.89): DeepSpeed's prefetch hides little of it; the mean.
LINK_EXPOSED = 1.2
# bench/link.py, 2 H200s (NVLink), all-gather of 1 GiB: 268 GB/s bus bandwidth.
NVLINK_BUSBW = 268e9
# Host→GPU copies of the offloaded frozen weights, three passes with checkpointing: read off the one measured
# offload step, 7B zero3_offload.json on one H100, 1.63 s, of which 0.88 s is not the other parts
# (offload_7b_1xh100): 3 × 13.7 GB / 0.88 s. Fitted on that one point, so the check cannot confirm it.
OFFLOAD_BYTES_PER_S = 47e9
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
    parts: dict[str, float]  # seconds per optimizer step (one micro-batch per GPU); they add up to the step
    host: dict[str, float] = field(default_factory=dict)  # the host's work per step, overlapping the device's

    @property
    def seconds(self) -> float:
        return sum(self.parts.values())


def _config_dict(model) -> dict:
    return {
        "num_hidden_layers": model.layers,
        "hidden_size": model.hidden,
        "intermediate_size": model.intermediate,
        "num_attention_heads": model.heads,
        "num_key_value_heads": model.kv_heads,
        "vocab_size": model.vocab,
        "head_dim": model.head_dim,
    }


def step_time(model, train, engine, gpus: int, link: Link = NVLINK, *, plain: bool = False) -> StepTime:
    """Predicted seconds per step of one set-up (``ModelShape``, ``TrainShape``, ``Engine`` from the planner);
    ``plain``: plain PyTorch (no DeepSpeed engine, one GPU), for comparisons."""
    from frod_ds.core.names import LLAMA_LINEARS
    from frod_ds.plan.flops import flops_per_token
    from frod_ds.plan.memory import frozen_tensors, trainable_tensors

    tokens = train.tokens
    flops = flops_per_token(
        _config_dict(model), train.seq_len, "frod", tokens, targets=train.targets, sparsity=train.sparsity
    )["total"]
    rate = link.peak_flops * EFFICIENCY
    passes = 3 if train.checkpointing else 2
    parts = {"compute": tokens * flops / rate, "recompute": tokens * flops / 3 / rate if train.checkpointing else 0.0}
    trainable = trainable_tensors(model, train)  # [(numel, count)]
    n_trainable = sum(count for _, count in trainable)
    if not plain and train.flat_trainables and n_trainable:
        n_trainable = 2 * model.layers  # σ and S of each decoder layer as one Parameter each
    frozen_bytes = sum(b * c for group in frozen_tensors(model, train).values() for b, c, _ in group)
    quantized_linears = 0
    if train.quant != "none":
        names = [t for t in train.targets] + (
            [n for n in LLAMA_LINEARS if n not in train.targets] if train.quantize_base else []
        )
        quantized_linears = len(names)
        elements = model.layers * sum(model.linear(n)[0] * model.linear(n)[1] for n in names)
        parts["dequantize"] = DEQUANT_DEVICE_S[train.quant] * elements * passes
    device = sum(parts.values())
    host = {"layers": passes * model.layers * (HOST_LAYER_PASS_S + HOST_DEQUANT_CALL_S * quantized_linears)}
    if not plain:
        host["DeepSpeed step"] = ZERO_STEP_HOST_S
        host["DeepSpeed tensors"] = ZERO_TENSOR_HOST_S * n_trainable
        if engine.stage == 3:
            per_pass = ZERO3_LAYER_PASS_S
            if train.zero3_flat_frozen and train.quant == "none":
                per_pass -= ZERO3_FROZEN_TENSOR_PASS_S * (len(train.targets) - 1)
            if not train.deepspeed_nvtx:
                per_pass -= ZERO3_NVTX_LAYER_PASS_S
            host["ZeRO-3 layer fetch"] = per_pass * model.layers * passes
    host = {k: link.host * v for k, v in host.items()}
    parts["host beyond device"] = max(0.0, sum(host.values()) - device)
    if plain:
        return StepTime(parts, host)
    if engine.bf16_overflow_check and train.dtype == "bfloat16" and engine.stage < 3:
        parts["overflow check"] = link.host * ZERO_CHECK_TENSOR_S * n_trainable
    n = gpus
    if engine.stage == 3:
        if engine.offload_param:
            parts["offload"] = passes * frozen_bytes / OFFLOAD_BYTES_PER_S
        elif n > 1:
            parts["link"] = LINK_EXPOSED * passes * frozen_bytes * (n - 1) / n / link.busbw
    if n > 1:
        trainable_bytes = sum(numel * count for numel, count in trainable) * train.e
        parts["gradient reduce"] = trainable_bytes * (n - 1) / n / link.busbw
    return StepTime(parts, host)
