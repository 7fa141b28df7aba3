"""Run by the training tests under torchrun: ``launch/train.py``'s setup and fit, plus white-box checks.

Writes ``<output_dir>/probe_rank<r>.json`` with, per rank: the partitioning of U/V (ZeRO-3 ``ds_tensor`` vs
``ds_numel``), gradients and optimizer state of frozen factors, σ and S before/after the first optimizer
step (to recover the learning rates actually applied), and rank 0's logits on fixed ids after training.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from launch.train import parse_args  # noqa: E402


def main() -> int:

    from frod_ds.config.recipe import load_recipe
    from frod_ds.model.apply import frod_modules
    from frod_ds.model.build import gathered
    from frod_ds.runtime import distributed as dist
    from frod_ds.train.loop import train_step
    from frod_ds.train.trainer import fit, setup

    args = parse_args()
    recipe = load_recipe(args.recipe, args.overrides)
    dist.init_deepspeed()  # as launch/train.py: the launcher's group, DeepSpeed's comm layer without its shm op
    run = setup(recipe, args.config)
    engine, model = run.engine, run.engine.module
    layers = dict(frod_modules(model))
    report: dict = {"rank": dist.get_rank(), "zero3": run.zero3}

    if run.zero3:
        report["partition"] = {
            name: {
                "U_local": m.u_parameter().ds_tensor.numel(),
                "U_full": m.u_parameter().ds_numel,
                "V_local": m.V.ds_tensor.numel(),
                "V_full": m.V.ds_numel,
                "V_persist": bool(m.V.ds_persist),
            }
            for name, m in layers.items()
        }
        from deepspeed.utils import z3_leaf_module

        decoder_layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
        report["decoder_layers"] = len(decoder_layers)
        report["leaf_decoder_layers"] = sum(bool(z3_leaf_module(m)) for m in decoder_layers)
        report["leaf_other"] = sum(bool(z3_leaf_module(m)) for m in model.modules()) - report["leaf_decoder_layers"]
        report["u_parameters"] = len({id(m.u_parameter()) for m in layers.values()})
    categories = {n.rsplit(".", 1)[-1] for n in layers}
    report["shared_v"] = all(len({id(m.V) for n, m in layers.items() if n.endswith("." + c)}) == 1 for c in categories)
    opt_params = (
        {id(p) for g in engine.optimizer.optimizer.param_groups for p in g["params"]}
        if hasattr(engine.optimizer, "optimizer")
        else set()
    )
    report["frozen_in_optimizer"] = any(
        id(m.u_parameter()) in opt_params or id(m.V) in opt_params for m in layers.values()
    )
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    report["param_dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
    report["trainable_leaves"] = sorted({n.rsplit(".", 1)[-1] for n in trainable})

    # First optimizer step, taken by hand so σ/S can be read around it; fit() then continues from step 1.
    def values(m):  # σ, S of one FRoD layer (views of its decoder layer's FRoDTrainables under ZeRO)
        with gathered(m.frod_parameters(), run.zero3):
            return m.frod_sigma.detach().clone().float().cpu(), m.frod_s.detach().clone().float().cpu()

    before = {n: values(m) for n, m in layers.items()}
    row = train_step(run, 0)
    after = {n: values(m) for n, m in layers.items()}
    d_sigma = torch.cat([(after[n][0] - before[n][0]).abs() for n in layers])
    d_s = torch.cat([(after[n][1] - before[n][1]).abs() for n in layers])
    report["first_step"] = {
        "logged_lr_sigma": row["lr_sigma"],
        "logged_lr_s": row["lr_s"],
        "median_abs_dsigma": float(d_sigma[d_sigma > 0].median()),
        "median_abs_ds": float(d_s[d_s > 0].median()),
        "frac_sigma_moved": float((d_sigma > 0).float().mean()),
        "frac_s_moved": float((d_s > 0).float().mean()),
    }
    report["frozen_grads_none"] = all(m.u_parameter().grad is None and m.V.grad is None for m in layers.values())
    run = dataclasses.replace(run, start_step=1)
    rc = fit(run)
    if run.zero3:  # fetch_per_layer's FixedParameters still replay what a fresh walk finds, the same objects
        from frod_ds.model.build import FixedParameters

        fixed = [m for m in model.modules() if isinstance(m.__dict__.get("named_parameters"), FixedParameters)]
        report["fixed_walks"] = {
            "modules": len(fixed),
            "used": sum(bool(m.named_parameters.cache) for m in fixed),
            "same": all(
                [(n, id(p)) for n, p in m.named_parameters()] == [(n, id(p)) for n, p in type(m).named_parameters(m)]
                for m in fixed
            ),
        }
    ids = torch.arange(3, 3 + 2 * 12).reshape(2, 12) % model.config.vocab_size
    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=ids).logits.float().cpu()
    if dist.is_main():
        torch.save(logits, Path(recipe.output_dir) / "probe_logits.pt")
    out = Path(recipe.output_dir) / f"probe_rank{dist.get_rank()}.json"
    out.write_text(json.dumps(report, indent=1))
    dist.destroy()
    return rc


if __name__ == "__main__":
    sys.exit(main())
