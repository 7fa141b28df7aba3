"""Engine checkpoints of a training run: write one (sealed), restore one on any world size.

``write_checkpoint``: DeepSpeed's files, each rank's RNG state, the world-size-independent record
(``frod_ds.train.trainable_state``) and the caller's identity records, then the seal (``frod_ds.train.checkpoints``);
older checkpoints beyond ``keep`` go only once the new one is sealed. ``restore_checkpoint``: on the layout that
wrote it DeepSpeed loads its own files (bitwise exact); on another, the record fills the new engine's partitions.
"""

from __future__ import annotations

import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from frod_ds.config.ds_config import BatchSizes
from frod_ds.io.torch_pickle import safe_load, use_safe_loads
from frod_ds.model.frozen_shards import shards_of
from frod_ds.runtime import distributed as dist
from frod_ds.runtime.atomic import atomic_write_text, disk_full_error
from frod_ds.runtime.errors import FrodError, note
from frod_ds.train.checkpoints import (
    COMPLETE,
    LATEST,
    check_root_files,
    detach_root_files,
    file_seal,
    files_to_seal,
    foreign_files,
    set_aside,
    step_of,
    tag_of,
    write_seal,
)
from frod_ds.train.trainable_state import (
    TRAINABLE_STATE,
    engine_layout,
    engine_params,
    gather_state,
    read_meta,
    read_state,
    replay_cpu_adam_steps,
    restore_state,
    write_state,
)

__all__ = ["Layout", "write_checkpoint", "restore_checkpoint"]


@dataclass(frozen=True)
class Layout:
    """How a run splits its global batch (``world × micro × accum``); not part of the run's identity."""

    world: int
    micro: int
    accum: int


def zero_stage_of(engine) -> int:
    return int(engine.zero_optimization_stage())


def _partition(engine) -> str | None:
    """ "layers" when the engine's frozen weights are partitioned by decoder layer (``frozen_shards``)."""
    return "layers" if shards_of(engine.module) is not None else None


def _layout_name(stage: int, partition: str | None) -> str:
    return "ZeRO-3 by decoder layer" if partition == "layers" else f"ZeRO-{stage}"


def write_checkpoint(engine, root: Path, step: int, layout: Layout, keep: int, records: dict[str, str]) -> None:
    """Collective. ``root/step<NNNNNNNN>/``: engine files, ``rng_rank<r>.pt``, the trainable-state record,
    ``records`` (file name → text, written by rank 0), the seal; then ``latest_complete`` and the clean-up."""
    ckpt = root / tag_of(step)
    dist.on_main(lambda: (check_root_files(root), detach_root_files(root)))  # anything planted since the start
    own = (TRAINABLE_STATE, *records)
    dist.on_main(lambda: _clear_step_dir(ckpt, own, step))
    state = gather_state(
        engine, step, (layout.world, layout.micro, layout.accum), zero_stage_of(engine), _partition(engine)
    )
    try:
        engine.save_checkpoint(str(root), tag=ckpt.name, client_state={"step": step}, exclude_frozen_parameters=True)
        rng = {
            "python": random.getstate(),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        }
        torch.save(rng, ckpt / f"rng_rank{dist.get_rank()}.pt")
        if dist.is_main():
            write_state(ckpt / TRAINABLE_STATE, *state)
            for name, text in records.items():
                (ckpt / name).write_text(text)
    except Exception as e:  # torch.save says RuntimeError, safetensors SafetensorError: a full disk is named so
        full = disk_full_error(ckpt, e)
        if full is None:
            raise
        shutil.rmtree(ckpt, ignore_errors=True)  # unsealed: never resumed from, only in the way
        raise full from None
    del state
    dist.barrier()
    names = files_to_seal(ckpt)  # every rank hashes (and fsyncs) its share of the files
    mine = {n: file_seal(ckpt / n) for n in names[dist.get_rank() :: dist.get_world_size()]}
    seals = {n: s for part in dist.all_gather_object(mine) for n, s in part.items()}
    if dist.is_main():
        write_seal(ckpt, seals)
        atomic_write_text(root / LATEST, ckpt.name)
        prune(root, ckpt.name, own, keep)
    dist.barrier()


