"""Per-task accuracy from per-row predictions, and the Markdown table beside the paper's numbers.

Pure functions over plain dicts: `summarize` turns one mode's prediction records (one per row, as
``frod_ds.eval.run`` writes to ``predictions.jsonl``) into that mode's part of ``results.json``, and
`markdown_table` renders the modes of a run side by side. Accuracies are fractions in [0, 1]; the
table shows percent.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["PAPER_RESULTS", "PAPER_MODEL", "MODE_NOTES", "summarize", "markdown_table"]

# FRoD paper, commonsense reasoning table, LLaMA2-7B, accuracy % (project spec FROD_SPEC §4). The paper's avg is
# the mean over these six tasks; it reports no ARC numbers.
PAPER_MODEL = "LLaMA2-7B"
PAPER_RESULTS: dict[str, dict[str, float]] = {
    "FRoD s=0.02": {
        "boolq": 87.74,
        "piqa": 83.62,
        "siqa": 81.17,
        "hellaswag": 93.28,
        "winogrande": 80.98,
        "obqa": 74.40,
    },
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


# One sentence per mode under the table.
MODE_NOTES = {
    "loglik": "loglik: argmax of the choices' summed log-probabilities "
    "(norm: divided by the answer's length in characters).",
    "generate": "generate: greedy decoding, the earliest answer string in the output.",
    "llm-adapters": "llm-adapters: LLM-Adapters' commonsense protocol (beam search of 4, 32 new tokens, first answer "
    "word after \"### Response:\"), the scoring of LLM-Adapters' and DoRA's published numbers.",
}
_UNMATCHED_NOTE = "unmatched: rows whose output holds no answer (counted wrong)."


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def summarize(records: Sequence[dict[str, Any]], tasks: Sequence[str], mode: str) -> dict[str, Any]:
    """``{"tasks": {task: {"accuracy", "n", "correct", ...}}, "average", ...}`` from per-row records.

    Each record has ``task`` and ``correct`` (bool); loglik records also ``correct_norm``,
    generate and llm-adapters records ``pred`` (None when no answer was found: ``unmatched``). ``average`` is the
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


def _mode_columns(mode: str) -> list[tuple[str, Callable[[Sequence[dict[str, Any]]], str]]]:
    """(header, cell of one or more task entries) of one mode's columns; several entries make an average row."""

    def acc(key: str) -> Callable[[Sequence[dict[str, Any]]], str]:
        return lambda entries: _pct(_mean([e[key] for e in entries]))

    if mode == "loglik":
        return [("loglik", acc("accuracy")), ("loglik norm", acc("accuracy_norm"))]
    return [(mode, acc("accuracy")), (f"{mode} unmatched", lambda entries: str(sum(e["unmatched"] for e in entries)))]


def markdown_table(results_by_mode: Mapping[str, dict[str, Any]], title: str | None = None) -> str:
    """Markdown table: one row per task and average rows; per mode its accuracy in % (loglik also the
    length-normalised one, generation modes the count of unmatched rows), the paper's methods beside.

    ``results_by_mode`` maps each mode to its `summarize` result; all modes scored the same rows, so
    one ``n`` column counts them. The paper columns of an average row hold the paper's mean over the
    same tasks (its own avg when all six are present); ARC has no paper number ("—").
    """
    modes = list(results_by_mode)
    assert modes, "markdown_table needs at least one mode"
    tasks = list(results_by_mode[modes[0]]["tasks"])
    for mode in modes:
        per_task = results_by_mode[mode]["tasks"]
        assert list(per_task) == tasks, f"mode {mode} scored tasks {list(per_task)}, not {tasks}"
        assert all(per_task[t]["n"] == results_by_mode[modes[0]]["tasks"][t]["n"] for t in tasks), (
            f"mode {mode} scored other row counts than {modes[0]}"
        )
    columns = [(mode, header, cell) for mode in modes for header, cell in _mode_columns(mode)]
    methods = list(PAPER_RESULTS)
    head = ["task", "n"] + [header for _, header, _ in columns] + [f"paper {m}" for m in methods]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(cells) + " |"

    def paper_cells(over: Sequence[str]) -> list[str]:
        if not over or any(t not in PAPER_TASKS for t in over):
            return ["—"] * len(methods)
        return [f"{_mean([PAPER_RESULTS[m][t] for t in over]):.2f}" for m in methods]

    def row(label: str, over: Sequence[str]) -> str:
        n = sum(results_by_mode[modes[0]]["tasks"][t]["n"] for t in over)
        cells = [cell([results_by_mode[mode]["tasks"][t] for t in over]) for mode, _, cell in columns]
        return line([label, str(n)] + cells + paper_cells(over))

    lines = []
    if title:
        lines += [title, ""]
    lines += [line(head), line(["---"] + ["---:"] * (len(head) - 1))]
    lines += [row(TASK_NAMES.get(task, task), [task]) for task in tasks]
    lines.append(row("**average**", tasks))
    paper = [t for t in tasks if t in PAPER_TASKS]
    if paper and len(paper) < len(tasks):
        lines.append(row("average (paper's tasks)", paper))
    notes = [MODE_NOTES[m] for m in modes] + ([_UNMATCHED_NOTE] if any(m != "loglik" for m in modes) else [])
    lines += [
        "",
        "Accuracy in %; average rows: unweighted mean over their tasks. " + " ".join(notes),
        f"Paper columns: the FRoD paper's commonsense results on {PAPER_MODEL}.",
    ]
    return "\n".join(lines) + "\n"
