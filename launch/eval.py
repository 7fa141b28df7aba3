"""Score a model on the commonsense tasks: per-task accuracy, a table beside the paper, per-row predictions.

    # a FRoD adapter checkpoint (base model and factor store from its adapter_config.json)
    python launch/eval.py --checkpoint out/run1/adapter-final --data data/cs170k --tasks all --output out/run1/eval
    # ... with the base model / factor store moved since training
    python launch/eval.py --checkpoint out/run1/adapter-final --base-model models/llama2-7b \\
        --factor-store factors/llama2-7b --data data/cs170k --tasks all --output out/run1/eval
    # a plain HF model dir or Hub id: a merged export, or the untouched base model as a baseline
    python launch/eval.py --model meta-llama/Llama-2-7b-hf --data data/cs170k --tasks boolq,piqa --output out/base/eval
    # greedy generation instead of log-likelihood; a quick look at 50 rows per task
    python launch/eval.py --model out/run1/merged --data data/cs170k --mode generate --limit 50 --output out/run1/eval-gen
    # data-parallel: each rank scores whole batches, rank 0 gathers and writes (same numbers for any rank count)
    torchrun --nproc_per_node 8 launch/eval.py --checkpoint out/run1/adapter-final --data data/cs170k --output out/run1/eval
    deepspeed --num_gpus 8 launch/eval.py --checkpoint out/run1/adapter-final --data data/cs170k --output out/run1/eval

Reads ``<data>/eval/<task>.jsonl`` (data_prep's output). Writes to ``--output``: ``results.json``,
``results.md`` (the table, also printed) and ``predictions.jsonl`` (one record per row, in file
order). The files are written to a temporary directory and renamed into place, so a failed run
leaves no partial results. User mistakes print one ``error: ...`` line and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from frod_ds import distributed as dist
from frod_ds.evaluation import EvalError, plan_batches, score_generate_rows, score_loglik_rows
from frod_ds.scoring import markdown_table, summarize

MODES = ("loglik", "generate")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    model = p.add_argument_group("model (exactly one of --checkpoint, --model)")
    model.add_argument("--checkpoint", help="FRoD adapter checkpoint dir (e.g. out/run1/adapter-final)")
    model.add_argument("--base-model", help="override the base model named in the checkpoint's adapter_config.json")
    model.add_argument("--factor-store", help="override the factor store named in the checkpoint's adapter_config.json")
    model.add_argument("--model", help="plain HF model dir or Hub id (a merged export, or a base model for a baseline)")
    model.add_argument("--tokenizer", help="tokenizer dir or Hub id for --model (default: the --model path)")
    p.add_argument("--data", required=True, help="data_prep output dir; rows are read from <data>/eval/<task>.jsonl")
    p.add_argument("--tasks", default="all", help="'all' or a comma list, e.g. boolq,piqa,arc_easy")
    p.add_argument("--output", required=True, help="dir for results.json, results.md and predictions.jsonl")
    p.add_argument("--mode", choices=MODES, default="loglik", help="loglik: argmax of the choices' summed log-probs; "
                   "generate: greedy decoding, the earliest answer string in the output is the prediction")
    p.add_argument("--max-new-tokens", type=int, default=16, help="generate mode: tokens decoded per row")
    p.add_argument("--batch-size", type=int, default=8, help="rows per forward pass (loglik scores all their choices at once)")
    p.add_argument("--limit", type=int, help="score only the first N rows of each task (quick runs)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="model dtype; auto = bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None,
                   help="set by the deepspeed launcher; ignored (LOCAL_RANK from the environment is used)")
    return p.parse_args(argv)


def validate_args(args: argparse.Namespace) -> None:
    """Raise EvalError listing every problem with the flags."""
    problems = []
    if bool(args.checkpoint) == bool(args.model):
        problems.append("pass exactly one of --checkpoint (FRoD adapter) or --model (plain HF model)")
    if args.model and (args.base_model or args.factor_store):
        problems.append("--base-model/--factor-store apply to --checkpoint only")
    if args.checkpoint and args.tokenizer:
        problems.append("--tokenizer applies to --model only (an adapter checkpoint brings its tokenizer)")
    for flag, value in (("--batch-size", args.batch_size), ("--max-new-tokens", args.max_new_tokens), ("--limit", args.limit)):
        if value is not None and value < 1:
            problems.append(f"{flag} must be >= 1, got {value}")
    if Path(args.output).exists() and not Path(args.output).is_dir():
        problems.append(f"--output {args.output} exists and is not a directory")
    if problems:
        raise EvalError("; ".join(problems))


def load_task_rows(data: str, tasks_spec: str, limit: int | None) -> dict[str, list[dict[str, Any]]]:
    """``{task: rows}`` from ``<data>/eval/<task>.jsonl``, validated by data_prep's reader.

    Every missing file is reported in one EvalError; a bad row raises ValueError naming file and line.
    """
    from data_prep.io import read_rows
    from data_prep.tasks import parse_tasks

    tasks = parse_tasks(tasks_spec)
    paths = {task: Path(data) / "eval" / f"{task}.jsonl" for task in tasks}
    missing = [str(path) for path in paths.values() if not path.is_file()]
    if missing:
        raise EvalError(f"no eval file {', '.join(missing)}; build it with data_prep or drop the task from --tasks")
    rows = {}
    for task, path in paths.items():
        task_rows = read_rows(path)[:limit]
        if not task_rows:
            raise EvalError(f"{path} has no rows")
        other = [r["task"] for r in task_rows if r["task"] != task]
        if other:
            raise EvalError(f"{path} holds rows of task {other[0]!r}; expected only {task!r}")
        empty = [r["id"] for r in task_rows if not all(r["choices"])]
        if empty:
            raise EvalError(f"{path}: row {empty[0]!r} has an empty answer string in 'choices'")
        rows[task] = task_rows
    return rows


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def load_model(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> tuple[torch.nn.Module, Any]:
    """(model in eval mode on `device`, tokenizer) from --checkpoint (FRoD adapter) or --model (plain HF)."""
    from frod_ds import adapter

    if args.checkpoint:
        if not adapter.is_adapter_checkpoint(args.checkpoint):
            raise EvalError(f"--checkpoint {args.checkpoint} is not a FRoD adapter checkpoint (no adapter_config.json); "
                            "pass a plain HF model with --model")
        model, tokenizer = adapter.load_frod_model(args.checkpoint, base_model=args.base_model,
                                                   factor_store=args.factor_store, dtype=dtype, device=str(device))
    else:
        if adapter.is_adapter_checkpoint(args.model):
            raise EvalError(f"--model {args.model} is a FRoD adapter checkpoint; pass it with --checkpoint")
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device)
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    return model.eval(), tokenizer


def evaluate_shard(model: torch.nn.Module, tokenizer: Any, rows: dict[str, list[dict[str, Any]]],
                   args: argparse.Namespace) -> list[dict[str, Any]]:
    """Prediction records of this rank's batches (batches strided over ranks), each with its row ``index``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    pad_id = next(i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if i is not None)
    records = []
    for task, task_rows in rows.items():
        batches = plan_batches(task_rows, args.batch_size)[rank::world]
        with tqdm(total=sum(map(len, batches)), desc=f"{task} (rank 0 of {world})" if world > 1 else task,
                  unit="row", disable=not dist.is_main(), dynamic_ncols=True) as bar:
            for batch in batches:
                batch_rows = [task_rows[i] for i in batch]
                if args.mode == "loglik":
                    scored = score_loglik_rows(model, tokenizer, batch_rows, pad_id)
                else:
                    scored = score_generate_rows(model, tokenizer, batch_rows, pad_id, args.max_new_tokens)
                records += [{"index": i, **record} for i, record in zip(batch, scored)]
                bar.update(len(batch))
    return records


