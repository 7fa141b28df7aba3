"""The planner's decisions: the fastest shipped set-up that fits (``recommend``) and the one-line hint
``frod train`` prints when the chosen set-up is likely out of memory or much slower (``hint``, ``train_hint``)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from frod_ds.config.ds_config import as_ds_config
from frod_ds.plan.memory import Plan, plan_memory
from frod_ds.plan.shapes import (
    Engine,
    GiB,
    ModelShape,
    TrainShape,
    engine_from_ds_config,
    load_model_shape,
    model_shape_from_config,
    shipped_engines,
    train_shape_from_recipe,
)
from frod_ds.plan.step_time import NVLINK, Link, step_time
from frod_ds.runtime.errors import FrodError

__all__ = [
    "VARIANTS",
    "HINT_MARGIN",
    "Recommendation",
    "frozen_label",
    "as_run",
    "candidates",
    "predicted_seconds",
    "recommend",
    "fewest_gpus",
    "no_fit_advice",
    "hint",
    "train_hint",
]

# Within one engine: the exact model first (gradient checkpointing costs about one more forward, ~1/3 of a
# step), then quantized frozen weights (they change the model: init drift, README), int8 before nf4 (smaller
# error), the targeted U_i alone before the whole base too (quantize_base).
VARIANTS = (("none", False), ("int8", False), ("int8", True), ("nf4", False), ("nf4", True))
# frod train names a faster shipped engine only when the step-time model predicts it this much faster (the
# model's check against measured steps: within 15%, bench/results/time_model_check.md).
HINT_MARGIN = 0.15


@dataclass
class Recommendation:
    engine: Engine
    quant: str
    quantize_base: bool
    checkpointing: bool
    plan: Plan
    reason: str
    tried: list[Plan] = field(default_factory=list)
    seconds: float = 0.0  # predicted seconds per step (frod_ds.plan.step_time)
    alternative: str = ""  # a much faster set-up at a coarser precision, named but not chosen
    recipe_dtype: str = "bfloat16"  # the recipe's model.dtype: the engine's JSON may train in another

    def describe(self) -> str:
        dtype = self.plan.train.dtype
        change = f" with model.dtype={dtype}" if dtype != self.recipe_dtype else ""  # its JSON refuses the recipe's
        q = frozen_label(self.plan.train)
        return f"{self.engine.name}{change}, {q}, gradient checkpointing {'on' if self.checkpointing else 'off'}"


SHORT_DTYPE = {"bfloat16": "bf16", "float32": "fp32"}


def frozen_label(train: TrainShape) -> str:
    """How a plan names the frozen weights' precision: their dtype, or the quantization."""
    if train.quant == "none":
        return f"frozen {SHORT_DTYPE.get(train.dtype, train.dtype)}"
    return f"frozen_quant={train.quant}" + (" quantize_base=true" if train.quantize_base else "")


def as_run(train: TrainShape, engine: Engine, quant: str, quantize_base: bool, checkpointing: bool) -> TrainShape:
    """``train`` as ``engine`` would run it with these choices: in the dtype its JSON requires, if any."""
    return replace(
        train,
        quant=quant,
        quantize_base=quantize_base,
        checkpointing=checkpointing,
        dtype=engine.dtype or train.dtype,
    )


def candidates(
    engines: list[Engine], train: TrainShape | None = None, checkpointing: bool | None = None
) -> list[tuple[Engine, str, bool, bool]]:
    """Every (engine, quant, quantize_base, checkpointing), grouped by precision: the recipe's own first (``train``;
    a quantized model is a different model, so precision is the recipe's choice), then ``VARIANTS`` from the most
    exact; within a precision, engines and checkpointing in the shipped order (the time model ranks them).
    ``checkpointing``: the user's own choice, kept (None: both are tried)."""
    own = [(train.quant, train.quantize_base)] if train is not None else []
    tiers = own + [v for v in VARIANTS if v not in own]
    return [(eng, q, qb, gc) for q, qb in tiers for eng in engines for gc in _checkpointing(checkpointing)]


def _checkpointing(chosen: bool | None) -> tuple[bool, ...]:
    """The gradient-checkpointing choices to try: the user's own, else both."""
    return (False, True) if chosen is None else (chosen,)


def predicted_seconds(model: ModelShape, plan: Plan, link: Link | None = None) -> float:
    """The step-time model's seconds for a planned set-up (``frod_ds.plan.step_time``)."""
    return step_time(model, plan.train, plan.engine, plan.gpus, link or NVLINK).seconds


