"""The learnability study's report: one JSON from every study directory, then Markdown and plots from that JSON.

``collect(OUT)`` reads ``OUT/<task>/seed<k>/real_study.json`` (the study's own documents; their ``heldout`` is the
task's validation split) and ``OUT/<task>/timing.json`` into ``learn_study.json``: per task and method, the chosen
run of every seed (answer-token loss per step, validation answer loss per evaluation, exact match per test split,
tan α per category at each checkpoint), the LR sweeps, the S-rate ratios, the cross-check, each method's speed
alone, and the derived numbers: steps to the better LoRA's final validation loss, the time that takes alone on
the device, accuracy means with 95% t-intervals over seeds. ``render(doc)`` writes ``report.md`` and the plots
from that JSON alone.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from studies.intervals import mean_interval, t_quantile
from studies.learn_convergence import NOT_REACHED, arith_gate, convergence
from studies.report import smooth_window

__all__ = ["t_quantile", "mean_interval", "collect", "render", "summary_complete", "SCALE_NOTE"]

SCALE_NOTE = (
    "SmolLM2-135M is not LLaMA-2-7B: these runs test whether each method learns tasks a 135M model can "
    "learn, on a budget of minutes; nothing here is a projection to 7B (the paper's scale), and the "
    "rankings may differ there."
)


def summary_complete(doc: dict, asked=None, needs_base: bool | None = None) -> bool:
    """Whether one seed's summary is whole: every method asked for (its config's, or ``asked``) chosen for good and
    tested, and the base evaluated where it was asked for. Read off the methods, not a stored flag, so that a seed
    merged from two calls is judged by what the merge holds."""
    cfg = doc.get("config", {})
    asked = set(cfg.get("methods", [])) if asked is None else set(asked)
    needs_base = bool(cfg.get("base_eval", False)) if needs_base is None else needs_base
    methods = doc.get("methods", {})
    tested = all(m in methods and "test" in methods[m] and (methods[m].get("chosen") or {}).get("final") for m in asked)
    return bool(asked) and tested and ("base" in doc or not needs_base)


def _chosen_run(method: dict) -> dict | None:
    c = method.get("chosen")
    return method["sweep"][c["index"]] if c else None


def _chosen_lr(doc: dict, method: str) -> float | None:
    """The LR ``doc`` (a seed's real_study.json) chose for ``method``, or None."""
    run = _chosen_run(doc["methods"].get(method, {}))
    return None if run is None else run["lr"]


def _validation_curve(run: dict) -> list[list[float]]:
    """``[[step, validation answer loss], ...]``: every validation evaluation (``--val-every``), else the
    checkpoints'."""
    if run.get("validation"):
        return [[p["step"], p["answer_loss"]] for p in run["validation"]]
    return [[c["step"], c["heldout_answer_loss"]] for c in run["checkpoints"]]


def _seed_entry(run: dict, method: dict) -> dict[str, Any]:
    tests = method.get("test", {}).get("exact", {}).get("tasks", {})
    return {
        "lr": run["lr"],
        "lr_s": run.get("lr_s"),
        "answer_loss": run["log"]["answer_loss"],
        "validation": _validation_curve(run),
        "validation_answer_loss": run["heldout"]["answer_loss"],
        "exact": {t: e["accuracy"] for t, e in tests.items()},
        "tan_alpha": [{"step": c["step"], **c["tan_alpha"]} for c in run["checkpoints"] if c.get("tan_alpha")],
        "shared_step_ms": run["step_ms"],
        "workers": run["workers"],
        "trainable_params": run["trainable_params"],
        "tokens": run["tokens"],
    }


def _order(name: str) -> tuple[int, str]:
    """Report order: the main methods as listed, then FRoD's ratio variants, then the cross-check."""
    from studies.config import MAIN_METHODS

    if name in MAIN_METHODS:
        return (MAIN_METHODS.index(name), name)
    return (len(MAIN_METHODS) + (0 if name.startswith("frod_ratio") else 1), name)


def _reach(curve: list[list[float]], target: float) -> int | None:
    """First step of a validation curve at or below ``target``."""
    return next((int(s) for s, v in curve if v <= target), None)


CROSS_CHECK_TOL = 1e-4  # relative per-step training-loss difference taken as agreement


def _cross_check(seed0: dict, steps: int) -> dict[str, Any] | None:
    """frod vs peftfrod_inj (same factors, support, σ⁰, LRs and batches): how far their runs differ. Where stock
    PEFT FRoD trained in fp32, its twin is ``frod_fp32`` (frod without autocast), not the bf16 ``frod``."""
    m = seed0["methods"]
    if "peftfrod_inj" not in m or "frod" not in m or "chosen" not in m["peftfrod_inj"]:
        return None
    inj = _chosen_run(m["peftfrod_inj"])
    twin = "frod_fp32" if "chosen" in m.get("frod_fp32", {}) else "frod"
    frod = next((r for r in m[twin]["sweep"] if r["lr"] == inj["lr"]), None)
    if frod is None:
        return None
    a, b = frod["log"]["loss"], inj["log"]["loss"]
    rel = [abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b)]
    # one implementation run twice on a GPU parts too (summation order): the early steps check the implementation,
    # the later ones only say how fast training amplifies rounding
    within = next((i for i, r in enumerate(rel) if r > CROSS_CHECK_TOL), len(rel))
    ex = lambda meth: meth.get("test", {}).get("exact", {}).get("tasks", {})  # noqa: E731
    return {
        "lr": inj["lr"],
        "twin": twin,
        "same_precision": twin == "frod_fp32" or not seed0["config"].get("peft_frod_fp32"),
        "max_rel_loss_difference": max(rel),
        "final_rel_loss_difference": rel[-1],
        "max_rel_loss_difference_first_10": max(rel[:10]),
        "steps_within_tolerance": within,
        "tolerance": CROSS_CHECK_TOL,
        "validation_answer_loss": {
            "frod": frod["heldout"]["answer_loss"],
            "peftfrod_inj": inj["heldout"]["answer_loss"],
        },
        "exact_peftfrod_inj": {t: e["accuracy"] for t, e in ex(m["peftfrod_inj"]).items()},
        "steps": steps,
    }


