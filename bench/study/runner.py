"""The study, stage by stage, under one time budget; the results document is saved after every stage.

1. Load the base model, the rows, tokenize once (train, a held-out slice of the train rows, test rows),
   pre-collate every step's batch: every run consumes the same batches (``context.RunContext``).
2. Preflight both eval protocols on a few rows; base model: held-out and test-slice accuracy (step 0 of
   the curves), then the test sets (generation on the curve slice only).
3. Sweep: every (method, LR) run, in rounds (every method's middle LR, then the low ones, then the high
   ones), so a budget cut leaves every method with about the same number of LRs. On a GPU the runs go to
   ``--workers`` processes sharing it (a 135M model's step is bound by kernel launches, not by the GPU);
   with one worker a round starts only if the last round's run times and the final evals' reserve fit.
4. Per method: the LR with the best held-out accuracy (ties: lower held-out answer-word loss), loudly
   flagged when it sits at an end of its sweep; its trained weights, merged into a plain model, are
   scored on the test sets with every protocol (in the workers, in parallel).
5. The paper's claim (``report.claim``), plots, Markdown tables.
"""

from __future__ import annotations

import datetime as _dt
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import device_name, versions
from bench.study.config import StudyConfig, StudyError, method_spec
from bench.study.context import RunContext
from bench.study.data import encode_study_examples, load_test_rows, make_batches, split_rows
from bench.study.models import load_base
from bench.study.parallel import WorkerPool
from bench.study.report import Results, claim, markdown_tables, smooth_window, sweep_table, write_plots
from data_prep.io import check_row
from frod_ds.data import BatchPlan

__all__ = ["run_study"]


class Log:
    """Progress lines to stdout and ``<out>/real_study.log`` (held back until ``attach``), with elapsed time."""

    def __init__(self, t0: float):
        self.t0, self.path, self.pending = t0, None, []

    def attach(self, out: Path) -> None:
        self.path = out / "real_study.log"
        self.path.write_text("".join(self.pending))

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
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain"], capture_output=True, text=True,
                               timeout=10)
        return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "") if sha.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def _sweep_order(n: int) -> list[int]:
    """Sweep indices centre first, then outwards (3 LRs: middle, low, high)."""
    return sorted(range(n), key=lambda i: (abs(i - (n - 1) / 2), i))


