"""The training loop: optimizer steps from a ``Run``'s start to its end, with held-out loss, rotation angles, metrics,
periodic and SIGTERM checkpoints, and the final adapter. ``Run`` is what setup decided; ``LoopState`` what changes."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from frod_ds.config.ds_config import zero_stage
from frod_ds.config.recipe import Recipe
from frod_ds.core.layer import tan_alpha
from frod_ds.formats.adapter_dir import AdapterConfig
from frod_ds.formats.factor_store import category_of
from frod_ds.model.adapter import adapter_state, read_adapter, write_adapter
from frod_ds.model.apply import frod_groups
from frod_ds.model.build import gathered
from frod_ds.model.frozen_shards import shards_of
from frod_ds.runtime import distributed as dist
from frod_ds.runtime.errors import FrodError, note
from frod_ds.train.data import BatchPlan, collate
from frod_ds.train.engine_state import Layout, write_checkpoint
from frod_ds.train.identity import identity_records
from frod_ds.train.metrics import MetricsLog, peak_mem_gb, plot_loss, reset_peak_mem
from frod_ds.train.preflight import Inputs
from frod_ds.train.profile import profiled
from frod_ds.train.run_dir import recipe_yaml, record_adapter
from frod_ds.train.schedule import group_lrs

__all__ = [
    "STOP_EXIT_CODE",
    "Run",
    "LoopState",
    "fit",
    "train_step",
    "eval_loss",
    "rotation_angles",
    "save_checkpoint",
    "save_adapter",
]

STOP_EXIT_CODE = 143  # 128 + SIGTERM: stopped on request, checkpoint written (130 for Ctrl-C)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # a checkpoint, then exit 128 + the signal


@dataclass(frozen=True)
class Run:
    """What ``setup`` decided for the loop; nothing in it changes while the loop runs."""

    inputs: Inputs  # the checked inputs: recipe, DeepSpeed config, base checkpoint, store, identities, data
    engine: Any  # the DeepSpeed engine (model, optimizer, LR scheduler)
    plan: BatchPlan
    total_steps: int
    adapter_config: AdapterConfig  # step and categories filled in at each save
    sigma0: dict[str, torch.Tensor]  # σ before training (rank 0), for the rotation angles
    start_step: int = 0  # the step of the checkpoint resumed from, 0 for a fresh run

    @property
    def recipe(self) -> Recipe:
        return self.inputs.recipe

    @property
    def out(self) -> Path:
        return Path(self.recipe.output_dir)

    @property
    def zero3(self) -> bool:
        return zero_stage(self.inputs.ds_config) == 3

    @property
    def pad_id(self) -> int:
        return self.inputs.tokenizer.pad_token_id

    @property
    def layout(self) -> Layout:
        """How this run splits its global batch over ranks (the layout its checkpoints record)."""
        t = self.recipe.train
        return Layout(dist.get_world_size(), t.micro_batch_size, t.grad_accum)


@dataclass
class LoopState:
    """What the loop changes: the step reached, consecutive non-finite losses, and a SIGTERM's or Ctrl-C's request
    to stop (``stop_signal``: which)."""

    step: int
    nonfinite: int = 0
    stop_requested: bool = False
    stop_signal: int = signal.SIGTERM


def save_checkpoint(run: Run, step: int) -> None:
    """The engine checkpoint of ``step`` with the run's identity records, sealed (``frod_ds.train.engine_state``)."""
    records = identity_records(run.inputs.store_identity, run.inputs.run_identity)
    write_checkpoint(run.engine, run.out / "checkpoints", step, run.layout, run.recipe.train.keep_checkpoints, records)


def save_adapter(run: Run, step: int, name: str) -> None:
    """The adapter of ``step`` as ``output_dir/name`` (collective under ZeRO-3; rank 0 writes)."""
    tensors, categories = adapter_state(run.engine.module, run.zero3, run.inputs.store_identity)

    def write() -> None:  # rank 0; its refusal (a changed adapter in the way, a full disk) stops every rank
        record_adapter(run.out, name)  # in the run's record before it is made
        write_adapter(
            run.out / name,
            tensors,
            dataclasses.replace(run.adapter_config, step=step, categories=categories),
            extra_files={"recipe.yaml": recipe_yaml(run.recipe)},
            what="output_dir",  # the recipe's key: train has no --out
        )

    dist.on_main(write)


