"""The DeepSpeed JSON: the only source of engine settings, resolved against the recipe in one place.

``resolve_ds_config`` fills the batch-size keys from the recipe (``"auto"`` or absent), refuses a JSON whose
concrete values disagree, refuses every other ``"auto"`` (plain ``deepspeed.initialize`` would), refuses
``optimizer``/``scheduler`` blocks (they override the client optimizer's per-group learning rates) and monitor
blocks whose logging package is not installed.
"""

from __future__ import annotations

import copy
import importlib.util
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from frod_ds._moved import forward_names
from frod_ds.config.ds_checks import (
    DuplicateKeyError,
    deepspeed_problems,
    ignored_settings,
    parse_json,
    scalar_problems,
    string_flags,
    unknown_keys,
)
from frod_ds.config.recipe import Recipe
from frod_ds.runtime.errors import FrodError, note
from frod_ds.runtime.paths import file_problem
from frod_ds.runtime.shipped import user_file

__all__ = [
    "DSConfigError",
    "BatchSizes",
    "ZeroSettings",
    "DS_DEFAULTS",
    "batch_sizes",
    "layout_of",
    "as_ds_config",
    "bf16_overflow_check",
    "required_dtype",
    "check_ds_config",
    "ds_config_problems",
    "note_ignored",
    "load_ds_config",
    "monitor_problems",
    "nvme_offloads",
    "offload_device",
    "resolve_ds_config",
    "zero_settings",
    "zero_stage",
]


class DSConfigError(FrodError):
    """A DeepSpeed config that cannot be used with this recipe."""


@dataclass(frozen=True)
class BatchSizes:
    micro: int  # per rank per forward
    accum: int  # micro-batches per optimizer step
    world: int  # data-parallel ranks

    @property
    def total(self) -> int:
        """Samples per optimizer step: the one place the global batch size is computed."""
        return self.micro * self.accum * self.world


def batch_sizes(recipe: Recipe, world_size: int) -> BatchSizes:
    """The recipe's batch sizes on ``world_size`` data-parallel ranks."""
    return BatchSizes(recipe.train.micro_batch_size, recipe.train.grad_accum, world_size)


def load_ds_config(path: str | Path) -> dict:
    """The DeepSpeed JSON at ``path`` (or the shipped one it names, outside a checkout: ``runtime.shipped``)."""
    p = user_file(path, "ds_configs")
    if not p.is_file():
        if p.is_symlink() or p.exists():  # a named pipe, a link loop, a directory: say which
            raise DSConfigError(f"DeepSpeed config {file_problem(p)}")
        raise DSConfigError(f"DeepSpeed config {p} not found (see ds_configs/)")
    try:
        cfg = parse_json(p.read_text())
    except DuplicateKeyError as e:
        raise DSConfigError(f"DeepSpeed config {p}: {e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DSConfigError(f"DeepSpeed config {p} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise DSConfigError(f"DeepSpeed config {p} must be a JSON object at the top level, got {type(cfg).__name__}")
    return cfg


def as_ds_config(config: Mapping[str, Any] | str | Path) -> dict:
    """A DeepSpeed config handed over parsed (a copy) or as its path (``load_ds_config``)."""
    return dict(config) if isinstance(config, Mapping) else load_ds_config(config)


def own_blocks(cfg: dict) -> list[str]:
    """The DeepSpeed blocks frod-ds sets itself, present in ``cfg``: each would override the recipe's."""
    return [
        f'remove the "{block}" block: frod-ds passes its own AdamW with per-group learning rates '
        "(lr_sigma, lr_s) and schedule from the recipe, and a DeepSpeed block would override them"
        for block in ("optimizer", "scheduler")
        if block in cfg
    ]


# DeepSpeed's monitor blocks and the package each imports when enabled (None: none), with its pip name
MONITOR_PACKAGES: dict[str, tuple[str, str] | None] = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "comet": ("comet_ml", '"comet_ml>=3.41.0"'),
    "csv_monitor": None,
}


