"""The study's report: smoothing, steps-to-loss, the paper's claim, plots and tables of the results document.

Steps-to-loss: the per-step losses of all runs come from the same batches in the same order, so curves are
compared step by step. A curve is smoothed by a trailing mean over ``window`` steps; FRoD "reaches" a LoRA
run's final loss at the first step where FRoD's smoothed curve is at or below LoRA's smoothed value at its
last step. Accuracy differences are paired (same test rows): ``d_i = correct_FRoD,i - correct_LoRA,i``,
mean ± 1.96·SE; "matches or beats" means the difference is not significantly negative.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "RESULTS_NAME",
    "smooth",
    "smooth_window",
    "steps_to_reach",
    "paired_difference",
    "claim",
    "write_plots",
    "correct_bits",
    "sweep_table",
    "markdown_tables",
]

RESULTS_NAME = "real_study.json"


def smooth_window(steps: int, frac: float) -> int:
    return max(1, int(round(frac * steps)))


def smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean: ``out[t] = mean(values[max(0, t-window+1) .. t])``."""
    out, acc = [], 0.0
    for t, v in enumerate(values):
        acc += v
        if t >= window:
            acc -= values[t - window]
        out.append(acc / min(t + 1, window))
    return out


def steps_to_reach(curve: Sequence[float], target: float) -> int | None:
    """First 1-based step whose value is ``<= target``, or None."""
    return next((t + 1 for t, v in enumerate(curve) if v <= target), None)


def correct_bits(records: Sequence[dict], tasks: Sequence[str]) -> dict[str, str]:
    """``{task: "0110..."}`` of per-row correctness in (task, id) order, for paired comparisons later."""
    out = {}
    for task in tasks:
        rows = sorted((r for r in records if r["task"] == task), key=lambda r: r["id"])
        out[task] = "".join("1" if r["correct"] else "0" for r in rows)
    return out


def paired_difference(bits_a: dict[str, str], bits_b: dict[str, str]) -> dict[str, Any]:
    """Paired accuracy difference a − b over all rows (micro) and the mean of per-task differences (macro)."""
    d, per_task = [], {}
    for task in bits_a:
        da = [int(x) - int(y) for x, y in zip(bits_a[task], bits_b[task], strict=True)]
        per_task[task] = sum(da) / len(da)
        d += da
    n = len(d)
    mean = sum(d) / n
    var = sum((x - mean) ** 2 for x in d) / max(1, n - 1)
    se = math.sqrt(var / n)
    return {
        "n": n,
        "micro_diff": mean,
        "micro_ci95": 1.96 * se,
        "macro_diff": sum(per_task.values()) / len(per_task),
        "per_task_diff": per_task,
        "significantly_worse": mean + 1.96 * se < 0,
        "significantly_better": mean - 1.96 * se > 0,
    }


def claim(methods: dict[str, dict], frod: str, loras: Sequence[str], window: int, total_steps: int) -> dict[str, Any]:
    """The paper's claim, per LoRA baseline: FRoD reaches LoRA's final training loss in <= 0.5x the steps
    (smoothed answer-word loss; whole-response loss beside it) and matches or beats its test accuracy."""
    out: dict[str, Any] = {"smoothing_window_steps": window, "total_steps": total_steps, "vs": {}}
    f = methods.get(frod, {})
    f_run = f.get("sweep", [])[f["chosen"]["index"]] if "chosen" in f else None
    for name in loras:
        m = methods.get(name, {})
        if f_run is None or "chosen" not in m:
            out["vs"][name] = {"available": False}
            continue
        l_run = m["sweep"][m["chosen"]["index"]]
        entry: dict[str, Any] = {"available": True}
        for key in ("answer_loss", "response_loss"):
            target = smooth(l_run["log"][key], window)[-1]
            reach = steps_to_reach(smooth(f_run["log"][key], window), target)
            entry[key] = {
                "lora_final_smoothed": target,
                "frod_final_smoothed": smooth(f_run["log"][key], window)[-1],
                "frod_steps_to_lora_final": reach,
                "ratio": None if reach is None else reach / len(l_run["log"][key]),
                "frod_sweep_steps_to_lora_final": [
                    steps_to_reach(smooth(r["log"][key], window), target) for r in f["sweep"]
                ],
            }
        ratio = entry["answer_loss"]["ratio"]
        entry["loss_claim_holds"] = ratio is not None and ratio <= 0.5
        acc_ok = []
        for protocol in f.get("test", {}):
            if protocol in m.get("test", {}):
                diff = paired_difference(f["test"][protocol]["correct_bits"], m["test"][protocol]["correct_bits"])
                diff["frod_average"] = f["test"][protocol]["average"]
                diff["lora_average"] = m["test"][protocol]["average"]
                entry[f"accuracy_{protocol}"] = diff
                acc_ok.append(not diff["significantly_worse"])
        entry["accuracy_claim_holds"] = bool(acc_ok) and all(acc_ok)
        entry["claim_holds"] = entry["loss_claim_holds"] and entry["accuracy_claim_holds"]
        out["vs"][name] = entry
    return out