def rotation_angles(run: Run) -> dict[str, float]:
    """``tan α`` per category (spec §2): ``sqrt(Σ‖ΔW_off‖² / Σ‖ΔW_on‖²)`` over the category's members."""
    sums: dict[str, list[float]] = {}
    shards = shards_of(run.engine.module)
    for held, members in frod_groups(run.engine.module):  # one gather per decoder layer under ZeRO-3
        params = {id(p): p for p in [*held, *(p for _, m in members for p in (m.u_parameter(), m.V))]}
        layer = contextlib.nullcontext() if shards is None else shards.gathered([m for _, m in members])
        with gathered(list(params.values()), run.zero3), layer:
            if dist.is_main():
                for name, m in members:
                    on, off = m.update_norms_sq(run.sigma0[name])
                    acc = sums.setdefault(category_of(name), [0.0, 0.0])
                    acc[0] += on
                    acc[1] += off
    return {cat: tan_alpha(on, off) for cat, (on, off) in sums.items()}


@torch.no_grad()
def eval_loss(run: Run) -> float:
    """Mean answer-token loss over the held-out rows, split across ranks."""
    engine, dev, examples = run.engine, dist.local_device(), run.inputs.eval_examples
    engine.eval()
    mine = examples[dist.get_rank() :: dist.get_world_size()]
    total = torch.zeros(2, dtype=torch.float64, device=dev)
    mb = run.recipe.train.micro_batch_size
    n_batches = math.ceil(len(examples) / (mb * dist.get_world_size()))
    for b in range(n_batches):  # same number of forwards on every rank (ZeRO-3 gathers are collective)
        chunk = mine[b * mb : (b + 1) * mb] or examples[:1]
        batch = {k: v.to(dev) for k, v in collate(chunk, run.pad_id).items()}
        loss = engine(**batch).loss.double()
        count = (batch["labels"][:, 1:] != -100).sum()
        if mine[b * mb : (b + 1) * mb]:
            total += torch.stack([loss * count, count.double()])
    engine.train()
    total = dist.all_reduce_sum(total)
    return float(total[0] / total[1].clamp(min=1))


def _grad_norm(engine) -> float:
    """``‖g‖₂`` of the trainable gradients the coming ``engine.step()`` applies (after the last backward of the
    step: accumulated and averaged over ranks), as DeepSpeed computes it to clip them."""
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    if not grads:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])))


class PhaseClock:
    """Seconds per phase of a step, summed over its micro-batches; each mark waits for the device first, so that a
    phase holds the work it queued (``train.phase_times``)."""

    def __init__(self, device: torch.device, on: bool) -> None:
        self.device, self.on, self.seconds = device, on, {}
        self.last = time.perf_counter()

    def mark(self, phase: str) -> None:
        if not self.on:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self.last
        self.last = now


def _micro_batches(run: Run, micro: list, clock: PhaseClock) -> tuple[list[torch.Tensor], int, float | None]:
    """Forward, backward and ``engine.step()`` over one optimizer step's micro-batches: their losses, tokens, and
    the gradient norm the loop computes itself where DeepSpeed keeps none."""
    engine, dev = run.engine, dist.local_device()
    losses, tokens, own_norm = [], 0, None
    for i, idx in enumerate(micro):
        batch = {k: v.to(dev) for k, v in collate([run.inputs.examples[i] for i in idx], run.pad_id).items()}
        clock.mark("data_s")
        loss = engine(**batch).loss
        clock.mark("forward_s")
        engine.backward(loss)
        clock.mark("backward_s")
        if i == len(micro) - 1 and not hasattr(engine.optimizer, "_global_grad_norm"):
            own_norm = _grad_norm(engine)  # fp32 stage 0 clips with a norm DeepSpeed does not keep
        engine.step()
        clock.mark("optimizer_s")
        losses.append(loss.detach().float())
        tokens += int(batch["attention_mask"].sum())
    return losses, tokens, own_norm