def monitor_problems(cfg: dict) -> list[str]:
    """Each enabled monitor block of ``cfg`` whose package is not installed: DeepSpeed imports it in the middle of
    ``deepspeed.initialize`` and fails there with a ``ModuleNotFoundError``."""
    out = []
    for block, package in MONITOR_PACKAGES.items():
        settings = cfg.get(block)
        if package is None or not isinstance(settings, dict) or settings.get("enabled") is not True:
            continue
        module, pip_name = package
        if importlib.util.find_spec(module) is None:
            out.append(
                f'the "{block}" block is enabled, but DeepSpeed logs through the `{module}` package, which is not '
                f"installed: pip install {pip_name}, or remove the block (frod-ds logs every step to "
                "output_dir/metrics.jsonl, and to TensorBoard with the recipe's train.tensorboard=true)"
            )
    return out


def ds_config_problems(cfg: dict) -> list[str]:
    """Everything in ``cfg`` DeepSpeed would ignore silently or fail on (``frod_ds.config.ds_checks``): unknown keys,
    booleans written as strings, mistyped settings DeepSpeed reads unchecked, then what its own config classes
    refuse (only once the rest is clean: their message would repeat it)."""
    problems = unknown_keys(cfg) + string_flags(cfg) + scalar_problems(cfg) + own_blocks(cfg)
    try:
        zero_stage(cfg)
    except DSConfigError as e:
        problems.append(str(e).removeprefix("DeepSpeed config: "))
    return problems or deepspeed_problems(cfg)


def note_ignored(cfg: dict, where: str | Path = "", partition: str = "auto", gather: str = "auto") -> None:
    """A ``note:`` naming the settings of ``cfg`` that have no effect under its ZeRO stage and precision (``partition``:
    ``train.zero3_partition``; the layer partition, ``frod_ds.config.zero3_layout``, runs σ and S under ZeRO-2)."""
    stage = zero_stage(cfg)
    layers = layout_of(cfg, partition) == "layers"
    optimizer_offload = offload_device(cfg, "offload_optimizer") is not None
    ignored = ignored_settings(cfg, stage, bool(nvme_offloads(cfg)), layers, optimizer_offload)
    if "activation_checkpointing" in cfg:  # frod-ds never hands DeepSpeed its checkpointing
        note("DeepSpeed config: activation_checkpointing has no effect; set the recipe's model.gradient_checkpointing")
    explicit = [f"train.{k}={v}" for k, v in (("zero3_partition", partition), ("zero3_gather", gather)) if v != "auto"]
    if stage != 3 and explicit:  # the recipe's ZeRO-3-only choices, given explicitly
        one = len(explicit) == 1
        note(
            f"{' and '.join(explicit)} {'has' if one else 'have'} no effect with ZeRO stage {stage}: "
            f"{'it chooses' if one else 'they choose'} how a ZeRO-3 JSON partitions and gathers the frozen weights"
        )
    if ignored:
        verb = "has" if len(ignored) == 1 else "have"
        note(
            f"DeepSpeed config{f' {where}' if where else ''}: {', '.join(ignored)} {verb} no effect with its ZeRO "
            f"stage ({stage}), precision and offload: DeepSpeed ignores {'it' if len(ignored) == 1 else 'them'}"
        )


def check_ds_config(cfg: dict, where: str | Path) -> None:
    """``DSConfigError`` naming every problem of ``cfg`` (``ds_config_problems``, the checks training makes too), and
    a note of what it ignores, for the commands that read a DeepSpeed JSON without training on it (``frod plan
    --config``)."""
    problems = ds_config_problems(cfg)
    if problems:
        raise DSConfigError(f"DeepSpeed config {where}: " + "; ".join(problems))
    note_ignored(cfg, where)
    for problem in monitor_problems(cfg):  # the machine that trains may have the package: said, not refused
        note(f"DeepSpeed config {where}: {problem} (frod train refuses it on a machine without it)")


check_ds_keys = check_ds_config  # its 0.1 name (it checked the keys only then)


def _autos(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, dict):
        return [k for key, v in node.items() for k in _autos(v, f"{prefix}{key}.")]
    if isinstance(node, list):
        return [k for i, v in enumerate(node) for k in _autos(v, f"{prefix}{i}.")]
    return [prefix[:-1]] if node == "auto" else []