def prune(root: Path, current: str, own: tuple[str, ...], keep: int) -> None:
    """Rank 0, after sealing ``current``: the sealed saves past the newest ``keep`` and the leftovers of killed
    saves (or removals) are removed, each only when it is the run's own (``_the_runs``); an empty step folder may be
    a user's placeholder and is kept."""
    sealed = sorted(
        (p.name for p in root.iterdir() if step_of(p.name) is not None and (p / COMPLETE).is_file()), key=step_of
    )
    for old in sealed[:-keep]:
        if old != current and _the_runs(root / old, own, sealed=True):
            _remove_save(root / old)
    for p in root.iterdir():  # leftovers of a save (or a removal) that was killed: never resumed from
        if p.is_dir() and step_of(p.name) is not None and not (p / COMPLETE).is_file() and p.name != current:
            if any(p.iterdir()) and _the_runs(p, own, sealed=False):
                _remove_save(p)


def _clear_step_dir(ckpt: Path, own: tuple[str, ...], step: int) -> None:
    """Rank 0: what is at ``ckpt`` before its save (a save killed there before, or an abandoned later timeline) is
    removed when it holds only what a save writes; else ``FrodError``: a user's folder is never deleted."""
    if not os.path.lexists(ckpt):
        return
    foreign = foreign_files(ckpt, own)
    if foreign:
        raise FrodError(
            f"{ckpt} is in the way of step {step}'s checkpoint and holds what no save writes "
            f"({', '.join(foreign[:3])}{' …' if len(foreign) > 3 else ''}): move it away and run the same command "
            "again (it resumes)"
        )
    _remove_save(ckpt, ignore_errors=False)


def _remove_save(ckpt: Path, ignore_errors: bool = True) -> None:
    """Delete the save ``ckpt``, its seal first: a kill part way leaves an unsealed folder, which the next save
    reclaims as a killed save's leftover, never a sealed-looking one missing its files."""
    (ckpt / COMPLETE).unlink(missing_ok=True)
    shutil.rmtree(ckpt, ignore_errors=ignore_errors)


def _the_runs(ckpt: Path, own: tuple[str, ...], sealed: bool) -> bool:
    """Whether the step folder ``ckpt`` is one of the run's saves, to prune: only the files a save writes and, when
    sealed, a trainable state of its own step (a copy under another step's name is the user's); else a note."""
    foreign = foreign_files(ckpt, own)
    why = f"it holds what no save writes ({', '.join(foreign[:3])})" if foreign else ""
    if not why and sealed:
        try:
            step = read_meta(ckpt / TRAINABLE_STATE).step
        except (OSError, ValueError, FrodError):
            step = None
        # absent: an older frod-ds's save, or one whose removal it began with the files, not the seal: the run's own
        if step != step_of(ckpt.name) and os.path.lexists(ckpt / TRAINABLE_STATE):
            why = f"its trainable state is of step {step} (a copy?)"
    if why:
        note(f"{ckpt} is left alone, not pruned: {why}")
    return not why


def _written_by(ckpt: Path) -> tuple[int, int | None, list[str] | None]:
    """``(world size, ZeRO stage, the engine's trainable Parameter names)`` of the run that wrote ``ckpt``; stage
    and names are None for a checkpoint of an older frod-ds (no trainable-state record), whose world size is its
    number of RNG files."""
    if (ckpt / TRAINABLE_STATE).is_file():
        meta = read_meta(ckpt / TRAINABLE_STATE)
        return meta.world_size, meta.zero_stage, meta.engine_params or meta.params
    return len(list(ckpt.glob("rng_rank*.pt"))), None, None


