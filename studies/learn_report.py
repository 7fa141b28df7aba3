"""The learnability study's report: one JSON from every study directory, then Markdown and plots from that JSON.

``collect(OUT)`` reads ``OUT/<task>/seed<k>/real_study.json`` (the study's own documents) into
``learn_study.json``: per task and method, the chosen run of every seed (answer-word loss per step, held-out
loss, exact-match accuracy per test split, tan α per category at each checkpoint, speed), the LR sweeps, and
the derived numbers: steps to the better LoRA's final loss, accuracy means with 95% t-intervals over seeds.
``render(doc)`` writes ``report.md`` and ``loss_<task>.png`` from that JSON alone.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from studies.report import smooth, smooth_window, steps_to_reach

__all__ = ["t_quantile", "mean_interval", "collect", "render", "SCALE_NOTE"]

SCALE_NOTE = (
    "SmolLM2-135M is not LLaMA-2-7B: these runs test whether each method learns tasks a 135M model can "
    "learn, on a budget of minutes; they say nothing about the paper's 7B numbers, and the rankings may "
    "differ at 7B."
)


def _t_pdf(x: float, df: int) -> float:
    c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    return math.exp(c - (df + 1) / 2 * math.log1p(x * x / df))


def _t_cdf_above_zero(x: float, df: int, n: int = 2000) -> float:
    """P(0 < T < x) by Simpson's rule (n even)."""
    h = x / n
    s = _t_pdf(0, df) + _t_pdf(x, df) + sum((4 if i % 2 else 2) * _t_pdf(i * h, df) for i in range(1, n))
    return s * h / 3


