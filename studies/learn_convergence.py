"""The learnability study's headline: which tasks count (the arithmetic pilot gate) and the convergence line the
README quotes (frod-ds FRoD's steps and seconds to the better LoRA's final validation loss, and the test exact
match of FRoD, that LoRA and full fine-tuning)."""

from __future__ import annotations

from typing import Any

from studies.config import ARITH_GATE

__all__ = ["NOT_REACHED", "arith_gate", "convergence", "headline_split"]

NOT_REACHED = "not reached"


def arith_gate(task: str, methods: dict[str, Any]) -> dict[str, Any] | None:
    """An arithmetic task's pilot gate (``ARITH_GATE``): full fine-tuning's exact match on the unseen pairs."""
    if not task.startswith("arith"):
        return None
    got = methods.get(ARITH_GATE["method"], {}).get("exact", {}).get(ARITH_GATE["split"])
    mean = None if got is None else got["mean"]
    passed = None if mean is None else mean >= ARITH_GATE["min_exact"]
    return {
        **{k: v for k, v in ARITH_GATE.items() if k != "pilot_only"},
        "exact": mean,
        "passed": passed,
        "excluded": passed is False and task in ARITH_GATE["pilot_only"],
    }


def headline_split(name: str, methods: dict[str, Any]) -> str | None:
    """The test split a task's line quotes: an arithmetic task's gate split (unseen operand pairs), a fact base's
    questions (``<task>_qa``: the facts asked in another wording); None where frod has no result on it."""
    split = ARITH_GATE["split"] if name.startswith("arith") else f"{name}_qa"
    return split if split in methods.get("frod", {}).get("exact", {}) else None


def _exact_said(name: str, t: dict[str, Any]) -> str:
    """`` (exact match on SPLIT: frod A%, lora64 B%, full C%)`` over the methods that have it, or ``""``."""
    split = headline_split(name, t["methods"])
    if split is None:
        return ""
    order = ["frod", t["better_lora"], "full"]
    got = [(m, t["methods"].get(m, {}).get("exact", {}).get(split)) for m in order]
    return f" (exact match on {split}: " + ", ".join(f"{m} {100 * e['mean']:.1f}%" for m, e in got if e) + ")"


def convergence(tasks: dict[str, Any]) -> dict[str, Any]:
    """Per task: frod's steps and seconds (alone) to the better LoRA's final validation loss, over its seeds,
    against that LoRA's own steps (its run length) and seconds; the sentence the README quotes."""
    rows = {}
    for name, t in tasks.items():
        e = t["methods"].get("frod")
        lora = t["methods"].get(t["better_lora"] or "")
        if not e or not lora or "steps_to_better_lora_final" not in e or (t.get("gate") or {}).get("excluded"):
            continue
        reach = list(e["steps_to_better_lora_final"].values())
        secs = [v for v in e.get("seconds_to_better_lora_final", {}).values() if v is not None]
        lora_alone = lora.get("alone")
        rows[name] = {
            "better_lora": t["better_lora"],
            "frod_steps": reach,
            "steps": t["steps"],
            "reached": sum(v is not None for v in reach),
            "seeds": len(reach),
            "provisional": bool(t.get("open_sweeps")),
            "frod_seconds_mean": sum(secs) / len(secs) if secs else None,
            "lora_seconds": None
            if not lora_alone
            else lora_alone["build_seconds"] + t["steps"] * lora_alone["step_ms"] / 1e3,
        }
    parts: dict[bool, list[str]] = {False: [], True: []}
    for name, r in rows.items():
        got = [v for v in r["frod_steps"] if v is not None]
        median = " (median)" if len(got) > 1 else ""
        steps = f"step {sorted(got)[len(got) // 2]} of {r['steps']}{median}" if got else NOT_REACHED
        parts[r["provisional"]].append(
            f"{name}: {r['reached']}/{r['seeds']} seeds, {steps}{_exact_said(name, tasks[name])}"
        )
    said = []
    if parts[False]:
        lead = "frod-ds FRoD against the better LoRA's final validation loss on SmolLM2-135M (seeds that reached it) — "
        said.append(lead + "; ".join(parts[False]))
    if parts[True]:
        said.append(
            "Provisionally (LR sweeps still open, the choices may change): " + "; ".join(parts[True])
            if parts[False]
            else "No task's LR sweeps are complete yet; provisionally (the choices may change), frod-ds FRoD against "
            "the better LoRA's final validation loss on SmolLM2-135M (seeds that reached it) — "
            + "; ".join(parts[True])
        )
    return {"tasks": rows, "sentence": ". ".join(said) or None}