def _agreement(c: dict) -> str:
    """How long the two runs agree, in words (records written before these fields say nothing)."""
    if "steps_within_tolerance" not in c:
        return "agreement by step not recorded"
    n, tol = c["steps_within_tolerance"], c["tolerance"]
    first = c["max_rel_loss_difference_first_10"]
    head = f"the per-step training losses agree within {first:.1e} relative over the first 10 steps"
    if n >= c["steps"]:
        return f"{head} and within {tol:g} over all {c['steps']}"
    return (
        f"{head} and within {tol:g} for the first {n} steps, then part as training amplifies rounding differences "
        "(the two sum in different orders)"
    )


def _ratios(seed0: dict) -> dict[str, Any] | None:
    """The σ:S LR ratios tried at frod's σ LR: validation answer loss of each, and the winner."""
    out = {}
    for name, m in seed0["methods"].items():
        k = 10 if name == "frod" else int(name.removeprefix("frod_ratio")) if name.startswith("frod_ratio") else None
        if k is None or "chosen" not in m:
            continue
        run = next((r for r in m["sweep"] if r["lr"] == seed0["methods"]["frod"]["chosen"]["lr"]), None)
        if run is not None:
            out[k] = run["heldout"]["answer_loss"]
    if len(out) < 2:
        return None
    best = min(out, key=out.get)
    ends = (min(out), max(out))
    return {
        "validation_answer_loss": {str(k): v for k, v in sorted(out.items())},
        "chosen": best,
        "at_end": best in ends and best != 10,
    }