def train_step(run: Run, step: int) -> dict[str, float]:
    """Optimizer step ``step`` (0-based) over this rank's micro-batches; the metrics row's values, all-reduced
    (the phase times, where asked for, are rank 0's)."""
    engine, dev = run.engine, dist.local_device()
    reset_peak_mem()
    t0 = time.perf_counter()
    clock = PhaseClock(dev, run.recipe.train.phase_times)
    lr_sigma, lr_s = group_lrs(engine.optimizer)  # the rates this step applies (the scheduler steps in engine.step)
    micro = run.plan.micro_batches(step)
    with profiled(run.out, step + 1, dist.get_rank(), run.recipe.train.profile_step == step + 1):
        losses, tokens, own_norm = _micro_batches(run, micro, clock)
        stats = dist.all_reduce_sum(  # waits for the device: the profile holds the step's end
            torch.tensor([torch.stack(losses).mean().item(), tokens], dtype=torch.float64, device=dev)
        )
    dt = time.perf_counter() - t0
    grad_norm = engine.get_global_grad_norm()
    grad_norm = own_norm if grad_norm is None else grad_norm
    return {
        "loss": float(stats[0]) / dist.get_world_size(),
        "lr_sigma": lr_sigma,
        "lr_s": lr_s,
        "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
        "tokens_per_s": float(stats[1]) / dt,
        "step_time_s": dt,
        "peak_mem_gb": peak_mem_gb(),
        **clock.seconds,
    }


def fit(run: Run) -> int:
    """Train from ``run.start_step`` to ``run.total_steps``; returns the process exit code."""
    bar = tqdm(
        total=run.total_steps, initial=run.start_step, disable=not dist.is_main(), desc="train", dynamic_ncols=True
    )
    handlers = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    try:
        return _fit(run, bar)
    except BaseException:
        bar.close()  # so that the one error line starts a line of its own, not after the progress bar
        raise
    finally:
        for sig, handler in handlers.items():  # the process's own again
            signal.signal(sig, handler)


def _publish_resumed_adapter(run: Run, step: int) -> None:
    """Collective. Write ``adapter-<step>`` of the checkpoint resumed from when it is missing: a kill between a
    save's seal and its adapter left the checkpoint without it, and the steps after it never write it."""
    name = f"adapter-{step}"
    if 0 < step < run.total_steps and dist.on_main(lambda: not os.path.lexists(run.out / name)):
        note(f"{run.out / name} is missing (a stop between its checkpoint and it): written from that checkpoint")
        save_adapter(run, step, name)


