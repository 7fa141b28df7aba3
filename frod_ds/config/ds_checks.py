"""The DeepSpeed JSON checked against what the pinned DeepSpeed (0.19.8) accepts, each check returning its problems
as lines (``frod_ds.config.ds_config`` raises them as one ``DSConfigError``).

Keys DeepSpeed does not know (it ignores them silently), keys given twice (JSON keeps the last), booleans written as
strings (DeepSpeed reads ``"false"`` as false, a plain truth test as true), settings that have no effect under the
chosen ZeRO stage or precision (``ignored_settings``: a note, not an error), and every value DeepSpeed's own config
classes refuse (``deepspeed_problems``: the ``DeepSpeedConfig`` a run would build, its error as one line instead of
a traceback in the middle of ``deepspeed.initialize``).
"""

from __future__ import annotations

import copy
import difflib
import functools
import logging
from collections.abc import Callable
from typing import Any

from frod_ds.runtime.strict_json import DuplicateKeyError, parse_json

__all__ = [
    "flat_items",
    "known_keys",
    "unknown_keys",
    "parse_json",
    "DuplicateKeyError",
    "string_flags",
    "scalar_problems",
    "ignored_settings",
    "deepspeed_problems",
]

# DeepSpeed's documented top-level keys (deepspeed.ai/docs/config-json). DeepSpeed itself ignores a top-level key it
# does not know, so a misspelled "gradient_cliping" silently trained without clipping.
_DS_TOP_LEVEL = frozenset(
    """
train_batch_size train_micro_batch_size_per_gpu gradient_accumulation_steps optimizer scheduler
communication_data_type seq_parallel_communication_data_type prescale_gradients gradient_predivide_factor
sparse_gradients fp16 bf16 amp torch_autocast gradient_clipping zero_optimization zero_allow_untested_optimizer
zero_force_ds_cpu_optimizer aio activation_checkpointing steps_per_print wall_clock_breakdown dump_state
memory_breakdown flops_profiler tensorboard wandb csv_monitor comet comms_logger autotuning elasticity
data_efficiency curriculum_learning data_types compression_training sparse_attention pipeline checkpoint nebula
eigenvalue progressive_layer_drop quantize_training hybrid_engine compile weight_quantization timers
disable_allgather dataloader_drop_last graph_harvesting use_data_before_expert_parallelism tensor_parallel
expert_parallel gradient_allreduce_op disable_python_gc log_level zenflow
""".split()
)
# zero_optimization keys only ZeRO-3 reads (DeepSpeedZeroConfig: the stage3_* aliases and their field names,
# parameter offload, ZeRO++ weight partitioning and quantization, the memory-efficient linear)
_STAGE3_ONLY = frozenset(
    """
stage3_prefetch_bucket_size prefetch_bucket_size stage3_param_persistence_threshold param_persistence_threshold
stage3_model_persistence_threshold model_persistence_threshold stage3_max_live_parameters max_live_parameters
stage3_max_reuse_distance max_reuse_distance stage3_gather_16bit_weights_on_model_save
gather_16bit_weights_on_model_save stage3_gather_fp16_weights_on_model_save stage3_module_granularity_threshold
module_granularity_threshold stage3_use_all_reduce_for_fetch_params use_all_reduce_for_fetch_params
stage3_allgather_sequential allgather_sequential offload_param zero_hpz_partition_size zero_quantized_weights
zero_quantized_nontrainable_weights memory_efficient_linear
""".split()
)
# top-level settings DeepSpeed reads without checking their type (a wrong one fails mid-run): what each must be
_FLAGS = """wall_clock_breakdown memory_breakdown dump_state prescale_gradients sparse_gradients
zero_allow_untested_optimizer zero_force_ds_cpu_optimizer dataloader_drop_last disable_allgather""".split()


@functools.lru_cache(maxsize=1)
def known_keys() -> tuple[frozenset[str], frozenset[str]]:
    """(top-level keys, ``zero_optimization`` keys) this DeepSpeed accepts: the documented list above plus every
    key name DeepSpeed's runtime defines as a constant (so a newer DeepSpeed's keys are not refused), and the
    fields and aliases of its ZeRO config model."""
    top = set(_DS_TOP_LEVEL)
    try:
        from deepspeed.runtime import constants as C
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    except ImportError:  # no DeepSpeed: nothing more to compare against
        return frozenset(top), frozenset()
    top.update(v for k, v in vars(C).items() if k.isupper() and isinstance(v, str) and v.isidentifier())
    zero = {name for name, f in DeepSpeedZeroConfig.model_fields.items() for name in (name, f.alias) if name}
    return frozenset(top), frozenset(zero)


