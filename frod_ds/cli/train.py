"""DeepSpeed training of FRoD adapters: ZeRO-2 when the frozen model fits one GPU (7B), ZeRO-3 when it does not (70B).

    deepspeed launch/train.py --config ds_configs/zero2.json --recipe recipes/llama2_7b_cs170k.yaml \\
        train.lr_sigma=2e-4 output_dir=runs/llama2-7b
    torchrun --nproc_per_node 8 launch/train.py --config ds_configs/zero3.json --recipe R_70b.yaml
    # CPU (CI, the demo): DS_ACCELERATOR=cpu deepspeed --num_gpus 2 launch/train.py --config \\
    #     ds_configs/zero3_cpu_fp32.json --recipe recipes/demo_tiny.yaml

Re-running the same command resumes from the last complete checkpoint in ``output_dir``. SIGTERM writes a
checkpoint and exits with 143. Exit 2 on invalid input (one ``error:`` line), before any training. On GPUs rank 0
prints one ``hint:`` line when the memory planner (``frod_ds.plan.recommend.train_hint``, the decision of
``python -m frod_ds plan``) predicts the chosen set-up out of memory, or a faster ZeRO set-up that fits.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        allow_abbrev=False, prog="frod train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--config", required=True, help="DeepSpeed JSON (ds_configs/*.json); the only engine settings")
    ap.add_argument("--recipe", default=None, help="YAML recipe (recipes/*.yaml); omitted keys take defaults")
    ap.add_argument("--nvme-path", default=None, help="override the NVMe offload path of the DeepSpeed config")
    ap.add_argument(
        "--local_rank",
        "--local-rank",
        type=int,
        default=None,
        help="set by the deepspeed launcher; the LOCAL_RANK env is used instead",
    )
    ap.add_argument("overrides", nargs="*", help="dotted recipe overrides, e.g. train.lr_sigma=2e-4 output_dir=runs/x")
    return ap.parse_args(argv)


def train(args: argparse.Namespace) -> int:
    from frod_ds.config.recipe import load_recipe
    from frod_ds.runtime import distributed as dist

    recipe = load_recipe(args.recipe, args.overrides)  # cheap checks first, before any process group
    dist.init_deepspeed()
    import torch

    from frod_ds.config.ds_config import load_ds_config
    from frod_ds.plan.recommend import train_hint
    from frod_ds.train.trainer import fit, removed_if_failed, setup

    gpu_bytes = (
        torch.cuda.get_device_properties(dist.local_device()).total_memory if torch.cuda.is_available() else None
    )
    ds_cfg = load_ds_config(args.config)
    hint = train_hint(recipe, ds_cfg, dist.get_world_size(), gpu_bytes, name=args.config)  # reads config.json only
    if hint:
        dist.print0(hint)
    with removed_if_failed(Path(recipe.output_dir)):  # a failed fresh run leaves no output_dir behind
        return fit(setup(recipe, args.config, args.nvme_path))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from frod_ds.runtime import entry

    return entry.run(lambda: train(args), init_group=False)


if __name__ == "__main__":
    from frod_ds.runtime.entry import run_script

    run_script(main, fast_exit=True)
