"""Which job of the study comes next, decided from the records so far (no torch, no I/O; ``runner`` acts on it).

A method's sweep is its configured grid plus any recorded LR past it. Its best run is the best held-out
accuracy (ties: lower held-out answer-word loss; ``--select-by answer_loss``: that loss alone); adding a run
can only replace the best, never bring back an earlier one. So only each method's current best needs its
weights kept and, before they go with the command, its test results.

Jobs, in priority: score a method's best run once no more training of that method can start in this command;
train the next run: grid rounds centre out (every method's middle LR, then low, then high), then one LR past
an end its complete sweep chose (``next_lr``, up to ``--extend`` times), then a settled best run whose test
results were lost with its weights. A run starts only if its predicted time (the longest recorded run of its
method, else of any method, × 1.1) ends before ``train_deadline``; an evaluation only if it ends before
``deadline``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

from studies.config import MethodSpec, StudyConfig, method_spec
from studies.records import RunRecord

__all__ = ["Key", "Schedule", "next_lr", "sweep_order"]

Key = tuple[str, float]  # (method, lr)


def sweep_order(n: int) -> list[int]:
    """Sweep indices centre first, then outwards (3 LRs: middle, low, high)."""
    return sorted(range(n), key=lambda i: (abs(i - (n - 1) / 2), i))


def next_lr(end: float, inner: float) -> float:
    """The LR one step past ``end`` away from its neighbour ``inner``: the step ``end / inner`` again, put on
    the half-decade grid (1 and 3 × 10^k) when that stays past ``end`` (1e-4, 3e-4 → 3e-5; 3e-4, 1e-4 → 1e-3)."""
    raw = end * end / inner
    k = math.floor(math.log10(raw))
    grid = [float(f"{c}e{e}") for e in (k - 1, k, k + 1) for c in (1, 3)]
    nice = min(grid, key=lambda c: abs(math.log(c / raw)))
    beyond = nice > end if raw > end else nice < end
    return float(f"{(nice if beyond else raw):.3g}")


def _alike(a: MethodSpec, b: MethodSpec) -> bool:
    """Two methods that train at about one speed: one kind, one precision."""
    return a.kind == b.kind and a.fp32 == b.fp32


class Schedule:
    """The runs recorded so far (``runs``), the weights at hand (``states``), the jobs out (``in_flight``)."""

    def __init__(
        self,
        cfg: StudyConfig,
        runs: dict[Key, RunRecord],
        deadline: float,
        train_deadline: float,
        tmp: Path | None,
        log: Callable[[str], None],
        warn: Callable[[str], None],
    ):
        self.cfg, self.runs, self.deadline, self.train_deadline = cfg, runs, deadline, train_deadline
        self.tmp, self.log, self.warn = tmp, log, warn
        self.states: dict[Key, Path] = {}  # trained weights of runs of this command (only each method's best kept)
        self.in_flight: dict[Key, str] = {}  # → "train" | "eval"

    def methods(self) -> list[str]:
        extra = sorted({m for m, _ in self.runs} - set(self.cfg.methods))
        return list(self.cfg.methods) + extra

    def grid(self, m: str) -> list[float]:
        return sorted(self.cfg.lrs.get(m, ()))

    def recorded(self, m: str) -> list[float]:
        return sorted(lr for name, lr in self.runs if name == m)

    def sweep(self, m: str) -> list[float]:
        return sorted(set(self.grid(m)) | set(self.recorded(m)))

    def best(self, m: str) -> RunRecord | None:
        runs = [self.runs[(m, lr)] for lr in self.recorded(m)]
        if not runs:
            return None
        if self.cfg.select_by == "accuracy":
            return min(runs, key=lambda r: (-r.heldout["accuracy"], r.heldout["answer_loss"]))
        return min(runs, key=lambda r: r.heldout["answer_loss"])

    def grid_complete(self, m: str) -> bool:
        return all((m, lr) in self.runs for lr in self.grid(m))

    def training(self, m: str) -> bool:
        return any(name == m and kind == "train" for (name, _), kind in self.in_flight.items())

    def extension(self, m: str) -> float | None:
        """The next LR past the end its complete sweep chose, while ``--extend`` allows; None otherwise."""
        best = self.best(m)
        if best is None or not self.grid_complete(m) or self.training(m):
            return None
        sweep = self.sweep(m)
        extra = [lr for lr in sweep if lr not in self.grid(m)]
        if len(sweep) < 2 or len(extra) >= self.cfg.extend or best.lr not in (sweep[0], sweep[-1]):
            return None
        return next_lr(sweep[0], sweep[1]) if best.lr == sweep[0] else next_lr(sweep[-1], sweep[-2])

    def settled(self, m: str) -> bool:
        """Its choice can no longer change: the grid is complete, nothing of it trains, no extension is due."""
        return self.grid_complete(m) and not self.training(m) and self.extension(m) is None

    def wanted_training(self) -> list[Key]:
        """Runs still to train, in order: grid rounds (centre out, every method per round), extensions, then
        settled best runs whose test results were lost with their weights."""
        methods = [m for m in self.cfg.methods]
        out: list[Key] = []
        n = max(len(self.grid(m)) for m in methods)
        for i in sweep_order(n):
            out += [(m, self.grid(m)[i]) for m in methods if i < len(self.grid(m))]
        out = [k for k in out if k not in self.runs]
        for m in methods:
            lr = self.extension(m)
            if lr is not None:
                out.append((m, lr))
        for m in methods:
            best = self.best(m)
            if best is not None and best.test is None and self.settled(m) and (m, best.lr) not in self.states:
                out.append((m, best.lr))
        return [k for k in out if k not in self.in_flight]

    def predicted_wall(self, m: str) -> float:
        """1.1 × the longest run of ``m`` so far, else of its kind and precision (a FRoD ratio runs at FRoD's
        speed, not at stock PEFT FRoD's), else 2 × of its kind (fp32 against bf16), else of any method."""
        spec = method_spec(m)
        mine = [r.wall_seconds for (name, _), r in self.runs.items() if name == m]
        alike = [r.wall_seconds for (name, _), r in self.runs.items() if _alike(method_spec(name), spec)]
        kin = [2 * r.wall_seconds for (name, _), r in self.runs.items() if method_spec(name).kind == spec.kind]
        every = [r.wall_seconds for r in self.runs.values()]
        return 1.1 * max(mine or alike or kin or every or [0.0])

    def predicted_eval(self) -> float:
        """The longest test evaluation so far; before any, half the eval reserve (which holds two rounds)."""
        seconds = [sum(p.get("seconds", 0.0) for p in r.test.values()) for r in self.runs.values() if r.test]
        return 1.1 * max(seconds) if seconds else 30 * self.cfg.eval_reserve_minutes

    def startable(self, key: Key, now: float) -> bool:
        return now + self.predicted_wall(key[0]) <= self.train_deadline

    def next_job(self, now: float) -> tuple | None:
        """The job to hand out now, marked in flight, or None (nothing wanted can start now)."""
        wanted = self.wanted_training()
        for m in self.methods():
            best = self.best(m)
            key = None if best is None else (m, best.lr)
            if key is None or best.test is not None or key in self.in_flight or key not in self.states:
                continue
            if self.training(m) or any(k[0] == m and self.startable(k, now) for k in wanted):
                continue  # a run of this method is still to come in this command: it may become the best
            if now + self.predicted_eval() > self.deadline:
                self.warn(
                    f"TEST EVAL DID NOT FIT: {m} lr={best.lr:g} (--max-minutes {self.cfg.max_minutes}); "
                    "the next command trains it again and scores it"
                )
                continue
            self.in_flight[key] = "eval"
            self.log(f"{m} lr={best.lr:g}: test evaluation ({'chosen' if self.settled(m) else 'best so far'})")
            return ("eval", m, best.lr, str(self.states[key]))
        for key in wanted:
            if self.startable(key, now):
                self.in_flight[key] = "train"
                # cut a run that overruns its prediction halfway into the eval reserve
                stop = self.deadline - 30 * self.cfg.eval_reserve_minutes
                path = self.tmp / f"state_{key[0]}_{key[1]!r}.pt"
                return ("train", key[0], key[1], stop, str(path))
        return None