def collect(out: Path) -> dict[str, Any]:
    """``learn_study.json``'s content from the study directories under ``out``."""
    tasks: dict[str, Any] = {}
    devices: set[str] = set()
    for task_dir in sorted(p for p in out.iterdir() if p.is_dir()):
        seeds = sorted(
            (int(m.group(1)), p)
            for p in task_dir.iterdir()
            if (m := re.fullmatch(r"seed(\d+)", p.name)) and (p / "real_study.json").is_file()
        )
        if not seeds:
            continue
        docs = {k: json.loads((p / "real_study.json").read_text()) for k, p in seeds}
        first = docs[min(docs)]
        devices |= {i["device"] for d in docs.values() for i in d["invocations"]}
        steps = first["data"]["steps"]
        window = smooth_window(steps, first["config"]["smooth_frac"])
        methods: dict[str, Any] = {}
        for k, d in sorted(docs.items()):
            for name, m in sorted(d["methods"].items(), key=lambda kv: _order(kv[0])):
                run = _chosen_run(m)
                if run is None or "test" not in m or run["lr"] != _chosen_lr(first, name):
                    continue  # a seed counts at the LR the first seed's sweep chose, never at another call's
                methods.setdefault(name, {"seeds": {}})["seeds"][str(k)] = _seed_entry(run, m)
        methods = dict(sorted(methods.items(), key=lambda kv: _order(kv[0])))
        sweeps = {
            name: [
                {
                    "lr": r["lr"],
                    "validation_answer_loss": r["heldout"]["answer_loss"],
                    "chosen": i == m.get("chosen", {}).get("index"),
                    "at_end": i == m.get("chosen", {}).get("index") and m["chosen"]["at_sweep_end"],
                    "extension": r["lr"] in m.get("extended", []),
                }
                for i, r in enumerate(m["sweep"])
            ]
            for name, m in sorted(first["methods"].items(), key=lambda kv: _order(kv[0]))
            if not (name.startswith("frod_ratio") or name in ("peftfrod_inj", "frod_fp32"))  # "ratios", "cross_check"
        }
        open_sweeps = [
            name
            for name, m in first["methods"].items()
            if name in sweeps and not (m.get("chosen") or {}).get("final", False)
        ]
        timing_path = task_dir / "timing.json"
        timing = json.loads(timing_path.read_text()) if timing_path.is_file() else None
        loras = {
            n: sum(s["validation_answer_loss"] for s in e["seeds"].values()) / len(e["seeds"])
            for n, e in methods.items()
            if n.startswith("lora")
        }
        better = min(loras, key=loras.get) if loras else None
        for name, e in methods.items():
            alone = (timing or {}).get("methods", {}).get(name)
            if better is not None:
                reach = {s: _reach(r["validation"], loras[better]) for s, r in e["seeds"].items()}
                e["steps_to_better_lora_final"] = reach
                if alone:
                    e["seconds_to_better_lora_final"] = {
                        s: None if v is None else alone["build_seconds"] + v * alone["step_ms"] / 1e3
                        for s, v in reach.items()
                    }
            splits = sorted({t for r in e["seeds"].values() for t in r["exact"]})
            e["exact"] = {
                t: mean_interval([r["exact"][t] for r in e["seeds"].values() if t in r["exact"]], (0.0, 1.0))
                for t in splits
            }
            if alone:
                e["alone"] = alone
        base = first.get("base", {}).get("test", {}).get("exact", {}).get("tasks", {})
        tasks[task_dir.name] = {
            "peft_frod_fp32": bool(first["config"].get("peft_frod_fp32")),
            "steps": steps,
            "batch_size": first["config"]["batch_size"],
            "smoothing_window": window,
            "train_rows": first["data"]["train_rows"],
            "validation_rows": first["data"]["heldout_rows"],
            "train_tokens": first["data"]["train_tokens"],
            "answer_tokens": first["data"]["answer_word_tokens"],
            "test_rows": first["data"]["test_rows_per_task"],
            "seeds": sorted(docs),
            "better_lora": better,
            "better_lora_final_validation_loss": loras.get(better),
            "base_exact": {t: e["accuracy"] for t, e in base.items()},
            "base_validation_answer_loss": first.get("step0", {}).get("heldout_answer_loss"),
            "methods": methods,
            "sweeps": sweeps,
            "ratios": _ratios(first),
            "cross_check": _cross_check(first, steps),
            "timing": None if timing is None else {k: v for k, v in timing.items() if k != "methods"},
            "complete": all(summary_complete(d) for d in docs.values()) and timing is not None,
            "open_sweeps": open_sweeps,
            "gate": arith_gate(task_dir.name, methods),
        }
    return {
        "benchmark": "learn_study",
        "devices": sorted(devices),
        "scale_note": SCALE_NOTE,
        "tasks": tasks,
        "convergence": convergence(tasks),
    }


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{100 * v:.1f}"


def _fmt_interval(e: dict) -> str:
    if e["lo"] is None:
        return f"{100 * e['mean']:.1f} (1 seed)"
    seeds = " / ".join(f"{100 * v:.1f}" for v in e["values"])
    return f"{100 * e['mean']:.1f} [{100 * e['lo']:.1f}, {100 * e['hi']:.1f}] ({seeds})"


def _fmt_reach(values: dict[str, Any], unit: str = "") -> str:
    if not values:
        return "—"
    return ", ".join(
        NOT_REACHED if v is None else (f"{v:.1f}{unit}" if isinstance(v, float) else f"{v}{unit}")
        for v in values.values()
    )


