"""What the planner plans for: a model's shapes (``ModelShape``, from config.json), the recipe's choices
(``TrainShape``) and the DeepSpeed settings that decide memory (``Engine``), each with its reader."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from frod_ds.config.ds_config import DS_DEFAULTS, bf16_overflow_check, load_ds_config, required_dtype, zero_settings
from frod_ds.core.names import DEFAULT_TARGETS, LLAMA_LINEARS
from frod_ds.io.model_config import LLAMA_FAMILY, config_problems
from frod_ds.runtime.errors import FrodError

__all__ = [
    "PlanError",
    "GiB",
    "ELEMENT_BYTES",
    "ModelShape",
    "TrainShape",
    "Engine",
    "load_model_shape",
    "model_shape_from_config",
    "train_shape_from_recipe",
    "engine_from_ds_config",
    "shipped_engines",
]


class PlanError(FrodError):
    """Input the memory planner cannot plan for (a config.json it does not model, unknown targets)."""


GiB = 2**30
ELEMENT_BYTES = {"bfloat16": 2, "float32": 4}
# DeepSpeed's values for the keys a JSON leaves out are frod_ds.config.ds_config.DS_DEFAULTS (checked against the
# installed DeepSpeed); an Engine built without a JSON takes them too.
_ZERO_DEFAULTS = DS_DEFAULTS["zero_optimization"]
# Under ZeRO-3, DeepSpeed replaces torch.nn.functional.linear process-wide with LinearFunctionForZeroStage3
# (zero_optimization.memory_efficient_linear, default true; deepspeed/runtime/zero/linear.py), which saves its
# input for the backward even when the weight is frozen: every F.linear then keeps its input.
LINEAR_KEEPS_INPUT_ZERO3 = bool(_ZERO_DEFAULTS["memory_efficient_linear"])
LINEARS = LLAMA_LINEARS
# The shipped configs, in the order ties are broken (the step-time model, frod_ds.plan.step_time, ranks them).
ENGINE_FILES = ("zero2.json", "zero3.json", "zero3_offload.json", "zero3_nvme.json")


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
    missing = [k for k in need if cfg.get(k) is None]
    if missing:
        raise PlanError(f"{where}: missing or non-integer {', '.join(missing)}; not a complete {mtype} config")
    problems = config_problems(cfg)  # the one check of config.json's values (frod_ds.io.model_config)
    if problems:
        raise PlanError(f"{where}: {'; '.join(problems)}; no model has these values: fix config.json")
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
    """From a checkpoint directory or a Hub id in the local cache; reads config.json only (checked by
    ``frod_ds.io.model_dir.check_config_file``, the one reader of it)."""
    from frod_ds.io.model_dir import check_config_file, resolve_config_file

    return model_shape_from_config(check_config_file(model), str(resolve_config_file(model)))


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
    # a ZeRO-3 JSON run with its frozen weights partitioned by decoder layer by frod-ds, σ and S under ZeRO-2
    # (frod_ds.config.zero3_layout); False: DeepSpeed's own stage 3
    layers: bool = False
    # the layer partition's gathers copied out of every GPU's mapped shards (one machine; frozen_shards.open_bank);
    # with offload_param the layer partition's shards are in host memory, copied in before each gather
    peer: bool = False
    # the model.dtype the JSON trains in (bf16.enabled true: bfloat16, false: float32); None: "auto" or absent,
    # the recipe's
    dtype: str | None = None
    # offload_param to NVMe: DeepSpeed's coordinator swaps the frozen weights in from the local disk each pass
    param_on_disk: bool = False

    @property
    def linear_keeps_input(self) -> bool:
        return self.stage == 3 and not self.layers and self.memory_efficient_linear


def engine_from_ds_config(
    cfg: dict[str, Any], name: str = "config", partition: str = "auto", gather: str = "auto"
) -> Engine:
    """The ``Engine`` of a DeepSpeed JSON as the one reader of it (``ds_config.zero_settings``) sees it. ZeRO-0/1
    are planned like ZeRO-2: each replicates the frozen model on every GPU. ``partition``, ``gather``: the recipe's
    ``train.zero3_partition`` and ``train.zero3_gather`` (auto is planned as peer copies: GPUs of one machine)."""
    from frod_ds.config.zero3_layout import check_gather, zero3_layout

    z = zero_settings(cfg)
    layout = zero3_layout(cfg, partition)
    check_gather(cfg, layout, gather)
    layers = layout == "layers"
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
        layers,
        layers and gather != "collective" and z.offload_param is None,  # host shards: the collective alone
        required_dtype(cfg),
        z.offload_param == "nvme",
    )


def shipped_engines() -> list[Engine]:
    """The shipped ds_configs, fastest first (their bucket sizes as written), read by the one DeepSpeed JSON
    reader; a missing one is an error naming it (``runtime.shipped``), never a stand-in."""
    from frod_ds.runtime.shipped import shipped_file

    return [
        engine_from_ds_config(load_ds_config(shipped_file("ds_configs", fname)), f"ds_configs/{fname}")
        for fname in ENGINE_FILES
    ]
