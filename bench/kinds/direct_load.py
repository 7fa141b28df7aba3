"""LoRA's frozen base read straight from its safetensors files, each rank only what it holds (``load = "direct"``).

The base is built without weights (``frod_ds/model/skeleton.py``): under ZeRO-3 as ``zero.Init``'s partitions, each
rank then reading its flat span of every tensor; otherwise on the meta device, filled by ``load_weights`` once PEFT
has added the adapters (drawn on the CPU, as on ``from_pretrained``'s path) and FSDP2 has sharded the model: a
DTensor gets the rows of dim 0 its shard holds, any other tensor comes whole. A rank's host memory holds one
tensor's share at a time; RoPE's buffers (non-persistent, never in the files) are computed afresh.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from itertools import chain
from pathlib import Path

import torch
from torch import nn

from frod_ds.io.hf_checkpoint import HFCheckpoint
from frod_ds.model.skeleton import recompute_rope, skeleton

__all__ = ["adapters_off_meta", "base_model", "load_weights", "own_rows", "own_span"]


def own_rows(n: int, rank: int, world: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of a dim 0 of ``n`` rows that FSDP2 gives rank ``rank`` of ``world``: ``torch.chunk``'s
    split, ``ceil(n / world)`` rows a rank, the last ones shorter or empty."""
    c = -(-n // world)
    return min(n, rank * c), min(n, (rank + 1) * c)


def own_span(numel: int, k: int, rank: int) -> tuple[int, int]:
    """Elements ``[lo, hi)`` of a flattened tensor of ``numel`` in rank ``rank``'s ZeRO-3 partition of ``k``
    (zero-padded past ``hi``)."""
    return min(numel, rank * k), min(numel, (rank + 1) * k)


def _read(ckpt: HFCheckpoint, key: str, lo: int, hi: int, unit: int, out: torch.Tensor) -> torch.Tensor:
    """Units ``[lo, hi)`` of tensor ``key`` (``unit`` bytes each) into the front of the CPU uint8 tensor ``out``."""
    ckpt.read_range(key, lo * unit, out[: (hi - lo) * unit])
    return out


def base_model(model_dir: Path, ds_cfg: dict | None) -> nn.Module:
    """The bf16 base of ``model_dir`` without weights: under ZeRO-3 (``ds_cfg``) its partitions, this rank's read in
    here; else on the meta device."""
    from transformers import AutoConfig

    from frod_ds.config.ds_config import zero_stage

    zero3 = ds_cfg is not None and zero_stage(ds_cfg) == 3
    with contextlib.ExitStack() as stack:
        if not zero3:
            stack.enter_context(torch.device("meta"))
        config = AutoConfig.from_pretrained(model_dir)
        model = stack.enter_context(skeleton(config, torch.bfloat16, set(), ds_cfg if zero3 else None))
    if zero3:
        _load_partitions(model, HFCheckpoint(model_dir))
        recompute_rope(model)
    return model


@torch.no_grad()
def _load_partitions(model: nn.Module, ckpt: HFCheckpoint) -> None:
    """Every ZeRO-3 parameter's partition on this rank: ``[rank·k, (rank+1)·k)`` of the flattened tensor (the layout
    ``zero.Init`` partitions in), read from the file into ``ds_tensor``."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    from frod_ds.runtime import distributed as dist

    for name, p in model.named_parameters():
        info = ckpt.info(name)
        assert tuple(info.shape) == tuple(p.ds_shape), f"{name}: {info.shape} in the files, {p.ds_shape} in the model"
        assert p.ds_status == ZeroParamStatus.NOT_AVAILABLE, f"{name} is gathered while its partition is loaded"
        k, unit = p.ds_tensor.numel(), info.dtype.itemsize
        lo, hi = own_span(p.ds_numel, k, dist.get_rank())
        buf = _read(ckpt, name, lo, hi, unit, torch.zeros(k * unit, dtype=torch.uint8))
        p.ds_tensor.copy_(buf.view(info.dtype))


@contextlib.contextmanager
def adapters_off_meta(model: nn.Module) -> Iterator[None]:
    """PEFT puts each new adapter on its base weight's device, which for a meta weight would leave it without values:
    while PEFT wraps the model, each meta ``nn.Linear`` weight is a CPU stand-in of its shape (a broadcast zero, no
    memory), so the adapters stay on the CPU where PEFT drew them, as on ``from_pretrained``'s path. The meta
    weights go back after, with the ``requires_grad`` PEFT gave their stand-ins."""
    swapped = []
    for m in model.modules():
        if isinstance(m, nn.Linear) and m.weight is not None and m.weight.is_meta:
            swapped.append((m, m.weight))
            m.weight = nn.Parameter(torch.zeros((), dtype=m.weight.dtype).expand(m.weight.shape), requires_grad=False)
    try:
        yield
    finally:
        for m, weight in swapped:
            m.weight = weight.requires_grad_(m.weight.requires_grad)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


@torch.no_grad()
def load_weights(model: nn.Module, model_dir: Path, device: torch.device) -> None:
    """Fill every parameter of ``model`` (PEFT-wrapped) still on the meta device from ``model_dir`` onto ``device``:
    a DTensor the rows its shard holds, any other tensor whole; then RoPE's buffers. Its checkpoint name is its own
    less ``.base_layer``."""
    from torch.distributed.tensor import DTensor, Shard

    ckpt, base = HFCheckpoint(model_dir), model.get_base_model()
    loaded = {}
    for name, p in base.named_parameters():
        local = _local(p)
        if not local.is_meta:
            continue
        assert "lora_" not in name, f"{name}: an adapter was left on the meta device (adapters_off_meta)"
        key, (lo, hi) = name.replace(".base_layer", ""), (0, p.shape[0])
        info = ckpt.info(key)
        assert tuple(info.shape) == tuple(p.shape), f"{key}: {info.shape} in the files, {tuple(p.shape)} in the model"
        if isinstance(p, DTensor):
            assert tuple(p.placements) == (Shard(0),), f"{name}: placements {p.placements}, FSDP2's are (Shard(0),)"
            lo, hi = own_rows(p.shape[0], p.device_mesh.get_local_rank(), p.device_mesh.size())
        assert local.shape[0] == hi - lo, f"{name}: the shard holds {local.shape[0]} rows, rows {lo}..{hi} are read"
        unit = math.prod(p.shape[1:]) * info.dtype.itemsize
        buf = _read(ckpt, key, lo, hi, unit, torch.empty((hi - lo) * unit, dtype=torch.uint8))
        t = buf.view(info.dtype).reshape(local.shape).to(device=device, dtype=p.dtype)
        if isinstance(p, DTensor):
            t = DTensor.from_local(t, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
        loaded[name] = nn.Parameter(t, requires_grad=p.requires_grad)
    base.load_state_dict(loaded, strict=False, assign=True)  # FSDP2's post-hook re-pads each sharded Parameter
    for m in base.modules():
        if type(m).__name__.endswith("RotaryEmbedding"):
            m.to_empty(device=device, recurse=False)
    recompute_rope(base)
    left = [n for n, t in chain(base.named_parameters(), base.named_buffers()) if _local(t).is_meta]
    assert not left, f"still on the meta device after loading: {left[:3]}"
