"""Which DeepSpeed ZeRO set-up is likely fastest for a model and a GPU count: the rule the README states.

FRoD trains a few hundred thousand numbers per layer (σ, S); nearly all memory is the frozen model (U_i, V,
and the untouched weights). ZeRO-2 keeps a full copy of the frozen model on every GPU and partitions only the
trainable tensors, their gradients and optimizer states: no parameter is gathered, so it is the fast choice
whenever the frozen model fits. ZeRO-3 also partitions the frozen weights and gathers each layer's weights
in every forward and backward: what a model that does not fit one GPU needs (70B), pure overhead on one that
does (LLaMA-2-7B on 4 H200s, bench/train_step.py: FRoD 8.4K tokens/s under ZeRO-3, 30.9K under ZeRO-2).
Offloading parameters to CPU or NVMe is slower still: for when even the partitioned model does not fit.

The rule, with ``F`` the frozen model's bytes in the training dtype and ``G`` one GPU's memory:

    F ≤ FIT_FRACTION · G                  ZeRO-2 (ds_configs/zero2.json)
    F / world_size ≤ FIT_FRACTION · G     ZeRO-3 (ds_configs/zero3.json)
    otherwise                             ZeRO-3 with parameter offload (ds_configs/zero3_offload.json)

``FIT_FRACTION`` leaves the other half of the GPU to activations, buffers and fragmentation; it is a rule of
thumb, not a memory plan (activations grow with micro-batch × sequence length and are not counted here).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FIT_FRACTION", "ZeroChoice", "recommend_zero", "zero_hint", "frozen_model_bytes", "choice_of_config"]

FIT_FRACTION = 0.5


@dataclass(frozen=True)
class ZeroChoice:
    stage: int  # 2 (frozen model replicated) or 3 (partitioned)
    offload: bool  # parameters offloaded to CPU / NVMe

    @property
    def config(self) -> str:
        return "ds_configs/zero3_offload.json" if self.offload else f"ds_configs/zero{self.stage}.json"


def recommend_zero(frozen_bytes: int, gpu_bytes: int, world_size: int) -> ZeroChoice:
    """The fastest ZeRO set-up that is likely to fit (the rule in the module docstring)."""
    budget = FIT_FRACTION * gpu_bytes
    if frozen_bytes <= budget:
        return ZeroChoice(2, False)
    if frozen_bytes / max(world_size, 1) <= budget:
        return ZeroChoice(3, False)
    return ZeroChoice(3, True)


def choice_of_config(ds_config: dict) -> ZeroChoice:
    """The ZeRO set-up a DeepSpeed JSON asks for (stages 0-2 replicate the frozen model, like 2)."""
    zero = ds_config.get("zero_optimization", {}) or {}
    offload = (zero.get("offload_param", {}) or {}).get("device") in ("cpu", "nvme")
    return ZeroChoice(3 if int(zero.get("stage", 0)) == 3 else 2, offload)


def zero_hint(chosen: ZeroChoice, frozen_bytes: int, gpu_bytes: int, world_size: int) -> str | None:
    """One line when ``chosen`` is likely the slow (or the failing) set-up for this model and GPU count."""
    best = recommend_zero(frozen_bytes, gpu_bytes, world_size)
    if best == chosen:
        return None
    f, g = frozen_bytes / 1e9, gpu_bytes / 1e9
    gpus = f"{world_size} GPU{'s' if world_size > 1 else ''}"
    if best.stage == 2:
        return (f"hint: the frozen model ({f:.1f} GB) fits one GPU ({g:.0f} GB): {best.config} is likely several "
                f"times faster than ZeRO-3{' with offload' if chosen.offload else ''} here (it gathers every layer's "
                "weights in each forward and backward); see README, 'Choosing a DeepSpeed config'")
    if chosen.stage == 2:
        return (f"hint: the frozen model ({f:.1f} GB) is more than {FIT_FRACTION:.0%} of one GPU ({g:.0f} GB) and "
                f"ZeRO-2 keeps a full copy on each: likely out of memory; use {best.config}")
    if best.offload:
        return (f"hint: the frozen model ({f:.1f} GB) split over {gpus} is still more than {FIT_FRACTION:.0%} of "
                f"one GPU ({g:.0f} GB): likely out of memory without offload; use {best.config} or more GPUs")
    return (f"hint: the frozen model ({f:.1f} GB) split over {gpus} fits without offload: {best.config} is likely "
            "faster than offloading parameters")


def frozen_model_bytes(tensor_numels: list[int], widths: list[int], bytes_per_element: int) -> int:
    """Bytes of a FRoD model's frozen tensors: every checkpoint tensor (U_i has W_i's shape) plus one (n, n) V
    per category, in the training dtype. ``tensor_numels``: the checkpoint's tensors; ``widths``: n per category."""
    return (sum(tensor_numels) + sum(n * n for n in widths)) * bytes_per_element
