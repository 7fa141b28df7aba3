"""How a ZeRO-3 run partitions its frozen weights (``train.zero3_partition``).

``layers``: frod-ds keeps 1/N of each unit's frozen weights (embedding, decoder layer, head) per rank and gathers a
unit around its use, the next one prefetched (``frod_ds.model.frozen_shards``); σ and S, a few MB, run under ZeRO-2,
so DeepSpeed's engine gets the JSON with stage 2; with ``offload_param`` to the CPU the shards live in pinned host
memory (faster than DeepSpeed's coordinator offloading them: ``bench/results/offload-7b``). ``deepspeed``: DeepSpeed's
stage-3 coordinator partitions every parameter; NVMe offload needs it (DeepSpeed's ZeRO-2 would keep an NVMe
optimizer on the GPU without a word). ``auto`` (the default): ``layers`` unless the JSON offloads anything to NVMe.
"""

from __future__ import annotations

from typing import Any

from frod_ds.config.ds_config import DSConfigError, layout_of, nvme_offloads, offload_device, zero_stage

__all__ = ["PEER_NO_HOST", "check_gather", "host_shards", "zero3_layout"]

# peer copies read the other GPUs' memory; host shards are in host memory (check_gather, frozen_shards.host_bank)
PEER_NO_HOST = (
    "the frozen weights' shards are offloaded to host memory (offload_param to the CPU), which peer copies cannot "
    "read; use train.zero3_gather=auto or collective, or a JSON without offload_param"
)


def zero3_layout(cfg: dict[str, Any], choice: str) -> str | None:
    """``"layers"`` or ``"deepspeed"`` for a ZeRO-3 ``cfg``, None for any other stage."""
    if zero_stage(cfg) == 3 and choice == "layers" and (nvme := nvme_offloads(cfg)):
        raise DSConfigError(
            "DeepSpeed config: train.zero3_partition=layers keeps the frozen weights' shards on the GPU or in host "
            f"memory and σ, S under ZeRO-2, but the JSON offloads to NVMe ({', '.join(sorted(nvme))}); use "
            "train.zero3_partition=auto"
        )
    return layout_of(cfg, choice)


def host_shards(cfg: dict[str, Any], layout: str | None) -> bool:
    """Whether the layer partition keeps the frozen weights' shards in host memory (``offload_param`` to the CPU)."""
    return layout == "layers" and offload_device(cfg, "offload_param") == "cpu"


def check_gather(cfg: dict[str, Any], layout: str | None, gather: str) -> None:
    """``DSConfigError`` for ``train.zero3_gather=peer`` with host shards: peer copies read other GPUs' memory, not
    host memory (one check for ``frod train`` before it builds anything and for ``frod plan``)."""
    if gather == "peer" and host_shards(cfg, layout):
        raise DSConfigError(f"DeepSpeed config: {PEER_NO_HOST}")
