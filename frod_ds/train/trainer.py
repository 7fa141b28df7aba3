"""DeepSpeed training of FRoD adapters: ``setup`` → ``fit``, with exact resume and SIGTERM checkpoints.

``setup`` checks every input first (``frod_ds.train.preflight``), then builds the model (``frod_ds.model.build``),
the optimizer (two AdamW groups with their own learning rates, handed to DeepSpeed: no optimizer block in the
JSON) and the engine, and restores the checkpoint to resume. ``fit`` (``frod_ds.train.loop``) runs optimizer
steps from a stateless ``BatchPlan``, so resume is a position. The output directory: docs/training.md.
"""

from __future__ import annotations

import dataclasses
import os
import random
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from frod_ds._moved import forward_names
from frod_ds.config.ds_checks import flat_items
from frod_ds.config.ds_config import as_ds_config, nvme_offloads, offload_device, zero_stage
from frod_ds.config.recipe import Recipe, recipe_to_dict
from frod_ds.config.zero3_layout import host_shards
from frod_ds.formats.adapter_dir import AdapterConfig
from frod_ds.formats.run_identity import RunIdentity
from frod_ds.io.dtypes import FLOAT_DTYPES
from frod_ds.model.adapter import load_adapter_into, supports_from_adapter
from frod_ds.model.apply import frod_groups, frod_param_groups
from frod_ds.model.build import build_frod_model, fetch_per_layer, gathered, make_supports
from frod_ds.model.build_layers import build_layer_partitioned
from frod_ds.model.frozen_shards import shards_of
from frod_ds.prep.tokens import tokenizer_sha256
from frod_ds.runtime import distributed as dist
from frod_ds.runtime.errors import note
from frod_ds.runtime.rank_agreement import first_unlike_rank, refuse_unlike, setting_differences
from frod_ds.runtime.shared_dir import check_shared_dir
from frod_ds.train.checkpoints import choose_checkpoint, step_of, unsealed_checkpoints
from frod_ds.train.data import BatchPlan
from frod_ds.train.engine_state import restore_checkpoint
from frod_ds.train.loop import Run, fit
from frod_ds.train.metrics import METRICS, drop_rows_after
from frod_ds.train.preflight import Inputs, preflight
from frod_ds.train.run_dir import check_no_unresumable_run, check_run_dir, open_run_dir, run_inputs
from frod_ds.train.schedule import lr_scheduler

__all__ = ["Run", "setup", "fit", "enable_gradient_checkpointing"]

USE_REENTRANT = False  # the gradient-checkpointing variant; see enable_gradient_checkpointing


