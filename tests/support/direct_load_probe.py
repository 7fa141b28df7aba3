"""Run by tests/bench/test_direct_load.py under tests/support/ranks.py (gloo, CPU): the step kind's LoRA
(``build_lora``, ``Stepper``) on each ``--engines`` engine, its base loaded by ``from_pretrained`` and by the direct
load (``bench/kinds/direct_load.py``); with ``--wrong-rows`` also the direct load reading, on every rank, the rows
(the ZeRO-3 span) of rank 0: the bug a lost rank offset makes. Rank 0 writes ``<out>/<engine>.pt``: per load, every
parameter gathered whole after the build, the losses of ``--steps`` steps, and the adapters gathered after them.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch

from bench.kinds import direct_load
from bench.kinds import step as step_kind
from bench.suite import STEP_KEYS
from frod_ds.runtime import distributed as dist


@contextlib.contextmanager
def rank0_rows():
    """The direct load with every rank reading rank 0's rows and span, each of its own length."""
    rows, span = direct_load.own_rows, direct_load.own_span

    def first_rows(n: int, rank: int, world: int) -> tuple[int, int]:
        lo, hi = rows(n, rank, world)
        return 0, hi - lo

    def first_span(numel: int, k: int, rank: int) -> tuple[int, int]:
        lo, hi = span(numel, k, rank)
        return 0, hi - lo

    direct_load.own_rows, direct_load.own_span = first_rows, first_span
    try:
        yield
    finally:
        direct_load.own_rows, direct_load.own_span = rows, span


def gathered(model, zero3: bool) -> dict[str, torch.Tensor]:
    """Every parameter of ``model`` whole, on the CPU (collective: every rank calls it)."""
    named = list(model.named_parameters())
    if zero3:
        import deepspeed

        with deepspeed.zero.GatheredParameters([p for _, p in named]):
            return {n: p.detach().clone() for n, p in named}
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().clone() for n, p in named}


def run(engine: str, load: str, model_dir: Path, steps: int) -> dict:
    world = dist.get_world_size()
    s = {**STEP_KEYS, "method": "lora", "engine": engine, "gpus": world, "batch": 2, "seq": 16, "gc": True}
    s.update(load=load, leaf_modules=engine == "zero3")
    ds_cfg, device = step_kind.ds_config(s, world), torch.device("cpu")
    model, groups = step_kind.build_lora(s, model_dir, ds_cfg, device)
    model.config.use_cache = False
    step = step_kind.Stepper(model, groups, s, ds_cfg, device)
    zero3 = step.engine is not None
    params = gathered(step.model, zero3)
    g = torch.Generator().manual_seed(1234 + dist.get_rank())  # each rank its own batches, as in the step kind
    vocab = step.model.config.vocab_size
    losses = [float(step(torch.randint(0, vocab, (s["batch"], s["seq"]), generator=g))) for _ in range(steps)]
    adapters = {n: t for n, t in gathered(step.model, zero3).items() if "lora_" in n}
    if zero3:
        step.engine.destroy()
    return {"params": params, "losses": losses, "adapters": adapters}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, type=Path, help="checkpoint folder")
    ap.add_argument("--out", required=True, type=Path, help="folder for <engine>.pt")
    ap.add_argument("--engines", default="fsdp2", help="comma-separated step-kind engines")
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps per build")
    ap.add_argument("--wrong-rows", action="store_true", help="also the direct load reading rank 0's rows")
    args = ap.parse_args()
    engines = args.engines.split(",")
    dist.init_deepspeed() if "zero3" in engines else dist.init_distributed()
    for engine in engines:
        out = {load: run(engine, load, args.model, args.steps) for load in ("from_pretrained", "direct")}
        if args.wrong_rows:
            with rank0_rows():
                out["wrong_rows"] = run(engine, "direct", args.model, args.steps)
        if dist.is_main():
            args.out.mkdir(parents=True, exist_ok=True)
            torch.save(out, args.out / f"{engine}.pt")
    dist.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
