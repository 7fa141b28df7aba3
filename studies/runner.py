"""The study under one time budget per command, resumable over several commands.

1. Load the base model, the rows, tokenize once (train, a held-out slice of the train rows, test rows),
   pre-collate every step's batch: every run consumes the same batches (``context.RunContext``). The study's
   identity (``records.study_identity``) must equal the one recorded in ``--out`` (resume) or in
   ``--resume-from`` (whose records are copied in first); nothing is written before that is checked.
2. Preflight both eval protocols on a few rows; base model: held-out and test-slice accuracy (step 0 of the
   curves), then the test sets (generation on the curve slice only) — each only if ``base.json`` lacks it.
3. Jobs (``schedule.Schedule`` decides which), one per idle executor slot (``--workers`` processes sharing
   the GPU, started before the base evaluations, or the main process), decided after every result: test
   evaluations of each method's best run before its weights go with the command, grid runs centre out,
   extensions past a sweep end, runs to train again; only what fits ``--max-minutes`` starts.
   Every finished run is a record in ``records/`` at once; a command cut off at any point keeps every one.
4. Per method: the LR with the best held-out accuracy (ties: lower held-out answer-word loss), flagged when
   it sits at an end of its sweep; the paper's claim (``report.claim``), plots, Markdown tables, from all
   records of all commands.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import device_name, versions
from frod_ds.formats.records import record_to_dict
from frod_ds.prep.rows import check_row
from frod_ds.runtime.atomic import atomic_write_text
from frod_ds.train.data import BatchPlan
from studies.config import StudyConfig, StudyError, method_spec
from studies.context import RunContext
from studies.data import encode_study_examples, load_test_rows, make_batches, split_rows
from studies.models import load_base
from studies.parallel import LocalExecutor, WorkerPool
from studies.records import Invocation, RunRecord, StudyDir, study_identity
from studies.report import RESULTS_NAME, claim, markdown_tables, smooth_window, sweep_table, write_plots
from studies.schedule import Schedule

__all__ = ["run_study"]


class Log:
    """Progress lines to stdout and ``<out>/real_study.log`` (held back until ``attach``), with elapsed time."""

    def __init__(self, t0: float):
        self.t0, self.path, self.pending = t0, None, []

    def attach(self, out: Path) -> None:
        self.path = out / "real_study.log"
        with open(self.path, "a") as f:
            f.write("".join(self.pending))

    def __call__(self, msg: str) -> None:
        line = f"[{time.perf_counter() - self.t0:7.1f}s] {msg}"
        print(line, flush=True)
        if self.path is None:
            self.pending.append(line + "\n")
        else:
            with open(self.path, "a") as f:
                f.write(line + "\n")


def _git_commit() -> str | None:
    try:
        root = Path(__file__).resolve().parents[2]
        sha = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain"], capture_output=True, text=True, timeout=10
        )
        return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "") if sha.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


class Study:
    def __init__(self, cfg: StudyConfig, argv: list[str], started: float, pool: WorkerPool | None = None):
        self.cfg, self.t0 = cfg, time.perf_counter()
        self.deadline = started + 60 * cfg.max_minutes  # wall clock: worker processes share it
        self.train_deadline = self.deadline - 60 * cfg.eval_reserve_minutes
        self.out, self.dir = Path(cfg.out), StudyDir(Path(cfg.out))
        self.log = Log(self.t0)
        want = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        if want == "cuda" and not torch.cuda.is_available():
            raise StudyError("--device cuda but no CUDA device is visible")
        self.device = torch.device(want)
        self.workers = pool.capacity if pool is not None else cfg.workers or (3 if self.device.type == "cuda" else 1)
        self.invocation = Invocation(
            command=" ".join([Path(sys.executable).name, *argv]),
            device=device_name(),
            date=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            versions={**versions(), "git": _git_commit()},
            workers=self.workers,
            max_minutes=cfg.max_minutes,
        )
        self.warned: set[str] = set()
        self.executor: LocalExecutor | WorkerPool | None = None
        self.pool = pool  # workers that outlive this study (``learn``), or None: this study starts its own
        self.busy = 0  # jobs handed out and not yet reported
        self.tmp: Path | None = None

    # -- 1. data, identity, records ------------------------------------------------------------------------

    def setup(self) -> None:
        cfg, dev = self.cfg, self.device
        torch.manual_seed(cfg.seed)  # TF32 stays off: fp32 matmuls (HJD, merges, the init check) stay exact
        train_rows, held_rows = split_rows(
            cfg.train_path, cfg.heldout, cfg.seed, cfg.train_limit, Path(cfg.heldout_file) if cfg.heldout_file else None
        )
        for row in held_rows:
            problem = check_row(row)
            if problem:
                raise StudyError(
                    f"held-out row {row.get('id')!r} of {cfg.train_path}: {problem}; training rows "
                    "need choices and label (the output of `python -m data_prep build`)"
                )
        held_by_task: dict[str, list[dict]] = {}
        for row in held_rows:
            held_by_task.setdefault(row["task"], []).append(row)
        test = load_test_rows(cfg.eval_path, cfg.eval_limit)
        identity = study_identity(cfg, dev.type)
        src = StudyDir(Path(cfg.resume_from)) if cfg.resume_from else None
        if src is not None:
            src.check_identity(identity, "--resume-from")
            src.base(), src.invocations()  # every record readable before anything is copied
        if self.dir.exists():
            self.dir.check_identity(identity, "--out")
            self.dir.base(), self.dir.invocations()
        base, tok = load_base(cfg.model, dev)
        t = time.perf_counter()
        train_ex = encode_study_examples(tok, train_rows, cfg.cutoff)
        held_ex = encode_study_examples(tok, held_rows, cfg.cutoff)
        plan = BatchPlan(len(train_ex), cfg.batch_size, 1, 1, 0, cfg.seed)
        steps = plan.total_steps(cfg.epochs, None)
        batches = make_batches(train_ex, plan, steps, tok.pad_token_id, cfg.train_on_inputs)
        # Held-out losses are token sums: batches of similar lengths (less padding) change nothing but the order.
        by_length = sorted(range(len(held_ex)), key=lambda i: (len(held_ex[i].input_ids), i))
        held_batches = make_batches(
            [held_ex[i] for i in by_length], None, 0, tok.pad_token_id, cfg.train_on_inputs, batch_size=cfg.eval_batch
        )
        checkpoints = sorted({max(1, round(steps * (i + 1) / cfg.checkpoints)) for i in range(cfg.checkpoints)})
        self.ctx = ctx = RunContext(
            cfg=cfg,
            device=dev,
            tok=tok,
            base=base,
            batches=[b.to(dev) for b in batches],
            held_batches=[b.to(dev) for b in held_batches],
            held_by_task=held_by_task,
            curve={t: rows[: cfg.curve_limit] for t, rows in test.items()},
            test=test,
            steps=steps,
            checkpoint_steps=checkpoints,
            log=self.log,
        )
        order = hashlib.sha256()
        for b in batches:
            order.update(b.digest.encode())
        self.data_order, self.total_tokens = order.hexdigest(), sum(b.n_tokens for b in batches)
        seen = [i for b in batches for i in b.indices]
        self.data = {
            "train_file": str(cfg.train_path),
            "eval_dir": str(cfg.eval_path),
            "train_rows": len(train_rows),
            "heldout_rows": len(held_rows),
            "heldout_ids": [r.get("id") for r in held_rows],
            "heldout_rows_per_task": {t: len(r) for t, r in held_by_task.items()},
            "steps": steps,
            "batch_size": cfg.batch_size,
            "epochs_seen": len(seen) / len(train_ex),
            "distinct_rows_seen": len(set(seen)),
            "train_tokens": self.total_tokens,
            "scored_tokens": sum(b.n_scored for b in batches),
            "answer_word_tokens": sum(b.n_answer for b in batches),
            "truncated_train_rows": sum(e.truncated for e in train_ex),
            "max_train_tokens": max(len(e.input_ids) for e in train_ex),
            "first_batch_ids": [train_rows[i].get("id") for i in batches[0].indices],
            "data_order_sha256": self.data_order,
            "test_rows_per_task": {t: len(r) for t, r in test.items()},
            "test_rows_are_full_sets": cfg.eval_limit is None,
            "curve_rows_per_task": {t: len(r) for t, r in ctx.curve.items()},
            "checkpoint_steps": checkpoints,
            "separators": sorted({repr(r.get("separator", "\nAnswer: ")) for r in train_rows}),
            "generation_scorer": ctx.gen_name,
            "setup_seconds": time.perf_counter() - t,
        }
        ctx.preflight()
        for where in [d for d in (self.dir, src) if d is not None and d.exists()]:
            for record in where.runs():
                seen = (record.steps, record.data_order_sha256, record.tokens)
                if seen != (steps, self.data_order, self.total_tokens):
                    raise StudyError(
                        f"run {record.method} lr={record.lr:g} in {where.path} saw other batches than "
                        "this command builds (the batching code changed?); choose a new --out"
                    )
        # Nothing is written before every input and every record has been read and checked.
        self.out.mkdir(parents=True, exist_ok=True)
        if not self.dir.exists():
            self.dir.create(identity)
        if src is not None and src.path.resolve() != self.out.resolve():
            copied = self.dir.copy_records_from(src)
            self.log(f"resume: copied {len(copied)} record(s) from {src.path}")
        self.identity = identity
        self.log.attach(self.out)
        self.plan = Schedule(
            cfg,
            {(r.method, r.lr): r for r in self.dir.runs()},
            self.deadline,
            self.train_deadline,
            None,
            self.log,
            self.warn_once,
        )
        self.runs = self.plan.runs  # every finished run, by (method, lr)
        self.base = self.dir.base()
        self.history = self.dir.invocations()
        self.history.invocations.append(self.invocation)
        self.index = len(self.history.invocations) - 1
        self.dir.write_invocations(self.history)
        d = self.data
        self.log(
            f"data: {d['train_rows']} train rows ({steps} steps of {cfg.batch_size}), "
            f"{d['heldout_rows']} held out, test {d['test_rows_per_task']}, "
            f"{d['train_tokens']} tokens/run ({d['answer_word_tokens']} answer-word); {self.workers} worker(s); "
            f"{len(self.runs)} finished run(s) in {self.out}"
        )
        self.save()

    # -- 2. base model ---------------------------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self.plan.wanted_training()) or any(
            (b := self.plan.best(m)) is not None and b.test is None for m in self.plan.methods()
        )

    def start_workers(self) -> None:
        """Spawn the workers and hand them their first jobs, so they start up and train while the main process
        evaluates the base model."""
        self.tmp = self.plan.tmp = Path(tempfile.mkdtemp(prefix="real_study_"))
        if not self.has_work():
            return
        if self.pool is not None:
            self.executor = self.pool
            self.pool.log = self.log
            self.executor.load(self.ctx)
            self.fill()
        elif self.workers > 1:
            self.executor = WorkerPool(self.workers, self.device, self.log)
            self.executor.load(self.ctx)
            self.fill()
        else:
            self.executor = LocalExecutor(self.ctx)

    def base_evals(self) -> None:
        """Step-0 metrics; (``base_eval``) the base model on the test sets, generation on the curve slice only
        (the untrained model rambles to the token limit: the slowest and least informative evaluation)."""
        if self.base.step0 is None:
            self.base.step0 = self.ctx.checkpoint_eval(self.ctx.base)
            self.dir.write_base(self.base)
        if self.cfg.base_eval and self.base.test is None:
            gen = " (llm-adapters on the curve slice)" if "llm-adapters" in self.cfg.protocols else ""
            self.log(f"base model: test evaluation{gen}")
            self.base.test = self.ctx.test_eval(self.ctx.base, gen_rows=self.ctx.curve, label="base")
            self.dir.write_base(self.base)
        else:
            self.log(f"base model: step-0 metrics{' and test results' if self.base.test else ''} from base.json")
        self.save()

    @torch.no_grad()
    def frod_init_check(self) -> None:
        """Max |logit difference| FRoD-at-init vs base on the first held-out batch (fp32, no autocast)."""
        if "frod" not in self.cfg.methods or self.base.frod_init is not None:
            return
        template, b = self.ctx.factory.frod_template(), self.ctx.held_batches[0]
        kw = dict(input_ids=b.input_ids[:4], attention_mask=b.attention_mask[:4], use_cache=False)
        diff = (template(**kw).logits - self.ctx.base(**kw).logits).abs().max().item()
        self.base.frod_init = {"max_logit_diff_fp32": diff, "hjd_seconds": self.ctx.factory.hjd_seconds}
        self.dir.write_base(self.base)
        self.log(
            f"frod: HJD + apply_frod in {self.ctx.factory.hjd_seconds:.1f} s; init max |logit - base| = "
            f"{diff:.2e} (fp32)"
        )

    # -- 3. jobs ---------------------------------------------------------------------------------------------

    def warn_once(self, message: str) -> None:
        if message not in self.warned:
            self.warned.add(message)
            self.log(f"WARNING: {message}")
            self.invocation.warnings.append(message)

    def fill(self) -> None:
        """Hand out jobs until every executor slot is busy or nothing more can start now."""
        while (
            self.executor is not None
            and self.busy < self.executor.capacity
            and (job := self.plan.next_job(time.time())) is not None
        ):
            self.executor.submit(job)
            self.busy += 1

    def run_jobs(self) -> None:
        if self.executor is None:
            return
        if isinstance(self.executor, WorkerPool):
            # The main process's copy of the data and models is no longer needed on the device.
            self.ctx.batches = []
            self.ctx.factory.templates.clear()
            self.ctx.base.to("cpu")
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        while True:
            self.fill()
            if self.busy == 0:
                break
            self.handle(self.executor.get())
            self.busy -= 1
        for m in self.cfg.methods:
            left = [k for k in self.plan.wanted_training() if k[0] == m]
            if left:
                self.warn_once(
                    f"LEFT FOR A LATER COMMAND: {m} lr={', '.join(f'{lr:g}' for _, lr in left)} "
                    f"(--max-minutes {self.cfg.max_minutes}); run the same command again, it resumes"
                )

    def handle(self, msg: tuple) -> None:
        if msg[0] == "trained":
            _, m, lr, entry, state_path = msg
            self.plan.in_flight.pop((m, lr))
            if not entry.pop("completed"):
                self.warn_once(
                    f"RUN STOPPED BY THE TIME BUDGET: {m} lr={lr:g} after {entry['steps']}/"
                    f"{self.ctx.steps} steps; not recorded, a later command trains it"
                )
                return
            record = RunRecord(method=m, workers=self.workers, invocation=self.index, **entry)
            self.runs[(m, lr)] = record
            self.dir.write_run(record)
            self.plan.states[(m, lr)] = Path(state_path)
            self.prune_states(m)
            tail = record.log["answer_loss"][-20:]
            self.log(
                f"{m} lr={lr:g}: {record.steps}/{self.ctx.steps} steps, {record.step_ms:.1f} ms/step, final "
                f"answer-word loss {sum(tail) / max(1, len(tail)):.4f}, held-out acc "
                f"{record.heldout['accuracy']:.4f} ({record.wall_seconds:.1f} s)"
            )
        else:
            _, m, lr, test, seconds = msg
            self.plan.in_flight.pop((m, lr))
            record = self.runs[(m, lr)]
            record.test = test
            self.dir.write_run(record)
            self.prune_states(m)
        self.save()

    def prune_states(self, m: str) -> None:
        """Delete the weights of method ``m``'s runs that are not its best or are already scored."""
        best = self.plan.best(m)
        for key in [k for k in self.plan.states if k[0] == m]:
            if key in self.plan.in_flight or (best is not None and key == (m, best.lr) and best.test is None):
                continue
            self.plan.states.pop(key).unlink(missing_ok=True)  # written by this process under its mkdtemp

    # -- 4. the report -----------------------------------------------------------------------------------------

    def method_doc(self, m: str) -> dict[str, Any]:
        spec = method_spec(m)
        sweep, grid = self.plan.sweep(m), self.plan.grid(m)
        doc: dict[str, Any] = {
            "kind": spec.kind,
            "rank": spec.rank,
            "lrs": sweep,
            "grid": grid,
            "extended": [lr for lr in sweep if lr not in grid],
            "sweep": [],
        }
        if spec.kind == "lora":
            doc["lora_alpha"] = self.cfg.lora_alpha_ratio * spec.rank
        for lr in self.plan.recorded(m):
            entry = record_to_dict(self.runs[(m, lr)])
            entry.pop("test", None)
            if entry.get("lr_s") is None:
                entry.pop("lr_s", None)
            doc["sweep"].append({**entry, "completed": True})
        best = self.plan.best(m)
        if best is not None:
            at_end = len(sweep) > 1 and best.lr in (sweep[0], sweep[-1])
            doc["chosen"] = {
                "index": self.plan.recorded(m).index(best.lr),
                "lr": best.lr,
                "selected_by": f"held-out {self.cfg.select_by}",
                "at_sweep_end": at_end,
                "sweep_complete": self.plan.grid_complete(m),
                "final": self.plan.settled(m),
            }
            if best.test is not None:
                doc["test"] = best.test
        return doc

    def warnings(self, methods: dict[str, dict]) -> list[str]:
        out = []
        for m, d in methods.items():
            if m not in self.cfg.methods:
                continue
            done = sum((m, lr) in self.runs for lr in d["grid"])
            if done < len(d["grid"]):
                out.append(
                    f"SWEEP INCOMPLETE: {m} has {done} of {len(d['grid'])} LRs; run the same command again "
                    "(it resumes in --out, or from --resume-from)"
                )
            c = d.get("chosen")
            if c and c["at_sweep_end"] and c["sweep_complete"]:
                side = "lowest" if c["lr"] == d["lrs"][0] else "highest"
                out.append(
                    f"LR AT SWEEP END: {m} chose lr={c['lr']:g}, the {side} of its sweep {d['lrs']}"
                    + (f" after {len(d['extended'])} extension(s)" if d["extended"] else "")
                    + (
                        "; run again to extend it"
                        if not c["final"]
                        else f"; raise --extend (now {self.cfg.extend}) or widen with --lrs {m}=..."
                    )
                )
            if c and "test" not in d:
                out.append(f"NO TEST RESULTS: {m} lr={c['lr']:g}; run the same command again")
        return out + list(self.invocation.warnings)

    def document(self) -> dict[str, Any]:
        cfg = self.cfg
        methods = {m: self.method_doc(m) for m in self.plan.methods()}
        inv = self.invocation
        doc: dict[str, Any] = {
            "benchmark": "real_study",
            "command": inv.command,
            "device": inv.device,
            "date": inv.date,
            "versions": inv.versions,
            "invocations": [record_to_dict(i) for i in self.history.invocations],
            "identity": record_to_dict(self.identity),
            "config": {**cfg.to_dict(), "workers_used": self.workers},
            "data": self.data,
            "timing_note": (
                "step_ms: training time per step, checkpoint evaluations excluded, with `workers` run(s) "
                "sharing the device (a speed comparison only when 1); wall_seconds: the whole run"
            ),
            "methods": methods,
        }
        if self.base.step0 is not None:
            doc["step0"] = self.base.step0
        if self.base.test is not None:
            doc["base"] = {"test": self.base.test}
        if self.base.frod_init is not None:
            doc["frod_init"] = self.base.frod_init
        doc["warnings"] = self.warnings(methods)
        doc["complete"] = all("test" in methods[m] and methods[m]["chosen"]["final"] for m in cfg.methods) and (
            not cfg.base_eval or "base" in doc
        )
        return doc

    def save(self, doc: dict[str, Any] | None = None) -> Path:
        path = self.out / RESULTS_NAME
        atomic_write_text(path, json.dumps(doc or self.document(), indent=1, allow_nan=True) + "\n")
        return path

    def finish(self) -> None:
        cfg, steps = self.cfg, self.ctx.steps
        self.invocation.wall_seconds = time.perf_counter() - self.t0
        self.dir.write_invocations(self.history)
        doc = self.document()
        loras = [m for m in doc["methods"] if method_spec(m).kind == "lora"]
        if "frod" in doc["methods"] and loras:
            doc["claim"] = claim(doc["methods"], "frod", loras, smooth_window(steps, cfg.smooth_frac), steps)
            for name, entry in doc["claim"]["vs"].items():
                if entry.get("available"):
                    a = entry["answer_loss"]
                    self.log(
                        f"claim vs {name}: FRoD reaches LoRA's final answer-word loss at step "
                        f"{a['frod_steps_to_lora_final']} of {steps} (ratio {a['ratio']}); "
                        f"loss claim {entry['loss_claim_holds']}, accuracy claim {entry['accuracy_claim_holds']}"
                    )
        sha = {r.data_order_sha256 for r in self.runs.values()}
        tokens = {r.tokens for r in self.runs.values()}
        doc["same_data_all_runs"] = len(sha) <= 1 and len(tokens) <= 1
        assert doc["same_data_all_runs"], "runs saw different data; this is a bug in the study"
        doc["sweep_table"] = sweep_table(doc)
        doc["wall_seconds"] = self.invocation.wall_seconds
        self.save(doc)
        for w in doc["warnings"]:
            if w not in self.invocation.warnings:
                self.log(f"WARNING: {w}")
        try:
            doc["table_md"] = markdown_tables(doc)
            self.log("results:\n" + doc["table_md"])
            doc["plots"] = [p.name for p in write_plots(doc, self.out)] if cfg.plots else []
        except Exception as e:  # noqa: BLE001 - the numbers are saved; tables and plots can be redone (--replot)
            doc["warnings"].append(f"table/plots failed: {type(e).__name__}: {e}; rerun with --replot")
            self.log(f"WARNING: {doc['warnings'][-1]}")
        path = self.save(doc)
        self.log(
            f"done in {doc['wall_seconds']:.1f} s; {len(self.runs)} run(s) recorded; complete={doc['complete']}; {path}"
        )

    def close(self) -> None:
        if self.executor is not None and self.executor is not self.pool:
            self.executor.close()
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)  # made by mkdtemp above


def run_study(cfg: StudyConfig, argv: list[str], started: float | None = None, pool: WorkerPool | None = None) -> Path:
    """Run (or go on with) the study ``cfg``; ``started``: the ``time.time()`` the budget counts from; ``pool``:
    workers kept across studies by the caller (closed by it)."""
    study = Study(cfg, argv, time.time() if started is None else started, pool)
    study.log(f"device {study.invocation.device}; methods {cfg.methods}; budget {cfg.max_minutes} min")
    study.setup()
    try:
        study.start_workers()
        study.base_evals()
        study.frod_init_check()
        study.run_jobs()
        study.finish()
    finally:
        study.close()
    return study.out / RESULTS_NAME