def write_plots(doc: dict[str, Any], out_dir: Path) -> list[Path]:
    """loss_vs_step.png, accuracy_vs_step.png and lr_sweep.png from the results document."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = {k: v for k, v in doc.get("methods", {}).items() if v.get("sweep")}
    if not methods:
        return []
    colors = dict(zip(methods, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    window = doc.get("claim", {}).get("smoothing_window_steps") or smooth_window(
        doc["data"]["steps"], doc["config"]["smooth_frac"]
    )
    paths = []

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    for ax, key, title in (
        (axes[0], "response_loss", "whole-response loss (answer + EOS)"),
        (axes[1], "answer_loss", "answer-word loss"),
    ):
        for name, m in methods.items():
            chosen = m.get("chosen", {}).get("index")
            for i, run in enumerate(m["sweep"]):
                ys = smooth(run["log"][key], window)
                main = i == chosen
                ax.plot(
                    range(1, len(ys) + 1),
                    ys,
                    color=colors[name],
                    lw=1.8 if main else 0.7,
                    alpha=1.0 if main else 0.35,
                    label=f"{name} lr={run['lr']:g}" + (" (chosen)" if main else ""),
                )
        for name, entry in doc.get("claim", {}).get("vs", {}).items():
            if entry.get("available"):
                ax.axhline(entry[key]["lora_final_smoothed"], color=colors[name], ls=":", lw=1)
                if entry[key]["frod_steps_to_lora_final"]:
                    ax.axvline(entry[key]["frod_steps_to_lora_final"], color=colors[name], ls=":", lw=1)
        ax.set_yscale("log")
        ax.set_xlabel("optimizer step (dotted: LoRA's final loss, and the step where FRoD reaches it)")
        ax.set_title(f"{title}, trailing mean of {window} steps")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    paths.append(out_dir / "loss_vs_step.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    base = doc.get("step0", {})
    for name, m in methods.items():
        if "chosen" not in m:
            continue
        run = m["sweep"][m["chosen"]["index"]]
        pts = [(0, base.get("test_slice_average"), base.get("heldout_accuracy"))] + [
            (c["step"], c["test_slice_average"], c["heldout_accuracy"]) for c in run["checkpoints"]
        ]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=colors[name], label=f"{name}: test slice")
        ax.plot(
            [p[0] for p in pts],
            [p[2] for p in pts],
            "x--",
            color=colors[name],
            alpha=0.6,
            label=f"{name}: held-out train slice",
        )
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("log-likelihood accuracy (mean over tasks)")
    per_task = doc["data"].get("curve_rows_per_task", {})
    rows = f"{min(per_task.values())}-{max(per_task.values())}" if per_task else "?"
    ax.set_title(
        f"accuracy vs step, each method at its chosen LR\n(test slice: first {rows} rows of each of "
        f"{len(per_task)} tasks)",
        fontsize=10,
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out_dir / "accuracy_vs_step.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4))
    for name, m in methods.items():
        done = [r for r in m["sweep"] if r.get("heldout")]
        lrs = [r["lr"] for r in done]
        axes[0].plot(lrs, [r["heldout"]["accuracy"] for r in done], "o-", color=colors[name], label=name)
        axes[1].plot(lrs, [r["heldout"]["answer_loss"] for r in done], "o-", color=colors[name], label=name)
    for ax, label in ((axes[0], "held-out accuracy (loglik)"), (axes[1], "held-out answer-word loss")):
        ax.set_xscale("log")
        ax.set_xlabel("learning rate (FRoD: sigma LR; S LR = 0.1x)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    paths.append(out_dir / "lr_sweep.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def sweep_table(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per run: method, LR, held-out accuracy and losses, final smoothed training losses, speed."""
    window = smooth_window(doc["data"]["steps"], doc["config"]["smooth_frac"])
    rows = []
    for name, m in doc.get("methods", {}).items():
        for i, run in enumerate(m["sweep"]):
            h = run.get("heldout") or {}
            rows.append(
                {
                    "method": name,
                    "lr": run["lr"],
                    "lr_s": run.get("lr_s"),
                    "completed": run["completed"],
                    "chosen": m.get("chosen", {}).get("index") == i,
                    "extension": run["lr"] in m.get("extended", []),
                    "heldout_accuracy": h.get("accuracy"),
                    "heldout_answer_loss": h.get("answer_loss"),
                    "final_answer_loss": smooth(run["log"]["answer_loss"], window)[-1] if run["steps"] else None,
                    "final_response_loss": smooth(run["log"]["response_loss"], window)[-1] if run["steps"] else None,
                    "step_ms": run["step_ms"],
                    "trainable_params": run["trainable_params"],
                }
            )
    return rows


