"""``frod export``: an adapter as a merged Hugging Face checkpoint or a stock PEFT adapter; a PEFT adapter imported.

    frod export --checkpoint runs/llama2-7b-cs170k/adapter-final --out exports/llama2-7b-frod
    frod export --checkpoint runs/x/adapter-final --format peft --out exports/x-peft
    frod export --from-peft peft/my-frod-adapter --base-model meta-llama/Llama-2-7b-hf --out imports/x

``--from-peft`` writes ``OUT/factor-store`` and ``OUT/adapter`` (``frod eval --checkpoint OUT/adapter``). The base
model and factor store are the adapter's own unless given. Exit codes: 0 ok, 2 bad input (one ``error:`` line).
"""

from __future__ import annotations

import argparse

from frod_ds.runtime.cli_parser import Parser, input_path, output_dir


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(
        allow_abbrev=False,
        prog="frod export",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--checkpoint", type=input_path, help="adapter directory written by training (adapter-<step> or adapter-final)"
    )
    src.add_argument(
        "--from-peft", type=input_path, metavar="PEFT_DIR", help="import this stock PEFT FRoD adapter directory instead"
    )
    p.add_argument("--out", required=True, type=output_dir, help="output directory (created; see --overwrite)")
    p.add_argument(
        "--format",
        choices=("hf", "peft"),
        default=None,
        help="with --checkpoint: hf (merged transformers checkpoint, default) or peft (stock PEFT adapter)",
    )
    p.add_argument(
        "--base-model",
        type=input_path,
        default=None,
        help="base model (directory or Hub id); default: the one the adapter's config names",
    )
    p.add_argument(
        "--factor-store",
        type=input_path,
        default=None,
        help="--checkpoint: override the adapter's factor store directory",
    )
    p.add_argument(
        "--dtype", default=None, help="--format hf: auto (keep each tensor's dtype), bfloat16, float16 or float32"
    )
    p.add_argument(
        "--shard-gb", type=float, default=None, help="--format hf: size of one output shard, GiB (default 5)"
    )
    p.add_argument(
        "--peft-tol",
        type=float,
        default=None,
        help="--format peft: largest relative error of a member's update ‖ΔW‖ allowed when S's support is "
        "kept sparse in PEFT's basis (default 1e-3; see README)",
    )
    p.add_argument("--device", default="cpu", help="where merges / basis changes are computed (cpu, cuda)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier output of this command at --out")
    return p.parse_args(argv)


def check_args(args: argparse.Namespace) -> list[str]:
    """Flags that do not apply to the chosen direction and format."""
    problems = []
    fmt = args.format or "hf"
    if args.from_peft and args.format:
        problems.append("--format applies to --checkpoint only (--from-peft writes a factor store and an adapter)")
    if args.from_peft and args.factor_store:
        problems.append("--factor-store applies to --checkpoint only (--from-peft writes its own)")
    if (args.from_peft or fmt == "peft") and (args.dtype is not None or args.shard_gb is not None):
        problems.append("--dtype/--shard-gb apply to --format hf only")
    if args.peft_tol is not None and (args.from_peft or fmt != "peft"):
        problems.append("--peft-tol applies to --format peft only")
    from frod_ds.runtime.validate import device_problem

    device = device_problem(args.device)
    if device:
        problems.append(device)
    return problems


def quiet_libraries() -> None:
    """The PEFT paths load models through transformers and peft: keep their progress bars, deprecation notes and
    optional-kernel notices off the terminal, so the output is this command's lines (and one ``error:`` line)."""
    import logging
    import warnings

    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # imported by peft; warns about optional kernels
    warnings.filterwarnings("ignore", category=UserWarning, module=r"(peft|torch)(\.|$)")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"transformers(\.|$)")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def export(args: argparse.Namespace) -> int:
    from frod_ds.runtime.errors import ExportError

    problems = check_args(args)
    if problems:
        raise ExportError("; ".join(problems))
    from frod_ds.runtime import deepspeed_state

    # transformers' save_pretrained imports DeepSpeed, which reads DS_ACCELERATOR
    deepspeed_state.check_accelerator(device=False)
    if args.from_peft or args.format == "peft":
        quiet_libraries()
    if args.from_peft:
        from frod_ds.interop.peft_import import import_peft

        rep = import_peft(args.from_peft, args.out, base_model=args.base_model, overwrite=args.overwrite)
        print(
            f"imported {args.from_peft} -> {args.out}/factor-store + {args.out}/adapter (max weight difference "
            f"{rep['max_weight_error']:.1e} relative to stock PEFT's)",
            flush=True,
        )
    elif args.format == "peft":
        from frod_ds.interop.peft_export import export_peft

        rep = export_peft(
            args.checkpoint,
            args.out,
            base_model=args.base_model,
            factor_store=args.factor_store,
            tol=1e-3 if args.peft_tol is None else args.peft_tol,
            device=args.device,
            overwrite=args.overwrite,
        )
        for cat, c in rep["categories"].items():
            print(
                f"  {cat:>10}: tau {c['tau']:g}, S nnz {c['nnz_frod']} -> {c['nnz_peft']}, update error "
                f"{c['max_update_error']:.1e}, weight error {c['max_weight_error']:.1e}",
                flush=True,
            )
        print(
            f"exported {args.checkpoint} -> {args.out} (loads with peft.PeftModel.from_pretrained(base, "
            f"{str(args.out)!r}))",
            flush=True,
        )
    else:
        from frod_ds.interop.hf_export import export_transformers

        out = export_transformers(
            args.checkpoint,
            args.out,
            base_model=args.base_model,
            factor_store=args.factor_store,
            dtype=args.dtype or "auto",
            shard_gb=5.0 if args.shard_gb is None else args.shard_gb,
            device=args.device,
            overwrite=args.overwrite,
        )
        print(
            f"exported {args.checkpoint} -> {out} (loads with transformers.AutoModelForCausalLM.from_pretrained)",
            flush=True,
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from frod_ds.runtime import entry

    return entry.run(lambda: export(args), init_group=False)


if __name__ == "__main__":  # as `frod export` runs
    from frod_ds.cli.main import module_main

    module_main("export")
