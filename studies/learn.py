"""The learnability study (``studies/learn_study.py``): generated tasks, every method, LR sweeps, seeds, timing.

Per task, the units in order, each resumable (``studies`` study directories under ``OUT/<task>/``):

    sweep     seed0/: the LR sweeps of the main methods (frod, peftfrod, peftfrod_sr02, lora16, lora64, full),
              extended past an end as the study does; chosen on the validation answer loss
    variants  seed0/: at frod's chosen σ LR, the S-rate ratios each side of 10:1 (frod_ratio3, frod_ratio30;
              one more past an end that wins: frod_ratio1 or frod_ratio100) and peftfrod_inj (stock PEFT FRoD
              on frod-ds' factors, trained as frod: the cross-check, once)
    seeds     seed1/, seed2/, ...: every chosen setting again (main methods, and the winning ratio if not 10:1)
    timing    timing.json: each method alone on the device (``studies.timing``)

Every method of a task trains on the same batches for the same ``--steps`` (the same training tokens, recorded
as ``data.train_tokens``). A command works through its tasks in order until its time is spent (a task left
unfinished passes the time left to the next); the next command skips what is recorded (``--resume-from``
copies a carried-back directory in first). One pool of worker processes serves every study of the command;
``--pack`` rewrites a tarball of ``OUT`` after every unit.
"""

from __future__ import annotations

import json
import shutil
import tarfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from frod_ds.runtime.atomic import atomic_write_text
from studies.config import MAIN_METHODS, RATIO_METHODS, StudyConfig, StudyError, parse_lrs
from studies.learn_report import summary_complete
from studies.loop import sparse_mm_autocast_ok
from studies.report import RESULTS_NAME
from studies.runner import run_study
from studies.tasks import task_steps

__all__ = ["MAIN_METHODS", "RATIO_METHODS", "RATIO_STEPS", "LearnConfig", "epochs_for_steps", "run_learn"]

RATIO_STEPS = (1, 3, 10, 30, 100)  # σ LR / S LR tried: 10 is frod; one step past a winning end
CROSS_CHECK = "peftfrod_inj"
FP32_TWIN = "frod_fp32"
TIMING_NAME = "timing.json"


@dataclass
class LearnConfig:
    model: str
    work: str  # the generated tasks: WORK/tasks/<task>/
    out: str
    tasks: list[str]
    methods: list[str] = field(default_factory=lambda: list(MAIN_METHODS))
    ratio_methods: list[str] = field(default_factory=lambda: list(RATIO_METHODS))
    cross_check: bool = True  # peftfrod_inj once per task, at frod's chosen σ LR
    lrs: list[str] = field(default_factory=list)  # --lrs METHOD=LR,... overrides
    steps: int = 160
    batch_size: int = 128
    seeds: int = 3
    max_minutes: float = 8.5
    eval_reserve_minutes: float = 1.5
    min_study_minutes: float = 2.0  # a unit does not start with less than this left
    resume_from: str | None = None
    extend: int = 2
    workers: int = 0
    device: str = "auto"
    checkpoints: int = 4
    val_points: int = 16  # validation losses per run (the steps-to-quality curve), checkpoints included
    curve_limit: int = 64
    eval_batch: int = 64
    cutoff: int = 64
    timing_steps: int = 30  # timed steps per method alone (0: no timing unit)
    timing_warmup: int = 5
    pack: str | None = None  # a .tgz of OUT rewritten after every unit


def epochs_for_steps(n_rows: int, batch: int, steps: int) -> float:
    """The ``epochs`` for which the study's ``BatchPlan`` makes exactly ``steps`` steps (it rounds up)."""
    per_epoch = n_rows // batch
    if per_epoch == 0:
        raise StudyError(f"{n_rows} training rows are fewer than one batch of {batch}; lower --batch-size")
    return (steps - 0.5) / per_epoch


