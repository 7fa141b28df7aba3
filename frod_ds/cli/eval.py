"""``frod eval``: score a model on the commonsense tasks: per-task accuracy, a table beside the paper, per-row
predictions (docs/eval.md).

Reads ``<data>/eval/<task>.jsonl`` (``frod data build``'s output) and writes ``results.json``, ``results.md``
and ``predictions.jsonl`` to ``--output`` all at once (a failed run leaves no partial results). Several ranks
each score whole batches; rank 0 gathers and writes the same numbers for any rank count. The run itself is
``frod_ds.eval.run``.
"""

from __future__ import annotations

import argparse

from frod_ds.runtime.cli_parser import Parser, input_path, output_path

EXAMPLES = """examples:
  # a FRoD adapter (base model and factor store from its adapter_config.json; --base-model, --factor-store
  # where they moved since training)
  frod eval --checkpoint out/run1/adapter-final --data data/cs170k --tasks all --output out/run1/eval
  # a plain HF model dir or Hub id: a merged export, or the untouched base model as a baseline
  frod eval --model meta-llama/Llama-2-7b-hf --data data/cs170k --tasks boolq,piqa --output out/base/eval
  # log-likelihood and LLM-Adapters' protocol (the published PEFT numbers' scoring) in one table
  frod eval --checkpoint out/run1/adapter-final --data data/la --mode loglik,llm-adapters --output out/run1/eval
  # greedy generation on 50 rows per task
  frod eval --model out/run1/merged --data data/cs170k --mode generate --limit 50 --output out/run1/eval-gen
  # several ranks
  torchrun --nproc-per-node 8 --no-python frod eval --checkpoint out/run1/adapter-final --data data/cs170k \\
      --output out/run1/eval
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(
        allow_abbrev=False,
        prog="frod eval",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    model = p.add_argument_group("model (exactly one of --checkpoint, --model)")
    model.add_argument(
        "--checkpoint", type=input_path, help="FRoD adapter checkpoint dir (e.g. out/run1/adapter-final)"
    )
    model.add_argument(
        "--base-model", type=input_path, help="override the base model named in the checkpoint's adapter_config.json"
    )
    model.add_argument(
        "--factor-store",
        type=input_path,
        help="override the factor store named in the checkpoint's adapter_config.json",
    )
    model.add_argument("--model", help="plain HF model dir or Hub id (a merged export, or a base model for a baseline)")
    model.add_argument("--tokenizer", help="tokenizer dir or Hub id for --model (default: the --model path)")
    p.add_argument(
        "--data",
        type=input_path,
        required=True,
        help="frod data build's output dir; rows are read from <data>/eval/<task>.jsonl",
    )
    p.add_argument("--tasks", default="all", help="'all' or a comma list, e.g. boolq,piqa,arc_easy")
    p.add_argument(
        "--output", type=output_path, required=True, help="dir for results.json, results.md and predictions.jsonl"
    )
    p.add_argument(
        "--mode",
        default="loglik",
        help="one or a comma list of: loglik (argmax of the choices' summed "
        "log-probs), generate (greedy decoding, the earliest answer string in the output is the prediction), "
        "llm-adapters (LLM-Adapters' protocol: beam search of 4, 32 new tokens, first answer word)",
    )
    p.add_argument("--max-new-tokens", type=int, default=16, help="generate mode: tokens decoded per row")
    p.add_argument(
        "--batch-size", type=int, default=8, help="rows per forward pass (loglik scores all their choices at once)"
    )
    p.add_argument("--limit", type=int, help="score only the first N rows of each task (quick runs)")
    p.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="model dtype; auto = bfloat16 on CUDA, float32 on CPU",
    )
    p.add_argument(
        "--local_rank",
        "--local-rank",
        type=int,
        default=None,
        help="set by the deepspeed launcher; ignored (LOCAL_RANK from the environment is used)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from frod_ds.eval.run import EvalConfig, run
    from frod_ds.runtime import entry

    return entry.run(lambda: run(EvalConfig.from_namespace(args)))


if __name__ == "__main__":  # as `frod eval` runs
    from frod_ds.cli.main import module_main

    module_main("eval")
