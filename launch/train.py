"""DeepSpeed training of FRoD adapters: ZeRO-2 when the frozen model fits one GPU (7B), ZeRO-3 when it does not (70B).

    deepspeed launch/train.py --config ds_configs/zero2.json --recipe recipes/llama2_7b_cs170k.yaml \\
        train.lr_sigma=2e-4 output_dir=runs/llama2-7b
    torchrun --nproc_per_node 8 launch/train.py --config ds_configs/zero3.json --recipe R_70b.yaml
    # CPU (CI, the demo): DS_ACCELERATOR=cpu deepspeed --num_gpus 2 launch/train.py --config \\
    #     ds_configs/zero3_cpu_fp32.json --recipe recipes/demo_tiny.yaml

Re-running the same command resumes from the last complete checkpoint in ``output_dir``. SIGTERM writes a
checkpoint and exits with 143. Exit 2 on invalid input (one ``error:`` line), before any training. On GPUs a
``hint:`` line says when the chosen ZeRO set-up is likely the slow one for the model and GPU count
(``frod_ds/engine_choice.py``: ZeRO-2 when the frozen model fits one GPU, ZeRO-3 when it does not).
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


def zero_hint_line(recipe, config_path: str, world_size: int, gpu_bytes: int | None) -> str | None:
    """``frod_ds.engine_choice``'s one-line hint when the chosen ZeRO set-up is likely the slow (or failing) one
    for this model and GPU count; None without a GPU, or when an input is unreadable (``setup`` reports that)."""
    if not gpu_bytes:
        return None
    import math

    import torch

    from frod_ds.build import DTYPES
    from frod_ds.ds_config import load_ds_config
    from frod_ds.engine_choice import choice_of_config, frozen_model_bytes, zero_hint
    from frod_ds.hf_checkpoint import HFCheckpoint, resolve_model_dir
    from frod_ds.store import FactorStore

    try:
        ckpt = HFCheckpoint(resolve_model_dir(recipe.model.base))
        numels = [math.prod(ckpt.shape(k)) for k in ckpt.keys()]
        store = FactorStore.open(recipe.model.factor_store)
        widths = [store.width(c) for c in recipe.model.targets if c in store.categories]
        chosen = choice_of_config(load_ds_config(config_path))
    except (ValueError, OSError, KeyError):
        return None
    elem = torch.finfo(DTYPES[recipe.model.dtype]).bits // 8
    return zero_hint(chosen, frozen_model_bytes(numels, widths, elem), gpu_bytes, world_size)


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

    gpu_bytes = torch.cuda.get_device_properties(dist.local_device()).total_memory if torch.cuda.is_available() else None
    hint = zero_hint_line(recipe, args.config, dist.get_world_size(), gpu_bytes)
    if hint:
        dist.print0(hint)
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
