"""Build a FRoD model with its frozen weights partitioned by decoder layer as it is read (ZeRO-3's layer layout).

The skeleton is made on the meta device; then the modules outside every unit (the final norm, the shared ``V`` of
each category) are read whole, and each unit (the input embedding, each decoder layer, the output head) is read
into host memory, cut to this rank's 1/N (``frod_ds.model.frozen_shards.shard_unit``, on the GPU) and dropped
before the next: every rank reads the checkpoint, none holds more than one unit of it. σ and S stay whole (the
engine runs them under ZeRO-2); ``FrozenShards`` gathers each unit around its use.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from frod_ds.core.layer import FRoDLinear, SparseSupport
from frod_ds.core.quant import QuantError, quantize_untargeted
from frod_ds.model.apply import mark_only_frod_trainable
from frod_ds.model.build import _load_module, _swap_targets, check_store_quant
from frod_ds.model.frozen_shards import attach, frozen_units, host_bank, install, not_mine, shard_unit, shared_params
from frod_ds.model.skeleton import recompute_rope, skeleton
from frod_ds.runtime.distributed import agree_on_error

__all__ = ["build_layer_partitioned"]


def _materialize(module: nn.Module) -> None:
    """Host tensors for ``module``'s own Parameters and buffers still on the meta device (values read next)."""
    for p in module.parameters(recurse=False):
        if p.is_meta:  # the same Parameter object (V is shared by a category's members), its attributes kept
            attrs = dict(p.__dict__)
            torch.utils.swap_tensors(p, nn.Parameter(torch.empty(p.shape, dtype=p.dtype), p.requires_grad))
            p.__dict__.update(attrs)
    for name, b in module.named_buffers(recurse=False):
        if b.is_meta:
            setattr(module, name, torch.empty(b.shape, dtype=b.dtype))


def build_layer_partitioned(
    model_dir,
    store,
    supports: Mapping[str, SparseSupport],
    dtype: torch.dtype,
    device: torch.device,
    quant: str = "none",
    quantize_base: bool = False,
    gather: str = "auto",
    offload: bool = False,
) -> nn.Module:
    """The base architecture with FRoD layers, loaded, its frozen weights partitioned across the ranks by unit
    (collective: every rank calls it). Arguments as ``build_frod_model``'s; ``device``: where the shards live.
    ``gather``: how a unit is gathered (``frozen_shards.open_bank``); ``offload``: the shards in pinned host
    memory (parameter offload to the CPU), gathered by the collective. Returns the model (σ, S, V and the modules
    outside every unit on the host, for the engine to move), its ``FrozenShards`` installed and recorded on it
    (``shards_of``)."""
    from transformers import AutoConfig

    from frod_ds.io.hf_checkpoint import HFCheckpoint

    check_store_quant(store, supports, quant)
    if quantize_base and quant == "none":
        raise QuantError("model.quantize_base=true needs model.frozen_quant nf4 or int8 (the kind it uses)")
    ckpt = model_dir if isinstance(model_dir, HFCheckpoint) else HFCheckpoint(model_dir)
    ckpt.config()
    keys = set(ckpt.keys())
    config = AutoConfig.from_pretrained(str(ckpt.dir))
    targeted = {name for c in supports for name in store.categories[c]}
    with torch.device("meta"), skeleton(config, dtype, targeted, None) as model:
        _swap_targets(model, store, supports, dtype, quant, flat=True, flat_frozen=False)
        if quantize_base:
            quantize_untargeted(model, quant, dtype)
    mark_only_frod_trainable(model)
    units = frozen_units(model)
    shared = shared_params(units)
    bank = host_bank(units, shared, device, gather, offload)  # laid out from the skeleton's shapes, before reads
    inside = {id(m) for _, unit in units for m in unit.modules()}
    state: dict = {"missing": [], "error": None, "v_done": set()}
    seen: set[int] = set()

    def load(name: str, module: nn.Module, skip: set[int] | frozenset = frozenset()) -> None:
        _materialize(module)
        fresh = [p for p in module.parameters(recurse=False) if id(p) not in seen or isinstance(module, FRoDLinear)]
        if not fresh:
            return  # tied weights already loaded through their first module
        seen.update(id(p) for p in module.parameters(recurse=False))
        _load_module(name, module, ckpt, keys, store, True, False, state, skip)

    for name, module in model.named_modules():  # outside the units: the final norm, the rotary embedding
        if id(module) not in inside:
            load(name, module)
    made = []
    for name, unit in units:
        others = not_mine(unit, shared)  # the other ranks' shares: not read here
        for sub, module in unit.named_modules(prefix=name):
            load(sub, module, others)
        if state["error"] is None:
            made += shard_unit(name, unit, shared, device, bank, offload)
    missing, error = state["missing"], state["error"]
    if missing:
        error = error or (
            f"{len(missing)} tensors missing from checkpoint {ckpt.dir}: {', '.join(missing[:5])}"
            f"{' …' if len(missing) > 5 else ''}"
        )
    agree_on_error(error)  # a rank that could not read stops them all, with its line
    recompute_rope(model)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert not left, f"tensors the layer-partitioned build did not read: {left[:5]}"
    attach(model, install(made, device, bank))
    return model
