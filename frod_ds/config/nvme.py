"""The NVMe-offload preflight: what DeepSpeed 0.19.8 would stop on mid-build when parameters go to NVMe (a swap
buffer too small for a partition, too few buffers for what one layer gathers, a shared parameter prefetched twice,
an op build its ``TORCH_CUDA_ARCH_LIST`` breaks), checked from the JSON and the model's sizes before it starts."""

from __future__ import annotations

from dataclasses import dataclass, field

from frod_ds.config.ds_config import DSConfigError, nvme_offloads, zero_settings

__all__ = [
    "DS_MIN_AIO_BYTES",
    "NvmeParams",
    "check_aio_build_env",
    "check_nvme_buffer",
    "check_nvme_buffer_count",
    "nvme_buffers_needed",
]


def check_nvme_buffer(cfg: dict, largest_numel: int, world_size: int) -> None:
    """``DSConfigError`` (one line) when parameters go to NVMe and DeepSpeed's swap buffers cannot hold the
    largest parameter's partition: DeepSpeed would stop with an assertion in the middle of the model build."""
    if "offload_param" not in nvme_offloads(cfg):
        return
    buf = zero_settings(cfg).nvme_buffer_size
    part = -(-largest_numel // world_size)
    if part > buf:
        raise DSConfigError(
            f"DeepSpeed config: zero_optimization.offload_param.buffer_size is {buf:,} elements, smaller "
            f"than the largest parameter's partition ({part:,} = {largest_numel:,} over {world_size} "
            f"rank(s)); set buffer_size to at least {part}"
        )


DS_MIN_AIO_BYTES = 1024**2  # DeepSpeed swaps a partition to NVMe only from max(this, aio.block_size) bytes


@dataclass(frozen=True)
class NvmeParams:
    """Element counts of a model's parameters, grouped the way DeepSpeed's NVMe swap buffers are used."""

    layers: list[list[int]]  # each decoder layer's own parameters
    shared: list[int]  # parameters several layers use (FRoD's V per category), each once
    other: list[int]  # the rest (embeddings, head, final norm)
    trainable: list[list[int]] = field(default_factory=list)  # each decoder layer's trainable ones (σ, S)

    @property
    def largest_frozen(self) -> int:
        """Elements of the largest frozen parameter (what one swap buffer must hold, whole or as a partition)."""
        return max([n for ns in self.layers for n in ns] + self.shared + self.other)


def _swapped(numels: list[int], world_size: int, elem_bytes: int, min_bytes: int) -> list[int]:
    return [n for n in numels if -(-n // world_size) * elem_bytes >= min_bytes]


def _min_swap_bytes(cfg: dict) -> int:
    return max(DS_MIN_AIO_BYTES, zero_settings(cfg).aio_block_size)


def _reuse_distance(cfg: dict) -> int:
    return int(zero_settings(cfg).max_reuse_distance)


def nvme_buffers_needed(cfg: dict, params: NvmeParams, world_size: int, elem_bytes: int) -> int:
    """The ``offload_param.buffer_count`` a ZeRO-3 run with parameters on NVMe needs (DeepSpeed 0.19.8).

    DeepSpeed holds one pinned swap buffer per swapped partition from its read-back until it is re-partitioned; a
    gather that finds too few stops with ``Not enough buffers``. Without prefetch or a reuse window at most one
    decoder layer, the shared parameters and one other parameter are gathered at once, so that is the count; a
    reuse window (``stage3_max_reuse_distance`` > 0) adds up to one buffer per smallest parameter that fits in it.
    """
    zs = zero_settings(cfg)
    swapped = lambda ns: _swapped(ns, world_size, elem_bytes, _min_swap_bytes(cfg))  # noqa: E731
    layer = max((len(swapped(ns)) for ns in params.layers), default=0)
    shared = len(swapped(params.shared))
    other = min(len(swapped(params.other)), 1)
    need = layer + shared + other
    # trainable partitions stay in host memory up to offload_param.max_in_cpu elements per rank; beyond that
    # DeepSpeed swaps them to NVMe too (any partition of at least the minimum size), a layer's at a time
    max_in_cpu = zs.max_in_cpu
    trainable_per_rank = sum(-(-n // world_size) for ns in params.trainable for n in ns)
    spill = trainable_per_rank > max_in_cpu
    if spill:
        need += max((len(swapped(ns)) for ns in params.trainable), default=0)
    reuse = _reuse_distance(cfg)
    every = swapped(
        [n for ns in params.layers + (params.trainable if spill else []) for n in ns] + params.shared + params.other
    )
    if reuse > 0 and every:
        need += -(-reuse // min(every))
    return max(min(need, len(every)), 1)


def check_nvme_buffer_count(cfg: dict, params: NvmeParams, world_size: int, elem_bytes: int) -> None:
    """``DSConfigError`` (one line) when parameters go to NVMe and DeepSpeed would run out of swap buffers
    (``nvme_buffers_needed``), or would prefetch a shared parameter from NVMe twice (DeepSpeed 0.19.8's NVMe
    prefetch does not skip a parameter that recurs in its window: ``param N already assigned swap buffer``)."""
    if "offload_param" not in nvme_offloads(cfg):
        return
    zs = zero_settings(cfg)
    prefetch = int(zs.prefetch_bucket_size)
    if prefetch > 0 and _swapped(params.shared, world_size, elem_bytes, _min_swap_bytes(cfg)):
        raise DSConfigError(
            f"DeepSpeed config: zero_optimization.stage3_prefetch_bucket_size is {prefetch:,} with "
            "parameters on NVMe, and DeepSpeed's NVMe prefetch swaps a parameter the layers share "
            "(FRoD's V) in twice and stops; set stage3_prefetch_bucket_size to 0"
        )
    have = zs.nvme_buffer_count
    need = nvme_buffers_needed(cfg, params, world_size, elem_bytes)
    if have < need:
        raise DSConfigError(
            f"DeepSpeed config: zero_optimization.offload_param.buffer_count is {have}, this model "
            f"gathers up to {need} NVMe-swapped parameters at once (one decoder layer, the shared "
            f"ones, one more{', and the stage3_max_reuse_distance window' if _reuse_distance(cfg) > 0 else ''}); "
            f"set buffer_count to at least {need}"
        )


def check_aio_build_env(cfg: dict, env: dict) -> None:
    """``DSConfigError`` (one line) when NVMe offload will JIT-build DeepSpeed's ``async_io`` op and
    ``TORCH_CUDA_ARCH_LIST`` holds an architecture its op builder cannot parse (DeepSpeed 0.19 reads each entry as
    ``int.int[+PTX]``: ``9.0a``, which CUDA images for Hopper set, stops the build with a ValueError mid-setup)."""
    if not nvme_offloads(cfg):
        return
    bad = [
        a
        for a in env.get("TORCH_CUDA_ARCH_LIST", "").replace(";", " ").split()
        if not all(p.isdigit() for p in a.split("+")[0].split("."))
    ]
    if bad:
        raise DSConfigError(
            f"NVMe offload builds DeepSpeed's async_io op, whose builder cannot parse "
            f"TORCH_CUDA_ARCH_LIST entry {bad[0]!r}; set TORCH_CUDA_ARCH_LIST without letter suffixes "
            f"(e.g. {bad[0].rstrip('abcdefghijklmnopqrstuvwxyz')!r}) for this run"
        )
