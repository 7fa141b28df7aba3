"""Export a FRoD adapter as a plain Hugging Face checkpoint (merged weights; loads with stock transformers).

    python launch/export.py --checkpoint runs/llama2-7b-cs170k/adapter-final --out exports/llama2-7b-frod
    python launch/export.py --checkpoint runs/x/adapter-final --out exports/x --dtype bfloat16 --device cuda

The base model and factor store come from the adapter's ``adapter_config.json`` unless ``--base-model`` /
``--factor-store`` say otherwise. Exit codes: 0 ok, 2 bad input (one ``error:`` line).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # `python launch/export.py`: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="adapter directory written by training (adapter-<step> or adapter-final)")
    p.add_argument("--out", required=True, type=Path, help="directory for the merged Hugging Face checkpoint")
    p.add_argument("--base-model", default=None, help="override the adapter's base model (directory or Hub id)")
    p.add_argument("--factor-store", default=None, help="override the adapter's factor store directory")
    p.add_argument("--dtype", default="auto", help="auto (keep each tensor's dtype), bfloat16, float16 or float32")
    p.add_argument("--shard-gb", type=float, default=5.0, help="size of one output shard, GiB")
    p.add_argument("--device", default="cpu", help="where the merges are computed (cpu, cuda)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    return p.parse_args(argv)


def export(args: argparse.Namespace) -> int:
    from frod_ds.export import export_transformers

    out = export_transformers(args.checkpoint, args.out, base_model=args.base_model, factor_store=args.factor_store,
                              dtype=args.dtype, shard_gb=args.shard_gb, device=args.device, overwrite=args.overwrite)
    print(f"exported {args.checkpoint} -> {out} (loads with transformers.AutoModelForCausalLM.from_pretrained)", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from frod_ds import entry

    return entry.run(lambda: export(args), init_group=False)


if __name__ == "__main__":
    sys.exit(main())
