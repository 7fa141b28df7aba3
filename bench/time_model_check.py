"""The planner's step-time model (``frod_ds.plan.step_time``) against every committed FRoD step measurement it models.

    python -m bench.time_model_check     # writes bench/results/time_model_check.json and .md

Each point is a committed step result of the earlier step matrix and the 70B-widths steps (frozen records,
docs/benchmarks.md), the offload run, or a row of ``bench/host_device.py`` (plain steps of 7B- and 70B-width layer
stacks, bf16 / NF4 / int8); the model is given the run's shape, tokens, checkpointing, quantization, DeepSpeed JSON
(as recorded), GPU count and the host's speed (``Link.host``: the H100 machine's host against the H200 machine's,
from their bf16 host probes in ``bench/results/host_device``).

The verdict is per configuration: points the model cannot tell apart (same device, same model inputs, hence the
same prediction) measured in several calls are one configuration, held to the goal by the median of its calls;
every call is listed with its own error and the configuration's call-to-call range. Goal: |prediction ÷ measured
− 1| ≤ ``CHECK_GOAL`` on every configuration held to it. Which constants were read off which points is written
beside each constant in the model's module: a point a constant was fitted on checks the model's form, not the
constant.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path

from bench.common import deepspeed_nvtx, llama_config, trainables_per_decoder_layer
from bench.kinds.shapes import SHAPES
from bench.kinds.synthetic import config_json
from frod_ds.config.ds_config import load_ds_config, zero_stage
from frod_ds.plan.memory import trainable_numel
from frod_ds.plan.shapes import TrainShape, engine_from_ds_config, model_shape_from_config
from frod_ds.plan.step_time import (
    CHECK_GOAL,
    CPU_OPTIMIZER_PARAM_S,
    CPU_OPTIMIZER_THREAD_PARAM_S,
    Link,
    rank_threads,
    step_time,
)

REPO = Path(__file__).resolve().parents[1]

RESULTS = REPO / "bench" / "results"
POINTS = [
    *sorted((RESULTS / "two_gpu_2xh200" / "matrix" / "configs").glob("train_step_frod_*.json")),
    *sorted((RESULTS / "zero3_levers" / "70b_widths").glob("*/seventy_b_step_frod_1gpu*.json")),
    RESULTS / "two_gpu_2xh200" / "70b_bf16_40_layers" / "seventy_b_step_frod.json",
    *sorted((RESULTS / "train_matrix_quant_1xh100").glob("**/configs/train_step_frod_*.json")),
    RESULTS / "offload_7b_1xh100" / "offload_zero3_7b.json",
    *sorted((RESULTS / "two_gpu_2xh200" / "70b_nf4_80_layers").glob("*/seventy_b_step_frod_*.json")),
]
# the DeepCompile calls: their FRoD runs in the shipped layout without DeepCompile
DEEPCOMPILE_CALLS = sorted((RESULTS / "zero3_levers").glob("deepcompile_*_layers/*/frod_*.json"))
HOST_DEVICE = sorted((RESULTS / "host_device").glob("*/host_device.json"))
# frod train's own runs of the chains whose optimizer steps on the CPU: their train and mfu stages
CHAIN_SUITES = (
    "offload-7b-train-2gpu",
    "offload-7b-train-1gpu",
    "offload-7b-phases",
    "offload-7b-rank-check",
    "offload-7b-profile",
    "offload-7b-l16-check",
    "offload-7b-host-probe",
    "offload-7b-pass-check",
)
# A chain run with train.phase_times synchronizes the device at each phase boundary: the host no longer runs ahead
# of the device, a step the model does not describe (its phases are what the CPU optimizer's constants are read off)
PHASE_TIMED = "phase-timed: the device is synchronized at each phase boundary"
PROBED = "the call's probe"
# Reported beside the goal, not held to it, with the reason (none at present)
OUTSIDE: dict[Path, str] = {}
# A measurement whose two windows differ by more than this cannot check a model to 15%
NOISY_SPREAD = 0.15
# the ZeRO-3 levers calls whose FRoD runs differ from the shipped JSONs in DeepSpeed settings only (the model
# reads each run's recorded JSON): the calls since the per-gradient bf16 check became a lever
LEVER_CALLS = sorted((RESULTS / "zero3_levers").glob("zero3_levers_*_2026112[7-9]T*.json"))
# build changes the model lacks (one σ and one S Parameter per FRoD layer it has: flat_trainables;
# one U per FRoD layer too: zero3_flat_frozen)
MODEL_LEVERS = ("v_partitioned", "leaf_modules", "per_module_fetch", "compile")
# the 70B chain's recipe at --shape 7b (the offload run records the step time, not the shape): full-depth 7B,
# micro-batch 4, cutoff 256, checkpointing, bf16, FRoD s=0.02 on the six targets
SEVEN_B = config_json(SHAPES["7b"])  # the benchmarks' one LLaMA-2-7B shape (bench/kinds/shapes.py)


def _lever_runs(path: Path) -> list[tuple[str, dict]]:
    doc = json.loads(path.read_text())
    return [
        (f"{path.relative_to(REPO)}: {r['name']}", r["result"])
        for r in doc["runs"]
        if r.get("status") == "ok"
        and r["method"] == "frod"
        and not any(r["result"].get("levers", {}).get(k) for k in MODEL_LEVERS)
        and not doc.get("interleave")
    ]  # configurations sharing the GPU in turns: not a step run alone


def host_probe_ms() -> dict[str, list[float]]:
    """Each machine kind's bf16 7B-widths host probe (``bench/host_device.py``'s short step), milliseconds."""
    probe: dict[str, list[float]] = {}
    for path in HOST_DEVICE:
        d = json.loads(path.read_text())
        (row,) = [r for r in d["runs"] if r["name"] == "7b_none"]
        probe.setdefault(_kind(d["device"]), []).append(row["host"]["step_ms"])
    return probe


def host_factors() -> dict[str, float]:
    """The host's time per device name relative to the machine the model's HOST_* constants were read on (the one
    H200 machine): each machine's host probe over the H200's."""
    probe = host_probe_ms()
    ref = statistics.median(probe["H200"])
    return {kind: statistics.median(v) / ref for kind, v in probe.items()}


def _kind(device: str) -> str:
    return "H100" if "H100" in device else "H200" if "H200" in device else device


def _host_device_points(path: Path) -> list[tuple[str, dict]]:
    """One step result per row of a ``bench/host_device.py`` JSON, in the step matrix's keys."""
    doc = json.loads(path.read_text())
    out = []
    for r in doc["runs"]:
        steps = r["all"]["step_ms"]  # two windows of --steps each, in order
        windows = [steps[: len(steps) // 2], steps[len(steps) // 2 :]]
        medians = [statistics.median(w) for w in windows]
        out.append(
            (
                f"{path.relative_to(REPO)}: {r['name']}",
                {
                    "device": doc["device"],
                    "engine": "plain",
                    "world_size": 1,
                    "ds_config": None,
                    "model": {
                        "hidden_size": r["hidden"],
                        "intermediate_size": r["intermediate"],
                        "num_hidden_layers": r["layers"],
                        "num_attention_heads": r["heads"],
                        "num_key_value_heads": r["kv_heads"],
                        "vocab_size": 32000,
                    },
                    "micro_batch": r["micro_batch"],
                    "seq_len": r["seq_len"],
                    "targets": doc["targets"],
                    "frod": {"sparsity": doc["sparsity"]},
                    "frozen_quant": r["quant"],
                    "quantize_base": r["quantize_base"],
                    "gradient_checkpointing": r["checkpointing"],
                    "step_s_median": r["step_ms"] / 1e3,
                    "window_spread": (max(medians) - min(medians)) / r["step_ms"],
                },
            )
        )
    return out


def _chain_points() -> list[tuple[str, dict]]:
    """One step result per finished train or mfu stage of ``CHAIN_SUITES`` (``frod train``, as users run it)."""
    out = []
    for suite in CHAIN_SUITES:
        for path in sorted((RESULTS / suite).glob("*/*.json")):
            d = json.loads(path.read_text())
            if d.get("stage") not in ("train", "mfu") or d.get("status") != "ok":
                continue
            s, f = d["settings"], d["metrics"]["figures"]
            probe = d["metrics"].get("host_probe")
            out.append((str(path.relative_to(REPO)), {"chain": s, "device": d["device"]["name"], "probe": probe, **f}))
    return out


def _flat_trainables(d: dict) -> bool:
    """Whether a run held σ and S per decoder layer: its recorded trainable tensor count where it has one; before
    that field, ZeRO-3 runs did unless ``--per-member-trainables``, ZeRO-2 runs never did."""
    recorded = trainables_per_decoder_layer(d)
    if recorded is not None:
        return recorded
    return (
        bool(d.get("ds_config"))
        and zero_stage(d["ds_config"]) == 3
        and d.get("levers", {}).get("per_member_trainables") is False
    )


def _point(path: Path | tuple[str, dict], hosts: dict[str, float], ref_ms: float) -> dict:
    if isinstance(path, tuple):
        label, d = path
    else:
        label, d = str(path.relative_to(REPO)), json.loads(path.read_text())
    if d.get("benchmark") == "offload_zero3_7b":
        model, gpus, config = SEVEN_B, 1, d["config"]
        train = TrainShape(
            micro_batch=4,
            seq_len=256,
            checkpointing=True,
            flat_trainables=False,
            zero3_flat_frozen=False,
            deepspeed_nvtx=True,
        )  # before them
        engine, plain = engine_from_ds_config(config, "zero3_offload.json", "deepspeed"), False
    elif "chain" in d:  # frod train on the shipped JSON, as the chain's own prediction reads it
        s = d["chain"]
        model, gpus = {**SEVEN_B, "num_hidden_layers": s["layers"] or 32}, s["gpus"]
        assert s["shape"] == "7b", f"{label}: only the 7b shape is modelled here, got {s['shape']}"
        sparsity = s.get("sparsity", 0.02)  # records before the setting ran at 0.02
        train = TrainShape(d["micro_batch"], s["seq"], s["dtype"], sparsity=sparsity, checkpointing=True)
        engine, plain = engine_from_ds_config(load_ds_config(REPO / s["config"]), s["config"]), False
    else:
        model = llama_config(d)
        f = d.get("frod") or {}
        train = TrainShape(
            micro_batch=d["micro_batch"],
            seq_len=d["seq_len"],
            targets=tuple(d["targets"]),
            sparsity=f.get("sparsity", 0.02),
            quant=d.get("frozen_quant") or "none",
            quantize_base=bool(d.get("quantize_base", False)),
            checkpointing=d["gradient_checkpointing"],
            flat_trainables=_flat_trainables(d),
            zero3_flat_frozen=d.get("levers", {}).get("per_member_frozen") is False,
            deepspeed_nvtx=deepspeed_nvtx(d),
        )
        gpus, plain = d["world_size"], d["engine"] == "plain"
        # these steps were measured under DeepSpeed's own stage 3 (before zero3.json's layer partition)
        engine = engine_from_ds_config(d["ds_config"] or {"zero_optimization": {"stage": 2}}, d["engine"], "deepspeed")
    kind_host = hosts[_kind(d["device"])]
    probe = d.get("probe") or {}
    measured_host = probe.get("shape") == "7b" and probe.get("host_step_ms")
    host = probe["host_step_ms"] / ref_ms if measured_host else kind_host
    shape = model_shape_from_config(model)
    link = Link(host=host, cpu_threads=(d["chain"].get("omp_threads") or None) if "chain" in d else None)
    pred = step_time(shape, train, engine, gpus, link, plain=plain)
    at_kind = step_time(shape, train, engine, gpus, dataclasses.replace(link, host=kind_host), plain=plain)
    meas = d["step_s_median"]
    extra = {}
    if "chain" in d and d["chain"].get("phase_times"):
        extra["outside"] = PHASE_TIMED
        if d.get("optimizer_s_median") is not None:  # rank 0's optimizer phase per parameter it steps
            extra["optimizer_s_per_rank_param"] = d["optimizer_s_median"] / (trainable_numel(shape, train) / gpus)
            extra["cpu_threads"] = rank_threads(link, gpus)
    return {
        **extra,
        "file": label,
        "device": d["device"],
        "engine": "plain" if plain else engine.name,
        "gpus": gpus,
        "layers": model["num_hidden_layers"],
        "hidden": model["hidden_size"],
        "checkpointing": train.checkpointing,
        "quant": train.quant + ("+base" if train.quantize_base else ""),
        "measured_ms": meas * 1e3,
        "predicted_ms": pred.seconds * 1e3,
        "error": pred.seconds / meas - 1,
        "host": host,
        "host_from": PROBED if measured_host else "the machine kind's",
        "predicted_at_kind_ms": at_kind.seconds * 1e3,
        "parts_ms": {k: v * 1e3 for k, v in pred.parts.items() if v},
        "host_ms": {k: v * 1e3 for k, v in pred.host.items() if v},
        "window_spread": d.get("window_spread", 0.0),
    }


def check() -> dict:
    hosts, ref_ms = host_factors(), statistics.median(host_probe_ms()["H200"])
    runs = [p for p in POINTS if p not in OUTSIDE] + [r for call in LEVER_CALLS for r in _lever_runs(call)]
    runs += [r for path in HOST_DEVICE for r in _host_device_points(path)] + _chain_points()
    runs += [
        p
        for p in DEEPCOMPILE_CALLS
        if not any(json.loads(p.read_text()).get("levers", {}).get(k) for k in (*MODEL_LEVERS, "per_member_trainables"))
    ]
    rows = [_point(p, hosts, ref_ms) for p in runs]
    rows += [{**_point(p, hosts, ref_ms), "outside": why} for p, why in OUTSIDE.items()]
    for r in rows:
        if not r.get("outside") and r["window_spread"] > NOISY_SPREAD:
            r["outside"] = f"noisy: its windows differ by {r['window_spread']:.0%}"
    configs: dict[tuple, list[dict]] = {}
    for r in rows:
        if not r.get("outside"):
            configs.setdefault(_config_key(r), []).append(r)
    groups = []
    for members in configs.values():
        measured = statistics.median(m["measured_ms"] for m in members)
        pred = statistics.median(m["predicted_ms"] for m in members)
        groups.append(
            {
                "files": [m["file"] for m in members],
                "device": members[0]["device"],
                "engine": members[0]["engine"],
                "gpus": members[0]["gpus"],
                "layers": members[0]["layers"],
                "hidden": members[0]["hidden"],
                "checkpointing": members[0]["checkpointing"],
                "quant": members[0]["quant"],
                "calls": len(members),
                "measured_ms": measured,
                "measured_range_ms": [min(m["measured_ms"] for m in members), max(m["measured_ms"] for m in members)],
                "predicted_ms": pred,
                "error": statistics.median(m["error"] for m in members),
                "probed_calls": sum(m["host_from"] == PROBED for m in members),
                "parts_ms": members[0]["parts_ms"],
                "host_ms": members[0]["host_ms"],
            }
        )
    read = {r["file"]: r["optimizer_s_per_rank_param"] for r in rows if "optimizer_s_per_rank_param" in r}
    threads = {r["file"]: r["cpu_threads"] for r in rows if "optimizer_s_per_rank_param" in r}
    by_threads = {
        t: statistics.median(v for f, v in read.items() if threads[f] == t) for t in sorted(set(threads.values()))
    }
    return {
        "cpu_optimizer": {
            "per_rank_param_s": read,
            "threads": threads,
            "median_by_threads": by_threads,
            "model_by_threads": {t: CPU_OPTIMIZER_PARAM_S + CPU_OPTIMIZER_THREAD_PARAM_S / t for t in by_threads},
        },
        "benchmark": "time_model_check",
        "goal": CHECK_GOAL,
        "noisy_spread": NOISY_SPREAD,
        "host_factors": hosts,
        "rows": rows,
        "configs": groups,
        "worst_error": max(abs(g["error"]) for g in groups),
        "within_goal": all(abs(g["error"]) <= CHECK_GOAL for g in groups),
    }


def _config_key(r: dict) -> tuple:
    """What the model sees of a point but the host's speed: the device kind and its prediction at the kind's host
    factor (the same inputs give the same one)."""
    return (
        _kind(r["device"]),
        r["engine"],
        r["gpus"],
        r["layers"],
        r["hidden"],
        r["checkpointing"],
        r["quant"],
        round(r["predicted_at_kind_ms"], 6),
    )


def render(doc: dict) -> str:
    hosts = ", ".join(f"{k} machine {v:.2f}" for k, v in sorted(doc["host_factors"].items()))
    lines = [
        "# The planner's step-time model against measured steps",
        "",
        "Generated by `python -m bench.time_model_check` from the committed result JSONs; the model is "
        "`frod_ds/plan/step_time.py`. Goal: |error| ≤ "
        f"{doc['goal']:.0%} on every configuration; worst {doc['worst_error']:.1%} "
        f"({'met' if doc['within_goal'] else '**not met**'}). A configuration is what the model sees of a point "
        "(device kind and every input of the model, hence one prediction); measured in several calls, it is held "
        "to the goal by the median of its calls, and each call is listed below with its own error. Not held to "
        f"it: a measurement whose two windows differ by more than {doc['noisy_spread']:.0%}. Host speed "
        f"relative to the H200 machine (`Link.host`, from the bf16 host probes of `bench/host_device.py`): {hosts}; "
        "a chain call that ran the same probe before its runs (`host_probe`) is predicted at its own host's speed "
        "(the `host` column below), and a configuration's error is the median of its calls' errors.",
        "",
        "## Configurations",
        "",
        "| configuration (first call) | calls | device | engine | GPUs | layers × hidden | ckpt | frozen | measured ms "
        "(median of calls) | calls' range ms | model ms | error | model parts, ms (the host's work beside the "
        "device's) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for g in doc["configs"]:
        parts = (
            ", ".join(f"{k} {v:.0f}" for k, v in g["parts_ms"].items())
            + " (host: "
            + ", ".join(f"{k} {v:.0f}" for k, v in g["host_ms"].items())
            + ")"
        )
        lo, hi = g["measured_range_ms"]
        calls = f"{g['calls']} ({g['probed_calls']} probed)" if g["probed_calls"] else str(g["calls"])
        lines.append(
            f"| {g['files'][0].removeprefix('bench/results/')} | {calls} | {g['device']} | {g['engine']} "
            f"| {g['gpus']} | {g['layers']} × {g['hidden']} | {'on' if g['checkpointing'] else 'off'} "
            f"| {g['quant']} | {g['measured_ms']:.0f} | {lo:.0f}–{hi:.0f} | {g['predicted_ms']:.0f} "
            f"| {g['error']:+.1%} | {parts} |"
        )
    cpu = doc.get("cpu_optimizer") or {}
    if cpu.get("per_rank_param_s"):
        lines += [
            "",
            "## The CPU optimizer's term",
            "",
            "Rank 0's optimizer phase (`train.phase_times`) over the σ and S values it steps (the model's trainables "
            "÷ GPUs), by the rank's OpenMP threads: "
            + "; ".join(
                f"{t} thread{'s' if int(t) > 1 else ''}: median {m:.3g} s per value, the model "
                f"{cpu['model_by_threads'][t]:.3g} (`CPU_OPTIMIZER_PARAM_S` + `CPU_OPTIMIZER_THREAD_PARAM_S` / {t})"
                for t, m in cpu["median_by_threads"].items()
            )
            + ".",
            "",
            "| run | threads | s per value of the rank |",
            "|---|---|---|",
            *(
                f"| {k.removeprefix('bench/results/')} | {cpu['threads'][k]} | {v:.3g} |"
                for k, v in cpu["per_rank_param_s"].items()
            ),
        ]
    lines += [
        "",
        "## Every call",
        "",
        "| result | device | engine | GPUs | layers × hidden | ckpt | frozen | host | measured ms | model ms | error |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        why = f" ({r['outside']})" if r.get("outside") else ""
        lines.append(
            f"| {r['file'].removeprefix('bench/results/')}{why} | {r['device']} | {r['engine']} "
            f"| {r['gpus']} | {r['layers']} × {r['hidden']} | {'on' if r['checkpointing'] else 'off'} "
            f"| {r['quant']} | {r['host']:.2f}{' (probe)' if r['host_from'] == PROBED else ''} "
            f"| {r['measured_ms']:.0f} | {r['predicted_ms']:.0f} | {r['error']:+.1%} |"
        )
    lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=RESULTS, help="where time_model_check.json and .md go")
    args = ap.parse_args()
    doc = check()
    (args.out / "time_model_check.json").write_text(json.dumps(doc, indent=1) + "\n")
    (args.out / "time_model_check.md").write_text(render(doc))
    print(render(doc))


if __name__ == "__main__":
    main()
