"""How a ZeRO-3 run partitions its frozen weights (``train.zero3_partition``).

``layers``: frod-ds keeps 1/N of each unit's frozen weights (embedding, decoder layer, head) per rank and gathers a
unit around its use, the next one prefetched (``frod_ds.model.frozen_shards``); σ and S, a few MB, run under ZeRO-2,
so DeepSpeed's engine gets the JSON with stage 2; with ``offload_param`` to the CPU the shards live in pinned host
memory. ``deepspeed``: DeepSpeed's stage-3 coordinator partitions every parameter; NVMe offload needs it. ``auto``
(the default): ``layers`` unless the JSON offloads parameters.
"""

from __future__ import annotations

from typing import Any

from frod_ds.config.ds_config import DSConfigError, offload_device, zero_stage

__all__ = ["host_shards", "zero3_layout"]


def zero3_layout(cfg: dict[str, Any], choice: str) -> str | None:
    """``"layers"`` or ``"deepspeed"`` for a ZeRO-3 ``cfg``, None for any other stage."""
    if zero_stage(cfg) != 3:
        return None
    offload = offload_device(cfg, "offload_param")
    if choice == "layers" and offload == "nvme":
        raise DSConfigError(
            "DeepSpeed config: train.zero3_partition=layers keeps the frozen weights' shards on the GPU or in host "
            'memory, but the JSON offloads parameters to NVMe ("offload_param"); use train.zero3_partition=auto'
        )
    return "deepspeed" if choice == "deepspeed" or (offload and choice == "auto") else "layers"


def host_shards(cfg: dict[str, Any], layout: str | None) -> bool:
    """Whether the layer partition keeps the frozen weights' shards in host memory (``offload_param`` to the CPU)."""
    return layout == "layers" and offload_device(cfg, "offload_param") == "cpu"
