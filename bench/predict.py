"""The planner's predictions for a suite's FRoD configurations, written before they are measured.

``python -m bench predict SUITE`` writes ``<results>/<suite>/predictions.json``: per configuration the step time
(``frod_ds.plan.step_time``) and the peak allocated memory per GPU (``frod_ds.plan.memory``) the planner gives for
its shape, micro-batch, engine and GPU count, with the commit they came from. The report sets each measured record
beside its prediction. LoRA and the torch-only multi-GPU engines (DDP, FSDP2) are not modelled.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from bench.kinds import shapes, step
from bench.record import commit, now
from bench.suite import Suite

__all__ = ["PREDICTIONS", "predict", "write_predictions", "read_predictions"]

PREDICTIONS = "predictions.json"
MODELLED = ("plain", "zero2", "zero3", "z3layers", "fshard")


def _engine(s: dict[str, Any]):
    from frod_ds.plan.shapes import engine_from_ds_config

    cfg = step.ds_config({**s, "engine": "zero2" if s["engine"] == "plain" else s["engine"]}, s["gpus"])
    if s["engine"] == "fshard":  # zero2.json's ZeRO-2 for σ and S, the frozen weights partitioned by unit
        engine = engine_from_ds_config(cfg, "fshard")
        return dataclasses.replace(engine, stage=3, layers=True, peer=s["gather"] != "collective")
    partition = {"zero3": "deepspeed", "z3layers": "layers"}.get(s["engine"], "auto")
    return engine_from_ds_config(cfg, s["engine"], partition, s["gather"])


def predict(s: dict[str, Any]) -> dict[str, float] | None:
    """``{"step_s", "peak_allocated_gib"}`` for step configuration ``s``; None where the planner has no model."""
    from frod_ds.plan.memory import plan_memory
    from frod_ds.plan.shapes import GiB, TrainShape, model_shape_from_config
    from frod_ds.plan.step_time import step_time

    if s["method"] != "frod" or s["engine"] not in MODELLED:
        return None
    sh = shapes.SHAPES[s["shape"]]
    model = model_shape_from_config(
        {
            "model_type": "llama",
            "hidden_size": sh.hidden,
            "intermediate_size": sh.inter,
            "num_hidden_layers": sh.layers,
            "num_attention_heads": sh.heads,
            "num_key_value_heads": sh.kv_heads,
            "vocab_size": sh.vocab,
        }
    )
    train = TrainShape(micro_batch=s["batch"], seq_len=s["seq"], checkpointing=s["gc"], sparsity=s["sparsity"])
    engine = _engine(s)
    plan = plan_memory(model, train, engine, s["gpus"], 141 * GiB)
    t = step_time(model, train, engine, s["gpus"], plain=s["engine"] == "plain")
    return {"step_s": t.seconds, "peak_allocated_gib": plan.allocated / GiB}


def write_predictions(results: Path, suite: Suite) -> Path:
    """Predict every modelled configuration of ``suite``; an existing file's entries for other configurations stay
    (a prediction is written once, before its measurement, and not rewritten after it)."""
    path = Path(results) / suite.name / PREDICTIONS
    doc = read_predictions(results, suite.name)
    made = {"commit": commit(), "date": now()}
    for c in suite.configs:
        p = predict(c.settings)
        if p is not None and c.name not in doc:
            doc[c.name] = {**p, **made, "settings": c.settings}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return path


def read_predictions(results: Path, suite: str) -> dict[str, dict[str, Any]]:
    path = Path(results) / suite / PREDICTIONS
    return json.loads(path.read_text()) if path.is_file() else {}