def _task_md(name: str, t: dict) -> str:
    out = [
        f"## {name}\n",
        f"{t['train_rows']} training rows, {t['validation_rows']} validation rows (LR selection), test rows "
        f"{t['test_rows']}. Budget, the same for every method: {t['steps']} steps of {t['batch_size']} rows "
        f"({t['train_tokens']:,} training tokens, {t['answer_tokens']:,} answer tokens), the same batches in the same "
        f"order; seeds {t['seeds']}. Training losses are trailing means over {t['smoothing_window']} steps.\n",
    ]
    gate = t.get("gate")
    if gate and gate["passed"] is False:
        said = (
            "so this task is kept as the pilot's record only and is out of the convergence line"
            if gate.get("excluded")
            else "short of the gate; no further arithmetic variant is tried, so this task is reported with that "
            "shortfall"
        )
        out.append(
            f"**Pilot gate not passed**: {gate['method']}'s exact match on `{gate['split']}` is "
            f"{_pct(gate['exact'])}% (the plan asks ≥ {_pct(gate['min_exact'])}%), {said} (docs/learn-study.md, "
            "Decisions).\n"
        )
    if t.get("open_sweeps"):
        out.append(
            f"**Provisional**: the LR sweeps of {', '.join(t['open_sweeps'])} are not complete; the choices, and the "
            "figures that follow from them, may change when a later call finishes them.\n"
        )
    if t.get("peft_frod_fp32"):
        out.append(
            "Stock PEFT FRoD (`peftfrod*`) trained in fp32, the others under bf16 autocast: its sparse matmul fails "
            "under bf16 autocast on this GPU.\n"
        )
    splits = sorted({s for e in t["methods"].values() for s in e["exact"]})
    target = t["better_lora_final_validation_loss"]
    head = [
        "method",
        "LR (S LR)",
        "seeds",
        "validation answer loss (mean)",
        (
            f"steps to {t['better_lora']}'s final validation loss ({target:.4f}) per seed"
            if target is not None
            else "steps to the better LoRA's final validation loss (no LoRA run)"
        ),
        "seconds alone to it (per seed)",
    ] + [f"exact match % {s} (95% CI, per seed)" for s in splits]
    out.append(
        "Exact match: the mean over seeds, its 95% t-interval (cut to 0–100: with three seeds the interval can reach "
        "past either end) and each seed's value.\n"
    )
    out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    if t["base_exact"]:
        base_loss = t.get("base_validation_answer_loss")
        out.append(
            f"| base | | | {'' if base_loss is None else f'{base_loss:.4f}'} | | | "
            + " | ".join(_pct(t["base_exact"].get(s)) for s in splits)
            + " |"
        )
    for m, e in t["methods"].items():
        s0 = e["seeds"].get("0") or next(iter(e["seeds"].values()))
        lr = f"{s0['lr']:.3g}" + (f" ({s0['lr_s']:.3g})" if s0.get("lr_s") else "")
        val = sum(s["validation_answer_loss"] for s in e["seeds"].values()) / len(e["seeds"])
        cells = [
            m,
            lr,
            str(len(e["seeds"])),
            f"{val:.4f}",
            _fmt_reach(e.get("steps_to_better_lora_final", {})),
            _fmt_reach(e.get("seconds_to_better_lora_final", {}), " s"),
        ]
        cells += [_fmt_interval(e["exact"][s]) if s in e["exact"] else "—" for s in splits]
        out.append("| " + " | ".join(cells) + " |")
    out.append("\nLR sweeps (seed 0; chosen by the lowest validation answer loss):\n")
    out += ["| method | LR | validation answer loss |", "|---|---|---|"]
    for m, rows in t["sweeps"].items():
        for r in rows:
            mark = (" (past the grid)" if r["extension"] else "") + (" (chosen)" if r["chosen"] else "")
            mark += " ⚠ still at an end of the sweep" if r.get("at_end") else ""
            out.append(f"| {m} | {r['lr']:g}{mark} | {r['validation_answer_loss']:.4f} |")
    if t["ratios"]:
        r = t["ratios"]
        cells = " · ".join(
            f"σ:S {k}:1 → {v:.4f}" + (" (chosen)" if int(k) == r["chosen"] else "")
            for k, v in r["validation_answer_loss"].items()
        )
        end = " ⚠ the choice is still at an end of the ratios tried" if r.get("at_end") else ""
        out.append(f"\nFRoD's σ:S LR ratio at its chosen σ LR (validation answer loss): {cells}{end}\n")
    if t["cross_check"]:
        c = t["cross_check"]
        twin = c.get("twin", "frod")
        caveat = (
            ""
            if c.get("same_precision", True)
            else " ⚠ not like for like: `frod` trained under bf16 autocast, `peftfrod_inj` in fp32 (a `frod_fp32` twin "
            "is still to run), rounding alone can part the runs, so this does not check the implementation"
        )
        out.append(
            f"\nCross-check, stock PEFT FRoD on frod-ds' factors, support and σ⁰ (`peftfrod_inj`) against `{twin}`, "
            f"same LRs ({c['lr']:g}) and batches: {_agreement(c)}; largest relative difference of the per-step "
            f"training loss {c['max_rel_loss_difference']:.2e} (last step {c['final_rel_loss_difference']:.2e}); "
            f"validation answer loss {c['validation_answer_loss']['frod']:.4f} vs "
            f"{c['validation_answer_loss']['peftfrod_inj']:.4f}.{caveat}\n"
        )
    rot = {
        m: e["seeds"]["0"]["tan_alpha"]
        for m, e in t["methods"].items()
        if "0" in e["seeds"] and e["seeds"]["0"]["tan_alpha"]
    }
    if rot:
        cats = sorted({c for rows in rot.values() for r in rows for c in r if c != "step"})
        out += [
            "\ntan α = ‖ΔW_off‖_F / ‖ΔW_on‖_F per category (seed 0, at the checkpoints):\n",
            "| method | step | " + " | ".join(cats) + " |",
            "|" + "---|" * (len(cats) + 2),
        ]
        for m, rows in rot.items():
            out += [f"| {m} | {r['step']} | " + " | ".join(f"{r[c]:.3g}" for c in cats) + " |" for r in rows]
    timed = {m: e["alone"] for m, e in t["methods"].items() if e.get("alone")}
    if timed:
        tm = t["timing"]
        out += [
            f"\nSpeed, each method alone on the device ({tm['device']}; {tm['steps']} timed steps after "
            f"{tm['warmup']}, this task's batches; build: the model from the base, FRoD's HJD or PEFT's own "
            "initialisation included):\n",
            "| method | trainable | ms/step | tokens/s | peak GiB | build s |",
            "|---|---|---|---|---|---|",
        ]
        for m, a in timed.items():
            peak = "—" if a["peak_mem_gb"] is None else f"{a['peak_mem_gb']:.2f}"
            out.append(
                f"| {m} | {a['trainable_params']:,} | {a['step_ms']:.1f} | {a['tokens_per_s']:,.0f} | {peak} | "
                f"{a['build_seconds']:.1f} |"
            )
    else:
        out.append("\nSpeed alone: not measured yet (the task's timing unit).\n")
    return "\n".join(out) + "\n"