def markdown_tables(doc: dict[str, Any]) -> str:
    """The summary table (one row per method at its chosen LR) and per-task test accuracy per protocol."""
    methods = {k: v for k, v in doc.get("methods", {}).items() if "chosen" in v}
    window = smooth_window(doc["data"]["steps"], doc["config"]["smooth_frac"])
    vs = doc.get("claim", {}).get("vs", {})
    loras = [k for k in vs if vs[k].get("available")]
    head = ["method", "LR", "trainable", "ms/step", "final answer-word loss", "held-out acc"]
    head += [f"test {p}" for p in doc["config"]["protocols"]]
    head += [f"FRoD steps to {name}'s final loss" for name in loras]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, m in methods.items():
        run = m["sweep"][m["chosen"]["index"]]
        lr = (
            f"{run['lr']:g}"
            + (f" (S {run['lr_s']:g})" if "lr_s" in run else "")
            + (" ⚠ end" if m["chosen"]["at_sweep_end"] else "")
        )
        cells = [
            name,
            lr,
            f"{run['trainable_params']:,}",
            f"{run['step_ms']:.1f}",
            f"{smooth(run['log']['answer_loss'], window)[-1]:.4f}",
            f"{100 * run['heldout']['accuracy']:.2f}",
        ]
        cells += [
            f"{100 * m['test'][p]['average']:.2f}" if p in m.get("test", {}) else "—"
            for p in doc["config"]["protocols"]
        ]
        for lora in loras:
            a = vs[lora]["answer_loss"]
            cells.append(
                f"{a['frod_steps_to_lora_final']} / {doc['data']['steps']}"
                if name == "frod" and a["frod_steps_to_lora_final"] is not None
                else ("never" if name == "frod" else "")
            )
        lines.append("| " + " | ".join(cells) + " |")
    out = "\n".join(lines) + "\n"
    out += (
        "\nLR sweeps (held-out = train rows never trained on):\n\n| method | LR | held-out acc | held-out answer "
        "loss | final answer-word loss | ms/step |\n|---|---|---|---|---|---|\n"
    )
    for r in sweep_table(doc):
        fmt = lambda v, f: "—" if v is None else format(v, f)  # noqa: E731
        acc = None if r["heldout_accuracy"] is None else 100 * r["heldout_accuracy"]
        mark = (" (past the grid)" if r.get("extension") else "") + (" (chosen)" if r["chosen"] else "")
        out += (
            f"| {r['method']} | {r['lr']:g}{mark} | {fmt(acc, '.2f')} | "
            f"{fmt(r['heldout_answer_loss'], '.4f')} | {fmt(r['final_answer_loss'], '.4f')} | {r['step_ms']:.1f} |\n"
        )
    for p in doc["config"]["protocols"]:
        rows = {
            **({"base": doc["base"]["test"]} if "base" in doc else {}),
            **{k: v["test"] for k, v in methods.items() if "test" in v},
        }
        rows = {k: v[p] for k, v in rows.items() if p in v}
        if not rows:
            continue
        tasks = list(next(iter(rows.values()))["tasks"])
        out += f"\nTest accuracy (%), {p}:\n\n| method | " + " | ".join(tasks) + " | average |\n"
        out += "|" + "---|" * (len(tasks) + 2) + "\n"
        for k, s in rows.items():
            cells = [
                f"{100 * s['tasks'][t]['accuracy']:.2f} (n={s['tasks'][t]['n']})" if t in s["tasks"] else "—"
                for t in tasks
            ]
            out += f"| {k} | " + " | ".join(cells) + f" | {100 * s['average']:.2f} |\n"
    return out
