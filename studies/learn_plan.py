"""Device seconds of the learnability study's units, and their grouping into GPU calls (``learn_study plan``).

A unit's wall time on one GPU shared by ``workers`` runs: rounds of concurrent runs (each ``steps`` steps at the
shared step time plus its evaluations), a study's setup, the tail of test evaluations. The constants are
estimates until measured (``from_results`` reads them off recorded runs); the plan is a schedule, not a result.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["Costs", "units", "calls", "from_results"]


@dataclass
class Costs:
    step_shared_s: float = 0.40  # one run's step with `workers` runs on the GPU (H200 alone: 0.11-0.23 s)
    run_overhead_s: float = 15.0  # a run's build, checkpoint and validation evaluations, shared
    test_eval_s: float = 15.0  # the test evaluation of a chosen run, shared
    setup_s: float = 20.0  # a study's setup: model load, tokenizing, base evaluations (workers already up)
    step_alone_s: float = 0.25  # timing unit: the slowest method's step alone
    build_alone_s: float = 6.0  # timing unit: a method's build (HJD / PEFT's init) alone
    workers: int = 6


def units(
    task: str, steps: int, methods: int, seeds: int, costs: Costs, timed: int = 7, warmup_plus_timed: int = 35
) -> list[dict[str, Any]]:
    """The units of one task in order, each with its estimated seconds on one GPU."""
    c = costs
    run = steps * c.step_shared_s + c.run_overhead_s
    sweep_runs = 3 * methods + math.ceil(methods / 2)  # 3 LRs each, about one extension per two methods
    rounds = math.ceil(sweep_runs / c.workers) + 1  # + the extensions, which wait for their method's grid
    seed_rounds = math.ceil((methods + 0.5) / c.workers)
    tail = c.test_eval_s
    return [
        {"task": task, "unit": "sweep", "runs": sweep_runs, "seconds": c.setup_s + rounds * run + c.test_eval_s},
        {"task": task, "unit": "variants", "runs": 3.5, "seconds": c.setup_s + 1.5 * run + c.test_eval_s},
        *(
            {"task": task, "unit": f"seed{k}", "runs": methods + 0.5, "seconds": c.setup_s + seed_rounds * run + tail}
            for k in range(1, seeds)
        ),
        {
            "task": task,
            "unit": "timing",
            "runs": timed,
            "seconds": c.setup_s + timed * (c.build_alone_s + warmup_plus_timed * c.step_alone_s),
        },
    ]


def calls(per_gpu: list[list[dict[str, Any]]], work_s: float) -> list[list[list[str]]]:
    """Units per call and GPU: each GPU works through its list; a call holds ``work_s`` seconds of work per GPU (a
    unit cut by a call's end goes on in the next: ``name (part)``)."""
    queues = [[dict(u) for u in units_] for units_ in per_gpu]
    out = []
    while any(queues):
        call = []
        for q in queues:
            left, names = work_s, []
            while q and left > 0:
                u = q[0]
                take = min(left, u["seconds"])
                whole = take == u["seconds"]
                names.append(f"{u['task']} {u['unit']}" + ("" if whole else " (part)"))
                u["seconds"] -= take
                left -= take
                if whole:
                    q.pop(0)
            call.append(names)
        out.append(call)
    return out


def from_results(results: Path, costs: Costs) -> Costs:
    """``costs`` with the shared step time, run overhead and test evaluation time measured in ``results``."""
    runs, evals, alone = [], [], []
    for doc_path in results.glob("*/seed*/real_study.json"):
        doc = json.loads(doc_path.read_text())
        for m in doc["methods"].values():
            runs += m["sweep"]
            if m.get("test"):
                evals.append(sum(p.get("seconds", 0.0) for p in m["test"].values()))
    for t in results.glob("*/timing.json"):
        alone += [a["step_ms"] / 1e3 for a in json.loads(t.read_text())["methods"].values()]
    if not runs:
        return costs
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    out = Costs(**asdict(costs))
    out.step_shared_s = med([r["step_ms"] / 1e3 for r in runs])
    out.run_overhead_s = med([r["wall_seconds"] - r["train_seconds"] for r in runs])
    out.workers = max(r["workers"] for r in runs)
    if evals:
        out.test_eval_s = med(evals)
    if alone:
        out.step_alone_s = max(alone)
    return out