def recommend(
    model: ModelShape,
    train: TrainShape,
    gpus: int,
    gpu_bytes: float,
    engines: list[Engine] | None = None,
    link: Link | None = None,
    checkpointing: bool | None = None,
) -> Recommendation | None:
    """The fastest set-up that fits (None when none does): within the first precision of ``candidates`` where
    anything fits, the engine and checkpointing (unless the user chose it: ``checkpointing``) with the least
    predicted step time; a one-line reason."""
    tried: list[Plan] = []
    tier: list[tuple[tuple, Plan, float]] = []
    for eng, q, qb, gc in candidates(engines or shipped_engines(), train, checkpointing):
        if tier and (q, qb) != tier[-1][0][1:3]:
            if any(p.fits for _, p, _ in tier):
                break
            tier = []
        plan = plan_memory(model, as_run(train, eng, q, qb, gc), eng, gpus, gpu_bytes)
        tried.append(plan)
        tier.append(((eng, q, qb, gc), plan, predicted_seconds(model, plan, link)))
    fitting = [t for t in tier if t[1].fits]
    if not fitting:
        return None
    (eng, q, qb, gc), plan, secs = min(fitting, key=lambda t: t[2])
    alternative = _quantized_alternative(model, train, gpus, gpu_bytes, engines, link, (q, qb), secs, checkpointing)
    reason = _reason(plan, secs, tier, tried) + alternative
    return Recommendation(eng, q, qb, gc, plan, reason, tried, secs, alternative, train.dtype)


def _quantized_alternative(
    model: ModelShape,
    train: TrainShape,
    gpus: int,
    gpu_bytes: float,
    engines: list[Engine] | None,
    link: Link | None,
    chosen: tuple[str, bool],
    secs: float,
    checkpointing: bool | None = None,
) -> str:
    """``; with <precision>: <engine> would take N ms`` when a coarser precision (the fastest of them) fits at under
    half the chosen step time (e.g. 70B in bf16 only fits with parameter offload), else ``""``. Not chosen: it changes
    the model."""
    later = VARIANTS[VARIANTS.index(chosen) + 1 :] if chosen in VARIANTS else ()
    best = None
    for q, qb in later:
        for eng in engines or shipped_engines():
            for gc in _checkpointing(checkpointing):
                plan = plan_memory(model, as_run(train, eng, q, qb, gc), eng, gpus, gpu_bytes)
                if plan.fits:
                    t = predicted_seconds(model, plan, link)
                    if best is None or t < best[0]:
                        best = (t, plan)
    if best is None or best[0] > 0.5 * secs:
        return ""
    t, plan = best
    return (
        f"; with {frozen_label(plan.train)} (a quantized model: it moves the logits), {plan.engine.name} would take "
        f"a predicted {t * 1e3:.0f} ms per step"
    )


def _reason(plan: Plan, secs: float, tier: list[tuple[tuple, Plan, float]], tried: list[Plan]) -> str:
    need, have = plan.needed / GiB, plan.gpu_bytes / GiB
    tight = f" (tight: {need / have:.0%} of the GPU)" if need > 0.9 * have else ""
    (_, fastest, fast_s) = min(tier, key=lambda t: t[2])
    step = f"predicted {secs * 1e3:.0f} ms per step"
    if fastest is plan:
        head = (
            "the fastest set-up fits"
            if any(tried[0] is p for _, p, _ in tier)
            else ("the recipe's precision fits nowhere; the most exact precision that fits, fastest set-up")
        )
        return f"{head}: {need:.1f} of {have:.1f} GiB per GPU, {step}{tight}"
    return (
        f"{fastest.engine.name} (gradient checkpointing {'on' if fastest.train.checkpointing else 'off'}) would be "
        f"faster ({fast_s * 1e3:.0f} ms) but needs {fastest.needed / GiB:.1f} GiB per GPU, more than {have:.1f}; "
        f"this is the fastest set-up that fits ({need:.1f} GiB, {step}){tight}"
    )


MAX_GPUS = 2**16  # where the search for a GPU count that fits gives up: beyond it only the per-GPU floor is left


def fewest_gpus(
    model: ModelShape, train: TrainShape, gpus: int, gpu_bytes: float, engines: list[Engine] | None = None
) -> int | None:
    """The fewest GPUs (more than ``gpus``) on which some shipped set-up fits, or None when none does on any count:
    the per-GPU need only falls with more GPUs (ZeRO-3 partitions), so a doubling then a bisection find it."""
    engines = engines or shipped_engines()
    fits = lambda n: any(  # noqa: E731
        plan_memory(model, as_run(train, e, q, qb, gc), e, n, gpu_bytes).fits
        for e, q, qb, gc in candidates(engines, train)
    )
    hi = max(1, gpus) * 2
    while not fits(hi):
        if hi >= MAX_GPUS:
            return None
        hi *= 2
    lo = max(1, gpus)  # does not fit (the caller's finding); hi fits
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


