"""Run by tests/train/test_checkpoint_residency.py under torchrun: how many frozen parameter elements ZeRO-3 holds
gathered at once during training, with and without gradient checkpointing.

Each ``--modes`` entry builds the run with ``frod_ds.train.trainer.setup`` and takes ``--steps`` optimizer steps with
``train_step``. Modes: ``plain`` (no checkpointing); ``trainer`` (``enable_gradient_checkpointing`` as the trainer
sets it), ``nonreentrant``, ``reentrant`` (the same with ``USE_REENTRANT`` forced); and any of the last three with
``-call``: each decoder layer's whole ``__call__`` is checkpointed, its module hooks included, as transformers
5.17's ``GradientCheckpointingLayer`` does (5.23 checkpoints ``forward`` and leaves the layer's own hooks outside).

After every fetch of DeepSpeed's parameter coordinator (the only moments the gathered set grows) the probe sums
``ds_numel`` over the frozen parameters whose ``ds_status`` is ``AVAILABLE`` (and ``AVAILABLE`` or ``INFLIGHT``:
a prefetch's buffers exist before it completes). Writes ``<output_dir>/residency_rank<r>.json``: per mode the
maxima per micro-batch, each step's loss and gradient norm, and the model's sizes (one decoder layer's own frozen
elements, the ``V``s the layers share, the whole frozen model); rank 0 also writes ``trainable_<mode>.pt``, the
σ/S values after the last step.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from launch.train import parse_args  # noqa: E402

MODES = ("plain", "trainer", "trainer-call", "nonreentrant", "reentrant", "nonreentrant-call", "reentrant-call")


class GatheredSampler:
    """The most frozen elements gathered at once, sampled after each ``fetch_sub_module``; one maximum per
    forward+backward (DeepSpeed's ``reset_step`` runs as each forward starts)."""

    def __init__(self):
        self.frozen: list = []
        self.current: tuple[int, int] | None = None  # (AVAILABLE, AVAILABLE or INFLIGHT); None: nothing fetched yet
        self.per_micro_batch: list[tuple[int, int]] = []

    def sample(self) -> None:
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        available = sum(p.ds_numel for p in self.frozen if p.ds_status == ZeroParamStatus.AVAILABLE)
        inflight = sum(p.ds_numel for p in self.frozen if p.ds_status == ZeroParamStatus.INFLIGHT)
        a, g = self.current or (0, 0)
        self.current = (max(a, available), max(g, available + inflight))

    def close_micro_batch(self) -> None:
        if self.current is not None:
            self.per_micro_batch.append(self.current)
        self.current = None

    def install(self) -> None:
        from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as C

        fetch, reset = C.fetch_sub_module, C.reset_step
        sampler = self

        def fetch_and_sample(coord, module, forward):
            fetch(coord, module, forward)
            sampler.sample()

        def reset_and_close(coord):
            sampler.close_micro_batch()
            reset(coord)

        C.fetch_sub_module, C.reset_step = fetch_and_sample, reset_and_close


def _checkpointed_call(self, *args, **kwargs):
    if self.training:
        return self._whole_call_checkpoint(functools.partial(torch.nn.Module.__call__, self, **kwargs), *args)
    return torch.nn.Module.__call__(self, *args, **kwargs)


def checkpoint_whole_call(model) -> None:
    """Make each decoder layer checkpoint its whole ``__call__`` (hooks included) with the checkpoint function the
    trainer set, instead of its ``forward``."""
    for layer in model.model.layers:
        layer._whole_call_checkpoint = layer._gradient_checkpointing_func
        layer.gradient_checkpointing = False  # its forward now runs plainly inside the checkpointed __call__
        cls = type(layer)
        layer.__class__ = type(f"WholeCall{cls.__name__}", (cls,), {"__call__": _checkpointed_call})


def model_sizes(model) -> dict[str, int]:
    """Frozen elements: one decoder layer's own (parameters no other layer uses), the ones several layers share
    (FRoD's ``V`` per category), and the whole model's."""
    frozen = [p for p in model.parameters() if not p.requires_grad]
    per_layer = [{id(p): p for p in layer.parameters() if not p.requires_grad} for layer in model.model.layers]
    uses: dict[int, int] = {}
    for params in per_layer:
        for i in params:
            uses[i] = uses.get(i, 0) + 1
    own = [sum(p.ds_numel for i, p in params.items() if uses[i] == 1) for params in per_layer]
    return {
        "layers": len(per_layer),
        "layer_own": max(own),
        "shared": sum(p.ds_numel for p in frozen if uses.get(id(p), 0) > 1),
        "total": sum(p.ds_numel for p in frozen),
    }


def measure(recipe, config: str, mode: str, steps: int, sampler: GatheredSampler) -> dict:
    from frod_ds.model.build import gathered
    from frod_ds.runtime import distributed as dist
    from frod_ds.train import loop, trainer

    checkpointing = mode != "plain"
    reentrant, enable = trainer.USE_REENTRANT, trainer.enable_gradient_checkpointing
    if not mode.startswith("trainer"):
        trainer.USE_REENTRANT = mode.startswith("reentrant")
    if mode.endswith("-call"):
        trainer.enable_gradient_checkpointing = lambda model: (enable(model), checkpoint_whole_call(model))
    recipe = dataclasses.replace(
        recipe,
        output_dir=str(Path(recipe.output_dir) / mode),
        model=dataclasses.replace(recipe.model, gradient_checkpointing=checkpointing),
    )
    try:
        run = trainer.setup(recipe, config)
    finally:
        trainer.USE_REENTRANT, trainer.enable_gradient_checkpointing = reentrant, enable
    model = run.engine.module
    sampler.frozen = [p for p in model.parameters() if not p.requires_grad]
    sampler.per_micro_batch, sampler.current = [], None
    run.engine.train()
    rows = [loop.train_step(run, s) for s in range(steps)]
    sampler.close_micro_batch()
    sampler.frozen = []
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    with gathered([p for _, p in trainable], run.zero3):
        if dist.is_main():
            torch.save(
                {n: p.detach().float().cpu().clone() for n, p in trainable},
                Path(recipe.output_dir).parent / f"trainable_{mode}.pt",
            )
    out = {
        "max_available": [a for a, _ in sampler.per_micro_batch],
        "max_gathered": [g for _, g in sampler.per_micro_batch],
        "loss": [r["loss"] for r in rows],
        "grad_norm": [r["grad_norm"] for r in rows],
        "sizes": model_sizes(model),
    }
    run.engine.destroy()
    del run, model
    gc.collect()
    return out


def main() -> int:

    from frod_ds.config.recipe import load_recipe
    from frod_ds.runtime import distributed as dist

    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--modes", default="plain,trainer,trainer-call,reentrant-call", help=f"comma-separated, of {', '.join(MODES)}"
    )
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps per mode")
    probe_args, rest = ap.parse_known_args()
    args = parse_args(rest)
    recipe = load_recipe(args.recipe, args.overrides)
    dist.init_deepspeed()  # as launch/train.py: the launcher's group, DeepSpeed's comm layer without its shm op
    sampler = GatheredSampler()
    sampler.install()
    report = {m: measure(recipe, args.config, m, probe_args.steps, sampler) for m in probe_args.modes.split(",")}
    (Path(recipe.output_dir) / f"residency_rank{dist.get_rank()}.json").write_text(json.dumps(report, indent=1))
    dist.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