def unknown_keys(cfg: dict) -> list[str]:
    """One problem per key DeepSpeed does not know, with the closest key it does."""
    top, zero = known_keys()
    problems = []
    zo = cfg.get("zero_optimization")
    for where, keys, known in (("", cfg, top), ("zero_optimization.", zo if isinstance(zo, dict) else {}, zero)):
        if not known:
            continue
        for key in keys:
            if key not in known:
                close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
                hint = f'; did you mean "{where}{close[0]}"?' if close else "; remove it"
                problems.append(f'unknown key "{where}{key}"{hint}')
    return problems


def flat_items(node: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """Every leaf of a JSON-like ``node`` with its dotted path (list items by index): ``[("a.b.0", 1), ...]``."""
    if isinstance(node, dict):
        return [x for k, v in node.items() for x in flat_items(v, f"{prefix}{k}.")]
    if isinstance(node, list):
        return [x for i, v in enumerate(node) for x in flat_items(v, f"{prefix}{i}.")]
    return [(prefix[:-1], node)]


def string_flags(cfg: dict) -> list[str]:
    """A boolean written as a string anywhere ("false", "True"): DeepSpeed reads it one way, a truth test the other."""
    return [
        f'{path} is the string "{v}"; write {v.lower()} without quotes (a JSON boolean)'
        for path, v in flat_items(cfg)
        if isinstance(v, str) and v.lower() in ("true", "false")
    ]


def scalar_problems(cfg: dict) -> list[str]:
    """Top-level settings DeepSpeed reads unchecked and fails on mid-run: ``steps_per_print`` a positive integer,
    the switches in ``_FLAGS`` booleans, ``gradient_predivide_factor`` a positive number."""
    problems = []
    v = cfg.get("steps_per_print")
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        problems.append(f"steps_per_print must be a positive integer, got {v!r}")
    problems += [
        f"{k} must be true or false, got {cfg[k]!r}" for k in _FLAGS if k in cfg and not isinstance(cfg[k], bool)
    ]
    v = cfg.get("gradient_predivide_factor")
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
        problems.append(f"gradient_predivide_factor must be a number > 0, got {v!r}")
    zero = cfg.get("zero_optimization") if isinstance(cfg.get("zero_optimization"), dict) else {}
    for old, new in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
        if zero.get(old) is not None:  # DeepSpeed maps them onto its own CPU optimizer, which frod-ds does not hand it
            problems.append(
                f'zero_optimization.{old} is DeepSpeed\'s deprecated switch: write "{new}": {{"device": "cpu"}} '
                "instead (as ds_configs/zero3_offload.json does)"
            )
    if zero.get("cpu_offload_use_pin_memory") is not None:
        problems.append(
            'zero_optimization.cpu_offload_use_pin_memory is DeepSpeed\'s deprecated switch: write "pin_memory" in '
            "offload_optimizer / offload_param instead"
        )
    stage = zero.get("stage", 0)
    if isinstance(stage, int) and stage >= 2 and zero.get("reduce_scatter", True) is not False:
        # DeepSpeed's ZeRO-2/3 optimizers assert on these when they reduce-scatter the gradients (their default)
        fix = f"or set zero_optimization.reduce_scatter false (ZeRO-{stage} reduce-scatters the gradients by default)"
        not_here = f"is not supported by DeepSpeed's ZeRO-{stage}: remove it, {fix}"
        if cfg.get("prescale_gradients") is True:
            problems.append(f"prescale_gradients true {not_here}")
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 and v != 1:
            problems.append(f"gradient_predivide_factor {v} {not_here}")
    for block in ("bf16", "fp16"):
        b = cfg.get(block)
        if b is not None and not isinstance(b, dict):
            problems.append(f'{block} must be an object such as {{"enabled": true}}, got {b!r}')
        elif isinstance(b, dict) and not _flag_or_auto(b.get("enabled", "auto")):
            problems.append(f'{block}.enabled must be true, false or "auto", got {b.get("enabled")!r}')
    return problems


def _flag_or_auto(v: Any) -> bool:
    """A JSON boolean, ``"auto"``, or a boolean written as a string (``string_flags`` names that one)."""
    return isinstance(v, bool) or (isinstance(v, str) and v.lower() in ("auto", "true", "false"))


def ignored_settings(
    cfg: dict, stage: int, nvme: bool, layers: bool = False, optimizer_offload: bool = False
) -> list[str]:
    """The settings of ``cfg`` DeepSpeed ignores under ZeRO ``stage`` (``nvme``: something is offloaded to NVMe):
    ``zero_optimization`` keys beyond ``stage`` without ZeRO, ZeRO-3's keys under ZeRO-1/2, ``bf16.check_grad_overflow``
    under DeepSpeed's ZeRO-3 (it checks fp16 steps only; ``layers``: frod-ds partitions a ZeRO-3 JSON's frozen weights
    by decoder layer and σ, S run under ZeRO-2, which reads it), a disabled precision's other keys, ``aio`` without
    NVMe, ``zero_force_ds_cpu_optimizer`` without an offloaded optimizer (``optimizer_offload``)."""
    zo = cfg.get("zero_optimization")
    zo = zo if isinstance(zo, dict) else {}
    out = []
    if stage == 0:
        out += [f"zero_optimization.{k}" for k in zo if k != "stage"]
    elif stage < 3:
        out += [f"zero_optimization.{k}" for k in zo if k in _STAGE3_ONLY]
    bf16, deepspeed_zero3 = cfg.get("bf16"), stage == 3 and not layers
    if isinstance(bf16, dict) and deepspeed_zero3 and bf16.get("enabled") is True and "check_grad_overflow" in bf16:
        out.append("bf16.check_grad_overflow")
    for block in ("bf16", "fp16"):
        b = cfg.get(block)
        if isinstance(b, dict) and b.get("enabled") is False:
            out += [f"{block}.{k}" for k in b if k != "enabled"]
    if "aio" in cfg and not nvme:
        out.append("aio")
    if "zero_force_ds_cpu_optimizer" in cfg and not optimizer_offload:
        out.append("zero_force_ds_cpu_optimizer")
    return out


# DeepSpeed's pydantic config classes → the JSON block each reads, to name a refused value by its path
_BLOCKS = {
    "DeepSpeedZeroConfig": "zero_optimization",
    "DeepSpeedFP16Config": "fp16",
    "DeepSpeedBF16Config": "bf16",
    "CompileConfig": "compile",
    "WeightQuantConfig": "weight_quantization",
}


def _validation_lines(e: Exception) -> list[str]:
    """A pydantic ``ValidationError`` as one line per error (``loc: msg, got input``); any other error's first line."""
    errors: Callable[[], list[dict]] | None = getattr(e, "errors", None)
    if callable(errors):
        block = [_BLOCKS[title]] if _BLOCKS.get(title := str(getattr(e, "title", ""))) else []
        try:
            return [f"{'.'.join(block + [str(p) for p in err['loc']])}: {err['msg']}{_got(err)}" for err in errors()]
        except (TypeError, KeyError):
            pass
    text = str(e).strip().splitlines()
    return [text[0] if text else type(e).__name__]


def _got(err: dict) -> str:
    """``, got <input>`` for a scalar input (a model-level error's input is the whole block: left out)."""
    value = err.get("input")
    return f", got {value!r}" if isinstance(value, (str, int, float, bool)) or value is None else ""


def deepspeed_problems(cfg: dict) -> list[str]:
    """What DeepSpeed's own ``DeepSpeedConfig`` refuses in ``cfg`` (batch sizes set to 1 here: the recipe gives
    them, ``ds_config.resolve_ds_config`` checks them), one line per problem; empty when it accepts it or when no
    DeepSpeed is installed."""
    try:
        from deepspeed.runtime.config import DeepSpeedConfig
    except ImportError:
        return []
    trial = copy.deepcopy(cfg)
    trial.pop("train_batch_size", None)
    trial.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1)
    ds_logger = logging.getLogger("DeepSpeed")
    level = ds_logger.level
    ds_logger.setLevel(logging.ERROR)  # its notes on what it read are not this check's output
    try:
        DeepSpeedConfig(trial)
    except Exception as e:  # noqa: BLE001 - whatever DeepSpeed raises on a value, said in one line
        return [f"DeepSpeed {_version()} refuses it: {line}" for line in _validation_lines(e)]
    finally:
        ds_logger.setLevel(level)
    return []


def _version() -> str:
    import deepspeed

    return deepspeed.__version__
