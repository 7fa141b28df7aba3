"""The trainable state of a run, independent of the world size: what resuming on another number of ranks needs.

DeepSpeed's ZeRO files hold σ, S and their AdamW moments as one flat partition per rank; each checkpoint also
carries them whole in ``trainable_state.safetensors`` (format: docs/formats.md, Engine checkpoints), written by
rank 0. ``gather_state`` reads it out of a live engine (collective); ``restore_state`` writes it into a fresh
engine of any world size: σ/S, each rank's slice of the fp32 master and moments, AdamW's step, the learning rates,
the scheduler and the engine's step counters. In fp32 the restored state is bitwise the saved one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from frod_ds.core.layer import FRoDTrainables
from frod_ds.formats.records import parse_json, record_from_dict, record_to_json
from frod_ds.model.build import gathered
from frod_ds.runtime.atomic import umask
from frod_ds.runtime.errors import FrodError

__all__ = [
    "TRAINABLE_STATE",
    "FORMAT",
    "TrainableState",
    "engine_params",
    "engine_layout",
    "gather_state",
    "write_state",
    "read_meta",
    "read_state",
    "replay_cpu_adam_steps",
    "restore_state",
]

TRAINABLE_STATE = "trainable_state.safetensors"
FORMAT = "frod-ds/trainable-state/v1"
_META_KEY = "frod_ds.trainable_state"  # on-disk key (the module's path before the package moved): never change
MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass
class TrainableState:
    """What a resume needs besides the tensors; ``world_size``/``micro_batch_size``/``grad_accum`` say which
    layout wrote it (not part of the run's identity: only their product, the global batch, is)."""

    format: str
    step: int  # optimizer steps taken: the data position (frod_ds.train.data.BatchPlan)
    adam_step: int  # AdamW's step count (bias correction)
    world_size: int
    micro_batch_size: int
    grad_accum: int
    zero_stage: int
    group_lrs: list[float]  # each optimizer group's learning rate for the next step
    scheduler: dict[str, Any]  # LambdaLR.state_dict()
    global_samples: int
    skipped_steps: int
    params: list[str] = field(default_factory=list)  # one σ and one S per FRoD layer (the tensors' names)
    # the engine's own trainable Parameters, in its order, where they are not ``params`` (σ and S held per decoder
    # layer: ``frod_ds.core.layer.FRoDTrainables``); left out otherwise, so an unchanged layout's record reads as
    # before. DeepSpeed's files load only into the same Parameters
    engine_params: list[str] | None = None
    # "layers": a ZeRO-3 JSON's frozen weights partitioned by decoder layer (frod_ds.config.zero3_layout), the
    # engine at ``zero_stage`` 2; None otherwise
    frozen_partition: str | None = None


Spans = list[tuple[str, int, int]]  # (tensor name in the record, start, end) within a Parameter, flattened


def _trainable(engine) -> list[tuple[str, torch.nn.Parameter, Spans]]:
    """Each trainable Parameter of the engine's module with the record's tensors it holds: a Parameter of one
    FRoD layer holds one (itself), a decoder layer's ``FRoDTrainables`` Parameter one per member, in order."""
    held = {
        id(p): (name, m, leaf)
        for name, m in engine.module.named_modules()
        if isinstance(m, FRoDTrainables)
        for leaf, p in m.named_parameters(recurse=False)
    }
    out = []
    for n, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        if id(p) not in held:
            out.append((n, p, [(n, 0, int(getattr(p, "ds_numel", p.numel())))]))
            continue
        name, m, leaf = held[id(p)]
        owner = name.rsplit(".", 1)[0]
        out.append((n, p, [(f"{owner}.{member}.{leaf}", a, b) for member, (a, b) in zip(m.members, m.spans(leaf))]))
    return out


def engine_params(engine) -> list[str]:
    """The engine's trainable Parameter names (what its DeepSpeed files hold, in order)."""
    return [n for n, _, _ in _trainable(engine)]


def engine_layout(engine) -> list[str] | None:
    """The record's ``engine_params`` for this engine: its trainable Parameter names where they are not one σ and
    one S per FRoD layer (σ and S held per decoder layer), None where they are."""
    return _layout(_trainable(engine))


def _record_names(trainable) -> list[str]:
    return [name for _, _, spans in trainable for name, _, _ in spans]


def _layout(trainable) -> list[str] | None:
    own = [n for n, _, _ in trainable]
    return None if own == _record_names(trainable) else own


def _split(value: torch.Tensor, n: str, spans: Spans) -> dict[str, torch.Tensor]:
    if len(spans) == 1 and spans[0][0] == n:
        return {n: value}
    flat = value.reshape(-1)
    return {name: flat[a:b].clone() for name, a, b in spans}


def _join(tensors: dict[str, torch.Tensor], n: str, spans: Spans, suffix: str = "") -> torch.Tensor:
    if len(spans) == 1 and spans[0][0] == n:
        return tensors[n + suffix]
    return torch.cat([tensors[name + suffix].reshape(-1) for name, _, _ in spans])


def _base_optimizer(engine):
    """The AdamW DeepSpeed steps: wrapped by ZeRO and by stage 0's bf16 optimizer, the engine's own at fp32 stage 0."""
    opt = engine.optimizer
    return getattr(opt, "optimizer", opt)


def _mapped(p) -> bool:
    """DeepSpeed maps ``p`` to its fp32 master (ZeRO-1/2/3, the bf16 optimizer): its ``safe_*`` helpers apply."""
    return hasattr(p, "ds_id") or hasattr(p, "_hp_mapping")


def _stage0_slot(engine, p) -> tuple[torch.Tensor, int, int]:
    """ZeRO stage 0 (plain data parallel, every rank holds everything): ``(the fp32 tensor AdamW steps, start, end)``
    of ``p``'s master in it, flattened. Under bf16 DeepSpeed's FP16 optimizers hold the masters: one per parameter
    (``FP16_UnfusedOptimizer``, beside torch's AdamW) or one flat per group (``FP16_Optimizer``); under fp32 the
    master is ``p`` itself."""
    opt = engine.optimizer
    for i, group in enumerate(getattr(opt, "fp16_groups", ())):
        start = 0
        for j, q in enumerate(group):
            if q is p:
                if hasattr(opt, "fp32_groups_flat"):
                    return opt.fp32_groups_flat[i], start, start + q.numel()
                return opt.fp32_groups[i][j], 0, q.numel()
            start += q.numel()
    assert not hasattr(opt, "fp16_groups"), "a trainable parameter outside the bf16 optimizer's groups"
    return p, 0, p.numel()


def _full_master(engine, p) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Collective under ZeRO-3. ``p``'s full fp32 master and AdamW moments (``MOMENTS``)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    if _mapped(p):
        return safe_get_full_fp32_param(p), [safe_get_full_optimizer_state(p, k) for k in MOMENTS]
    flat, a, b = _stage0_slot(engine, p)
    state = _base_optimizer(engine).state[flat]
    return flat.reshape(-1)[a:b].view(p.shape), [state[k].reshape(-1)[a:b].view(p.shape) for k in MOMENTS]


def _set_stage0_master(engine, p, value: torch.Tensor, moments: dict[str, torch.Tensor], adam_step: int) -> None:
    """Stage 0: put ``p``'s fp32 master, moments and AdamW step count in place (every rank holds them whole)."""
    flat, a, b = _stage0_slot(engine, p)
    state = _base_optimizer(engine).state[flat]
    flat.data.reshape(-1)[a:b].copy_(value.reshape(-1))
    for k in MOMENTS:
        state[k].reshape(-1)[a:b].copy_(moments[k].reshape(-1))
    step = state["step"]  # bf16: DeepSpeed stepped once at start-up to create the state
    state["step"] = step.new_full((), float(adam_step)) if isinstance(step, torch.Tensor) else adam_step


def _link_optimizer_state(engine) -> None:
    """ZeRO-1/2: point every parameter's optimizer-state fragment at AdamW's current state. DeepSpeed links
    them once, right after the first group's first ``step()`` — before the second group (S) has any state —
    so ``safe_get/set_full_optimizer_state`` would find no moments for S without this. ZeRO-3 reads the
    state directly and needs nothing."""
    opt = engine.optimizer
    if hasattr(opt, "_lazy_init_hp_params_optimizer_state"):
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()


def _adam_step(base) -> int:
    steps = {int(s["step"]) for s in base.state.values() if "step" in s}
    assert len(steps) <= 1, f"AdamW partitions disagree on the step count: {steps}"
    return steps.pop() if steps else 0


def gather_state(
    engine, step: int, layout: tuple[int, int, int], zero_stage: int, frozen_partition: str | None = None
) -> tuple[dict[str, torch.Tensor], TrainableState] | None:
    """Collective. Full fp32 values and AdamW moments of every trainable parameter, on rank 0 (None elsewhere).
    ``layout``: (world size, micro-batch size, grad accumulation) of the run writing it."""
    from frod_ds.runtime import distributed as dist

    base = _base_optimizer(engine)
    _link_optimizer_state(engine)
    tensors: dict[str, torch.Tensor] = {}
    trainable = _trainable(engine)
    for name, p, spans in trainable:
        value, moments = _full_master(engine, p)
        assert value is not None, f"{name}: DeepSpeed holds no fp32 master for it"
        if dist.is_main():
            tensors.update(_split(value.detach().float().cpu().contiguous(), name, spans))
            for k, m in zip(MOMENTS, moments):
                part = _split(m.detach().float().cpu().contiguous(), name, spans)
                tensors.update({f"{t}.{k}": v for t, v in part.items()})
    if not dist.is_main():
        return None
    sched = engine.lr_scheduler
    meta = TrainableState(
        format=FORMAT,
        step=step,
        adam_step=_adam_step(base),
        world_size=layout[0],
        micro_batch_size=layout[1],
        grad_accum=layout[2],
        zero_stage=zero_stage,
        group_lrs=[float(g["lr"]) for g in base.param_groups],
        scheduler=_plain(sched.state_dict()) if sched is not None else {},
        global_samples=int(engine.global_samples),
        skipped_steps=int(engine.skipped_steps),
        params=_record_names(trainable),
        engine_params=_layout(trainable),
        frozen_partition=frozen_partition,
    )
    return tensors, meta


def _plain(obj: Any) -> Any:
    """A scheduler state dict as JSON values (tensors and tuples become numbers and lists)."""
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return obj.item() if obj.numel() == 1 else obj.tolist()
    return obj


def write_state(path: Path, tensors: dict[str, torch.Tensor], meta: TrainableState) -> None:
    save_file(tensors, str(path), metadata={_META_KEY: record_to_json(meta, indent=None)})
    os.chmod(path, 0o666 & ~umask())  # save_file creates it 0600 whatever the umask


def _open(path: Path, tensors: bool) -> tuple[dict[str, torch.Tensor], TrainableState]:
    try:
        with safe_open(str(path), framework="pt") as f:
            text = (f.metadata() or {}).get(_META_KEY)
            out = {k: f.get_tensor(k) for k in f.keys()} if tensors else {}
    except Exception as e:  # noqa: BLE001 - safetensors raises several types for a damaged file
        raise FrodError(f"{path} is corrupt ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
    if text is None:
        raise FrodError(f"{path} is not a frod-ds trainable-state record (no {_META_KEY!r} metadata)")
    meta = record_from_dict(TrainableState, parse_json(text, path, FrodError), str(path), FrodError)
    if meta.format != FORMAT:
        raise FrodError(f"{path}: format {meta.format!r}, not {FORMAT!r}; it was written by another frod-ds")
    return out, meta


def read_meta(path: Path) -> TrainableState:
    """The record's `TrainableState` only (no tensors read)."""
    return _open(path, tensors=False)[1]


def read_state(path: Path) -> tuple[dict[str, torch.Tensor], TrainableState]:
    """The record at ``path``; ``FrodError`` naming the file when it is not one."""
    tensors, meta = _open(path, tensors=True)
    missing = [f"{n}{s}" for n in meta.params for s in ("", *(f".{k}" for k in MOMENTS)) if f"{n}{s}" not in tensors]
    if missing:
        raise FrodError(f"{path} has no tensor {missing[0]!r}; it is damaged")
    return tensors, meta


def _local_slice(full: torch.Tensor, param, rank: int) -> torch.Tensor:
    """This rank's ZeRO-3 partition of a flattened full tensor: ``[rank·k, (rank+1)·k)``, zero-padded at the end."""
    k = param.ds_tensor.numel()
    flat = full.reshape(-1)
    out = torch.zeros(k, dtype=flat.dtype)
    lo, hi = min(rank * k, flat.numel()), min((rank + 1) * k, flat.numel())
    out[: hi - lo] = flat[lo:hi]
    return out


def _flat_partitions(engine, base) -> list[torch.Tensor]:
    """The fp32 tensors AdamW steps on this rank: ZeRO-3 hands each sub-group's flat partition to the optimizer
    only for the duration of its ``step()``; ZeRO-1/2 keep one per group in ``param_groups``."""
    flats = getattr(engine.optimizer, "fp32_partitioned_groups_flat", None)
    return list(flats) if flats is not None else [p for g in base.param_groups for p in g["params"]]


def _create_adam_state(engine, base, adam_step: int) -> None:
    """AdamW's per-partition state as its first ``step()`` would create it (zeros), with ``adam_step`` steps."""
    torch_adamw = type(base).__name__ != "DeepSpeedCPUAdam"  # which keeps its step count as an int
    on_device = any(g.get("fused") or g.get("capturable") for g in base.param_groups)
    for flat in _flat_partitions(engine, base):
        state = base.state[flat]
        if state:
            continue
        state["step"] = (
            torch.full((), float(adam_step), dtype=torch.float32, device=flat.device if on_device else "cpu")
            if torch_adamw
            else adam_step
        )
        for k in MOMENTS:
            state[k] = torch.zeros_like(flat, dtype=torch.float32)


def replay_cpu_adam_steps(engine) -> None:
    """DeepSpeedCPUAdam's C++ side keeps β₁ᵗ and β₂ᵗ as running float products, stepped once per step; a fresh
    one meeting step t first computes them with ``pow``, which differs in the last bits, so a resumed run would
    drift from the uninterrupted one after its first update. Replaying the restored step count on one-element
    scratch tensors, group by group as ``step()`` does, makes the products the uninterrupted run's."""
    base = _base_optimizer(engine)
    if type(base).__name__ != "DeepSpeedCPUAdam":
        return
    adam_step = max((int(st["step"]) for st in base.state.values() if "step" in st), default=0)
    scratch = [torch.zeros(1) for _ in range(4)]
    for step in range(1, adam_step + 1):
        for g in base.param_groups:
            b1, b2 = g["betas"]
            base.ds_opt_adam.adam_update(base.opt_id, step, 0.0, b1, b2, g["eps"], 0.0, True, *scratch)


def restore_state(engine, tensors: dict[str, torch.Tensor], meta: TrainableState, zero3: bool) -> None:
    """Put a `read_state` record into a freshly initialised engine (any world size). Collective."""
    from deepspeed.utils import (
        safe_set_full_fp32_param,
        safe_set_full_optimizer_state,
        safe_set_local_fp32_param,
        safe_set_local_optimizer_state,
    )

    from frod_ds.runtime import distributed as dist

    params = _trainable(engine)
    names = _record_names(params)
    if sorted(names) != sorted(meta.params):
        raise FrodError(
            f"the checkpoint's trainable parameters ({len(meta.params)}) are not this model's "
            f"({len(names)}); it belongs to another model or targets"
        )
    base = _base_optimizer(engine)
    if getattr(engine.optimizer, "swap_optimizer", False):
        raise FrodError(
            f"resuming on another world size with the optimizer state offloaded to NVMe is not "
            f"supported; resume on {meta.world_size} rank(s), or with a config without NVMe offload"
        )
    _create_adam_state(engine, base, meta.adam_step)
    _link_optimizer_state(engine)
    rank = dist.get_rank()
    with torch.no_grad():
        for name, p, spans in params:
            value = _join(tensors, name, spans)
            moments = {k: _join(tensors, name, spans, f".{k}") for k in MOMENTS}
            with gathered([p], zero3, modifier_rank=0):
                if not zero3 or dist.is_main():
                    p.data.copy_(value.to(p.dtype).reshape(p.shape))
            if zero3:
                safe_set_local_fp32_param(p, _local_slice(value, p, rank).to(p.ds_tensor.device))
                for k in MOMENTS:
                    safe_set_local_optimizer_state(p, _local_slice(moments[k], p, rank).to(p.ds_tensor.device), k)
            elif not _mapped(p):
                _set_stage0_master(engine, p, value, moments, meta.adam_step)
            else:
                safe_set_full_fp32_param(p, value.to(p.device))
                for k in MOMENTS:
                    safe_set_full_optimizer_state(p, moments[k].to(p.device), k)
    for group, lr in zip(base.param_groups, meta.group_lrs):
        group["lr"] = lr
    if engine.lr_scheduler is not None and meta.scheduler:
        engine.lr_scheduler.load_state_dict(meta.scheduler)
    engine.global_steps = meta.step
    engine.global_samples = meta.global_samples
    engine.skipped_steps = meta.skipped_steps