def no_fit_advice(
    model: ModelShape, train: TrainShape, gpus: int, gpu_bytes: float, engines: list[Engine] | None = None
) -> str:
    """What to do when no shipped set-up fits ``gpus`` GPUs: the fewest GPUs that would do, or, when more GPUs cannot
    help (activations, logits and what each GPU keeps whole do not shrink with their number), what would."""
    need = fewest_gpus(model, train, gpus, gpu_bytes, engines)
    if need is not None:
        return f"no shipped set-up fits {gpus} GPU(s) of {gpu_bytes / GiB:.1f} GiB; from {need} GPUs one does"
    floor = min(
        (
            plan_memory(model, as_run(train, e, q, qb, gc), e, MAX_GPUS, gpu_bytes)
            for e, q, qb, gc in candidates(engines or shipped_engines(), train)
        ),
        key=lambda p: p.needed,
    )
    top = sorted(floor.parts.items(), key=lambda kv: -kv[1])[:2]
    return (
        f"no shipped set-up fits a GPU of {gpu_bytes / GiB:.1f} GiB on any number of GPUs: each needs at least "
        f"{floor.needed / GiB:.1f} GiB ({', '.join(f'{k} {v / GiB:.1f}' for k, v in top)} GiB), which more GPUs do "
        f"not shrink; lower train.micro_batch_size or data.cutoff_len ({train.micro_batch} x {train.seq_len} tokens "
        "per GPU now), or use GPUs with more memory"
    )


def hint(model: ModelShape, train: TrainShape, chosen: Engine, gpus: int, gpu_bytes: float) -> str | None:
    """One line for ``frod train`` when ``chosen`` (with the recipe's quantization and checkpointing) is likely
    out of memory, or another shipped engine fits the same recipe and the step-time model predicts it at least
    ``HINT_MARGIN`` faster; None otherwise."""
    engines = shipped_engines()
    plan = plan_memory(model, train, chosen, gpus, gpu_bytes)
    if not plan.fits:
        rec = recommend(model, train, gpus, gpu_bytes, engines)
        fix = f"use {rec.describe()}{rec.alternative}" if rec else no_fit_advice(model, train, gpus, gpu_bytes, engines)
        return (
            f"hint: predicted {plan.needed / GiB:.1f} GiB per GPU under {chosen.name} ({gpus} GPU(s) of "
            f"{gpu_bytes / GiB:.1f} GiB): likely out of memory; {fix} (frod plan)"
        )
    mine = predicted_seconds(model, plan)
    same_recipe = [e for e in engines if e.name != chosen.name and e.dtype in (None, train.dtype)]  # no dtype change
    fitting = [p for p in (plan_memory(model, train, e, gpus, gpu_bytes) for e in same_recipe) if p.fits]
    others = [(predicted_seconds(model, p), p) for p in fitting]
    if others:
        secs, best = min(others, key=lambda t: t[0])
        if secs < mine * (1 - HINT_MARGIN):
            return (
                f"hint: {best.engine.name} fits this recipe on {gpus} GPU(s) ({best.needed / GiB:.1f} of "
                f"{gpu_bytes / GiB:.1f} GiB) and is faster than {chosen.name}: predicted {secs * 1e3:.0f} vs "
                f"{mine * 1e3:.0f} ms per step (frod plan)"
            )
    return None


def train_hint(
    recipe: Any,
    ds_config: Mapping[str, Any] | str | os.PathLike,
    world_size: int,
    gpu_bytes: float | None,
    layer_saves: str = "z",
    *,
    name: str = "the DeepSpeed config",
    model_config: Mapping[str, Any] | None = None,
) -> str | None:
    """``hint`` for ``frod train``: the recipe, its DeepSpeed JSON (parsed, or its path; ``name``: how the line
    names it), the world size and one GPU's memory; ``model_config``: the base model's config.json when the caller
    has read it already. None without a GPU, and when an input is unusable (training's own checks report that)."""
    if not gpu_bytes:
        return None
    try:
        if isinstance(ds_config, (str, os.PathLike)):  # named by its path, as in 0.1
            name = str(ds_config)
        model = (
            model_shape_from_config(dict(model_config))
            if model_config is not None
            else load_model_shape(recipe.model.base)
        )
        t = recipe.train
        engine = engine_from_ds_config(as_ds_config(ds_config), name, t.zero3_partition, t.zero3_gather)
        return hint(model, train_shape_from_recipe(recipe, layer_saves), engine, world_size, gpu_bytes)
    except (FrodError, OSError, KeyError):
        return None
