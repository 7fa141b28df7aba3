"""The learnability study's plots, from ``learn_study.json`` alone: per task the training and validation
answer-token loss of every method's chosen runs, and exact match by fact-base size (the saturation sweep)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from studies.report import smooth

__all__ = ["plot_tasks"]


def plot_tasks(doc: dict[str, Any], out: Path) -> list[Path]:
    """``loss_<task>.png`` per task and ``facts_by_size.png`` with two fact-base sizes or more; their paths."""
    paths: list[Path] = []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for name, t in doc["tasks"].items():
        base = t.get("base_validation_answer_loss")
        fig, axes = plt.subplots(1, 2, figsize=(13, 4.6))
        for m, e in t["methods"].items():
            color = f"C{list(t['methods']).index(m) % 10}"
            for s, r in sorted(e["seeds"].items()):
                main = dict(lw=1.6 if s == "0" else 0.6, alpha=1 if s == "0" else 0.5, color=color)
                ys = smooth(r["answer_loss"], t["smoothing_window"])
                axes[0].plot(range(1, len(ys) + 1), ys, label=m if s == "0" else None, **main)
                v = [[0, base]] + r["validation"] if base else r["validation"]
                axes[1].plot([p[0] for p in v], [p[1] for p in v], **main)
        if t["better_lora_final_validation_loss"] is not None:
            axes[1].axhline(t["better_lora_final_validation_loss"], color="k", ls=":", lw=1)
        axes[0].set_title(f"{name}: training answer-token loss (trailing mean of {t['smoothing_window']})")
        axes[1].set_title(f"validation answer-token loss from the base (dotted: {t['better_lora']}'s final)")
        for ax in axes:
            ax.set_yscale("log")
            ax.set_xlabel("step (thin: other seeds)")
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=7)
        fig.tight_layout()
        paths.append(out / f"loss_{name}.png")
        fig.savefig(paths[-1], dpi=90)
        plt.close(fig)
    sizes = sorted((int(n[5:]), n) for n in doc["tasks"] if re.fullmatch(r"facts\d+", n))
    if len(sizes) >= 2:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.4))
        for ax, split in zip(axes, ("recall", "qa")):
            methods = list(dict.fromkeys(m for _, n in sizes for m in doc["tasks"][n]["methods"]))
            for i, m in enumerate(methods):
                pts = [
                    (size, e["mean"], e["lo"], e["hi"])
                    for size, n in sizes
                    if (e := doc["tasks"][n]["methods"].get(m, {}).get("exact", {}).get(f"{n}_{split}"))
                ]
                if pts:
                    err = [[p[1] - (p[2] if p[2] is not None else p[1]) for p in pts]]
                    err.append([(p[3] if p[3] is not None else p[1]) - p[1] for p in pts])
                    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
                    ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, color=f"C{i % 10}", label=m)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("people in the fact base (3 facts each)")
            ax.set_ylabel(f"exact match, {split} (95% CI over seeds)")
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=7)
        fig.tight_layout()
        paths.append(out / "facts_by_size.png")
        fig.savefig(paths[-1], dpi=90)
        plt.close(fig)
    return paths
