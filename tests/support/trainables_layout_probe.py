"""Run by tests/train/test_zero2_trainables_layout.py under torchrun: the same training run twice in one launch,
once as the trainer builds it (under ZeRO-1/2 σ and S held per decoder layer, ``FRoDTrainables``) and once with
one σ and one S Parameter per FRoD layer (``build_frod_model(..., flat_trainables=False)``, the layout before).

Each ``--modes`` entry builds the run with ``frod_ds.train.trainer.setup`` and takes ``--steps`` optimizer steps with
``train_step``. Rank 0 writes ``<output_dir>/layout_<mode>.pt``: the engine's trainable Parameter names, each
step's loss and gradient norm, and every FRoD layer's σ and S after the last step (read through the layer, so both
layouts give them per member).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from launch.train import parse_args  # noqa: E402

MODES = ("decoder-layer", "frod-layer")


def measure(recipe, config: str, mode: str, steps: int) -> None:
    from frod_ds.model.apply import frod_modules
    from frod_ds.model.build import gathered
    from frod_ds.runtime import distributed as dist
    from frod_ds.train import loop, trainer

    build = trainer.build_frod_model
    if mode == "frod-layer":
        trainer.build_frod_model = functools.partial(build, flat_trainables=False)
    recipe = dataclasses.replace(recipe, output_dir=str(Path(recipe.output_dir) / mode))
    try:
        run = trainer.setup(recipe, config)
    finally:
        trainer.build_frod_model = build
    model = run.engine.module
    run.engine.train()
    rows = [loop.train_step(run, s) for s in range(steps)]
    layers = dict(frod_modules(model))
    params = [p for m in layers.values() for p in m.frod_parameters()]
    with gathered(params, run.zero3):
        if dist.is_main():
            values = {
                f"{name}.{leaf}": getattr(m, leaf).detach().float().cpu().clone()
                for name, m in layers.items()
                for leaf in ("frod_sigma", "frod_s")
            }
            torch.save(
                {
                    "params": [n for n, p in model.named_parameters() if p.requires_grad],
                    "loss": [r["loss"] for r in rows],
                    "grad_norm": [r["grad_norm"] for r in rows],
                    "values": values,
                },
                Path(recipe.output_dir).parent / f"layout_{mode}.pt",
            )
    run.engine.destroy()
    del run, model
    gc.collect()


def main() -> int:
    from frod_ds.config.recipe import load_recipe
    from frod_ds.runtime import distributed as dist

    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps per mode")
    probe_args, rest = ap.parse_known_args()
    args = parse_args(rest)
    recipe = load_recipe(args.recipe, args.overrides)
    dist.init_deepspeed()  # as launch/train.py: the launcher's group, DeepSpeed's comm layer without its shm op
    for mode in probe_args.modes.split(","):
        measure(recipe, args.config, mode, probe_args.steps)
    dist.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
