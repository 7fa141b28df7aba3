"""The learnability study (``studies/learn_study.py``): generated tasks, every method, LR sweeps, then seeds.

Per task, the study directories under ``OUT/<task>/``, each one ``studies`` study (its records, identity,
resume and time budget unchanged):

    seed0/   the LR sweeps of the main methods (frod, peftfrod, lora16, lora64, full; extended past an end as
             the study does), then, once frod's choice is final, the S-rate ratios each side of 10:1
             (``frod_ratio3``, ``frod_ratio30``) at frod's chosen σ LR, added to the same directory
    seed1/, seed2/, ...   every method of seed0 at its chosen LR, with another seed (data order, LoRA init,
             FRoD support)

Every method of a task trains on the same batches for the same ``--steps`` (the same training tokens, recorded
as ``data.train_tokens``). A command works through the tasks in order until its time is spent; the next
command skips what is recorded (``--resume-from`` copies a carried-back directory in first).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from studies.config import StudyConfig, StudyError, parse_lrs
from studies.report import RESULTS_NAME
from studies.runner import run_study

__all__ = ["MAIN_METHODS", "RATIO_METHODS", "LearnConfig", "epochs_for_steps", "run_learn"]

MAIN_METHODS = ("frod", "peftfrod", "lora16", "lora64", "full")
RATIO_METHODS = ("frod_ratio3", "frod_ratio30")  # S LR = σ LR / 3 and / 30, each side of the paper's 10


@dataclass
class LearnConfig:
    model: str
    work: str  # the generated tasks: WORK/tasks/<task>/
    out: str
    tasks: list[str]
    methods: list[str] = field(default_factory=lambda: list(MAIN_METHODS))
    ratio_methods: list[str] = field(default_factory=lambda: list(RATIO_METHODS))
    lrs: list[str] = field(default_factory=list)  # --lrs METHOD=LR,... overrides
    steps: int = 72
    batch_size: int = 128
    seeds: int = 3
    max_minutes: float = 8.5
    eval_reserve_minutes: float = 1.5
    min_study_minutes: float = 2.5  # a task's study does not start with less than this left
    resume_from: str | None = None
    extend: int = 2
    workers: int = 0
    device: str = "auto"
    checkpoints: int = 6
    curve_limit: int = 64
    eval_batch: int = 64
    cutoff: int = 64


def epochs_for_steps(n_rows: int, batch: int, steps: int) -> float:
    """The ``epochs`` for which the study's ``BatchPlan`` makes exactly ``steps`` steps (it rounds up)."""
    per_epoch = n_rows // batch
    if per_epoch == 0:
        raise StudyError(f"{n_rows} training rows are fewer than one batch of {batch}; lower --batch-size")
    return (steps - 0.5) / per_epoch


def _study_config(
    cfg: LearnConfig, task: str, seed: int, methods: list[str], lrs: dict[str, tuple[float, ...]], extend: int
) -> StudyConfig:
    tdir = Path(cfg.work) / "tasks" / task
    n_rows = sum(1 for _ in open(tdir / "train.jsonl"))
    sub = f"{task}/seed{seed}"
    resume = Path(cfg.resume_from) / sub if cfg.resume_from else None
    study = StudyConfig(
        model=cfg.model,
        data=str(tdir),
        out=str(Path(cfg.out) / sub),
        heldout_file=str(tdir / "heldout.jsonl"),
        methods=methods,
        lrs=lrs,
        batch_size=cfg.batch_size,
        cutoff=cfg.cutoff,
        epochs=epochs_for_steps(n_rows, cfg.batch_size, cfg.steps),
        seed=seed,
        checkpoints=cfg.checkpoints,
        curve_limit=cfg.curve_limit,
        eval_batch=cfg.eval_batch,
        protocols=("loglik", "exact"),
        select_by="answer_loss",
        max_minutes=cfg.max_minutes,
        eval_reserve_minutes=cfg.eval_reserve_minutes,
        workers=cfg.workers,
        device=cfg.device,
        extend=extend,
        resume_from=str(resume) if resume is not None and (resume / "study.json").is_file() else None,
    )
    study.validate()
    return study


def _doc(out: Path) -> dict | None:
    path = out / RESULTS_NAME
    return json.loads(path.read_text()) if path.is_file() else None


def _chosen(doc: dict | None, method: str) -> float | None:
    """A method's LR once its choice is final (sweep complete, no extension due), else None."""
    m = (doc or {}).get("methods", {}).get(method, {})
    c = m.get("chosen")
    return c["lr"] if c and c["final"] else None


def _left(started: float, cfg: LearnConfig) -> float:
    return cfg.max_minutes - (time.time() - started) / 60


def _finished(study: StudyConfig) -> dict | None:
    """The results of ``study`` if every method it asks for is chosen for good and scored, in ``--out`` or in the
    directory it resumes from (then copied to ``--out``, so every command's output holds the whole study)."""
    for where in (study.out, study.resume_from):
        doc = _doc(Path(where)) if where else None
        methods = (doc or {}).get("methods", {})
        if doc and all(
            m in methods
            and "test" in methods[m]
            and methods[m]["chosen"]["final"]
            and set(study.lrs[m]) <= set(methods[m]["lrs"])
            for m in study.methods
        ):
            if Path(where) != Path(study.out):
                shutil.copytree(where, study.out, dirs_exist_ok=True)
            return doc
    return None


def _run(cfg: LearnConfig, study: StudyConfig, argv: list[str], started: float, log) -> dict | None:
    """Run one study with the time left of this command (its deadline is the command's); its results document.
    A finished study is not loaded again (that costs a model load per study and command)."""
    done = _finished(study)
    if done is not None:
        log(f"finished: {study.out} ({', '.join(study.methods)})")
        return done
    if _left(started, cfg) < cfg.min_study_minutes:
        log(f"left for a later command: {study.out} ({_left(started, cfg):.1f} min left)")
        if study.resume_from and not Path(study.out).exists():  # keep what was carried in, in this output
            shutil.copytree(study.resume_from, study.out)
        return _doc(Path(study.out))
    run_study(study, argv, started)
    return _doc(Path(study.out))


def run_learn(cfg: LearnConfig, argv: list[str], started: float, log=print) -> None:
    """Every task: sweeps (seed 0), the S-rate ratios at frod's σ, the other seeds at the chosen LRs."""
    for task in cfg.tasks:
        sweep = _study_config(cfg, task, 0, cfg.methods, parse_lrs(cfg.lrs, cfg.methods), cfg.extend)
        doc = _run(cfg, sweep, argv, started, log)
        chosen = {m: _chosen(doc, m) for m in cfg.methods}
        if any(lr is None for lr in chosen.values()):
            log(
                f"{task}: sweeps not final yet ({', '.join(m for m, lr in chosen.items() if lr is None)}); "
                "the next command goes on"
            )
            break
        ratios = {m: (chosen["frod"],) for m in cfg.ratio_methods} if "frod" in chosen else {}
        if ratios:  # the same directory: same identity, more methods
            doc = _run(
                cfg, replace(sweep, methods=list(ratios), lrs=ratios, extend=0, resume_from=None), argv, started, log
            )
            if not all(_chosen(doc, m) is not None and "test" in doc["methods"][m] for m in ratios):
                break
        every = {**{m: (lr,) for m, lr in chosen.items()}, **ratios}
        done = True
        for seed in range(1, cfg.seeds):
            doc = _run(cfg, _study_config(cfg, task, seed, list(every), every, 0), argv, started, log)
            done = bool(doc and doc.get("complete"))
            if not done:
                break
        if not done:
            break
