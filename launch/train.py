"""ZeRO-3 training of FRoD adapters.

    deepspeed launch/train.py --config ds_configs/zero3.json --recipe recipes/llama2_7b_cs170k.yaml \\
        train.lr_sigma=2e-4 output_dir=runs/llama2-7b
    torchrun --nproc_per_node 8 launch/train.py --config ds_configs/zero3_offload.json --recipe R.yaml
    # CPU (CI, the demo): DS_ACCELERATOR=cpu deepspeed --num_gpus 2 launch/train.py --config \\
    #     ds_configs/zero3_cpu_fp32.json --recipe recipes/demo_tiny.yaml

Re-running the same command resumes from the last complete checkpoint in ``output_dir``. SIGTERM writes a
checkpoint and exits with 143. Exit 2 on invalid input (one ``error:`` line), before any training.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

USER_ERRORS = (ValueError, FileNotFoundError)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="DeepSpeed JSON (ds_configs/*.json); the only engine settings")
    ap.add_argument("--recipe", default=None, help="YAML recipe (recipes/*.yaml); omitted keys take defaults")
    ap.add_argument("--nvme-path", default=None, help="override the NVMe offload path of the DeepSpeed config")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None,
                    help="set by the deepspeed launcher; the LOCAL_RANK env is used instead")
    ap.add_argument("overrides", nargs="*", help="dotted recipe overrides, e.g. train.lr_sigma=2e-4 output_dir=runs/x")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from frod_ds import distributed as dist
    from frod_ds.recipe import load_recipe

    try:
        recipe = load_recipe(args.recipe, args.overrides)  # cheap checks first, before any process group
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import deepspeed
    import torch

    if "RANK" not in os.environ and "SLURM_STEP_NUM_TASKS" not in os.environ:
        # `python launch/train.py`: DeepSpeed still needs a process group, so make a one-rank one.
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 10000))
    dist.init_distributed()
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    from frod_ds.trainer import fit, setup

    try:
        try:
            run = setup(recipe, args.config, args.nvme_path)
        except USER_ERRORS as e:
            if dist.is_main():
                print(f"error: {e}", file=sys.stderr)
            return 2
        return fit(run)
    finally:
        dist.destroy()


if __name__ == "__main__":
    import warnings

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    sys.exit(main())
