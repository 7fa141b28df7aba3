"""Step-time model: predicted seconds per optimizer step of FRoD training for one set-up, from the shapes and a
few measured constants, so the planner can rank the set-ups that fit by speed instead of by a fixed order.

    step = max(device, host) + overflow check + link + offload + gradient reduce + CPU optimizer

Each term and the constants behind it: docs/memory.md; where each constant was read: docs/benchmarks.md.
``bench/time_model_check.py`` sets the model against every committed FRoD step measurement. It ranks set-ups; it is
not a promise of a step time on another machine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from frod_ds.core.names import LLAMA_LINEARS
from frod_ds.plan.flops import flops_per_token
from frod_ds.plan.memory import frozen_tensors, trainable_tensors
from frod_ds.plan.shapes import Engine, ModelShape, TrainShape

__all__ = ["StepTime", "Link", "step_time", "rank_threads", "CHECK_GOAL", "NVLINK"]

# Fraction of the dense bf16 peak FRoD's model FLOPs reach on the GPU.
EFFICIENCY = 0.50
# DeepSpeed's host work (seconds, on the H200 machine's host): per step, per trainable tensor, per ZeRO-3 decoder
# layer and pass, less per frozen tensor a layer no longer has with one U Parameter (FRoDFrozen), less per layer and
# pass with DeepSpeed's NVTX ranges off.
ZERO_STEP_HOST_S = 40e-3
ZERO_TENSOR_HOST_S = 1.5e-4
ZERO3_LAYER_PASS_S = 2.3e-3
ZERO3_FROZEN_TENSOR_PASS_S = 1.6e-4
ZERO3_NVTX_LAYER_PASS_S = 1.6e-4
# DeepSpeed's bf16 per-gradient overflow check under ZeRO-2, per trainable tensor (off in the shipped zero2.json).
ZERO_CHECK_TENSOR_S = 1.0e-4
# Exposed ZeRO-3 gather time over the link floor (DeepSpeed's prefetch hides little of it).
LINK_EXPOSED = 1.2
# The same for the layer partition (one coalesced gather per unit on a side stream, the next one prefetched; a
# checkpointed layer's recompute reuses its backward's gather): read off the 7B shape on 2 H200s.
LAYERS_LINK_EXPOSED = 0.7
# The same with the gathers copied out of every GPU's mapped shards (copy engines, no NCCL kernel beside the GEMMs):
# read off the 7B shape on 2 H200s (zero3-2gpu, series 4-5).
PEER_LINK_EXPOSED = 0.27
# All-gather bus bandwidth of 2 H200s over NVLink (bench/results/two_gpu_2xh200/matrix/link_2gpu.json).
NVLINK_BUSBW = 268e9
# Host-to-GPU copies of offloaded frozen weights under DeepSpeed's coordinator (fitted on its one measured step,
# less the CPU optimizer's term below).
OFFLOAD_BYTES_PER_S = 70e9
# Host-to-GPU copies of the layer partition's host shards, on its side stream beside the compute: read off the 7B
# shape on one H200 (offload-7b), where the copies are the whole step.
HOST_SHARD_BYTES_PER_S = 54e9
# Reads of NVMe-offloaded frozen weights under DeepSpeed's coordinator (async_io): the disk's read speed decides it.
# Read off the GPU machine's local disk (nvme-7b-train-1gpu); a machine's own drives may be several times faster.
DISK_BYTES_PER_S = 2.1e9
# The optimizer on the CPU (offload_optimizer: DeepSpeedCPUAdam's step, the gradients' copies, unscaling and
# overflow check on the host), seconds per trainable parameter of one rank (each rank steps its 1/N of σ and S), as
# a part no OpenMP thread shortens plus a part that divides by the rank's threads: read off rank 0's optimizer phase
# (offload-7b-phases at one thread, median 2.42e-9 s; offload-7b-pass-check at 16 threads, 4.4e-10 s).
CPU_OPTIMIZER_PARAM_S = 3.05e-10
CPU_OPTIMIZER_THREAD_PARAM_S = 2.115e-9
# OpenMP threads of a lone rank: torchrun sets OMP_NUM_THREADS=1 only when it starts several ranks on a machine,
# so one rank gets every core (the H200 machines' 16 per GPU); with several, one each.
LONE_RANK_THREADS = 16
# Dequantization on the GPU, seconds per quantized element and pass.
DEQUANT_DEVICE_S = {"nf4": 1.4e-12, "int8": 7.9e-12}
# The host's time per decoder layer and pass of a bf16 FRoD step, and per quantized linear and pass on top of it.
HOST_LAYER_PASS_S = 2.8e-3
HOST_DEQUANT_CALL_S = 3.5e-4
# The check's goal: every committed step within 15% of its prediction (bench/results/time_model_check.md).
CHECK_GOAL = 0.15


@dataclass(frozen=True)
class Link:
    """What the GPUs of one job share: all-gather bus bandwidth (bytes/s), one GPU's dense bf16 peak (FLOP/s), and
    how fast the host issues work."""

    busbw: float = NVLINK_BUSBW
    peak_flops: float = 989.4e12  # H100 / H200 SXM
    host: float = 1.0  # the host's time for the same work relative to the machine HOST_* were read on
    cpu_threads: int | None = None  # OpenMP threads per rank; None: the launcher's (1, or LONE_RANK_THREADS alone)


NVLINK = Link()


def rank_threads(link: Link, gpus: int) -> int:
    """OpenMP threads of each rank's CPU optimizer: ``link.cpu_threads``, else the launcher's (torchrun: one per
    rank with several ranks, every core for a lone one)."""
    return link.cpu_threads or (LONE_RANK_THREADS if gpus == 1 else 1)


@dataclass
class StepTime:
    parts: dict[str, float]  # seconds per optimizer step (one micro-batch per GPU); they add up to the step
    host: dict[str, float] = field(default_factory=dict)  # the host's work per step, overlapping the device's

    @property
    def seconds(self) -> float:
        return sum(self.parts.values())


def _config_dict(model: ModelShape) -> dict:
    return {
        "num_hidden_layers": model.layers,
        "hidden_size": model.hidden,
        "intermediate_size": model.intermediate,
        "num_attention_heads": model.heads,
        "num_key_value_heads": model.kv_heads,
        "vocab_size": model.vocab,
        "head_dim": model.head_dim,
    }


def _side_exposed(side: float, parts: dict[str, float], host: dict[str, float], passes: int, device: float) -> float:
    """The side stream's time not hidden, pass by pass: the forward's copies hide only behind the forward's work
    (a third of the compute), the backward's behind the backward's (the rest and the recompute), so a step whose
    copies match its device time overall still waits on them in the forward. ``device``: the GPU's work."""
    forward = parts["compute"] / 3 + parts.get("dequantize", 0.0) / passes
    host_forward = host.get("layers", 0.0) / passes
    per_pass = [(forward, host_forward), (device - forward, sum(host.values()) - host_forward)]
    return max(0.0, sum(max(side / 2, dev, hst) for dev, hst in per_pass) - device - parts["host beyond device"])


