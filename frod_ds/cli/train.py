"""``frod train``: DeepSpeed ZeRO-2/3 training of FRoD adapters from a recipe and a DeepSpeed JSON (docs/training.md).

ZeRO-2 when the frozen model fits one GPU (7B), ZeRO-3 when it does not (70B). Re-running the same command resumes
from the last complete checkpoint in ``output_dir``; SIGTERM writes a checkpoint and exits with 143; invalid input
is one ``error:`` line and exit 2, before any training. On GPUs rank 0 prints one ``hint:`` line when the memory
planner (``frod plan``) predicts the chosen set-up out of memory, or a faster ZeRO set-up that fits.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from frod_ds.runtime.cli_parser import Parser, input_path

EXAMPLES = """examples:
  frod train --config ds_configs/zero2.json --recipe recipes/llama2_7b_cs170k.yaml train.lr_sigma=2e-4 \\
      output_dir=runs/llama2-7b
  frod train --config ds_configs/zero3_nvme.json --nvme-path /local_nvme --recipe R_70b.yaml
  torchrun --nproc-per-node 8 --no-python frod train --config ds_configs/zero3.json --recipe R_70b.yaml
  DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 --no-python frod train --config ds_configs/zero3_cpu_fp32.json \\
      --recipe recipes/demo_tiny.yaml
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = Parser(
        allow_abbrev=False,
        prog="frod train",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--config", type=input_path, required=True, help="DeepSpeed JSON (ds_configs/*.json); the only engine settings"
    )
    ap.add_argument(
        "--recipe", type=input_path, default=None, help="YAML recipe (recipes/*.yaml); omitted keys take defaults"
    )
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


def gpu_memory() -> float | None:
    """Bytes of this rank's GPU, None without one (then no hint is printed)."""
    import torch

    from frod_ds.runtime import distributed as dist

    return torch.cuda.get_device_properties(dist.local_device()).total_memory if torch.cuda.is_available() else None


def train(args: argparse.Namespace) -> int:
    from frod_ds.config.recipe import load_recipe
    from frod_ds.runtime import distributed as dist

    recipe = load_recipe(args.recipe, args.overrides)  # cheap checks first, before any process group
    dist.init_deepspeed()
    from frod_ds.plan.recommend import train_hint
    from frod_ds.train.run_dir import writing_run
    from frod_ds.train.trainer import fit, setup

    gpu_bytes = gpu_memory()

    def print_hint(inputs) -> None:  # from what setup read once: the parsed JSON and the base's config.json
        world = dist.get_world_size()
        cfg = inputs.user_ds_config  # the JSON as given: under the layer partition the engine's is stage 2
        hint = train_hint(recipe, cfg, world, gpu_bytes, name=args.config, model_config=inputs.base.config())
        if hint:
            dist.print0(hint)

    # rank 0 holds output_dir's lease until the run ends; a failed fresh run leaves no output_dir behind
    with writing_run(Path(recipe.output_dir)):
        return fit(setup(recipe, args.config, args.nvme_path, on_inputs=print_hint))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from frod_ds.runtime import entry

    return entry.run(lambda: train(args), init_group=False)


if __name__ == "__main__":  # as `frod train` runs
    from frod_ds.cli.main import module_main

    module_main("train")
