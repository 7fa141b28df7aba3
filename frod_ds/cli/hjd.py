"""``frod hjd``: decompose a base model's targeted weights once, into a factor store (docs/hjd.md).

Rerunning a killed run with the same arguments skips the categories already complete; ``--categories`` builds
the store one part at a time (runs adding to one store must agree on its settings). On CPU each rank takes its
share of the cores, with passive OpenMP waits unless OMP_* is set. Exit codes: 0 ok, 2 user error (one
``error:`` line from rank 0), 1 verification failed; under torchrun any failing worker makes it exit 1.
"""

from __future__ import annotations

import time

PROCESS_START = time.time()  # before the imports: start-up time is reported

import argparse  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

from frod_ds.core.names import LLAMA_LINEARS  # noqa: E402
from frod_ds.hjd.sharding import DEFAULT_TARGETS, readahead_budget, start_readahead  # noqa: E402  (no torch yet)
from frod_ds.runtime.cli_parser import Parser, input_dir, output_dir, seed_int  # noqa: E402
from frod_ds.runtime.launch_env import ranks_on_this_node  # noqa: E402

EXAMPLES = """examples:
  frod hjd --model meta-llama/Llama-2-7b-hf --out factors/llama2-7b
  frod hjd --model /ckpt/tiny --out factors/tiny --device cpu
  frod hjd --model /ckpt/70b-q-only --out factors/70b-nf4 --quant nf4 --categories q_proj
  frod hjd --verify factors/llama2-7b --model meta-llama/Llama-2-7b-hf
  torchrun --nproc-per-node 8 --no-python frod hjd --model /ckpt/llama-2-70b --out factors/llama2-70b
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(
        allow_abbrev=False,
        prog="frod hjd",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model", required=True, help="local checkpoint directory (config.json + *.safetensors) or HF Hub id"
    )
    p.add_argument("--out", type=output_dir, help="factor store directory to create or resume (shared by all ranks)")
    p.add_argument(
        "--verify",
        type=input_dir,
        metavar="DIR",
        help="verify the factor store DIR against --model instead of building",
    )
    p.add_argument(
        "--targets",
        nargs="+",
        default=list(DEFAULT_TARGETS),
        help="module names forming one category each across layers (space- or comma-separated)",
    )
    p.add_argument(
        "--categories",
        nargs="+",
        default=None,
        help="only these of --targets in this run (space- or comma-separated), added to the store in --out; "
        "the checkpoint needs only their weights. Default: all targets",
    )
    p.add_argument("--pi", type=float, default=1e-3, help="ridge term π > 0 of T_pi (spec §1)")
    p.add_argument(
        "--dtype", choices=["float32", "float64"], default="float32", help="HJD compute dtype (fp32 runs with TF32 off)"
    )
    p.add_argument(
        "--u-dtype",
        choices=["auto", "float32", "bfloat16", "float16", "float64"],
        default="auto",
        help="dtype U_i is stored in; auto: the checkpoint's. float32 for a bf16 checkpoint keeps the FRoD "
        "model exact at init under fp32 compute (the store's U then takes twice the checkpoint's bytes)",
    )
    p.add_argument(
        "--quant",
        choices=["none", "nf4", "int8"],
        default="none",
        help="store U_i quantized (bitsandbytes NF4, blocks of 64, or int8 per row): a 70B store ~4x (nf4) "
        "smaller; training then needs model.frozen_quant of the same kind",
    )
    p.add_argument(
        "--part-mb",
        type=float,
        default=256.0,
        help="size of one U/sigma part file, MiB; smaller parts overlap writing with computing",
    )
    p.add_argument(
        "--method",
        choices=["auto", "householder"],
        default="auto",
        help="auto: Gram/Cholesky route where the stack is well conditioned, Householder TSQR elsewhere; "
        "householder: always the Householder TSQR",
    )
    p.add_argument(
        "--device-cache-gb",
        type=float,
        default=16.0,
        help="weights and Gram matrices (Householder route: Q blocks) kept on the GPU between passes, GiB",
    )
    p.add_argument(
        "--block-gb",
        type=float,
        default=4.0,
        help="Householder route: largest stack of weights (in the compute dtype) a rank QRs at once, GiB",
    )
    p.add_argument("--io-threads", type=int, default=8, help="threads reading weights (half as many write factors)")
    p.add_argument(
        "--prefetch-gb",
        type=float,
        default=4.0,
        help="weights read ahead of use onto the device, at most this many GiB",
    )
    p.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="auto: the rank's GPU (NCCL) if CUDA is available, else CPU (gloo)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace a store in --out built with another configuration")
    p.add_argument(
        "--no-fsync",
        dest="fsync",
        action="store_false",
        help="skip fsync of factor files (faster; a power loss may then corrupt a store marked complete)",
    )
    p.add_argument(
        "--samples", type=int, default=2, help="--verify: members per category whose reconstruction is checked"
    )
    p.add_argument("--seed", type=seed_int, default=0, help="--verify: seed of the member sample")
    p.add_argument(
        "--tol",
        type=float,
        default=None,
        help="--verify: largest relative reconstruction error (default by U's dtype: bf16 2e-2, fp32 1e-4; "
        "quantized U: nf4 0.2, int8 3e-2)",
    )
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed launcher
    args = p.parse_args(argv)
    args.targets = [t for item in args.targets for t in item.split(",") if t]
    others = [t for t in args.targets if t not in LLAMA_LINEARS]
    if others:  # training takes only these (model.targets): a store of others could never be trained with
        linears = " ".join(LLAMA_LINEARS)
        p.error(f"--targets {' '.join(others)}: not LLaMA decoder linears ({linears}), which training takes")
    if args.categories is not None:
        args.categories = [c for item in args.categories for c in item.split(",") if c]
    if (args.out is None) == (args.verify is None):
        p.error("pass exactly one of --out (build a store) or --verify DIR (check one)")
    if args.samples < 1:  # 0 would check nothing and say OK
        p.error(f"--samples must be an integer >= 1 (members checked per category), got {args.samples}")
    if args.tol is not None and not (math.isfinite(args.tol) and args.tol > 0):  # else every member "fails"
        p.error(f"--tol must be a finite number > 0 (a relative reconstruction error), got {args.tol}")
    given = [f"--{dest}" for dest in ("samples", "seed", "tol") if getattr(args, dest) != p.get_default(dest)]
    if args.verify is None and given:  # a check's settings on a build: the user meant --verify
        what = "is a setting" if len(given) == 1 else "are settings"
        p.error(f"{', '.join(given)} {what} of --verify DIR's checks, which building a store with --out does not run")
    return args


def build(args: argparse.Namespace) -> int:
    import torch

    from frod_ds.hjd.stage import StageConfig, run_stage
    from frod_ds.runtime import distributed as D

    cfg = D.on_all(
        lambda: StageConfig(
            model=args.model,
            out=args.out,
            targets=tuple(args.targets),
            pi=args.pi,
            dtype=getattr(torch, args.dtype),
            block_gb=args.block_gb,
            device_cache_gb=args.device_cache_gb,
            part_mb=args.part_mb,
            device=args.device,
            overwrite=args.overwrite,
            fsync=args.fsync,
            method=args.method,
            io_threads=args.io_threads,
            prefetch_gb=args.prefetch_gb,
            quant=args.quant,
            categories=None if args.categories is None else tuple(args.categories),
            **({} if args.u_dtype == "auto" else {"u_dtype": getattr(torch, args.u_dtype)}),
        )
    )
    manifest = run_stage(cfg, process_start=PROCESS_START)
    if manifest is not None:
        _print_summary(manifest)
    return 0


def verify(args: argparse.Namespace) -> int:
    """Rank 0 checks the store; the other ranks (if any) wait for the verdict."""
    import torch

    from frod_ds.model.store_verify import verify_store
    from frod_ds.runtime import distributed as D

    device = torch.device("cpu") if args.device == "cpu" else D.local_device()
    problems = D.on_main(
        lambda: verify_store(args.verify, args.model, samples=args.samples, seed=args.seed, tol=args.tol, device=device)
    )
    if D.is_main():
        for line in problems:
            print(f"verify: {line}", file=sys.stderr)
        if problems:  # the details above, then the one line a failed check ends with
            from frod_ds.model.store_reader import FactorStore

            what = problems[0] if len(problems) == 1 else f"{len(problems)} problems above"
            build = f"frod hjd --model {args.model} --out {args.verify}"
            unfinished = len(problems) == 1 and not FactorStore.open(args.verify, allow_incomplete=True).complete
            if unfinished:
                todo = f"finish it: {build} resumes"
            elif len(problems) == 1 and "was built from" in what:  # a good store of another model
                todo = "check --model: the store is of the model it was built from (build this one's in another --out)"
            else:
                todo = f"build it again: {build} --overwrite"
            print(
                f"error: factor store {args.verify} failed verification against --model {args.model} ({what}); {todo}",
                file=sys.stderr,
                flush=True,
            )
        else:
            print(f"verify {args.verify}: OK", flush=True)
    return 1 if problems else 0


def _print_summary(manifest) -> None:
    run = manifest.run
    print(
        f"{'category':>10} {'members':>7} {'width':>6} {'route':>11} {'seconds':>8} {'max err':>9} {'stored err':>10}"
    )
    for c, rec in manifest.categories.items():
        if rec.complete:
            print(
                f"{c:>10} {len(rec.members):>7} {rec.width:>6} {rec.method or '?':>11} {rec.seconds:>8.2f} "
                f"{rec.max_error:>9.2e} {rec.max_stored_error:>10.2e}"
            )
    print(
        f"total {run.seconds:.1f} s, world size {run.world_size}, complete: {manifest.complete}"
        + (
            ""
            if manifest.complete
            else f" (missing {', '.join(manifest.missing_categories)}: add them with "
            f"--categories {','.join(manifest.missing_categories)})"
        )
    )
    for r in run.ranks:
        mem = f", peak GPU {r.peak_device_gib:.2f} GiB" if r.peak_device_gib is not None else ""
        print(
            f"  rank {r.rank}: {r.seconds:.1f} s{mem}, peak host RSS {r.peak_host_rss_gib:.2f} GiB, "
            f"read {r.tensors_read} tensors / {r.bytes_read / 2**30:.2f} GiB",
            flush=True,
        )


def _cpu_threading_env(args: argparse.Namespace) -> None:
    """Before torch loads: OpenMP threads of a CPU run sleep while they wait, unless the user chose the
    threading (OMP_NUM_THREADS or OMP_WAIT_POLICY set). Spinning threads lose their core whenever another
    process is busy on it, and every parallel region then waits for them."""
    if args.device != "cuda" and "OMP_NUM_THREADS" not in os.environ:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _set_cpu_threads(args: argparse.Namespace) -> None:
    """CPU runs without OMP_NUM_THREADS: torch's default thread count (the physical cores) divided by the
    ranks on this node, so that srun or the DeepSpeed launcher (which set no OMP_NUM_THREADS, unlike
    torchrun) do not run ranks × cores threads."""
    import torch

    on_cpu = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
    if on_cpu and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, torch.get_num_threads() // ranks_on_this_node()))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _cpu_threading_env(args)
    if args.out is not None:  # the kernel reads this rank's first weights while torch loads
        start_readahead(args.model, args.categories or args.targets, readahead_budget())
    _set_cpu_threads(args)
    from frod_ds.runtime import entry

    return entry.run(lambda: _on_alike_ranks(args), backend="gloo" if args.device == "cpu" else None)


def _on_alike_ranks(args: argparse.Namespace) -> int:
    """``--verify`` or the build, once every rank was found given rank 0's flags (a rank with another --pi would
    write factors the manifest does not describe); refused on all ranks otherwise."""
    from frod_ds.runtime import distributed as D
    from frod_ds.runtime.rank_agreement import check_ranks_agree

    flags = {k.replace("_", "-"): str(v) for k, v in vars(args).items() if k != "local_rank"}
    D.on_all(lambda: check_ranks_agree({"--": flags}, "a launcher passing one rank other flags?"))
    return verify(args) if args.verify is not None else build(args)


if __name__ == "__main__":  # as `frod hjd` runs
    from frod_ds.cli.main import module_main

    module_main("hjd")