def setup(
    recipe: Recipe,
    ds_config: Mapping[str, Any] | str | os.PathLike,
    nvme_path: str | None = None,
    *,
    on_inputs: Callable[[Inputs], None] | None = None,
) -> Run:
    """Check the inputs, build model, optimizer and engine, restore the newest sound checkpoint if any.

    ``ds_config``: the DeepSpeed JSON or its path (read here, once). ``on_inputs`` sees the checked inputs before
    the model is built (``frod train`` prints the planner's hint from them, so nothing is read twice)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    out = Path(recipe.output_dir)
    dist.on_all(lambda: check_run_dir(out, run_inputs(recipe)))  # before anything reads or writes there
    # The checkpoint to resume: rank 0 checks the files against their seals (newest first) once for all.
    resume = (None, []) if recipe.train.new_run else dist.on_main(lambda: choose_checkpoint(out / "checkpoints"))
    if resume[0] is None and not recipe.train.new_run:
        dist.on_all(lambda: check_no_unresumable_run(out))
    # Every check of the inputs, on every rank; a user error on any rank stops all of them with one line.
    inputs = dist.on_all(lambda: preflight(recipe, as_ds_config(ds_config), nvme_path, resume[0]))
    dist.on_all(lambda: _check_ranks_agree(recipe, inputs))
    if on_inputs is not None:
        on_inputs(inputs)
    # every rank writes its checkpoint shards there and rank 0 seals them: one directory for all nodes
    check_shared_dir(out, "output_dir")
    t = recipe.train
    plan = BatchPlan(len(inputs.examples), t.micro_batch_size, t.grad_accum, world, rank, t.seed)
    total = plan.total_steps(t.epochs, t.max_steps)
    _seed_everything(t.seed + rank)
    engine, sigma0 = _engine(inputs, rank, total)
    run = Run(inputs, engine, plan, total, _adapter_config(inputs), sigma0)
    if dist.is_main():
        open_run_dir(recipe)
    dist.barrier()
    return dataclasses.replace(run, start_step=_resume(run, *resume))


def _check_ranks_agree(recipe: Recipe, inputs: Inputs) -> None:
    """``FrodError`` on every rank unless each was started with rank 0's recipe and DeepSpeed JSON and reads the
    same inputs (the run's identity: data, tokenizer, base digests): nodes reading different copies of a recipe or
    a data file would train one mixed run whose record states rank 0's settings only."""
    settings = {
        "": dict(flat_items(recipe_to_dict(recipe))),
        "DeepSpeed ": dict(flat_items(inputs.user_ds_config or dict(inputs.ds_config))),
    }
    found = first_unlike_rank({"settings": settings, "identity": inputs.run_identity.to_json()})
    if found is None:
        return
    rank, first, theirs = found
    diff = setting_differences(first["settings"], theirs["settings"], rank)
    if not diff:
        ident = RunIdentity.from_json(first["identity"], "rank 0")
        diff = ident.differences(RunIdentity.from_json(theirs["identity"], f"rank {rank}")) or ["run identity"]
    refuse_unlike(diff, "a node reading another copy of the recipe, the DeepSpeed JSON or the data?")


def enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    """Checkpoint every decoder layer (recomputed in the backward), non-reentrant (``USE_REENTRANT``), so that
    ZeRO-3 holds about one layer's frozen weights gathered at a time: a reentrant recompute charges them to the
    model around the layers, whose backward never ends (docs/training.md, Gradient checkpointing under ZeRO-3;
    tests/train/test_checkpoint_residency.py)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": USE_REENTRANT})
    if USE_REENTRANT:  # a reentrant checkpoint passes a gradient only through inputs that require one
        model.enable_input_require_grads()
    else:  # transformers turns it on anyway; without it the backward stops at the first layer's input
        model.disable_input_require_grads()
    model.config.use_cache = False


def _engine(inputs: Inputs, rank: int, total_steps: int) -> tuple[Any, dict[str, torch.Tensor]]:
    """The DeepSpeed engine of the FRoD model built from the checked inputs, and σ before training (rank 0)."""
    import deepspeed

    recipe, store, init, ds_cfg = inputs.recipe, inputs.store, inputs.init_adapter, inputs.ds_config
    m = recipe.model
    build_nvme_op(ds_cfg)
    supports = (
        make_supports(store, list(m.targets), m.sparsity, m.seed) if init is None else supports_from_adapter(*init)
    )
    t_build = time.perf_counter()
    if inputs.partition == "layers":  # ZeRO-3's frozen weights partitioned by decoder layer; σ, S under ZeRO-2
        model = build_layer_partitioned(
            inputs.base,
            store,
            supports,
            FLOAT_DTYPES[m.dtype],
            dist.local_device(),
            m.frozen_quant,
            m.quantize_base,
            gather=recipe.train.zero3_gather,
            offload=host_shards(inputs.user_ds_config or {}, inputs.partition),
        )
    else:
        model = build_frod_model(
            inputs.base,
            store,
            supports,
            FLOAT_DTYPES[m.dtype],
            ds_cfg,
            rank=rank,
            quant=m.frozen_quant,
            quantize_base=m.quantize_base,
        )
    dist.print0(f"model built in {time.perf_counter() - t_build:.1f} s (skeleton, factor store and checkpoint reads)")
    shards = shards_of(model)
    if shards is not None and shards.units:
        collective = "NCCL" if dist.backend() == "nccl" else "gloo"
        how = "copies out of every GPU's mapped shards" if shards.bank is not None else f"{collective} all-gathers"
        dist.print0(f"frozen weights: 1/{dist.get_world_size()} per rank by decoder layer, gathered by {how}")
    zero3 = zero_stage(ds_cfg) == 3
    sigma0 = _initial_sigma(model, zero3)  # the factor store's σ, before an init adapter replaces it
    if init is not None:  # before deepspeed.initialize: the optimizer's master copies are made from these values
        load_adapter_into(model, init.tensors, zero3)
    if m.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    if zero3:
        fetch_per_layer(model)  # after checkpointing, which turns the first layer's input gradient off
    if cpu_optimizer(ds_cfg, dist.local_device()) == "torch" and "zero_force_ds_cpu_optimizer" not in ds_cfg:
        note(
            "the offloaded optimizer steps with torch's AdamW: on a machine without a GPU DeepSpeedCPUAdam's "
            'C++ build (minutes) buys nothing; set "zero_force_ds_cpu_optimizer": true in the JSON to build it'
        )
        ds_cfg = {**ds_cfg, "zero_force_ds_cpu_optimizer": False}  # DeepSpeed accepts a client optimizer then
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=_optimizer(model, recipe, ds_cfg),
        lr_scheduler=lr_scheduler(recipe, total_steps),
        config=ds_cfg,
    )
    return engine, sigma0


def build_nvme_op(ds_cfg: Mapping[str, Any]) -> None:
    """NVMe offload: DeepSpeed's ``async_io`` op, JIT-built through ``op_build.load_op`` (a lock that dies with its
    holder, ninja in a session that dies with the launch) before the model build, where DeepSpeed would build it
    bare; DeepSpeed then reuses the loaded op."""
    if nvme_offloads(dict(ds_cfg)):
        from deepspeed.ops.op_builder import AsyncIOBuilder

        from frod_ds.runtime import op_build

        op_build.load_op(AsyncIOBuilder())


def cpu_optimizer(ds_cfg: Mapping[str, Any], device: torch.device) -> str | None:
    """What steps an offloaded optimizer: None when the JSON offloads none; ``"deepspeed"`` (DeepSpeedCPUAdam, its
    ``cpu_adam`` op JIT-built on first use) or ``"torch"`` (torch's AdamW on the CPU), which DeepSpeed's own
    ``zero_force_ds_cpu_optimizer`` picks when given (false: torch), and the device when not (no GPU: torch)."""
    if offload_device(ds_cfg, "offload_optimizer") is None:
        return None
    force = ds_cfg.get("zero_force_ds_cpu_optimizer")
    if force is None:
        return "torch" if device.type == "cpu" else "deepspeed"
    return "torch" if force is False else "deepspeed"


def _optimizer(model: torch.nn.Module, recipe: Recipe, ds_cfg: Mapping[str, Any]) -> torch.optim.Optimizer:
    """AdamW over σ and S at their own learning rates; DeepSpeedCPUAdam when the JSON offloads the optimizer and
    ``zero_force_ds_cpu_optimizer`` is not false (:func:`cpu_optimizer`; ``_engine`` sets it for a GPU-less run)."""
    t = recipe.train
    groups = frod_param_groups(model, t.lr_sigma, t.lr_s, t.weight_decay)
    ds_cpu_adam = ds_cfg.get("zero_force_ds_cpu_optimizer", True) is not False
    if offload_device(ds_cfg, "offload_optimizer") is not None and ds_cpu_adam:  # stepped on the CPU by DeepSpeed
        from deepspeed.accelerator import get_accelerator
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        from frod_ds.runtime import op_build

        # DeepSpeedCPUAdam JIT-builds cpu_adam on its first use in a TORCH_EXTENSIONS_DIR: built here under a lock
        # that dies with its holder (a build killed mid-way must not hang every later launch); DeepSpeed then
        # reuses the loaded op, and later launches load the cached build.
        op_build.load_op(get_accelerator().create_op_builder("CPUAdamBuilder"))
        return DeepSpeedCPUAdam(groups, lr=t.lr_sigma, betas=tuple(t.betas), adamw_mode=True)
    return torch.optim.AdamW(groups, lr=t.lr_sigma, betas=tuple(t.betas))


def _adapter_config(inputs: Inputs) -> AdapterConfig:
    """What every adapter of the run records (local paths made absolute so it loads from any directory)."""
    m, init, identity = inputs.recipe.model, inputs.init_adapter, inputs.store_identity
    return AdapterConfig(
        base_model=_absolute_if_local(m.base),
        factor_store=_absolute_if_local(m.factor_store),
        factor_store_fingerprint=identity.fingerprint,
        tokenizer=_absolute_if_local(m.tokenizer) if m.tokenizer else None,
        tokenizer_sha256=tokenizer_sha256(inputs.tokenizer),
        targets=list(m.targets),
        sparsity=m.sparsity if init is None else init.config.sparsity,
        seed=m.seed if init is None else init.config.seed,
        init_adapter=_absolute_if_local(m.init_adapter) if init is not None else None,
        pi=identity.pi,
        hjd_dtype=identity.hjd_dtype,
        dtype=m.dtype,
        frozen_quant=m.frozen_quant,  # eval and export rebuild the same quantized model
        quantize_base=m.quantize_base,
    )


def _absolute_if_local(path_or_id: str) -> str:
    p = Path(path_or_id)
    return str(p.resolve()) if p.exists() else path_or_id


def _initial_sigma(model: torch.nn.Module, zero3: bool) -> dict[str, torch.Tensor]:
    """σ⁰ as the model holds it (model dtype, so bf16 rounding is not counted as an update); rank 0 keeps it."""
    sigma0 = {}
    for params, members in frod_groups(model):
        with gathered(params, zero3):
            if dist.is_main():
                sigma0.update({name: m.frod_sigma.detach().float().cpu().clone() for name, m in members})
    return sigma0


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def _resume(run: Run, tag: str | None, skipped: list[tuple[str, str]]) -> int:
    """Restore checkpoint ``tag`` that setup chose (``skipped``: newer ones that failed their check); returns the
    step to continue from (0: none)."""
    root = run.out / "checkpoints"
    unsealed = [u for u in dist.on_main(lambda: unsealed_checkpoints(root)) if tag is None or step_of(u) > step_of(tag)]
    if unsealed and dist.is_main():
        note(
            f"{', '.join(unsealed)} in {root}: no COMPLETE seal (a save that never finished), not resumed "
            f"from; {'starting at step 0' if tag is None else f'resuming from {tag}'}"
        )
    step = 0
    if tag is not None:
        step = restore_checkpoint(run.engine, root, tag, skipped, run.layout, run.zero3)
    # rows of the steps after the one continued from are replayed: dropped (a line torn by a kill too)
    finished = step >= run.total_steps
    dist.on_main(lambda: drop_rows_after(run.out / METRICS, step, run.recipe.train.log_every, finished))
    if tag is not None:
        dist.print0(f"resumed from {tag}: step {step}/{run.total_steps}")
    return step


# Names that moved to the trainer's parts in 0.2.0: importing them from here warns (frod_ds._moved).
_MOVED_NAMES = {
    "lr_lambda": "frod_ds.train.schedule",
    "removed_if_failed": "frod_ds.train.run_dir",
    "PREVIOUS_RUN": "frod_ds.train.run_dir",
    "RUN_KIND": "frod_ds.train.run_dir",
    "RUN_HOSTS": "frod_ds.train.run_dir",
    "STORE_IDENTITY": "frod_ds.train.identity",
    "nvme_params": "frod_ds.train.preflight",
    "plot_loss": "frod_ds.train.metrics",
    "eval_loss": "frod_ds.train.loop",
    "rotation_angles": "frod_ds.train.loop",
    "save_adapter": "frod_ds.train.loop",
    "save_checkpoint": "frod_ds.train.loop",
    "STOP_EXIT_CODE": "frod_ds.train.loop",
}


__getattr__ = forward_names(__name__, _MOVED_NAMES)