def _fit(run: Run, bar: tqdm) -> int:
    t = run.recipe.train
    state = LoopState(run.start_step)

    def on_stop(signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and state.stop_requested:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now, the last sealed checkpoint stays
        state.stop_requested, state.stop_signal = True, signum

    for sig in STOP_SIGNALS:
        signal.signal(sig, on_stop)
    log = MetricsLog(run.out, t.tensorboard) if dist.is_main() else None  # importable: checked in preflight
    run.engine.train()
    final = run.out / "adapter-final"
    if state.step >= run.total_steps and final.is_dir():
        damage = dist.on_main(lambda: _adapter_damage(final))
        if damage is None:
            bar.close()
            why = f"; no step runs, so train.profile_step {t.profile_step} profiles none" if t.profile_step else ""
            dist.print0(
                f"{run.out} holds a finished run (step {state.step}/{run.total_steps}); adapter-final left as it is"
                + why
            )
            if log is not None:
                if not os.path.lexists(run.out / "loss.png"):  # the run was stopped while it drew the plot
                    plot_loss(log.path, run.out / "loss.png")
                log.close()
            return 0
        note(f"{damage}; writing adapter-final again from the checkpoint of step {state.step}")  # bit for bit
    _publish_resumed_adapter(run, state.step)
    if t.profile_step and not state.step < t.profile_step <= run.total_steps and dist.is_main():
        note(
            f"train.profile_step {t.profile_step} is not among the steps this run takes ({state.step + 1} to "
            f"{run.total_steps}): no step is profiled"
        )
    if torch.cuda.is_available():
        dist.print0(
            f"memory: {peak_mem_gb():.2f} GiB allocated at most while building and restoring the model "
            "(rank 0); metrics.jsonl's peak_mem_gb is each step's own peak"
        )
    while state.step < run.total_steps:
        stop = _step(run, state, log, bar)
        if stop:
            bar.close()
            name = signal.Signals(state.stop_signal).name
            msg = f"{name}: checkpoint saved at step {state.step}; re-run the same command to resume"
            dist.print0(msg, file=sys.stderr)  # where every command's stop line goes
            return 128 + state.stop_signal  # 143 for SIGTERM, 130 for Ctrl-C
    bar.close()
    if state.step > run.start_step:  # resumed at the last step: the checkpoint resumed from is that step's
        save_checkpoint(run, state.step)
    save_adapter(run, state.step, "adapter-final")
    if log is not None:
        plot_loss(log.path, run.out / "loss.png")
        log.close()
    return 0


def _adapter_damage(final: Path) -> str | None:
    """Why a finished run's ``adapter-final`` cannot be read back (a file deleted, a checksum that no longer holds),
    or None when it can."""
    try:
        read_adapter(final)
    except FrodError as e:
        return str(e)
    return None


def _step(run: Run, state: LoopState, log: MetricsLog | None, bar: tqdm) -> bool:
    """One optimizer step with what follows it (eval, rotation angles, the metrics row, a checkpoint); True when
    a SIGTERM stopped the run (its checkpoint written)."""
    t = run.recipe.train
    row: dict[str, Any] = {"step": state.step + 1, **train_step(run, state.step)}
    state.step = step = row["step"]
    state.nonfinite = 0 if math.isfinite(row["loss"]) else state.nonfinite + 1
    if state.nonfinite >= t.max_nonfinite_steps:  # the loss is all-reduced: every rank agrees
        bar.close()
        raise dist.CollectiveError(
            f"{state.nonfinite} consecutive steps with a non-finite loss (last: step {step}, loss "
            f"{row['loss']}, grad norm {row['grad_norm']}); stopped without writing adapter-final. Check the "
            "base weights and factor store for NaN/inf and lower train.lr_sigma / train.lr_s "
            "(train.max_nonfinite_steps sets how many are allowed)"
        )
    if t.eval_every and run.inputs.eval_examples and step % t.eval_every == 0:
        row["eval_loss"] = eval_loss(run)
    if t.rotation_every and (step % t.rotation_every == 0 or step == run.total_steps):
        row["tan_alpha"] = rotation_angles(run)
    if log is not None and (step % t.log_every == 0 or step == run.total_steps or "tan_alpha" in row):
        log.write(row)
        bar.set_postfix(
            loss=f"{row['loss']:.4f}",
            lr_sigma=f"{row['lr_sigma']:.2e}",
            lr_s=f"{row['lr_s']:.2e}",
            tok_s=f"{row['tokens_per_s']:.0f}",
        )
    bar.update(1)
    stop = dist.all_reduce_sum(torch.tensor([float(state.stop_requested)], device=dist.local_device())).item() > 0
    due = bool(t.save_every) and step % t.save_every == 0 and step < run.total_steps
    if due and state.nonfinite and not stop:
        # the optimizer skipped this step: its state may not exist yet (DeepSpeed fails to save it) and a
        # non-finite state is nothing to resume from; the non-finite stop above decides what happens
        dist.print0(f"step {step}: loss not finite, checkpoint skipped")
    elif due or stop:  # a kill between the two: the resume writes the adapter (``_publish_resumed_adapter``)
        save_checkpoint(run, step)
        save_adapter(run, step, f"adapter-{step}")
    return stop