class Study:
    def __init__(self, cfg: StudyConfig, argv: list[str]):
        self.cfg, self.t0 = cfg, time.perf_counter()
        self.deadline = time.time() + 60 * cfg.max_minutes  # wall clock: worker processes share it
        self.out = Path(cfg.out)
        self.log = Log(self.t0)
        want = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        if want == "cuda" and not torch.cuda.is_available():
            raise StudyError("--device cuda but no CUDA device is visible")
        self.device = torch.device(want)
        self.workers = cfg.workers or (3 if self.device.type == "cuda" else 1)
        self.results = Results(self.out, {
            "benchmark": "real_study",
            "command": " ".join([Path(sys.executable).name, *argv]),
            "device": device_name(),
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "versions": {**versions(), "git": _git_commit()},
            "config": {**cfg.to_dict(), "workers_used": self.workers},
            "methods": {},
        }, log=self.log)
        self.states: dict[tuple[str, int], Any] = {}  # trained state (one worker) or its file (several)
        self.pool: WorkerPool | None = None
        self.tmp: Path | None = None

    # -- 1. data -----------------------------------------------------------------------------------------

    def setup(self) -> None:
        cfg, dev = self.cfg, self.device
        torch.manual_seed(cfg.seed)  # TF32 stays off: fp32 matmuls (HJD, merges, the init check) stay exact
        train_rows, held_rows = split_rows(cfg.train_path, cfg.heldout, cfg.seed, cfg.train_limit)
        for row in held_rows:
            problem = check_row(row)
            if problem:
                raise StudyError(f"held-out row {row.get('id')!r} of {cfg.train_path}: {problem}; training rows "
                                 "need choices and label (the output of `python -m data_prep build`)")
        held_by_task: dict[str, list[dict]] = {}
        for row in held_rows:
            held_by_task.setdefault(row["task"], []).append(row)
        test = load_test_rows(cfg.eval_path, cfg.eval_limit)
        base, tok = load_base(cfg.model, dev)
        t = time.perf_counter()
        train_ex = encode_study_examples(tok, train_rows, cfg.cutoff)
        held_ex = encode_study_examples(tok, held_rows, cfg.cutoff)
        plan = BatchPlan(len(train_ex), cfg.batch_size, 1, 1, 0, cfg.seed)
        steps = plan.total_steps(cfg.epochs, None)
        batches = make_batches(train_ex, plan, steps, tok.pad_token_id, cfg.train_on_inputs)
        held_batches = make_batches(held_ex, None, 0, tok.pad_token_id, cfg.train_on_inputs, batch_size=cfg.eval_batch)
        checkpoints = sorted({max(1, round(steps * (i + 1) / cfg.checkpoints)) for i in range(cfg.checkpoints)})
        self.ctx = ctx = RunContext(cfg=cfg, device=dev, tok=tok, base=base, batches=[b.to(dev) for b in batches],
                                    held_batches=[b.to(dev) for b in held_batches], held_by_task=held_by_task,
                                    curve={t: rows[: cfg.curve_limit] for t, rows in test.items()}, test=test,
                                    steps=steps, checkpoint_steps=checkpoints, log=self.log)
        seen = [i for b in batches for i in b.indices]
        self.results.doc["data"] = {
            "train_file": str(cfg.train_path), "eval_dir": str(cfg.eval_path),
            "train_rows": len(train_rows), "heldout_rows": len(held_rows),
            "heldout_ids": [r.get("id") for r in held_rows],
            "heldout_rows_per_task": {t: len(r) for t, r in held_by_task.items()},
            "steps": steps, "batch_size": cfg.batch_size, "epochs_seen": len(seen) / len(train_ex),
            "distinct_rows_seen": len(set(seen)),
            "train_tokens": sum(b.n_tokens for b in batches),
            "scored_tokens": sum(b.n_scored for b in batches),
            "answer_word_tokens": sum(b.n_answer for b in batches),
            "truncated_train_rows": sum(e.truncated for e in train_ex),
            "max_train_tokens": max(len(e.input_ids) for e in train_ex),
            "first_batch_ids": [train_rows[i].get("id") for i in batches[0].indices],
            "test_rows_per_task": {t: len(r) for t, r in test.items()},
            "test_rows_are_full_sets": cfg.eval_limit is None,
            "curve_rows_per_task": {t: len(r) for t, r in ctx.curve.items()},
            "checkpoint_steps": checkpoints,
            "separators": sorted({repr(r.get("separator", "\nAnswer: ")) for r in train_rows}),
            "generation_scorer": ctx.gen_name,
            "setup_seconds": time.perf_counter() - t,
        }
        ctx.preflight()
        # Nothing is written before every input has been read and checked.
        self.out.mkdir(parents=True, exist_ok=True)
        self.log.attach(self.out)
        self.results.save()
        d = self.results.doc["data"]
        self.log(f"data: {d['train_rows']} train rows ({steps} steps of {cfg.batch_size}), "
                 f"{d['heldout_rows']} held out, test {d['test_rows_per_task']}, "
                 f"{d['train_tokens']} tokens/run ({d['answer_word_tokens']} answer-word); {self.workers} worker(s)")

    # -- 2. base model -----------------------------------------------------------------------------------

    def start_workers(self) -> None:
        """Spawn the workers now, so they start up while the main process evaluates the base model."""
        if self.workers > 1:
            self.tmp = Path(tempfile.mkdtemp(prefix="real_study_"))
            self.ctx.save(self.tmp / "context.pt")
            self.pool = WorkerPool(self.tmp / "context.pt", self.workers, self.device, self.log)

    def base_evals(self) -> None:
        """Step-0 metrics; (``base_eval``) the base model on the test sets, generation on the curve slice only
        (the untrained model rambles to the token limit: the slowest and least informative evaluation)."""
        self.results.doc["step0"] = self.ctx.checkpoint_eval(self.ctx.base)
        self.results.save()
        if self.cfg.base_eval:
            self.log("base model: test evaluation (llm-adapters on the curve slice)")
            self.results.doc["base"] = {"test": self.ctx.test_eval(self.ctx.base, gen_rows=self.ctx.curve, label="base")}
            self.results.save()

    @torch.no_grad()
    def frod_init_check(self) -> None:
        """Max |logit| difference FRoD-at-init vs base on the first held-out batch (fp32, no autocast)."""
        if "frod" not in self.cfg.methods:
            return
        template, b = self.ctx.factory.frod_template(), self.ctx.held_batches[0]
        kw = dict(input_ids=b.input_ids[:4], attention_mask=b.attention_mask[:4], use_cache=False)
        diff = (template(**kw).logits - self.ctx.base(**kw).logits).abs().max().item()
        self.results.doc["frod_init"] = {"max_logit_diff_fp32": diff, "hjd_seconds": self.ctx.factory.hjd_seconds}
        self.log(f"frod: HJD + apply_frod in {self.ctx.factory.hjd_seconds:.1f} s; init max |logit - base| = "
                 f"{diff:.2e} (fp32)")

    # -- 3. sweep ----------------------------------------------------------------------------------------

    def record(self, name: str, entry: dict[str, Any]) -> None:
        m = self.results.doc["methods"][name]
        m["sweep"].append(entry)
        m["sweep"].sort(key=lambda e: e["lr"])
        self.results.save()
        h = entry["heldout"] or {}
        tail = entry["log"]["answer_loss"][-20:]
        self.log(f"{name} lr={entry['lr']:g}: {entry['steps']}/{self.ctx.steps} steps, {entry['step_ms']:.1f} ms/step, "
                 f"final answer-word loss {sum(tail) / max(1, len(tail)):.4f}, held-out acc "
                 f"{h.get('accuracy', float('nan')):.4f} ({entry['wall_seconds']:.1f} s)")
        if not entry["completed"]:
            self.results.warn(f"RUN STOPPED BY THE TIME BUDGET: {name} lr={entry['lr']:g} after "
                              f"{entry['steps']}/{self.ctx.steps} steps; it is excluded from selection")

    def sweep(self) -> None:
        cfg = self.cfg
        for name in cfg.methods:
            spec = method_spec(name)
            self.results.doc["methods"][name] = {"kind": spec.kind, "rank": spec.rank, "lrs": list(cfg.lrs[name]),
                                                 "sweep": []}
            if spec.kind == "lora":
                self.results.doc["methods"][name]["lora_alpha"] = cfg.lora_alpha_ratio * spec.rank
        self.results.doc["timing_note"] = (
            f"step_ms: training time per step, checkpoint evaluations excluded, with {self.workers} run(s) sharing "
            "the device (a speed comparison only when 1); wall_seconds: the whole run")
        n = len(next(iter(cfg.lrs.values())))
        jobs = [(name, index) for index in _sweep_order(n) for name in cfg.methods]
        train_deadline = self.deadline - 60 * cfg.eval_reserve_minutes
        if self.pool is None:
            self._sweep_here(jobs, n, train_deadline)
        else:
            self._sweep_workers(jobs, train_deadline)
        for name in cfg.methods:
            done = sum(r["completed"] for r in self.results.doc["methods"][name]["sweep"])
            if done < n:
                self.results.warn(f"SWEEP CUT SHORT: {name} has {done} of {n} LRs within --max-minutes "
                                  f"{cfg.max_minutes}; raise it or shrink with --train-limit / --eval-limit / --batch-size")

    def _sweep_here(self, jobs: list[tuple[str, int]], n: int, train_deadline: float) -> None:
        """One run at a time; a round starts only if the last round's wall times fit before the deadline."""
        walls: dict[str, float] = {}
        per_round = len(self.cfg.methods)
        for k in range(n):
            if k > 0 and time.time() + sum(walls.values()) > train_deadline:
                return
            for name, index in jobs[k * per_round:(k + 1) * per_round]:
                entry, state = self.ctx.train_one(name, index, train_deadline)
                walls[name] = entry["wall_seconds"]
                if state is not None:
                    self.states[(name, index)] = state
                self.record(name, entry)
                if not entry["completed"]:
                    return

    def _sweep_workers(self, jobs: list[tuple[str, int]], train_deadline: float) -> None:
        for name, index in jobs:
            self.pool.submit(("train", name, index, train_deadline, str(self.tmp / f"state_{name}_{index}.pt")))
        # The main process's copy of the data and model is no longer needed on the device.
        self.ctx.batches, self.ctx.factory._frod = [], None
        self.ctx.base.to("cpu")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        for _ in jobs:
            msg = self.pool.get()
            if msg[0] == "skipped":
                self.log(f"{msg[1]} lr={self.cfg.lrs[msg[1]][msg[2]]:g}: skipped, it would not finish in the budget")
                continue
            _, name, index, entry, state_path = msg
            if state_path is not None:
                self.states[(name, index)] = state_path
            self.record(name, entry)

    # -- 4. selection and final evaluation ---------------------------------------------------------------

    def select(self) -> list[tuple[str, int]]:
        """Each method's chosen run, as (method, LR index); flags a choice at an end of its sweep."""
        cfg, chosen = self.cfg, []
        for name in cfg.methods:
            m = self.results.doc["methods"][name]
            done = [i for i, r in enumerate(m["sweep"]) if r["completed"] and r["heldout"]]
            if not done:
                continue
            if cfg.select_by == "accuracy":
                best = min(done, key=lambda i: (-m["sweep"][i]["heldout"]["accuracy"],
                                                m["sweep"][i]["heldout"]["answer_loss"]))
            else:
                best = min(done, key=lambda i: m["sweep"][i]["heldout"]["answer_loss"])
            run = m["sweep"][best]
            at_end = run["lr"] in (min(cfg.lrs[name]), max(cfg.lrs[name]))
            m["chosen"] = {"index": best, "lr": run["lr"], "selected_by": f"held-out {cfg.select_by}",
                           "at_sweep_end": at_end, "sweep_complete": len(done) == len(cfg.lrs[name])}
            if at_end:
                side = "lowest" if run["lr"] == min(cfg.lrs[name]) else "highest"
                self.results.warn(f"LR AT SWEEP END: {name} chose lr={run['lr']:g}, the {side} of its sweep "
                                  f"{list(cfg.lrs[name])}; widen it with --lrs {name}=...")
            chosen.append((name, run["index"]))
        self.results.save()
        return chosen

    def final_evals(self, chosen: list[tuple[str, int]]) -> None:
        methods = self.results.doc["methods"]
        if self.pool is None:
            longest = 0.0
            for name, index in chosen:
                if time.time() + longest > self.deadline:
                    self.results.warn(f"FINAL EVAL SKIPPED: {name} (no time left under --max-minutes "
                                      f"{self.cfg.max_minutes})")
                    continue
                self.log(f"{name}: chosen lr={self.cfg.lrs[name][index]:g}; test evaluation")
                t = time.perf_counter()
                methods[name]["test"] = self.ctx.final_test(name, self.states[(name, index)])
                longest = max(longest, time.perf_counter() - t)
                self.results.save()
            return
        for name, index in chosen:
            self.log(f"{name}: chosen lr={self.cfg.lrs[name][index]:g}; test evaluation in a worker")
            self.pool.submit(("eval", name, self.states[(name, index)]))
        for _ in chosen:
            _, name, test, seconds = self.pool.get()
            methods[name]["test"] = test
            self.results.save()

    # -- 5. claim, plots ---------------------------------------------------------------------------------

    def finish(self) -> None:
        doc, cfg, steps = self.results.doc, self.cfg, self.ctx.steps
        loras = [m for m in cfg.methods if method_spec(m).kind == "lora"]
        if "frod" in cfg.methods and loras:
            doc["claim"] = claim(doc["methods"], "frod", loras, smooth_window(steps, cfg.smooth_frac), steps)
            for name, entry in doc["claim"]["vs"].items():
                if entry.get("available"):
                    a = entry["answer_loss"]
                    self.log(f"claim vs {name}: FRoD reaches LoRA's final answer-word loss at step "
                             f"{a['frod_steps_to_lora_final']} of {steps} (ratio {a['ratio']}); "
                             f"loss claim {entry['loss_claim_holds']}, accuracy claim {entry['accuracy_claim_holds']}")
        sha = {r["data_order_sha256"] for m in doc["methods"].values() for r in m["sweep"] if r["completed"]}
        tokens = {r["tokens"] for m in doc["methods"].values() for r in m["sweep"] if r["completed"]}
        doc["same_data_all_runs"] = len(sha) <= 1 and len(tokens) <= 1
        assert doc["same_data_all_runs"], "runs saw different data; this is a bug in the study"
        doc["sweep_table"] = sweep_table(doc)
        doc["wall_seconds"] = time.perf_counter() - self.t0
        complete = all("test" in m and m.get("chosen", {}).get("sweep_complete") for m in doc["methods"].values())
        doc["complete"] = complete and (not cfg.base_eval or "base" in doc)
        self.results.save()
        try:
            doc["table_md"] = markdown_tables(doc)
            self.log("results:\n" + doc["table_md"])
            doc["plots"] = [p.name for p in write_plots(doc, self.out)]
        except Exception as e:  # noqa: BLE001 - the numbers are saved; tables and plots can be redone (--replot)
            self.results.warn(f"table/plots failed: {type(e).__name__}: {e}; rerun with --replot")
        self.results.save()
        self.log(f"done in {doc['wall_seconds']:.1f} s; complete={doc['complete']}; {self.results.path}")

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)  # made by mkdtemp above


def run_study(cfg: StudyConfig, argv: list[str]) -> Path:
    study = Study(cfg, argv)
    study.log(f"device {study.results.doc['device']}; methods {cfg.methods}; budget {cfg.max_minutes} min")
    study.setup()
    try:
        study.start_workers()
        study.base_evals()
        study.frod_init_check()
        study.sweep()
        study.final_evals(study.select())
        study.finish()
    finally:
        study.close()
    return study.results.path