def restore_checkpoint(
    engine, root: Path, tag: str, skipped: list[tuple[str, str]], layout: Layout, zero3: bool
) -> int:
    """Collective. Restore ``root/tag`` into ``engine`` (after setting aside ``skipped``: ``(tag, why)``);
    returns the step it was written at."""
    if dist.is_main():
        for bad, why in skipped:
            dest = set_aside(root, bad)
            note(
                f"checkpoint {root / bad} skipped ({why}); resuming from the newest complete one, {tag} "
                f"(the skipped one moved to {dest.name})"
            )
    world, stage, params = dist.on_main(lambda: _written_by(root / tag))
    here = zero_stage_of(engine)
    if stage is None and engine_layout(engine) is not None:
        raise FrodError(
            f"checkpoint {root / tag} was written by an older frod-ds, without the record needed to "
            "load its σ and S into this engine's per-decoder-layer tensors; resume it with the "
            "frod-ds that wrote it"
        )
    if world == layout.world and stage in (None, here) and params in (None, engine_params(engine)):
        if dist.is_main() and (root / tag / TRAINABLE_STATE).is_file():
            was = read_meta(root / tag / TRAINABLE_STATE)
            if was.micro_batch_size != layout.micro:
                note(f"resumed from {tag}{_split_note(was.micro_batch_size, layout.micro)}")
        step = _load_engine_files(engine, root, tag)
    else:
        step = _load_trainable_state(engine, root / tag, world, stage, here, layout, zero3)
    replay_cpu_adam_steps(engine)
    return step


def _split_note(was: int, now: int) -> str:
    """The loss is a mean per micro-batch: another micro_batch_size (same global batch) weighs the tokens otherwise."""
    return (
        f"; micro_batch_size {was} -> {now} weights each micro-batch's tokens differently, so losses are close to, "
        f"not equal to, the original layout's (train.micro_batch_size={was} continues it exactly)"
    )


def _load_engine_files(engine, root: Path, tag: str) -> int:
    """Same world size and ZeRO stage: DeepSpeed's own files, and each rank's RNG state (every file loaded with
    ``weights_only``, DeepSpeed's few classes allowed: ``frod_ds.io.torch_pickle``)."""
    use_safe_loads(engine)
    path, client = engine.load_checkpoint(
        str(root), tag=tag, load_module_strict=False, load_optimizer_states=True, load_lr_scheduler_states=True
    )
    if path is None:
        raise RuntimeError(f"could not load engine checkpoint {tag} from {root}")
    rng = safe_load(root / tag / f"rng_rank{dist.get_rank()}.pt")
    random.setstate(rng["python"])
    torch.set_rng_state(rng["torch"])
    if torch.cuda.is_available() and rng.get("cuda") is not None:
        torch.cuda.set_rng_state(rng["cuda"])
    return int(client["step"])


def _load_trainable_state(
    engine, ckpt: Path, world: int, stage: int | None, here: int, layout: Layout, zero3: bool
) -> int:
    """Another world size (or ZeRO stage): the world-size-independent record. The RNG states stay as seeded
    (seed + rank): training draws no random numbers (no dropout; the data order is ``BatchPlan``'s)."""
    if stage is None:
        raise FrodError(
            f"checkpoint {ckpt} was written on {world} rank(s) by an older frod-ds, without the "
            f"record a resume on another world size needs ({TRAINABLE_STATE}); resume it on {world} "
            "rank(s) with the same DeepSpeed config"
        )
    tensors, meta = dist.on_all(lambda: read_state(ckpt / TRAINABLE_STATE))
    restore_state(engine, tensors, meta, zero3)
    del tensors
    held = "per decoder layer" if meta.engine_params else "per FRoD layer"
    now = "per FRoD layer" if engine_layout(engine) is None else "per decoder layer"
    was, is_ = _layout_name(stage, meta.frozen_partition), _layout_name(here, _partition(engine))
    change = ", ".join(
        [f"from {world} rank{'s' * (world != 1)} on {layout.world}"] * (world != layout.world)
        + [f"from {was} on {is_}"] * (was != is_)
        + [f"from σ and S held {held} to {now}"] * (held != now)
    )
    split = "" if meta.micro_batch_size == layout.micro else _split_note(meta.micro_batch_size, layout.micro)
    note(
        f"resumed {change} "
        f"(same global batch {BatchSizes(meta.micro_batch_size, meta.grad_accum, meta.world_size).total}) "
        f"from {ckpt.name}/{TRAINABLE_STATE}{split}"
    )
    return meta.step