def step_time(
    model: ModelShape, train: TrainShape, engine: Engine, gpus: int, link: Link = NVLINK, *, plain: bool = False
) -> StepTime:
    """Predicted seconds per step of one set-up; ``plain``: plain PyTorch (no DeepSpeed engine, one GPU), for
    comparisons."""
    tokens = train.tokens
    flops = flops_per_token(
        _config_dict(model), train.seq_len, "frod", tokens, targets=train.targets, sparsity=train.sparsity
    )["total"]
    rate = link.peak_flops * EFFICIENCY
    passes = 3 if train.checkpointing else 2
    parts = {"compute": tokens * flops / rate, "recompute": tokens * flops / 3 / rate if train.checkpointing else 0.0}
    trainable = trainable_tensors(model, train)  # [(numel, count)]
    n_trainable = sum(count for _, count in trainable)
    if not plain and train.flat_trainables and n_trainable:
        n_trainable = 2 * model.layers  # σ and S of each decoder layer as one Parameter each
    frozen_bytes = sum(b * c for group in frozen_tensors(model, train).values() for b, c, _ in group)
    quantized_linears = 0
    if train.quant != "none":
        names = [t for t in train.targets] + (
            [n for n in LLAMA_LINEARS if n not in train.targets] if train.quantize_base else []
        )
        quantized_linears = len(names)
        elements = model.layers * sum(model.linear(n)[0] * model.linear(n)[1] for n in names)
        parts["dequantize"] = DEQUANT_DEVICE_S[train.quant] * elements * passes
    device = sum(parts.values())
    host = {"layers": passes * model.layers * (HOST_LAYER_PASS_S + HOST_DEQUANT_CALL_S * quantized_linears)}
    if not plain:
        host["DeepSpeed step"] = ZERO_STEP_HOST_S
        host["DeepSpeed tensors"] = ZERO_TENSOR_HOST_S * n_trainable
        if engine.stage == 3 and not engine.layers:
            per_pass = ZERO3_LAYER_PASS_S
            if train.zero3_flat_frozen and train.quant == "none":
                per_pass -= ZERO3_FROZEN_TENSOR_PASS_S * (len(train.targets) - 1)
            if not train.deepspeed_nvtx:
                per_pass -= ZERO3_NVTX_LAYER_PASS_S
            host["ZeRO-3 layer fetch"] = per_pass * model.layers * passes
    host = {k: link.host * v for k, v in host.items()}
    parts["host beyond device"] = max(0.0, sum(host.values()) - device)
    if plain:
        return StepTime(parts, host)
    if engine.bf16_overflow_check and train.dtype == "bfloat16" and (engine.stage < 3 or engine.layers):
        parts["overflow check"] = link.host * ZERO_CHECK_TENSOR_S * n_trainable
    n = gpus
    if engine.layers:  # every frozen tensor but V and the final norm, gathered for the forward and the backward
        shared = sum(b * c for b, c, _ in frozen_tensors(model, train)["frozen V"]) + model.hidden * train.e
        moved = 2 * (frozen_bytes - shared)
        gather = moved * (n - 1) / n / link.busbw
        if engine.offload_param:  # the side stream copies this rank's shard in, then gathers the rest
            side = moved / n / HOST_SHARD_BYTES_PER_S + gather
            parts["offload"] = _side_exposed(side, parts, host, passes, device)
        elif n > 1:
            parts["link"] = (PEER_LINK_EXPOSED if engine.peer else LAYERS_LINK_EXPOSED) * gather
    elif engine.stage == 3:
        if engine.offload_param:
            rate = DISK_BYTES_PER_S if engine.param_on_disk else OFFLOAD_BYTES_PER_S
            parts["offload"] = passes * frozen_bytes / rate
        elif n > 1:
            parts["link"] = LINK_EXPOSED * passes * frozen_bytes * (n - 1) / n / link.busbw
    trainable_numel = sum(numel * count for numel, count in trainable)
    if n > 1:
        parts["gradient reduce"] = trainable_numel * train.e * (n - 1) / n / link.busbw
    if engine.offload_optimizer:  # after the backward: nothing to hide behind; the host's work
        per_value = CPU_OPTIMIZER_PARAM_S + CPU_OPTIMIZER_THREAD_PARAM_S / rank_threads(link, n)
        parts["CPU optimizer"] = link.host * trainable_numel / n * per_value
    return StepTime(parts, host)