# DeepSpeed 0.19.8's value for each key a JSON leaves out, by the block it sits in: ``zero_optimization``
# (deepspeed/runtime/zero/config.py DeepSpeedZeroConfig, under the JSON names, i.e. the stage3_* aliases),
# ``zero_optimization.offload_param`` (zero/offload_config.py DeepSpeedZeroOffloadParamConfig) and ``aio``
# (swap_tensor/constants.py). overlap_comm is absent on purpose: its default depends on the stage
# (``zero_settings``). The one table of them; tests/config/test_ds_config_defaults.py reads the installed DeepSpeed's
# config classes and fails when one drifts.
DS_DEFAULTS: dict[str, dict[str, int | bool]] = {
    "zero_optimization": {
        "stage": 0,
        "reduce_bucket_size": 500_000_000,
        "allgather_bucket_size": 500_000_000,
        "stage3_prefetch_bucket_size": 50_000_000,
        "stage3_param_persistence_threshold": 100_000,
        "stage3_max_live_parameters": 1_000_000_000,
        "stage3_max_reuse_distance": 1_000_000_000,
        "memory_efficient_linear": True,
    },
    "zero_optimization.offload_param": {"buffer_count": 5, "buffer_size": 100_000_000, "max_in_cpu": 1_000_000_000},
    "aio": {"block_size": 1_048_576},
    "bf16": {"check_grad_overflow": True},
}
OFFLOADS = ("offload_param", "offload_optimizer")


def _zero_block(cfg: dict) -> Any:
    """``zero_optimization`` (``{}`` when absent; ``zero_stage`` refuses anything but an object)."""
    return cfg.get("zero_optimization", {})