def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile (p > 0.5) of Student's t with ``df`` degrees of freedom, by bisection on its CDF."""
    lo, hi = 0.0, 1.0
    while 0.5 + _t_cdf_above_zero(hi, df) < p:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if 0.5 + _t_cdf_above_zero(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


def mean_interval(values: list[float]) -> dict[str, Any]:
    """Mean and its 95% t-interval over seeds (no interval from one seed)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return {"mean": mean, "lo": None, "hi": None, "n": n, "values": values}
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t_quantile(0.975, n - 1) * sd / math.sqrt(n)
    return {"mean": mean, "lo": mean - half, "hi": mean + half, "n": n, "values": values}


def _chosen_run(method: dict) -> dict | None:
    c = method.get("chosen")
    return method["sweep"][c["index"]] if c else None


def _seed_entry(run: dict, method: dict) -> dict[str, Any]:
    tests = method.get("test", {}).get("exact", {}).get("tasks", {})
    return {
        "lr": run["lr"],
        "lr_s": run.get("lr_s"),
        "answer_loss": run["log"]["answer_loss"],
        "heldout_answer_loss": run["heldout"]["answer_loss"],
        "exact": {t: e["accuracy"] for t, e in tests.items()},
        "tan_alpha": [{"step": c["step"], **c["tan_alpha"]} for c in run["checkpoints"] if c.get("tan_alpha")],
        "step_ms": run["step_ms"],
        "tokens_per_s": run["tokens"] / run["train_seconds"] if run["train_seconds"] else None,
        "peak_mem_gb": run["peak_mem_gb"],
        "trainable_params": run["trainable_params"],
        "workers": run["workers"],
        "tokens": run["tokens"],
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
            for name, m in d["methods"].items():
                run = _chosen_run(m)
                if run is not None and "test" in m:
                    methods.setdefault(name, {"seeds": {}})["seeds"][str(k)] = _seed_entry(run, m)
        sweeps = {
            name: [
                {
                    "lr": r["lr"],
                    "heldout_answer_loss": r["heldout"]["answer_loss"],
                    "chosen": i == m.get("chosen", {}).get("index"),
                    "extension": r["lr"] in m.get("extended", []),
                }
                for i, r in enumerate(m["sweep"])
            ]
            for name, m in first["methods"].items()
        }
        finals = {
            name: smooth(e["seeds"]["0"]["answer_loss"], window)[-1] for name, e in methods.items() if "0" in e["seeds"]
        }
        loras = {n: v for n, v in finals.items() if n.startswith("lora")}
        better = min(loras, key=loras.get) if loras else None
        for name, e in methods.items():
            if better is not None:
                e["steps_to_better_lora_final"] = {
                    s: steps_to_reach(smooth(r["answer_loss"], window), loras[better]) for s, r in e["seeds"].items()
                }
            splits = sorted({t for r in e["seeds"].values() for t in r["exact"]})
            e["exact"] = {
                t: mean_interval([r["exact"][t] for r in e["seeds"].values() if t in r["exact"]]) for t in splits
            }
        base = first.get("base", {}).get("test", {}).get("exact", {}).get("tasks", {})
        tasks[task_dir.name] = {
            "steps": steps,
            "batch_size": first["config"]["batch_size"],
            "smoothing_window": window,
            "train_rows": first["data"]["train_rows"],
            "train_tokens": first["data"]["train_tokens"],
            "answer_tokens": first["data"]["answer_word_tokens"],
            "test_rows": first["data"]["test_rows_per_task"],
            "seeds": sorted(docs),
            "better_lora": better,
            "better_lora_final_answer_loss": loras.get(better),
            "base_exact": {t: e["accuracy"] for t, e in base.items()},
            "methods": methods,
            "sweeps": sweeps,
            "complete": all(d.get("complete") for d in docs.values()),
        }
    return {"benchmark": "learn_study", "devices": sorted(devices), "scale_note": SCALE_NOTE, "tasks": tasks}


def _fmt_interval(e: dict) -> str:
    if e["lo"] is None:
        return f"{100 * e['mean']:.1f} (1 seed)"
    return f"{100 * e['mean']:.1f} [{100 * e['lo']:.1f}, {100 * e['hi']:.1f}]"


def _task_md(name: str, t: dict) -> str:
    out = [
        f"## {name}\n",
        f"{t['train_rows']} training rows; every method {t['steps']} steps of {t['batch_size']} "
        f"({t['train_tokens']:,} training tokens, {t['answer_tokens']:,} answer tokens); seeds {t['seeds']}; "
        f"test rows {t['test_rows']}. Losses are trailing means over {t['smoothing_window']} steps.\n",
    ]
    splits = sorted({s for e in t["methods"].values() for s in e["exact"]})
    head = [
        "method",
        "LR (S LR)",
        "seeds",
        "final answer loss (seed 0)",
        f"steps to {t['better_lora']}'s final loss (per seed)",
    ] + [f"exact match % {s}" for s in splits]
    out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    if t["base_exact"]:
        out.append(
            "| base | | | | | " + " | ".join(f"{100 * t['base_exact'].get(s, float('nan')):.1f}" for s in splits) + " |"
        )
    for m, e in t["methods"].items():
        s0 = e["seeds"].get("0") or next(iter(e["seeds"].values()))
        lr = f"{s0['lr']:g}" + (f" ({s0['lr_s']:g})" if s0.get("lr_s") else "")
        final = smooth(s0["answer_loss"], t["smoothing_window"])[-1]
        reach = ", ".join("never" if v is None else str(v) for v in e.get("steps_to_better_lora_final", {}).values())
        cells = [m, lr, str(len(e["seeds"])), f"{final:.4f}", reach or "—"]
        cells += [_fmt_interval(e["exact"][s]) if s in e["exact"] else "—" for s in splits]
        out.append("| " + " | ".join(cells) + " |")
    out.append("\nLR sweeps (seed 0; selection by held-out answer loss):\n")
    out += ["| method | LR | held-out answer loss |", "|---|---|---|"]
    for m, rows in t["sweeps"].items():
        for r in rows:
            mark = (" (past the grid)" if r["extension"] else "") + (" (chosen)" if r["chosen"] else "")
            out.append(f"| {m} | {r['lr']:g}{mark} | {r['heldout_answer_loss']:.4f} |")
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
    out += [
        "\nSpeed (seed 0's chosen run; runs shared the device with `workers` others, so these compare methods "
        "only at equal workers):\n",
        "| method | trainable | workers | ms/step | tokens/s | peak GiB |",
        "|---|---|---|---|---|---|",
    ]
    for m, e in t["methods"].items():
        s0 = e["seeds"].get("0") or next(iter(e["seeds"].values()))
        peak = "—" if s0["peak_mem_gb"] is None else f"{s0['peak_mem_gb']:.2f}"
        tps = "—" if s0["tokens_per_s"] is None else f"{s0['tokens_per_s']:,.0f}"
        out.append(f"| {m} | {s0['trainable_params']:,} | {s0['workers']} | {s0['step_ms']:.1f} | {tps} | {peak} |")
    return "\n".join(out) + "\n"


def render(doc: dict[str, Any], out: Path) -> list[Path]:
    """``report.md`` and one loss plot per task, from ``learn_study.json``'s content alone."""
    text = (
        "# Does frod-ds' FRoD learn like FRoD? Generated tasks on a real model\n\n"
        f"_Generated by `python -m studies.learn_study report` from `learn_study.json`; devices: "
        f"{', '.join(doc['devices']) or '—'}._\n\n**Scale.** {doc['scale_note']}\n\n"
        + "\n".join(_task_md(n, t) for n, t in doc["tasks"].items())
    )
    paths = [out / "report.md"]
    paths[0].write_text(text)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for name, t in doc["tasks"].items():
        fig, ax = plt.subplots(figsize=(7.5, 4.5))
        for m, e in t["methods"].items():
            for s, r in sorted(e["seeds"].items()):
                ys = smooth(r["answer_loss"], t["smoothing_window"])
                ax.plot(
                    range(1, len(ys) + 1),
                    ys,
                    lw=1.6 if s == "0" else 0.6,
                    alpha=1 if s == "0" else 0.5,
                    color=f"C{list(t['methods']).index(m)}",
                    label=m if s == "0" else None,
                )
        if t["better_lora_final_answer_loss"] is not None:
            ax.axhline(t["better_lora_final_answer_loss"], color="k", ls=":", lw=1)
        ax.set_yscale("log")
        ax.set_xlabel(f"step (dotted: {t['better_lora']}'s final loss; thin: other seeds)")
        ax.set_ylabel("answer-token loss")
        ax.set_title(f"{name}: answer-token loss, trailing mean of {t['smoothing_window']} steps")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(out / f"loss_{name}.png")
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    return paths
