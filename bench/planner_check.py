"""The memory planner against measured GPU peaks: every FRoD DeepSpeed configuration in step-matrix results.

    python -m bench.planner_check bench/results/train_matrix_4xh200/configs \\
        bench/results/train_step_matrix_1xh200.json --out bench/results/planner_check.json

Inputs are the earlier step matrix's result JSONs (one per file, or a matrix JSON's ``configs`` list). For each FRoD
run under ZeRO-2/3 the planner (``frod_ds.plan.memory.plan_memory``, which reads the model's config fields only) is
given the run's shape, micro-batch × sequence, checkpointing, layer variant and DeepSpeed JSON (as recorded in the
result), and its ``allocated`` prediction is set against the measured ``torch.cuda.max_memory_allocated`` over the
timed steps (the highest rank). Plain-PyTorch runs and LoRA runs are not what the planner models and are skipped.
Writes a JSON and prints a Markdown table with the relative error; the goal is |error| ≤ 15%.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.common import llama_config
from frod_ds.plan.memory import plan_memory
from frod_ds.plan.shapes import GiB, TrainShape, engine_from_ds_config, model_shape_from_config

GOAL = 0.15


def load_runs(paths: list[Path]) -> list[dict]:
    runs = []
    for p in paths:
        files = sorted(p.glob("*.json")) if p.is_dir() else [p]
        for f in files:
            doc = json.loads(f.read_text())
            for d in doc.get("configs", [doc]):
                runs.append({**d, "_file": f.name})
    return runs


def check(d: dict) -> dict | None:
    """The planner's prediction for one measured FRoD DeepSpeed run; None for runs it does not model."""
    if d.get("method") != "frod" or d.get("ds_config") is None or not d.get("peak_allocated_gib"):
        return None
    cfg = llama_config(d)
    f = d.get("frod") or {}
    train = TrainShape(
        micro_batch=d["micro_batch"],
        seq_len=d["seq_len"],
        dtype="bfloat16",
        targets=tuple(d["targets"]),
        sparsity=f.get("sparsity", 0.02),
        quant=d.get("frozen_quant") or "none",
        quantize_base=bool(d.get("quantize_base", False)),
        checkpointing=d["gradient_checkpointing"],
        layer_saves="M" if f.get("impl") == "autograd" else "z",
    )
    variant = {"autograd": "keeps M"}.get(f.get("impl"), "") or (
        "keeps x, modelled as z" if f.get("save") == "x" else ""
    )
    engine = engine_from_ds_config(d["ds_config"], Path(d["config"]).name)
    plan = plan_memory(model_shape_from_config(cfg), train, engine, d["world_size"], 140 * GiB)
    pred, meas = plan.allocated / GiB, d["peak_allocated_gib"]
    return {
        "file": d["_file"],
        "device": d["device"],
        "config": Path(d["config"]).name,
        "gpus": d["world_size"],
        "gradient_checkpointing": d["gradient_checkpointing"],
        "layer_saves": train.layer_saves,
        "frozen_quant": train.quant,
        "variant": variant,
        "measured_gib": meas,
        "predicted_gib": pred,
        "error": pred / meas - 1,
        "parts_gib": {k: v / GiB for k, v in plan.parts.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("inputs", nargs="+", type=Path, help="result JSONs, matrix JSONs or folders of them")
    ap.add_argument("--out", type=Path, default=None, help="write the comparison here (JSON)")
    args = ap.parse_args()
    rows = [r for r in (check(d) for d in load_runs(args.inputs)) if r]
    if not rows:
        raise SystemExit("error: no FRoD DeepSpeed run with a measured peak in the inputs")
    md = ["| run | device | config | GPUs | measured peak GiB | planner GiB | error |", "|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["device"], r["config"], r["gpus"])):
        notes = [
            x
            for x in (
                r["variant"],
                r["frozen_quant"] if r["frozen_quant"] != "none" else "",
                "checkpointing" if r["gradient_checkpointing"] else "",
            )
            if x
        ]
        tag = f" ({', '.join(notes)})" if notes else ""
        md.append(
            f"| {r['file']} | {r['device']} | {r['config']}{tag} "
            f"| {r['gpus']} | {r['measured_gib']:.1f} | {r['predicted_gib']:.1f} | {r['error'] * 100:+.0f}% |"
        )
    within = sum(abs(r["error"]) <= GOAL for r in rows)
    md.append(f"\n{within} of {len(rows)} within ±{GOAL:.0%}")
    text = "\n".join(md)
    print(text)
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "benchmark": "planner_check",
                    "inputs": [str(p) for p in args.inputs],
                    "goal": GOAL,
                    "rows": rows,
                    "table_md": text,
                },
                indent=2,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