def zero_stage(cfg: dict) -> int:
    """The ZeRO stage of a DeepSpeed config (0 when absent); ``DSConfigError`` unless it is 0, 1, 2 or 3."""
    zo = _zero_block(cfg)
    if not isinstance(zo, dict):
        raise DSConfigError(f'DeepSpeed config: zero_optimization must be an object ({{"stage": 2, ...}}), got {zo!r}')
    stage = zo.get("stage", DS_DEFAULTS["zero_optimization"]["stage"])
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise DSConfigError(f"DeepSpeed config: zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
    return stage


def as_stage2(cfg: dict) -> dict:
    """A copy of ZeRO-3 ``cfg`` at stage 2, without the settings only stage 3 reads (``stage3_*``, offload_param)."""
    out = copy.deepcopy(cfg)
    zo = out["zero_optimization"]
    for key in [k for k in zo if k.startswith("stage3_") or k == "offload_param"]:
        del zo[key]
    zo["stage"] = 2
    return out


def required_dtype(cfg: dict) -> str | None:
    """The model.dtype a JSON trains in: ``bf16.enabled`` true, bfloat16; false, float32; None for "auto" or
    absent (the recipe's)."""
    bf16 = cfg.get("bf16")
    enabled = bf16.get("enabled") if isinstance(bf16, dict) else None
    return ("bfloat16" if enabled else "float32") if isinstance(enabled, bool) else None


def bf16_overflow_check(cfg: dict) -> bool:
    """Whether DeepSpeed tests every bf16 gradient for inf/NaN before a ZeRO-1/2 step (``bf16.check_grad_overflow``,
    DeepSpeed's default when absent; ZeRO-3 checks only fp16 steps)."""
    bf16 = cfg.get("bf16")
    value = bf16.get("check_grad_overflow") if isinstance(bf16, dict) else None
    return bool(DS_DEFAULTS["bf16"]["check_grad_overflow"] if value is None else value)


def offload_device(cfg: dict, which: str) -> str | None:
    """Where ``zero_optimization.<which>`` (``offload_param`` or ``offload_optimizer``) puts its tensors:
    ``"cpu"``, ``"nvme"``, or None (absent, null, or ``"device": "none"``). The one reader of the offload blocks:
    the trainer's optimizer choice, the planner's engine and the NVMe checks all ask here."""
    assert which in OFFLOADS, f"{which!r} is not one of {OFFLOADS}"
    zo = _zero_block(cfg)
    block = zo.get(which) if isinstance(zo, dict) else None
    device = block.get("device") if isinstance(block, dict) else None
    return device if device in ("cpu", "nvme") else None


def nvme_offloads(cfg: dict) -> set[str]:
    """Which of ``offload_param`` / ``offload_optimizer`` go to NVMe."""
    return {k for k in OFFLOADS if offload_device(cfg, k) == "nvme"}


def layout_of(cfg: dict, choice: str) -> str | None:
    """How a ZeRO-3 ``cfg`` partitions its frozen weights under ``train.zero3_partition`` ``choice``: ``"layers"``
    unless ``choice`` is ``deepspeed`` or something goes to NVMe; None for any other stage. The rule without its
    refusal (``frod_ds.config.zero3_layout.zero3_layout`` adds that), so that this module's notes can read it."""
    if zero_stage(cfg) != 3:
        return None
    return "deepspeed" if choice == "deepspeed" or nvme_offloads(cfg) else "layers"


def _number(cfg: dict, block: str, key: str) -> int | float:
    """``block.key`` of ``cfg`` (``block`` dotted from the top), DeepSpeed's default (``DS_DEFAULTS``) when absent;
    ``DSConfigError`` when it is not a number (DeepSpeed would refuse it mid-start)."""
    node: Any = cfg
    for part in block.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    value = node.get(key) if isinstance(node, dict) else None
    if value is None:
        return DS_DEFAULTS[block][key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DSConfigError(
            f"DeepSpeed config: {block}.{key} must be a number, got {value!r}; give a number or "
            f"leave the key out for DeepSpeed's default ({DS_DEFAULTS[block][key]:,})"
        )
    return value


@dataclass(frozen=True)
class ZeroSettings:
    """The ZeRO settings of a DeepSpeed JSON that decide memory and the NVMe checks, each key the JSON leaves out
    at DeepSpeed's default (``DS_DEFAULTS``). Sizes are in elements, as DeepSpeed counts them."""

    stage: int
    offload_param: str | None  # "cpu", "nvme" or None
    offload_optimizer: str | None
    overlap_comm: bool
    reduce_bucket_size: int | float
    allgather_bucket_size: int | float
    prefetch_bucket_size: int | float  # stage3_prefetch_bucket_size
    param_persistence_threshold: int | float  # stage3_param_persistence_threshold
    max_live_parameters: int | float  # stage3_max_live_parameters
    max_reuse_distance: int | float  # stage3_max_reuse_distance
    memory_efficient_linear: bool
    nvme_buffer_count: int  # offload_param.buffer_count
    nvme_buffer_size: int  # offload_param.buffer_size
    max_in_cpu: int  # offload_param.max_in_cpu
    aio_block_size: int  # aio.block_size (bytes)


def zero_settings(cfg: dict) -> ZeroSettings:
    """``cfg``'s ZeRO settings as DeepSpeed 0.19.8 reads them; ``DSConfigError`` for a stage or size it would refuse."""
    stage = zero_stage(cfg)
    zo = _zero_block(cfg)
    z = lambda key: _number(cfg, "zero_optimization", key)  # noqa: E731
    op = lambda key: int(_number(cfg, "zero_optimization.offload_param", key))  # noqa: E731
    # DeepSpeedZeroConfig.overlap_comm_valid: on by default under ZeRO-3 only
    overlap = zo.get("overlap_comm")
    linear = zo.get("memory_efficient_linear")
    return ZeroSettings(
        stage,
        offload_device(cfg, "offload_param"),
        offload_device(cfg, "offload_optimizer"),
        stage == 3 if overlap is None else bool(overlap),
        z("reduce_bucket_size"),
        z("allgather_bucket_size"),
        z("stage3_prefetch_bucket_size"),
        z("stage3_param_persistence_threshold"),
        z("stage3_max_live_parameters"),
        z("stage3_max_reuse_distance"),
        bool(DS_DEFAULTS["zero_optimization"]["memory_efficient_linear"] if linear is None else linear),
        op("buffer_count"),
        op("buffer_size"),
        op("max_in_cpu"),
        int(_number(cfg, "aio", "block_size")),
    )


def _nvme_problems(cfg: dict) -> list[str]:
    """An NVMe offload DeepSpeed would not do as written: under ZeRO-1/2 (its optimizer stays on the GPU without a
    word), or without a folder to swap to."""
    out = []
    stage = (cfg.get("zero_optimization") or {}).get("stage", 0)
    for key in sorted(nvme_offloads(cfg)):
        if isinstance(stage, int) and stage < 3:
            out.append(
                f"zero_optimization.{key} offloads to NVMe, which DeepSpeed does only under ZeRO stage 3 (stage is "
                f'{stage}); use ds_configs/zero3_nvme.json, or "device": "cpu"'
            )
        elif not cfg["zero_optimization"][key].get("nvme_path"):
            out.append(f"zero_optimization.{key} offloads to NVMe but names no nvme_path; pass --nvme-path DIR")
    return out


def resolve_ds_config(cfg: dict, recipe: Recipe, world_size: int, nvme_path: str | None = None) -> dict:
    """A concrete copy of ``cfg`` for ``deepspeed.initialize``; raises ``DSConfigError`` on any conflict."""
    cfg = copy.deepcopy(cfg)
    zero_stage(cfg)
    bs = batch_sizes(recipe, world_size)
    problems = unknown_keys(cfg) + string_flags(cfg) + scalar_problems(cfg)
    for key, want in (
        ("train_micro_batch_size_per_gpu", bs.micro),
        ("gradient_accumulation_steps", bs.accum),
        ("train_batch_size", bs.total),
    ):
        have = cfg.get(key, "auto")
        if have == "auto":
            cfg[key] = want
        elif have != want:
            problems.append(
                f"{key}={json.dumps(have)} in the DeepSpeed config but the recipe gives {want} "
                f"(micro_batch_size={bs.micro} x grad_accum={bs.accum} x world_size={bs.world}); "
                f'set it to "auto" or change the recipe'
            )
    clip = cfg.get("gradient_clipping", "auto")
    if clip == "auto":
        cfg["gradient_clipping"] = recipe.train.max_grad_norm
    elif (
        isinstance(clip, bool) or not isinstance(clip, (int, float)) or float(clip) != float(recipe.train.max_grad_norm)
    ):
        # DeepSpeed would clip at its own value while the recorded recipe says another: one source of truth
        problems.append(
            f"gradient_clipping={clip!r} in the DeepSpeed config but the recipe gives "
            f'train.max_grad_norm={recipe.train.max_grad_norm}; set gradient_clipping to "auto" or change '
            "train.max_grad_norm"
        )
    want_bf16 = recipe.model.dtype == "bfloat16"
    bf16 = cfg.setdefault("bf16", {})
    if not isinstance(bf16, dict):
        pass  # scalar_problems named it
    elif bf16.get("enabled", "auto") == "auto":
        bf16["enabled"] = want_bf16
    elif required_dtype(cfg) not in (None, recipe.model.dtype):
        problems.append(
            f"bf16.enabled={bf16['enabled']} in the DeepSpeed config but model.dtype={recipe.model.dtype}; "
            "make them agree"
        )
    if isinstance(cfg.get("fp16"), dict) and cfg["fp16"].get("enabled") is True:
        problems.append("fp16 is not supported (FRoD's sigma/S need bf16 or fp32); use bf16")
    problems += own_blocks(cfg) + monitor_problems(cfg)
    if nvme_path is not None:
        if not nvme_offloads(cfg):  # the flag would change nothing: the run the user meant would not happen
            problems.append(
                "--nvme-path is given, but this DeepSpeed config offloads nothing to NVMe; use "
                "ds_configs/zero3_nvme.json (or drop --nvme-path)"
            )
        for key in nvme_offloads(cfg):
            cfg["zero_optimization"][key]["nvme_path"] = nvme_path
    problems += _nvme_problems(cfg)
    autos = _autos(cfg)
    if autos:
        problems.append(f'unresolved "auto" for {", ".join(autos)}: give concrete values')
    elif not problems:
        try:  # a ZeRO size DeepSpeed would refuse only in the middle of deepspeed.initialize
            zero_settings(cfg)
        except DSConfigError as e:
            problems.append(str(e).removeprefix("DeepSpeed config: "))
        problems += [] if problems else deepspeed_problems(cfg)
    if problems:
        raise DSConfigError("DeepSpeed config: " + "; ".join(problems))
    note_ignored(cfg, partition=recipe.train.zero3_partition, gather=recipe.train.zero3_gather)
    return cfg


# the NVMe preflight moved to frod_ds.config.nvme; its old names here forward to it with a warning
_MOVED_NAMES = dict.fromkeys(
    (
        "NvmeParams",
        "DS_MIN_AIO_BYTES",
        "check_aio_build_env",
        "check_nvme_buffer",
        "check_nvme_buffer_count",
        "nvme_buffers_needed",
    ),
    "frod_ds.config.nvme",
)
__getattr__ = forward_names(__name__, _MOVED_NAMES)
