"""Per-GPU memory of FRoD training by part, from the shapes alone (no weights are read): ``plan_memory``.

The bytes are those one GPU allocates at the peak (end of the forward, start of the backward, where every saved
activation is alive); ``Plan.fits``: allocated · (1 + FRAGMENTATION) + CUDA_CONTEXT_GIB ≤ GPU memory. The parts and
how each is counted: docs/memory.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from frod_ds.core.sizes import blob_nbytes, ordering
from frod_ds.plan.shapes import LINEARS, Engine, GiB, ModelShape, TrainShape

__all__ = [
    "ADAM_STATE_BYTES",
    "CUDA_CONTEXT_GIB",
    "FRAGMENTATION",
    "Plan",
    "plan_memory",
    "layer_activation_bytes",
    "frozen_tensors",
    "trainable_tensors",
    "trainable_numel",
    "activation_bytes_per_token",
]

# DeepSpeed ZeRO with a bf16/fp16 model keeps, per trainable element, an fp32 master copy and Adam's exp_avg and
# exp_avg_sq in fp32 (ZeRO paper, "mixed precision Adam": 12 bytes); on the CPU with offload_optimizer.
ADAM_STATE_BYTES = 12
# Gradient partitions (ZeRO-2's contiguous_gradients buffer, ZeRO-3's grad_partitions_flat_buffer) are in
# data_types.grad_accum_dtype, which defaults to the model dtype (DeepSpeedEngine.get_data_types); with
# offload_optimizer they live in pinned CPU memory.
# HF LlamaRMSNorm casts its input to fp32 and keeps that copy for pow/mul's backward (4 bytes per element);
# ``weight * x.to(dtype)`` keeps only the (frozen) weight. Two norms per layer, one at the end.
NORM_SAVED_BYTES = 4
# SDPA (flash / memory-efficient kernels) saves q, k, v, its output and the fp32 logsumexp per head and token.
# With a padding mask, transformers repeats GQA's k and v to all heads before SDPA (use_gqa_in_sdpa is False
# when a mask is given), so the saved k and v have the query width.
LSE_BYTES = 4
# The loss: transformers' ForCausalLMLoss computes on ``logits.float()`` (4 bytes), log_softmax keeps its fp32
# output (4) and the backward starts with a dense fp32 gradient of it (4), while the model's logits (e) are
# alive: (e + 12) bytes per vocabulary entry and token at the start of the backward.
LOSS_FP32_COPIES = 3
# The caching allocator reserves more than it allocates (block rounding, fragmentation between micro-batches of
# different lengths); CUDA context, cuBLAS workspaces and NCCL buffers are outside max_memory_allocated (about
# 0.5 + 0.5 GiB on an H100). Where both numbers come from: docs/memory.md.
FRAGMENTATION = 0.10
CUDA_CONTEXT_GIB = 1.0


@dataclass
class Plan:
    parts: dict[str, float]  # bytes per GPU
    gpus: int
    gpu_bytes: float
    activations_other: float  # activation bytes with the other gradient-checkpointing choice
    engine: Engine
    train: TrainShape
    host_bytes: float = 0.0  # what offload puts in the node's CPU memory (all its ranks together)

    @property
    def allocated(self) -> float:
        return sum(self.parts.values())

    @property
    def needed(self) -> float:
        return self.allocated * (1 + FRAGMENTATION) + CUDA_CONTEXT_GIB * GiB

    @property
    def fits(self) -> bool:
        return self.needed <= self.gpu_bytes


def _weight_bytes(shape: tuple[int, int], quant: str, e: int) -> int:
    return math.prod(shape) * e if quant == "none" else blob_nbytes(quant, shape)


def _orders(model: ModelShape, train: TrainShape, grad: bool = True) -> dict[str, str]:
    return {t: ordering(train.tokens, *model.linear(t), grad) for t in train.targets}


def layer_activation_bytes(
    model: ModelShape, train: TrainShape, linear_keeps_input: bool = False
) -> tuple[float, float]:
    """``(per token, per forward call)`` bytes one decoder layer keeps for its backward.

    Norms, SDPA and SwiGLU's saved tensors, FRoD's z = Vᵀx per member (token order) or its shared input x (weight
    order) per token; the weight order's W = U M Vᵀ and, with ``layer_saves="M"``, M per call.
    ``linear_keeps_input`` (ZeRO-3's memory_efficient_linear): every ``F.linear`` also keeps its input. Term by
    term: docs/memory.md.
    """
    e, h, f = train.e, model.hidden, model.intermediate
    q = model.heads * model.head_dim
    per_token = 2 * NORM_SAVED_BYTES * h + e * (4 * q) + LSE_BYTES * model.heads + e * 3 * f
    per_call = 0.0
    groups = {
        "q_proj": "attn",
        "k_proj": "attn",
        "v_proj": "attn",
        "o_proj": "o",
        "gate_proj": "mlp",
        "up_proj": "mlp",
        "down_proj": "down",
    }
    x_saved = set()
    plain = train.layer_saves == "M"  # the plain-autograd layer (impl="autograd") calls F.linear; the Functions do not
    for t, order in _orders(model, train).items():
        m, n = model.linear(t)
        if order == "tokens":
            per_token += e * n
            if linear_keeps_input and plain and train.quant == "none":
                per_token += e * n  # F.linear(h, U) keeps h (a quantized U goes through its own Function)
        else:
            if groups[t] not in x_saved:
                per_token += e * n
                x_saved.add(groups[t])
            per_call += e * m * n * (2 if plain and train.quant != "none" else 1)  # W (+ plain autograd: dense Ũ)
            if linear_keeps_input and plain:
                per_call += e * m * n  # F.linear(U M, V) keeps U M
        if plain:
            per_call += e * n * n
    if linear_keeps_input and not (train.quantize_base and train.quant != "none"):
        for t in LINEARS:
            if t not in train.targets and groups[t] not in x_saved:
                per_token += e * model.linear(t)[1]  # a dense untargeted linear's input
                x_saved.add(groups[t])
    return per_token, per_call


def frozen_tensors(model: ModelShape, train: TrainShape) -> dict[str, list[tuple[float, int, bool]]]:
    """``{part: [(bytes, count, in_each_layer), ...]}``: every frozen tensor's size in memory (quantized blobs as
    stored), how many of that size the model has, and whether they are one per decoder layer. ZeRO-3 decides
    partitioning per tensor, so sizes are kept apart."""
    e, h, L = train.e, model.hidden, model.layers
    base_q = train.quant if train.quantize_base else "none"
    return {
        "frozen U_i": [(_weight_bytes(model.linear(t), train.quant, e), L, True) for t in train.targets],
        "frozen V": [(model.linear(t)[1] ** 2 * e, 1, False) for t in train.targets],
        "frozen other": [
            (_weight_bytes(model.linear(n), base_q, e), L, True) for n in LINEARS if n not in train.targets
        ]
        + [(h * e, 2 * L, True), (h * e, 1, False), (model.vocab * h * e, 1 if model.tied else 2, False)],
    }


def trainable_tensors(model: ModelShape, train: TrainShape) -> list[tuple[int, int]]:
    """``[(numel, count), ...]`` of σ (n) and S (round(s·n²)) per member (``frod_ds.core.sizes.trainable_numel``)."""
    return [
        x
        for t in train.targets
        for x in ((model.linear(t)[1], model.layers), (round(train.sparsity * model.linear(t)[1] ** 2), model.layers))
    ]


def trainable_numel(model: ModelShape, train: TrainShape) -> int:
    return sum(numel * count for numel, count in trainable_tensors(model, train))


def _resident(numel: float, engine: Engine, gpus: int) -> float:
    """The fraction of a parameter of ``numel`` elements that one GPU holds: all of it under ZeRO-2 (σ and S of the
    layer partition too) and for ZeRO-3's persistent parameters (below stage3_param_persistence_threshold), 1/N
    under ZeRO-3, none with parameter offload."""
    if engine.stage != 3 or engine.layers or numel < engine.persistence:
        return 1.0
    return 0.0 if engine.offload_param else 1.0 / gpus


def _layer_gathered_numel(model: ModelShape, train: TrainShape, engine: Engine) -> float:
    """Elements ZeRO-3 gathers for one layer (quantized blobs in model-dtype elements); persistent ones excluded."""
    e = train.e
    per_layer = [(b / e, c) for items in frozen_tensors(model, train).values() for b, c, layer in items if layer]
    per_layer += [(n, c) for n, c in trainable_tensors(model, train)]
    return sum(n * c / model.layers for n, c in per_layer if n >= engine.persistence)


def _layers_kept(layers: int, p_layer: float, p_head: float, max_reuse: float) -> int:
    """How many layers k = 0, 1, … (of ``layers``) satisfy ``2·k·p_layer + p_head < max_reuse``: the gathered layers
    ZeRO-3 keeps for reuse (closed form: a config may claim any number of layers)."""
    if p_head >= max_reuse:
        return 0
    if p_layer <= 0:
        return layers
    return min(layers, math.ceil((max_reuse - p_head) / (2 * p_layer)))


def plan_memory(model: ModelShape, train: TrainShape, engine: Engine, gpus: int, gpu_bytes: float) -> Plan:
    """Peak bytes per GPU by part for one set-up (the parts: docs/memory.md)."""
    e, T, L, N = train.e, train.tokens, model.layers, max(1, gpus)
    parts: dict[str, float] = {}
    frozen = frozen_tensors(model, train)
    for part, items in frozen.items():
        if engine.layers:  # 1/N of every unit's tensors (embedding, layers, head); V and the final norm whole
            whole = [part == "frozen V" or (not in_layer and b == model.hidden * e) for b, _, in_layer in items]
            share = 0.0 if engine.offload_param else 1 / N  # offloaded: the shards are in host memory
            parts[part] = sum(b * c * (1.0 if w else share) for (b, c, _), w in zip(items, whole))
        else:
            parts[part] = sum(b * c * _resident(b / e, engine, N) for b, c, _ in items)
    P = trainable_numel(model, train)
    on_gpu = 0 if engine.offload_optimizer else e + ADAM_STATE_BYTES  # gradient partition + fp32 master and moments
    parts["trainable + optimizer"] = sum(
        n * c * (e * _resident(n, engine, N) + on_gpu / N) for n, c in trainable_tensors(model, train)
    )
    per_token, per_call = layer_activation_bytes(model, train, engine.linear_keeps_input)
    full = L * (per_token * T + per_call)
    ckpt = L * e * model.hidden * T + per_token * T + per_call  # each layer's input + one layer recomputed
    m_all = L * sum(e * model.linear(t)[1] ** 2 for t in train.targets) if train.layer_saves == "M" else 0.0
    m_ckpt = m_all / L  # checkpointing: only the recomputed layer's M is alive
    if train.checkpointing:
        parts["activations"], parts["M kept for backward"], other = ckpt - m_ckpt, m_ckpt, full - m_all
    else:
        parts["activations"], parts["M kept for backward"], other = full - m_all, m_all, ckpt - m_ckpt
    parts["logits + loss"] = T * model.vocab * (e + 4 * LOSS_FP32_COPIES) + (
        T * e * model.hidden if engine.linear_keeps_input else 0
    )
    gathered = 0.0
    # N = 1 without offload: ZeRO-3 points parameters at their only partition, no copy. With parameter offload the
    # partitions live on the CPU and every gathered parameter is a full copy on the GPU, on any N (DeepSpeed's
    # NoGatherHandle copies ds_tensor to the device). Checkpointing is non-reentrant (trainer.USE_REENTRANT): a
    # recompute's gathers are released with its layer, so the window is the same as without checkpointing.
    if engine.layers and (N > 1 or engine.offload_param):  # the backward's start: head gathered, last layer fetched
        layer = sum(b * c / L for items in frozen.values() for b, c, in_layer in items if in_layer)
        head = model.vocab * model.hidden * e
        gathered = layer + max(layer, head)
    elif engine.stage == 3 and (N > 1 or engine.offload_param):
        P_layer = _layer_gathered_numel(model, train, engine)
        P_head = model.vocab * model.hidden
        kept = _layers_kept(L, P_layer, P_head, engine.max_reuse)
        V_full = sum(b * c for b, c, _ in frozen["frozen V"] if b / e >= engine.persistence)
        gathered = (min(engine.max_live, kept * P_layer + P_head) + engine.prefetch_bucket) * e + V_full
    parts["ZeRO-3 gathered"] = gathered
    # ZeRO-1/2 allocate two reduce buckets with overlap_comm (stage_1_and_2.py ipg_buffer), ZeRO-3 one flat one.
    zero2 = engine.stage == 2 or engine.layers
    parts["DeepSpeed buffers"] = engine.reduce_bucket * e * (2 if zero2 and engine.overlap_comm else 1)
    host = 0.0
    if engine.offload_param:  # every rank's partition of the frozen and trainable parameters, in pinned memory
        host += sum(b * c for items in frozen.values() for b, c, _ in items if b / e >= engine.persistence)
        host += sum(n * c * e for n, c in trainable_tensors(model, train) if n >= engine.persistence)
    if engine.offload_optimizer:
        host += P * (e + ADAM_STATE_BYTES)  # gradient partitions, fp32 master and moments
    return Plan(parts, N, gpu_bytes, other, engine, train, host)


def activation_bytes_per_token(model: ModelShape, train: TrainShape) -> dict[str, float]:
    """Saved bytes per token over the whole model, without and with gradient checkpointing (for reports)."""
    per_token, _ = layer_activation_bytes(model, train, False)
    return {
        "no_checkpointing": model.layers * per_token,
        "checkpointing": model.layers * train.e * model.hidden + per_token,
    }
