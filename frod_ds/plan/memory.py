"""Memory planner: per-GPU memory of FRoD training by part, from ``config.json`` alone, and the fastest set-up that
fits.

    python -m frod_ds plan --model meta-llama/Llama-2-7b-hf --gpus 2 --recipe recipes/llama2_7b_cs170k.yaml
    python -m frod_ds plan --model /ckpt/llama-2-70b --gpus 2 --config ds_configs/zero3.json \\
        recipe: model.frozen_quant=nf4

Everything is derived from the shapes (no weights are read) and the constants below, which say where each comes
from. ``plan_memory`` gives the bytes one GPU allocates at the peak (end of the forward / start of the backward,
where every saved activation is alive) for one set-up; ``recommend`` walks the set-ups from fastest to slowest
(``candidates``: the recipe's precision first) and returns, within the first precision where anything fits, the set-up
with the least predicted step time (``frod_ds.plan.step_time``, a model checked against measured steps), with a one-line
reason. ``hint`` is what ``launch/train.py`` prints when the chosen set-up is the slow (or the failing) one.

Parts (bytes per GPU; ``e`` = bytes of the model dtype, ``N`` = GPUs, ``T`` = tokens per micro-batch per GPU):

    frozen U_i          Σ U_i in the model dtype or as quantized blobs;      / N under ZeRO-3, 0 with parameter offload
    frozen V            Σ_c n_c² · e (one V per category);                   idem
    frozen other        embeddings, lm_head, norms, untargeted linears (quantized with quantize_base); idem
    trainable+optimizer σ, S: parameter e, gradient e, fp32 master + Adam moments (ADAM_STATE_BYTES), partitioned
    activations         Σ_layers T · (saved bytes per token of a LLaMA block + FRoD's z per member); with gradient
                        checkpointing: each layer's input, plus one layer recomputed in the backward
    M kept for backward the dense (n, n) M = diag σ + S of every member per forward (the layer before its autograd
                        Function: ``layer_saves="M"``; the Function keeps z only: ``"z"``)
    logits + loss       T · vocab · LOSS_BYTES_PER_VOCAB(e)
    ZeRO-3 gathered     full parameters gathered and not yet released (N > 1): the V's, lm_head, and the layers whose
                        next use (in the backward) is within stage3_max_reuse_distance, capped by max_live_parameters
    DeepSpeed buffers   gradient reduce buckets (reduce_bucket_size from the JSON)

``fits``: allocated · (1 + FRAGMENTATION) + CUDA_CONTEXT_GIB ≤ GPU memory.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from typing import Any

from frod_ds.config.ds_config import DS_DEFAULTS, bf16_overflow_check, load_ds_config, zero_settings
from frod_ds.core.names import DEFAULT_TARGETS, LLAMA_LINEARS
from frod_ds.runtime.errors import FrodError

__all__ = [
    "PlanError",
    "ModelShape",
    "TrainShape",
    "Engine",
    "Plan",
    "Recommendation",
    "plan_memory",
    "recommend",
    "hint",
    "candidates",
    "predicted_seconds",
    "load_model_shape",
    "model_shape_from_config",
    "engine_from_ds_config",
    "train_shape_from_recipe",
    "shipped_engines",
    "trainable_numel",
    "layer_activation_bytes",
    "train_hint",
]


class PlanError(FrodError):
    """Input the memory planner cannot plan for (a config.json it does not model, unknown targets)."""


GiB = 2**30

# ---- constants: every number the plan uses, with where it comes from ----------------------------------------------

ELEMENT_BYTES = {"bfloat16": 2, "float32": 4}
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
# PyTorch's caching allocator reserves more than it allocates (block rounding, fragmentation between micro-
# batches of different lengths): 10% is what the HJD and training benches here show (reserved / allocated
# 1.05–1.5 on small peaks, lower on large ones). CUDA context, cuBLAS workspaces and NCCL channel buffers are
# not counted by torch.cuda.max_memory_allocated: about 0.5 GiB (context) + 0.5 GiB (NCCL) on an H100.
FRAGMENTATION = 0.10
CUDA_CONTEXT_GIB = 1.0
# DeepSpeed's values for the keys a JSON leaves out are frod_ds.config.ds_config.DS_DEFAULTS (checked against the
# installed DeepSpeed); an Engine built without a JSON takes them too.
_ZERO_DEFAULTS = DS_DEFAULTS["zero_optimization"]
# Under ZeRO-3, DeepSpeed replaces torch.nn.functional.linear process-wide with LinearFunctionForZeroStage3
# (zero_optimization.memory_efficient_linear, default true; deepspeed/runtime/zero/linear.py), which saves its
# input for the backward even when the weight is frozen: every F.linear then keeps its input.
LINEAR_KEEPS_INPUT_ZERO3 = bool(_ZERO_DEFAULTS["memory_efficient_linear"])
LLAMA_FAMILY = ("llama", "mistral", "qwen2")
LINEARS = LLAMA_LINEARS
# The shipped configs, in the order ties are broken (the step-time model, frod_ds.plan.step_time, ranks them).
ENGINE_FILES = ("zero2.json", "zero3.json", "zero3_offload.json", "zero3_nvme.json")
# Within one engine: the exact model first (gradient checkpointing costs about one more forward, ~1/3 of a
# step), then quantized frozen weights (they change the model: init drift, README), int8 before nf4 (smaller
# error), the targeted U_i alone before the whole base too (quantize_base).
VARIANTS = (("none", False), ("int8", False), ("int8", True), ("nf4", False), ("nf4", True))
# launch/train.py names a faster shipped engine only when the step-time model predicts it this much faster (the
# model's check against measured steps: within 15%, bench/results/time_model_check.md).
HINT_MARGIN = 0.15


# ---- inputs ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """A LLaMA-family decoder's shapes, from its config.json."""

    model_type: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool

    def linear(self, name: str) -> tuple[int, int]:
        """(out, in) of one layer's linear ``name``."""
        h, q, kv, f = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        return {
            "q_proj": (q, h),
            "k_proj": (kv, h),
            "v_proj": (kv, h),
            "o_proj": (h, q),
            "gate_proj": (f, h),
            "up_proj": (f, h),
            "down_proj": (h, f),
        }[name]

    @property
    def parameters(self) -> int:
        per_layer = sum(math.prod(self.linear(n)) for n in LINEARS) + 2 * self.hidden
        return self.layers * per_layer + self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden


def model_shape_from_config(cfg: dict[str, Any], where: str = "config.json") -> ModelShape:
    """``PlanError`` (one line) for a config the planner does not model."""
    mtype = cfg.get("model_type")
    if mtype not in LLAMA_FAMILY:
        raise PlanError(
            f"{where}: model_type {mtype!r} is not one the planner models (LLaMA-family decoders: "
            f"{', '.join(LLAMA_FAMILY)})"
        )
    need = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    missing = [k for k in need if not isinstance(cfg.get(k), int)]
    if missing:
        raise PlanError(f"{where}: missing or non-integer {', '.join(missing)}; not a complete {mtype} config")
    heads = cfg["num_attention_heads"]
    return ModelShape(
        mtype,
        cfg["hidden_size"],
        cfg["intermediate_size"],
        cfg["num_hidden_layers"],
        heads,
        int(cfg.get("num_key_value_heads") or heads),
        int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
        cfg["vocab_size"],
        bool(cfg.get("tie_word_embeddings", False)),
    )


def load_model_shape(model: str) -> ModelShape:
    """From a checkpoint directory or a Hub id in the local cache; reads config.json only."""
    from frod_ds.io.hf_checkpoint import resolve_config_file

    path = resolve_config_file(model)
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, OSError) as e:
        raise PlanError(f"{path} is not readable JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise PlanError(f"{path} is not a JSON object")
    return model_shape_from_config(cfg, str(path))


@dataclass(frozen=True)
class TrainShape:
    """What the recipe decides about memory."""

    micro_batch: int = 4
    seq_len: int = 256
    dtype: str = "bfloat16"
    targets: tuple[str, ...] = DEFAULT_TARGETS
    sparsity: float = 0.02
    quant: str = "none"
    quantize_base: bool = False
    checkpointing: bool = False
    layer_saves: str = "z"  # "z": FRoDLinear's autograd Function keeps z = Vᵀx only; "M": it also keeps M
    # DeepSpeed's ZeRO (stages 1-3) holds a decoder layer's σ and S as two Parameters (frod_ds.core.layer.
    # FRoDTrainables, the build's default); False: one σ and one S Parameter per FRoD layer (builds before it, and
    # the benchmarks' comparison)
    flat_trainables: bool = True
    # ZeRO-3 holds a decoder layer's dense U_i as one frozen Parameter (frod_ds.core.layer.FRoDFrozen, the build's
    # default without quantization or NVMe parameter offload); False: one per FRoD layer (builds before it)
    zero3_flat_frozen: bool = True
    # DeepSpeed's NVTX ranges on (FROD_DS_NVTX=1; DeepSpeed's default, the runs before frod-ds turned them off)
    deepspeed_nvtx: bool = False

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_len

    @property
    def e(self) -> int:
        return ELEMENT_BYTES[self.dtype]


def train_shape_from_recipe(recipe, layer_saves: str = "z", seq_len: int | None = None) -> TrainShape:
    m, d, t = recipe.model, recipe.data, recipe.train
    return TrainShape(
        t.micro_batch_size,
        seq_len or d.cutoff_len,
        m.dtype,
        tuple(m.targets),
        m.sparsity,
        m.frozen_quant,
        m.quantize_base,
        m.gradient_checkpointing,
        layer_saves,
    )


@dataclass(frozen=True)
class Engine:
    """The DeepSpeed settings that decide memory."""

    name: str
    stage: int
    offload_param: bool = False
    offload_optimizer: bool = False
    overlap_comm: bool = False
    reduce_bucket: float = float(_ZERO_DEFAULTS["reduce_bucket_size"])
    prefetch_bucket: float = float(_ZERO_DEFAULTS["stage3_prefetch_bucket_size"])
    persistence: float = float(_ZERO_DEFAULTS["stage3_param_persistence_threshold"])
    max_live: float = float(_ZERO_DEFAULTS["stage3_max_live_parameters"])
    max_reuse: float = float(_ZERO_DEFAULTS["stage3_max_reuse_distance"])
    memory_efficient_linear: bool = LINEAR_KEEPS_INPUT_ZERO3
    bf16_overflow_check: bool = True  # ZeRO-2 tests every bf16 gradient before a step (time only, not memory)

    @property
    def linear_keeps_input(self) -> bool:
        return self.stage == 3 and self.memory_efficient_linear


def engine_from_ds_config(cfg: dict[str, Any], name: str = "config") -> Engine:
    """The ``Engine`` of a DeepSpeed JSON as the one reader of it (``ds_config.zero_settings``) sees it. ZeRO-0/1
    are planned like ZeRO-2: each replicates the frozen model on every GPU."""
    z = zero_settings(cfg)
    return Engine(
        name,
        3 if z.stage == 3 else 2,
        z.offload_param is not None,
        z.offload_optimizer is not None,
        z.overlap_comm,
        float(z.reduce_bucket_size),
        float(z.prefetch_bucket_size),
        float(z.param_persistence_threshold),
        float(z.max_live_parameters),
        float(z.max_reuse_distance),
        z.memory_efficient_linear,
        bf16_overflow_check(cfg),
    )


def shipped_engines() -> list[Engine]:
    """The shipped ds_configs, fastest first (their bucket sizes as written), read by the one DeepSpeed JSON
    reader; a missing one is an error naming it (``runtime.shipped``), never a stand-in."""
    from frod_ds.runtime.shipped import shipped_file

    return [
        engine_from_ds_config(load_ds_config(shipped_file("ds_configs", fname)), f"ds_configs/{fname}")
        for fname in ENGINE_FILES
    ]


# ---- the arithmetic -------------------------------------------------------------------------------------------------


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
    if quant == "none":
        return math.prod(shape) * e
    from frod_ds.core.sizes import blob_nbytes

    return blob_nbytes(quant, shape)


def _orders(model: ModelShape, train: TrainShape, grad: bool = True) -> dict[str, str]:
    from frod_ds.core.sizes import ordering

    return {t: ordering(train.tokens, *model.linear(t), grad) for t in train.targets}


def layer_activation_bytes(
    model: ModelShape, train: TrainShape, linear_keeps_input: bool = False
) -> tuple[float, float]:
    """``(per token, per forward call)`` bytes one decoder layer keeps for its backward.

    Per token: 2 norms × NORM_SAVED_BYTES·h; SDPA's q, k, v, output (k, v repeated to all heads) and logsumexp;
    SwiGLU's gate (SiLU's input), SiLU's output and up (the product's operands); frozen linears keep no input.
    FRoD per member in the token order: z = Vᵀx (n); in the weight order: its input x once per input shared by
    several members. Per call: the weight order's W = U M Vᵀ (m·n) per member, and M (n²) with ``layer_saves="M"``.
    ``linear_keeps_input`` (ZeRO-3's memory_efficient_linear, LINEAR_KEEPS_INPUT): every ``F.linear`` also keeps
    its input: the plain-autograd FRoD layer's h = M z (n) per member (token order) or U M (m·n, weight order),
    and a dense untargeted linear's input (down_proj: f).
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
    """``[(numel, count), ...]`` of σ (n) and S (round(s·n²)) per member (``frod_ds.core.layer.trainable_numel``)."""
    return [
        x
        for t in train.targets
        for x in ((model.linear(t)[1], model.layers), (round(train.sparsity * model.linear(t)[1] ** 2), model.layers))
    ]


def trainable_numel(model: ModelShape, train: TrainShape) -> int:
    return sum(numel * count for numel, count in trainable_tensors(model, train))


def _resident(numel: float, engine: Engine, gpus: int) -> float:
    """The fraction of a parameter of ``numel`` elements that one GPU holds: all of it under ZeRO-2 and for
    ZeRO-3's persistent parameters (below stage3_param_persistence_threshold), 1/N under ZeRO-3, none with
    parameter offload."""
    if engine.stage != 3 or numel < engine.persistence:
        return 1.0
    return 0.0 if engine.offload_param else 1.0 / gpus


def _layer_gathered_numel(model: ModelShape, train: TrainShape, engine: Engine) -> float:
    """Elements ZeRO-3 gathers for one layer (quantized blobs in model-dtype elements); persistent ones excluded."""
    e = train.e
    per_layer = [(b / e, c) for items in frozen_tensors(model, train).values() for b, c, layer in items if layer]
    per_layer += [(n, c) for n, c in trainable_tensors(model, train)]
    return sum(n * c / model.layers for n, c in per_layer if n >= engine.persistence)


def plan_memory(model: ModelShape, train: TrainShape, engine: Engine, gpus: int, gpu_bytes: float) -> Plan:
    """Peak bytes per GPU by part for one set-up (module docstring)."""
    e, T, L, N = train.e, train.tokens, model.layers, max(1, gpus)
    parts: dict[str, float] = {}
    frozen = frozen_tensors(model, train)
    for part, items in frozen.items():
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
    if engine.stage == 3 and (N > 1 or engine.offload_param):
        P_layer = _layer_gathered_numel(model, train, engine)
        P_head = model.vocab * model.hidden
        kept = sum(1 for k in range(L) if 2 * k * P_layer + P_head < engine.max_reuse)
        V_full = sum(b * c for b, c, _ in frozen["frozen V"] if b / e >= engine.persistence)
        gathered = (min(engine.max_live, kept * P_layer + P_head) + engine.prefetch_bucket) * e + V_full
    parts["ZeRO-3 gathered"] = gathered
    # ZeRO-1/2 allocate two reduce buckets with overlap_comm (stage_1_and_2.py ipg_buffer), ZeRO-3 one flat one.
    parts["DeepSpeed buffers"] = engine.reduce_bucket * e * (2 if engine.stage == 2 and engine.overlap_comm else 1)
    host = 0.0
    if engine.offload_param:  # every rank's partition of the frozen and trainable parameters, in pinned memory
        host += sum(b * c for items in frozen.values() for b, c, _ in items if b / e >= engine.persistence)
        host += sum(n * c * e for n, c in trainable_tensors(model, train) if n >= engine.persistence)
    if engine.offload_optimizer:
        host += P * (e + ADAM_STATE_BYTES)  # gradient partitions, fp32 master and moments
    return Plan(parts, N, gpu_bytes, other, engine, train, host)


# ---- decisions ------------------------------------------------------------------------------------------------------


@dataclass
class Recommendation:
    engine: Engine
    quant: str
    quantize_base: bool
    checkpointing: bool
    plan: Plan
    reason: str
    tried: list[Plan] = field(default_factory=list)
    seconds: float = 0.0  # predicted seconds per step (frod_ds.plan.step_time)
    alternative: str = ""  # a much faster set-up at a coarser precision, named but not chosen

    def describe(self) -> str:
        q = (
            "frozen bf16"
            if self.quant == "none"
            else f"frozen_quant={self.quant}" + (" quantize_base=true" if self.quantize_base else "")
        )
        return f"{self.engine.name}, {q}, gradient checkpointing {'on' if self.checkpointing else 'off'}"


def candidates(engines: list[Engine], train: TrainShape | None = None) -> list[tuple[Engine, str, bool, bool]]:
    """Every (engine, quant, quantize_base, checkpointing), grouped by precision: the recipe's own first (``train``;
    a quantized model is a different model, so precision is the recipe's choice), then ``VARIANTS`` from the most
    exact; within a precision, engines and checkpointing in the shipped order (the time model ranks them)."""
    own = [(train.quant, train.quantize_base)] if train is not None else []
    tiers = own + [v for v in VARIANTS if v not in own]
    return [(eng, q, qb, gc) for q, qb in tiers for eng in engines for gc in (False, True)]


def predicted_seconds(model: ModelShape, plan: Plan, link=None) -> float:
    """The step-time model's seconds for a planned set-up (``frod_ds.plan.step_time``)."""
    from frod_ds.plan.step_time import NVLINK, step_time

    return step_time(model, plan.train, plan.engine, plan.gpus, link or NVLINK).seconds


def recommend(
    model: ModelShape, train: TrainShape, gpus: int, gpu_bytes: float, engines: list[Engine] | None = None, link=None
) -> Recommendation | None:
    """The fastest set-up that fits (None when none does): within the first precision of ``candidates`` where
    anything fits, the engine and checkpointing with the least predicted step time; a one-line reason."""
    tried: list[Plan] = []
    tier: list[tuple[tuple, Plan, float]] = []
    for eng, q, qb, gc in candidates(engines or shipped_engines(), train):
        if tier and (q, qb) != tier[-1][0][1:3]:
            if any(p.fits for _, p, _ in tier):
                break
            tier = []
        plan = plan_memory(model, replace(train, quant=q, quantize_base=qb, checkpointing=gc), eng, gpus, gpu_bytes)
        tried.append(plan)
        tier.append(((eng, q, qb, gc), plan, predicted_seconds(model, plan, link)))
    fitting = [t for t in tier if t[1].fits]
    if not fitting:
        return None
    (eng, q, qb, gc), plan, secs = min(fitting, key=lambda t: t[2])
    alternative = _quantized_alternative(model, train, gpus, gpu_bytes, engines, link, (q, qb), secs)
    return Recommendation(
        eng, q, qb, gc, plan, _reason(plan, secs, tier, tried) + alternative, tried, secs, alternative
    )


def _quantized_alternative(
    model: ModelShape,
    train: TrainShape,
    gpus: int,
    gpu_bytes: float,
    engines: list[Engine] | None,
    link,
    chosen: tuple[str, bool],
    secs: float,
) -> str:
    """``; with <precision>: <engine> would take N ms`` when a coarser precision (the fastest of them) fits at under
    half the chosen
    step time (e.g. 70B in bf16 only fits with parameter offload), else ``""``. Not chosen: it changes the model."""
    later = VARIANTS[VARIANTS.index(chosen) + 1 :] if chosen in VARIANTS else ()
    best = None
    for q, qb in later:
        for eng in engines or shipped_engines():
            for gc in (False, True):
                plan = plan_memory(
                    model, replace(train, quant=q, quantize_base=qb, checkpointing=gc), eng, gpus, gpu_bytes
                )
                if plan.fits:
                    t = predicted_seconds(model, plan, link)
                    if best is None or t < best[0]:
                        best = (t, plan)
    if best is None or best[0] > 0.5 * secs:
        return ""
    t, plan = best
    q = f"frozen_quant={plan.train.quant}" + (" quantize_base=true" if plan.train.quantize_base else "")
    return (
        f"; with {q} (a quantized model: it moves the logits), {plan.engine.name} would take a predicted "
        f"{t * 1e3:.0f} ms per step"
    )


def _reason(plan: Plan, secs: float, tier: list[tuple[tuple, Plan, float]], tried: list[Plan]) -> str:
    need, have = plan.needed / GiB, plan.gpu_bytes / GiB
    tight = f" (tight: {need / have:.0%} of the GPU)" if need > 0.9 * have else ""
    (_, fastest, fast_s) = min(tier, key=lambda t: t[2])
    step = f"predicted {secs * 1e3:.0f} ms per step"
    if fastest is plan:
        head = (
            "the fastest set-up fits"
            if any(tried[0] is p for _, p, _ in tier)
            else ("the recipe's precision fits nowhere; the most exact precision that fits, fastest set-up")
        )
        return f"{head}: {need:.1f} of {have:.1f} GiB per GPU, {step}{tight}"
    return (
        f"{fastest.engine.name} (gradient checkpointing {'on' if fastest.train.checkpointing else 'off'}) would be "
        f"faster ({fast_s * 1e3:.0f} ms) but needs {fastest.needed / GiB:.1f} GiB per GPU, more than {have:.1f}; "
        f"this is the fastest set-up that fits ({need:.1f} GiB, {step}){tight}"
    )


def hint(model: ModelShape, train: TrainShape, chosen: Engine, gpus: int, gpu_bytes: float) -> str | None:
    """One line for ``launch/train.py`` when ``chosen`` (with the recipe's quantization and checkpointing) is likely
    out of memory, or another shipped engine fits the same recipe and the step-time model predicts it at least
    ``HINT_MARGIN`` faster; None otherwise."""
    engines = shipped_engines()
    plan = plan_memory(model, train, chosen, gpus, gpu_bytes)
    if not plan.fits:
        rec = recommend(model, train, gpus, gpu_bytes, engines)
        fix = f"use {rec.describe()}{rec.alternative}" if rec else "no shipped set-up fits: use more GPUs"
        return (
            f"hint: predicted {plan.needed / GiB:.1f} GiB per GPU under {chosen.name} ({gpus} GPU(s) of "
            f"{gpu_bytes / GiB:.1f} GiB): likely out of memory; {fix} (python -m frod_ds plan)"
        )
    mine = predicted_seconds(model, plan)
    others = [
        (predicted_seconds(model, p), p)
        for p in (plan_memory(model, train, e, gpus, gpu_bytes) for e in engines if e.name != chosen.name)
        if p.fits
    ]
    if others:
        secs, best = min(others, key=lambda t: t[0])
        if secs < mine * (1 - HINT_MARGIN):
            return (
                f"hint: {best.engine.name} fits this recipe on {gpus} GPU(s) ({best.needed / GiB:.1f} of "
                f"{gpu_bytes / GiB:.1f} GiB) and is faster than {chosen.name}: predicted {secs * 1e3:.0f} vs "
                f"{mine * 1e3:.0f} ms per step (python -m frod_ds plan)"
            )
    return None


def activation_bytes_per_token(model: ModelShape, train: TrainShape) -> dict[str, float]:
    """Saved bytes per token over the whole model, without and with gradient checkpointing (for reports)."""
    per_token, _ = layer_activation_bytes(model, train, False)
    return {
        "no_checkpointing": model.layers * per_token,
        "checkpointing": model.layers * train.e * model.hidden + per_token,
    }


def train_hint(
    recipe, config_path: str, world_size: int, gpu_bytes: float | None, layer_saves: str = "z"
) -> str | None:
    """``hint`` for ``launch/train.py``: the recipe, its DeepSpeed JSON, the world size and one GPU's memory (None
    without a GPU: no line). None too when an input is unreadable (training's own checks report that)."""
    if not gpu_bytes:
        return None
    try:
        model = load_model_shape(recipe.model.base)
        engine = engine_from_ds_config(load_ds_config(config_path), str(config_path))
        return hint(model, train_shape_from_recipe(recipe, layer_saves), engine, world_size, gpu_bytes)
    except (FrodError, OSError, KeyError):
        return None
