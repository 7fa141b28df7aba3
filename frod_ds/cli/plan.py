"""``frod plan``: per-GPU memory of FRoD training and the fastest set-up that fits (reads config.json only).

    frod plan --model meta-llama/Llama-2-7b-hf --gpus 1
    frod plan --model /ckpt/llama-2-70b --gpus 2 --config ds_configs/zero3.json \\
        --recipe recipes/llama2_7b_cs170k.yaml model.frozen_quant=nf4 model.gradient_checkpointing=true

Exit codes: 0 the planned set-up fits, 1 it does not (or nothing does), 2 user error (one ``error:`` line).
"""

from __future__ import annotations

import argparse

from frod_ds.runtime.cli_parser import Parser, input_path

GiB = 2**30
H100_GIB = 79.1  # torch.cuda.get_device_properties(0).total_memory of an 80 GB H100, in GiB


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ap = Parser(
        allow_abbrev=False, prog="frod plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model", required=True, help="checkpoint directory or Hub id (local cache only); config.json is read"
    )
    p.add_argument("--gpus", type=int, required=True, help="data-parallel GPUs (ranks)")
    p.add_argument(
        "--gpu-mem",
        type=float,
        default=H100_GIB,
        help=f"memory of one GPU in GiB as torch reports it (default {H100_GIB}: an 80 GB H100)",
    )
    p.add_argument(
        "--recipe",
        type=input_path,
        default=None,
        help="YAML recipe: micro-batch, cutoff_len, targets, sparsity, dtype, "
        "checkpointing, frozen_quant (defaults: the recipe defaults)",
    )
    p.add_argument(
        "--config",
        type=input_path,
        default=None,
        help="plan this DeepSpeed JSON; without it, plan the recommended set-up",
    )
    p.add_argument("--seq-len", type=int, default=None, help="tokens per example (default: the recipe's cutoff_len)")
    p.add_argument(
        "--layer-saves",
        choices=["z", "M"],
        default="z",
        help="what FRoDLinear keeps for its backward: z (autograd Function) or z and the dense M (the "
        "plain-autograd layer)",
    )
    p.add_argument("overrides", nargs="*", help="dotted recipe overrides, e.g. model.frozen_quant=nf4")
    args = ap.parse_args(argv)
    from frod_ds.config.recipe import MAX_INT

    if args.gpus < 1:
        ap.error(f"--gpus must be an integer >= 1 (GPUs per node), got {args.gpus}")
    if not args.gpu_mem > 0 or args.gpu_mem == float("inf"):  # nan compares false
        ap.error(f"--gpu-mem must be a finite number of GiB > 0 (memory per GPU), got {args.gpu_mem}")
    if args.seq_len is not None and not 1 <= args.seq_len <= MAX_INT:
        got = str(args.seq_len) if len(str(args.seq_len)) < 20 else f"a {len(str(args.seq_len))}-digit number"
        ap.error(f"--seq-len must be between 1 and {MAX_INT} tokens, got {got}")
    return args


def _gib(x: float) -> str:
    return f"{x / GiB:8.2f}"


def print_plan(plan, title: str, model=None) -> None:
    print(title)
    for part, b in plan.parts.items():
        print(f"  {part:<24}{_gib(b)} GiB")
    print(f"  {'total allocated':<24}{_gib(plan.allocated)} GiB")
    from frod_ds.plan.memory import CUDA_CONTEXT_GIB, FRAGMENTATION

    verdict = "fits" if plan.fits else "does NOT fit"
    print(
        f"  needed (+{FRAGMENTATION:.0%} allocator, +{CUDA_CONTEXT_GIB:.1f} GiB CUDA/NCCL): "
        f"{plan.needed / GiB:.1f} of {plan.gpu_bytes / GiB:.1f} GiB per GPU: {verdict}"
    )
    if model is not None:
        from frod_ds.plan.step_time import DISK_BYTES_PER_S, NVLINK, rank_threads, step_time

        t = step_time(model, plan.train, plan.engine, plan.gpus, NVLINK)
        parts = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in t.parts.items() if v >= 5e-4)
        print(
            f"  predicted step on H100/H200-class GPUs with NVLink: {t.seconds * 1e3:.0f} ms ({parts}; the model: "
            "frod_ds/plan/step_time.py, checked in bench/results/time_model_check.md)"
        )
        if plan.engine.param_on_disk:
            print(
                f"  its offload term reads the frozen weights from disk at {DISK_BYTES_PER_S / 1e9:.1f} GB/s each "
                "pass (a measured local disk); a faster drive shortens it in proportion"
            )
        if plan.engine.offload_optimizer:
            n = rank_threads(NVLINK, plan.gpus)
            threads = f"every core ({n} assumed)" if n > 1 else "one per rank"
            print(
                f"  its CPU optimizer term runs on the host with torchrun's OpenMP threads, {threads}; OMP_NUM_THREADS "
                "sets them (the deepspeed launcher gives every rank every core), and steps with it vary from run to "
                "run (bench/results/time_model_check.md)"
            )
    if plan.host_bytes:
        print(
            f"  offloaded to host memory (all ranks of a node together): {plan.host_bytes / GiB:.1f} GiB"
            + (" (NVMe: parameters on disk, host keeps buffers)" if plan.engine.param_on_disk else "")
        )
    other = "with" if not plan.train.checkpointing else "without"
    print(
        f"  activations {other} gradient checkpointing: {plan.activations_other / GiB:.2f} GiB "
        f"(instead of {plan.parts['activations'] / GiB:.2f})"
    )


