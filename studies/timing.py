"""Each method's speed alone on the device: step time, tokens/s, peak memory and build time (``learn``'s last unit
of a task), on the task's own first batches and the study's one training loop (``loop.train_run``).

Per method, in one process with no other run on the device: a fresh ``ModelFactory`` builds the model (its build
time includes FRoD's HJD or PEFT's own initialisation), the base model goes to the host, ``warmup`` steps run, then
``steps`` timed steps (synchronised at both ends; peak memory counts from their start: weights, gradients,
optimizer state and activations of that run alone). The LR is the method's chosen one; it does not change the time.
"""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import device_name
from frod_ds.train.data import BatchPlan
from studies.config import StudyConfig, method_spec
from studies.data import encode_study_examples, make_batches, split_rows
from studies.loop import fp32_only, train_run
from studies.models import ModelFactory, load_base, make_optimizer, trainable_numel

__all__ = ["time_methods", "check_methods"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_methods(
    cfg: StudyConfig, lrs: dict[str, float], device: torch.device, warmup: int, steps: int, log=print
) -> dict[str, Any]:
    """``{"device", "warmup", "steps", "methods": {method: {step_ms, tokens_per_s, peak_mem_gb, build_seconds,
    trainable_params, lr}}}`` for the methods of ``lrs`` (method → LR), each trained alone on ``device``."""
    base, tok = load_base(cfg.model, device)
    train_rows, _ = split_rows(
        cfg.train_path, cfg.heldout, cfg.seed, cfg.train_limit, Path(cfg.heldout_file) if cfg.heldout_file else None
    )
    examples = encode_study_examples(tok, train_rows, cfg.cutoff)
    plan = BatchPlan(len(examples), cfg.batch_size, 1, 1, 0, cfg.seed)
    batches = [b.to(device) for b in make_batches(examples, plan, warmup + steps, tok.pad_token_id, False)]
    out: dict[str, Any] = {}
    for name, lr in lrs.items():
        spec = method_spec(name)
        base.to(device)
        factory = ModelFactory(base, cfg)
        _sync(device)
        t0 = time.perf_counter()
        model = factory.build(spec)
        _sync(device)
        build = time.perf_counter() - t0
        del factory  # its templates are not part of a training run's memory
        base.to("cpu")
        if device.type == "cuda":
            torch.cuda.empty_cache()
        optimizer = make_optimizer(spec, model, lr, cfg)
        with fp32_only() if cfg.peft_frod_fp32 and spec.kind.startswith("peftfrod") else contextlib.nullcontext():
            train_run(model, optimizer, batches[:warmup], cfg, device, set(), lambda step: {}, math.inf)
            run = train_run(model, optimizer, batches[warmup:], cfg, device, set(), lambda step: {}, math.inf)
        out[name] = {
            "lr": lr,
            "step_ms": 1e3 * run.train_seconds / run.steps,
            "tokens_per_s": run.tokens / run.train_seconds,
            "peak_mem_gb": run.peak_mem_gb,
            "build_seconds": build,
            "trainable_params": trainable_numel(model),
            "tokens_per_step": run.tokens / run.steps,
        }
        e = out[name]
        peak = "—" if e["peak_mem_gb"] is None else f"{e['peak_mem_gb']:.2f} GiB"
        log(
            f"timing {name}: {e['step_ms']:.1f} ms/step, {e['tokens_per_s']:,.0f} tokens/s, peak {peak}, "
            f"built in {build:.1f} s (alone on {device.type})"
        )
        del model, optimizer
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"device": device_name(), "alone": True, "warmup": warmup, "steps": steps, "methods": out}


def check_methods(cfg: StudyConfig, lrs: dict[str, float], device: torch.device, steps: int = 2, log=print) -> dict:
    """Every method through what a run does, briefly: build, ``steps`` training steps with checkpoint and
    validation evaluations, merge, the test protocols on two rows per split. ``{method: "ok" | the error}``:
    the first GPU call's check that no method fails hours into the study."""
    from studies.context import RunContext
    from studies.data import load_test_rows

    base, tok = load_base(cfg.model, device)
    train_rows, held_rows = split_rows(cfg.train_path, cfg.heldout, cfg.seed, cfg.train_limit, Path(cfg.heldout_file))
    examples = encode_study_examples(tok, train_rows, cfg.cutoff)
    plan = BatchPlan(len(examples), cfg.batch_size, 1, 1, 0, cfg.seed)
    held = encode_study_examples(tok, held_rows[:8], cfg.cutoff)
    test = {t: rows[:2] for t, rows in load_test_rows(cfg.eval_path, None).items()}
    ctx = RunContext(
        cfg=cfg,
        device=device,
        tok=tok,
        base=base,
        batches=[b.to(device) for b in make_batches(examples, plan, steps, tok.pad_token_id, False)],
        held_batches=[b.to(device) for b in make_batches(held, None, 0, tok.pad_token_id, False, batch_size=8)],
        held_by_task={held_rows[0]["task"]: held_rows[:8]},
        curve=test,
        test=test,
        steps=steps,
        checkpoint_steps=[steps],
        log=log,
    )
    out = {}
    for name, lr in lrs.items():
        try:
            entry, state = ctx.train_one(name, lr, math.inf)
            assert state is not None and entry["checkpoints"], "the run did not finish"
            ctx.final_test(name, state)
            out[name] = "ok"
        except Exception as e:  # noqa: BLE001 - reported per method; the check's exit code says it failed
            out[name] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        log(f"check {name}: {out[name]}")
    return out