def write_outputs(output: Path, files: dict[str, str]) -> None:
    """Write `files` into a temporary sibling of `output`, then rename them into place."""
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.tmp-", dir=output.parent))
    try:
        for name, text in files.items():
            (tmp / name).write_text(text, encoding="utf-8")
        if output.is_dir():
            for name in files:
                os.replace(tmp / name, output / name)
            tmp.rmdir()
        else:
            tmp.rename(output)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def report(args: argparse.Namespace, tasks: list[str], records: list[dict[str, Any]]) -> None:
    """Rank 0: results.json, results.md and predictions.jsonl from all ranks' records."""
    order = {task: k for k, task in enumerate(tasks)}
    records = sorted(records, key=lambda r: (order[r["task"]], r["index"]))
    results = summarize(records, tasks, args.mode)
    results["config"] = {
        "mode": args.mode,
        "checkpoint": args.checkpoint,
        "base_model": args.base_model,
        "factor_store": args.factor_store,
        "model": args.model,
        "data": args.data,
        "limit": args.limit,
        "batch_size": args.batch_size,
        "max_new_tokens": args.max_new_tokens if args.mode == "generate" else None,
        "dtype": args.dtype,
        "world_size": dist.get_world_size(),
    }
    title = f"Commonsense accuracy, {args.mode}: {args.checkpoint or args.model}"
    table = markdown_table(results, title=title)
    write_outputs(Path(args.output), {
        "results.json": json.dumps(results, indent=2) + "\n",
        "results.md": table,
        "predictions.jsonl": "".join(json.dumps(r) + "\n" for r in records),
    })
    dist.print0(table)
    dist.print0(f"wrote {args.output}/results.json, results.md, predictions.jsonl")


def run(args: argparse.Namespace) -> None:
    validate_args(args)  # the checks up to the model load give every rank the same outcome
    rows = load_task_rows(args.data, args.tasks, args.limit)
    device = dist.local_device()
    model, tokenizer = load_model(args, device, resolve_dtype(args.dtype, device))
    try:
        records = evaluate_shard(model, tokenizer, rows, args)
    except (ValueError, OSError) as exc:
        exc.rank_local = True  # a row only this rank scores: its error is printed here, not on rank 0
        raise
    shards = dist.all_gather_object(records)
    failure = None
    if dist.is_main():
        try:
            report(args, list(rows), [r for shard in shards for r in shard])
        except Exception as exc:
            failure = exc
    message = dist.broadcast_object(None if failure is None else f"cannot write results to {args.output}: {failure}")
    if failure is not None:
        raise failure  # rank 0: an OSError becomes the error line, anything else its traceback
    if message:
        raise EvalError(message)  # the other ranks exit with rank 0's outcome


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dist.init_distributed()
    try:
        run(args)
    except (ValueError, OSError) as exc:  # EvalError, data_prep's row errors, missing model files
        local = getattr(exc, "rank_local", False)
        if dist.is_main() or local:
            where = f"(rank {dist.get_rank()}) " if local and dist.get_world_size() > 1 else ""
            print(f"error: {where}{' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    finally:
        dist.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