def _facts_md(tasks: dict[str, Any]) -> str:
    """Exact match by fact-base size (the saturation sweep), per method and test split."""
    sizes = sorted((int(n[5:]), n) for n in tasks if re.fullmatch(r"facts\d+", n))
    if len(sizes) < 2:
        return ""
    methods = list(dict.fromkeys(m for _, n in sizes for m in tasks[n]["methods"]))
    out = ["## Fact base by size\n", "Exact match % (mean over seeds) per size; recall / qa.\n"]
    out += ["| method | " + " | ".join(f"{n}" for _, n in sizes) + " |", "|" + "---|" * (len(sizes) + 1)]
    for m in methods:
        cells = []
        for _, n in sizes:
            e = tasks[n]["methods"].get(m, {}).get("exact", {})
            pick = [_pct(e[k]["mean"]) if k in e else "—" for k in (f"{n}_recall", f"{n}_qa")]
            cells.append(" / ".join(pick))
        out.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n\nPlot: `facts_by_size.png`.\n\n"


def render(doc: dict[str, Any], out: Path) -> list[Path]:
    """``report.md`` and per task one plot (training and validation loss), from ``learn_study.json`` alone."""
    conv = doc["convergence"]["sentence"]
    text = (
        "# Does frod-ds' FRoD learn like FRoD? Generated tasks on a real model\n\n"
        f"_Generated by `python -m studies.learn_study report` from `learn_study.json`; devices: "
        f"{', '.join(doc['devices']) or '—'}._\n\n**Scale.** {doc['scale_note']}\n\n"
        + (f"**Convergence.** {conv}.\n\n" if conv else "")
        + _facts_md(doc["tasks"])
        + "\n".join(_task_md(n, t) for n, t in doc["tasks"].items())
    )
    paths = [out / "report.md"]
    paths[0].write_text(text)
    from studies.learn_plots import plot_tasks

    paths += plot_tasks(doc, out)
    return paths