def plan_command(args: argparse.Namespace) -> int:
    from frod_ds.config.ds_config import DSConfigError, check_ds_config, load_ds_config, resolve_ds_config
    from frod_ds.config.recipe import recipe_from_tree, recipe_tree, sets
    from frod_ds.core.names import LLAMA_LINEARS
    from frod_ds.core.sizes import empty_support
    from frod_ds.plan.memory import plan_memory, trainable_numel
    from frod_ds.plan.recommend import frozen_label, no_fit_advice, recommend
    from frod_ds.plan.shapes import (
        ELEMENT_BYTES,
        PlanError,
        engine_from_ds_config,
        load_model_shape,
        train_shape_from_recipe,
    )

    model = load_model_shape(args.model)
    tree = recipe_tree(args.recipe, args.overrides)
    recipe = recipe_from_tree(tree, paths=False)
    train = train_shape_from_recipe(recipe, args.layer_saves, args.seq_len)
    unknown = [t for t in train.targets if t not in LLAMA_LINEARS]
    if unknown:
        raise PlanError(f"model.targets {unknown} are not LLaMA linears ({' '.join(LLAMA_LINEARS)})")
    for t in train.targets:  # what frod train refuses before it starts (S with no entry to train)
        problem = empty_support(t, model.linear(t)[1], train.sparsity)
        if problem:
            raise PlanError(problem)
    gpu = args.gpu_mem * GiB
    print(
        f"{args.model}: {model.model_type}, hidden {model.hidden}, intermediate {model.intermediate}, "
        f"{model.layers} layers, {model.heads}/{model.kv_heads} heads, vocab {model.vocab}: "
        f"{model.parameters / 1e9:.2f}B parameters"
    )
    print(
        f"FRoD on {' '.join(train.targets)}, density {train.sparsity}: {trainable_numel(model, train) / 1e6:.1f}M "
        f"trainable; {train.micro_batch} x {train.seq_len} tokens per GPU, {train.dtype} "
        f"({ELEMENT_BYTES[train.dtype]} bytes), FRoDLinear keeps {'z and M' if train.layer_saves == 'M' else 'z'}"
    )
    chosen = train.checkpointing if sets(tree, "model.gradient_checkpointing") else None  # the user's, kept
    rec = recommend(model, train, args.gpus, gpu, checkpointing=chosen)
    code = 0
    if args.config:
        cfg = load_ds_config(args.config)
        check_ds_config(cfg, args.config)
        try:  # what training on --gpus would refuse besides: batch sizes, bf16, clipping against the recipe
            resolve_ds_config(cfg, recipe, args.gpus)
        except DSConfigError as e:
            raise DSConfigError(str(e).replace("DeepSpeed config:", f"DeepSpeed config {args.config}:", 1)) from None
        t = recipe.train
        engine = engine_from_ds_config(cfg, args.config, t.zero3_partition, t.zero3_gather)
        plan = plan_memory(model, train, engine, args.gpus, gpu)
        if engine.layers and (args.gpus > 1 or engine.offload_param):  # how the gathers are planned (training.md)
            how = "copies out of the other GPUs' memory (one machine)" if engine.peer else "NCCL all-gathers"
            where = ", shards in host memory (offload_param)" if engine.offload_param else ""
            print(f"\n{args.config}: frozen weights partitioned by decoder layer{where}, gathered by {how}")
        q = frozen_label(train)
        print_plan(
            plan,
            f"\n{args.config} on {args.gpus} GPU(s), {q}, gradient checkpointing "
            f"{'on' if train.checkpointing else 'off'}:",
            model,
        )
        code = 0 if plan.fits else 1
    elif rec is not None:
        print_plan(rec.plan, f"\n{rec.describe()} on {args.gpus} GPU(s):", model)
    if rec is None:
        print(f"\nnothing fits, not even with offload and NF4: {no_fit_advice(model, train, args.gpus, gpu)}")
        return 1
    print(f"\nfastest set-up that fits: {rec.describe()} — {rec.reason}")
    return code


def main(argv: list[str] | None = None) -> int:
    from frod_ds.runtime import entry

    args = parse_args(argv)
    return entry.run(lambda: plan_command(args), init_group=False)  # user errors: one ``error:`` line, exit 2


if __name__ == "__main__":  # as `frod plan` runs
    from frod_ds.cli.main import module_main

    module_main("plan")
