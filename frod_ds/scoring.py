"""Per-task accuracy from per-row predictions, and the Markdown table beside the paper's numbers.

Pure functions over plain dicts: `summarize` turns prediction records (one per row, as
``launch/eval.py`` writes to ``predictions.jsonl``) into the ``results.json`` body, and
`markdown_table` renders it. Accuracies are fractions in [0, 1]; the table shows percent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["PAPER_RESULTS", "PAPER_MODEL", "summarize", "markdown_table"]

# FRoD paper, commonsense reasoning table, LLaMA2-7B, accuracy % (project spec FROD_SPEC §4). The paper's avg is
# the mean over these six tasks; it reports no ARC numbers.
PAPER_MODEL = "LLaMA2-7B"
PAPER_RESULTS: dict[str, dict[str, float]] = {
    "FRoD s=0.02": {"boolq": 87.74, "piqa": 83.62, "siqa": 81.17, "hellaswag": 93.28, "winogrande": 80.98, "obqa": 74.40},
    "Full FT": {"boolq": 88.50, "piqa": 83.79, "siqa": 81.16, "hellaswag": 92.50, "winogrande": 82.95, "obqa": 78.60},
    "LoRA": {"boolq": 69.80, "piqa": 79.90, "siqa": 70.50, "hellaswag": 83.60, "winogrande": 82.60, "obqa": 81.00},
    "DoRA": {"boolq": 71.80, "piqa": 83.10, "siqa": 79.90, "hellaswag": 89.10, "winogrande": 83.00, "obqa": 81.20},
}
PAPER_TASKS = tuple(PAPER_RESULTS["FRoD s=0.02"])

TASK_NAMES = {
    "boolq": "BoolQ",
    "piqa": "PIQA",
    "siqa": "SIQA",
    "hellaswag": "HellaSwag",
    "winogrande": "WinoGrande",
    "obqa": "OBQA",
    "arc_easy": "ARC-e",
    "arc_challenge": "ARC-c",
}


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def summarize(records: Sequence[dict[str, Any]], tasks: Sequence[str], mode: str) -> dict[str, Any]:
    """``{"tasks": {task: {"accuracy", "n", "correct", ...}}, "average", ...}`` from per-row records.

    Each record has ``task`` and ``correct`` (bool); loglik records also ``correct_norm``,
    generate records ``pred`` (None when no answer string was found). ``average`` is the
    unweighted mean of the task accuracies (the paper's avg); ``average_paper_tasks`` the same
    over the tasks the paper reports, when any were evaluated.
    """
    per_task: dict[str, dict[str, Any]] = {}
    for task in tasks:
        rows = [r for r in records if r["task"] == task]
        assert rows, f"no predictions for task {task!r}"
        entry: dict[str, Any] = {"accuracy": _mean([float(r["correct"]) for r in rows]), "n": len(rows)}
        entry["correct"] = sum(bool(r["correct"]) for r in rows)
        if mode == "loglik":
            entry["accuracy_norm"] = _mean([float(r["correct_norm"]) for r in rows])
            entry["correct_norm"] = sum(bool(r["correct_norm"]) for r in rows)
        else:
            entry["unmatched"] = sum(r["pred"] is None for r in rows)
        per_task[task] = entry

    results: dict[str, Any] = {"tasks": per_task, "average": _mean([e["accuracy"] for e in per_task.values()])}
    if mode == "loglik":
        results["average_norm"] = _mean([e["accuracy_norm"] for e in per_task.values()])
    paper = [t for t in tasks if t in PAPER_TASKS]
    if paper:
        results["average_paper_tasks"] = _mean([per_task[t]["accuracy"] for t in paper])
    results["n"] = sum(e["n"] for e in per_task.values())
    return results


def _pct(fraction: float) -> str:
    return f"{100 * fraction:.2f}"


def markdown_table(results: dict[str, Any], title: str | None = None) -> str:
    """Markdown table: one row per task and average rows, ours in %, the paper's methods beside.

    The paper columns of an average row hold the paper's mean over the same tasks (its own avg
    when all six are present); ARC has no paper number ("—").
    """
    per_task = results["tasks"]
    tasks = list(per_task)
    norm = all("accuracy_norm" in e for e in per_task.values())
    methods = list(PAPER_RESULTS)
    head = ["task", "n", "accuracy"] + (["acc_norm"] if norm else []) + [f"paper {m}" for m in methods]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(cells) + " |"

    def paper_cells(over: Sequence[str]) -> list[str]:
        if not over or any(t not in PAPER_TASKS for t in over):
            return ["—"] * len(methods)
        return [f"{_mean([PAPER_RESULTS[m][t] for t in over]):.2f}" for m in methods]

    lines = []
    if title:
        lines += [title, ""]
    lines += [line(head), line(["---"] + ["---:"] * (len(head) - 1))]
    for task in tasks:
        e = per_task[task]
        cells = [TASK_NAMES.get(task, task), str(e["n"]), _pct(e["accuracy"])]
        cells += [_pct(e["accuracy_norm"])] if norm else []
        lines.append(line(cells + paper_cells([task])))

    def average_row(label: str, over: Sequence[str]) -> str:
        cells = [label, str(sum(per_task[t]["n"] for t in over)), _pct(_mean([per_task[t]["accuracy"] for t in over]))]
        cells += [_pct(_mean([per_task[t]["accuracy_norm"] for t in over]))] if norm else []
        return line(cells + paper_cells(over))

    lines.append(average_row("**average**", tasks))
    paper = [t for t in tasks if t in PAPER_TASKS]
    if paper and len(paper) < len(tasks):
        lines.append(average_row("average (paper's tasks)", paper))
    lines += ["", f"Accuracy in %. Paper columns: the FRoD paper's commonsense results on {PAPER_MODEL}."]
    return "\n".join(lines) + "\n"