def _study_config(
    cfg: LearnConfig,
    task: str,
    seed: int,
    methods: list[str],
    lrs: dict[str, tuple[float, ...]],
    extend: int,
    peft_frod_fp32: bool = False,
) -> StudyConfig:
    tdir = Path(cfg.work) / "tasks" / task
    n_rows = sum(1 for _ in open(tdir / "train.jsonl"))
    steps = task_steps(task, cfg.steps)
    sub = f"{task}/seed{seed}"
    resume = Path(cfg.resume_from) / sub if cfg.resume_from else None
    study = StudyConfig(
        model=cfg.model,
        data=str(tdir),
        out=str(Path(cfg.out) / sub),
        heldout_file=str(tdir / "validation.jsonl"),
        methods=methods,
        lrs=lrs,
        batch_size=cfg.batch_size,
        cutoff=cfg.cutoff,
        epochs=epochs_for_steps(n_rows, cfg.batch_size, steps),
        seed=seed,
        checkpoints=cfg.checkpoints,
        val_every=max(1, steps // cfg.val_points) if cfg.val_points else 0,
        curve_limit=cfg.curve_limit,
        eval_batch=cfg.eval_batch,
        protocols=("loglik", "exact"),
        select_by="answer_loss",
        plots=False,
        peft_frod_fp32=peft_frod_fp32,
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


def _scored(doc: dict | None, methods) -> bool:
    return doc is not None and summary_complete(doc, methods, needs_base=False)


def _validation_loss(doc: dict, method: str) -> float:
    m = doc["methods"][method]
    return m["sweep"][m["chosen"]["index"]]["heldout"]["answer_loss"]


def ratio_name(k: int) -> str:
    return "frod" if k == 10 else f"frod_ratio{k}"


def best_ratio(doc: dict, tried: list[int]) -> int:
    """The σ:S ratio (of ``tried``) whose run at frod's σ LR has the lowest validation answer loss."""
    return min(tried, key=lambda k: _validation_loss(doc, ratio_name(k)))


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


def pack(out: Path, path: Path) -> None:
    """``path``: a gzipped tarball of ``out``'s contents (written aside, then renamed: never half a file)."""
    tmp = path.with_name(path.name + ".tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        for child in sorted(out.iterdir()) if out.is_dir() else []:
            tar.add(child, arcname=child.name)
    tmp.replace(path)


class Learn:
    """One command of the study: its time budget, the worker pool its studies share, the units it runs."""

    def __init__(self, cfg: LearnConfig, argv: list[str], started: float, log=print):
        self.cfg, self.argv, self.started, self.log = cfg, argv, started, log
        want = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        self.device = torch.device(want)
        self.pool = None
        # stock PEFT FRoD trains as a PEFT user can: in fp32 where its sparse matmul fails under bf16 autocast
        self.peft_fp32 = not sparse_mm_autocast_ok(self.device)
        if self.peft_fp32:
            log("stock PEFT FRoD runs in fp32: torch.sparse.mm fails under bf16 autocast on this device")

    def config(self, task: str, seed: int, methods: list[str], lrs: dict, extend: int) -> StudyConfig:
        return _study_config(self.cfg, task, seed, methods, lrs, extend, self.peft_fp32)

    def shared_pool(self):
        n = self.cfg.workers or (3 if self.device.type == "cuda" else 1)
        if self.pool is None and n > 1:
            from studies.parallel import WorkerPool

            self.pool = WorkerPool(n, self.device, self.log)
        return self.pool

    def unit_done(self) -> None:
        if self.cfg.pack:
            pack(Path(self.cfg.out), Path(self.cfg.pack))

    def study(self, study: StudyConfig) -> dict | None:
        """Run one study with the time left of this command (its deadline is the command's); its results. A
        finished study is not loaded again (that costs a model load per study and command)."""
        done = _finished(study)
        if done is not None:
            self.log(f"finished: {study.out} ({', '.join(study.methods)})")
            return done
        if _left(self.started, self.cfg) < self.cfg.min_study_minutes:
            self.log(f"left for a later command: {study.out} ({_left(self.started, self.cfg):.1f} min left)")
            if study.resume_from and not Path(study.out).exists():  # keep what was carried in, in this output
                shutil.copytree(study.resume_from, study.out)
            return _doc(Path(study.out))
        run_study(study, self.argv, self.started, self.shared_pool())
        self.unit_done()
        return _doc(Path(study.out))

    def variants(self, sweep: StudyConfig, sigma: float) -> tuple[dict | None, list[str]]:
        """The S-rate ratios at frod's σ LR (and one past a winning end) and the cross-check; (doc, the methods
        the seeds repeat besides the main ones: the winning ratio unless it is 10:1)."""
        cfg = self.cfg
        # where stock PEFT FRoD trains in fp32, frod trains once in fp32 beside it: the cross-check compares like
        twins = [CROSS_CHECK] + ([FP32_TWIN] if self.peft_fp32 else [])
        first = list(cfg.ratio_methods) + (twins if cfg.cross_check else [])
        if not first:
            return _doc(Path(sweep.out)), []
        fixed = dict(extend=0, resume_from=None)
        grids = dict(sweep.lrs)  # the main methods' grids stay known to the directory's report
        doc = self.study(replace(sweep, methods=first, lrs={**grids, **{m: (sigma,) for m in first}}, **fixed))
        if not _scored(doc, first):
            return None, []
        tried = sorted([10] + [int(m.removeprefix("frod_ratio")) for m in cfg.ratio_methods])
        best = best_ratio(doc, tried)
        i = RATIO_STEPS.index(best) if best in RATIO_STEPS else -1
        if len(tried) > 1 and best in (tried[0], tried[-1]) and 0 < i < len(RATIO_STEPS) - 1:
            past = RATIO_STEPS[i - 1] if best == tried[0] else RATIO_STEPS[i + 1]
            lrs = {**grids, **{m: (sigma,) for m in first}, ratio_name(past): (sigma,)}
            doc = self.study(replace(sweep, methods=[ratio_name(past)], lrs=lrs, **fixed))
            if not _scored(doc, [ratio_name(past)]):
                return None, []
            best = best_ratio(doc, sorted([*tried, past]))
        return doc, [] if best == 10 else [ratio_name(best)]

    def timing(self, task: str, lrs: dict[str, float]) -> bool:
        """Each method alone on the device, into ``OUT/<task>/timing.json`` (methods already timed are kept)."""
        from studies.timing import time_methods

        cfg = self.cfg
        path = Path(cfg.out) / task / TIMING_NAME
        carried = Path(cfg.resume_from) / task / TIMING_NAME if cfg.resume_from else None
        found = next((p for p in (path, carried) if p is not None and p.is_file()), None)
        doc = json.loads(found.read_text()) if found else None
        missing = {m: lr for m, lr in lrs.items() if not doc or m not in doc["methods"]}
        if not missing:
            if not path.is_file():
                atomic_write_text(path, json.dumps(doc, indent=1) + "\n")
            return True
        if _left(self.started, cfg) < cfg.min_study_minutes:
            self.log(f"left for a later command: timing of {task}")
            return False
        study = self.config(task, 0, list(missing), {m: (lr,) for m, lr in missing.items()}, 0)
        new = time_methods(study, missing, self.device, cfg.timing_warmup, cfg.timing_steps, self.log)
        if doc:
            new["methods"] = {**doc["methods"], **new["methods"]}
        atomic_write_text(path, json.dumps(new, indent=1) + "\n")
        self.unit_done()
        return True

    def task(self, task: str) -> bool:
        """Every unit of ``task`` that fits; True once all are recorded."""
        cfg = self.cfg
        sweep = self.config(task, 0, cfg.methods, parse_lrs(cfg.lrs, cfg.methods), cfg.extend)
        doc = self.study(sweep)
        chosen = {m: _chosen(doc, m) for m in cfg.methods}
        if any(lr is None for lr in chosen.values()) or not _scored(doc, cfg.methods):
            missing = [m for m, lr in chosen.items() if lr is None]
            self.log(f"{task}: sweeps not final or not scored yet ({', '.join(missing)}); the next command goes on")
            return False
        extra: list[str] = []
        if "frod" in chosen:
            doc, extra = self.variants(sweep, chosen["frod"])
            if doc is None:
                return False
        every = {**chosen, **{m: chosen["frod"] for m in extra}}
        for seed in range(1, cfg.seeds):
            lrs = {m: (lr,) for m, lr in every.items()}
            doc = self.study(self.config(task, seed, list(every), lrs, 0))
            if not _scored(doc, list(every)):  # every method's run tested (a merged seed's flag can lag)
                return False
        if cfg.timing_steps:  # a ratio variant runs at frod's speed: the main methods and the cross-check
            timed = {**chosen, **({CROSS_CHECK: chosen["frod"]} if cfg.cross_check and "frod" in chosen else {})}
            return self.timing(task, timed)
        return True

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        self.unit_done()


def run_learn(cfg: LearnConfig, argv: list[str], started: float, log=print) -> None:
    """Every task in order, as far as this command's time goes (a task's units in order: see the module doc). A task
    left unfinished (time, or a run that did not fit what is left) does not hold up the next: each unit checks the
    time left itself, so what remains of the budget goes to whatever still fits."""
    learn = Learn(cfg, argv, started, log)
    try:
        for task in cfg.tasks:
            learn.task(task)
    finally:
        learn.close()
