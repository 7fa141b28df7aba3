"""The study, stage by stage, under one time budget; the results document is saved after every stage.

1. Load the base model, the rows, tokenize once (train, a held-out slice of the train rows, test rows),
   pre-collate every step's batch onto the device: every run consumes the same batch objects.
2. Preflight both eval protocols on a few rows; base model: held-out and test-slice accuracy (step 0 of
   the curves), then its full test evaluation (the reference, and the measured cost of one final eval).
3. Sweep rounds: round k trains every method at its k-th LR, centre of each sweep first, so a budget cut
   leaves every method with the same number of LRs. A round starts only if the last round's run times plus
   the final evals' reserve fit in the budget.
4. Per method: the LR with the best held-out accuracy (ties: lower held-out answer-word loss), loudly
   flagged when it sits at an end of its sweep; its trained weights, merged into a plain model, are
   scored on the test sets with every protocol.
5. The paper's claim (``report.claim``), plots, a Markdown table.
"""

from __future__ import annotations

import datetime as _dt
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import device_name, versions
from bench.study.config import StudyConfig, StudyError, method_spec
from bench.study.data import encode_study_examples, load_test_rows, make_batches, split_rows
from bench.study.evaluate import heldout_losses, llm_adapters_eval, loglik_eval, resolve_gen_impl
from bench.study.loop import train_run
from bench.study.models import (ModelFactory, load_base, load_trainable_state, make_optimizer, merged_for_eval,
                                trainable_numel, trainable_state)
from bench.study.report import (Results, claim, correct_bits, markdown_tables, smooth_window, sweep_table,
                                write_plots)
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


def _micro(summary: dict) -> float:
    tasks = summary["tasks"].values()
    return sum(e["correct"] for e in tasks) / sum(e["n"] for e in tasks)


class Study:
    def __init__(self, cfg: StudyConfig, argv: list[str]):
        self.cfg, self.t0 = cfg, time.perf_counter()
        self.deadline = self.t0 + 60 * cfg.max_minutes
        self.out = Path(cfg.out)
        self.log = Log(self.t0)
        want = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        if want == "cuda" and not torch.cuda.is_available():
            raise StudyError("--device cuda but no CUDA device is visible")
        self.device = torch.device(want)
        self.results = Results(self.out, {
            "benchmark": "real_study",
            "command": " ".join([Path(sys.executable).name, *argv]),
            "device": device_name(),
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "versions": {**versions(), "git": _git_commit()},
            "config": cfg.to_dict(),
            "methods": {},
        }, log=self.log)
        self.states: dict[tuple[str, int], dict] = {}
        self.eval_seconds = 0.0  # the longest final evaluation so far

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
        self.held_by_task: dict[str, list[dict]] = {}
        for row in held_rows:
            self.held_by_task.setdefault(row["task"], []).append(row)
        self.test = load_test_rows(cfg.eval_path, cfg.eval_limit)
        self.base, self.tok = load_base(cfg.model, dev)
        self.pad_id = self.tok.pad_token_id
        self.curve = {t: rows[: cfg.curve_limit] for t, rows in self.test.items()}
        t = time.perf_counter()
        train_ex = encode_study_examples(self.tok, train_rows, cfg.cutoff)
        held_ex = encode_study_examples(self.tok, held_rows, cfg.cutoff)
        plan = BatchPlan(len(train_ex), cfg.batch_size, 1, 1, 0, cfg.seed)
        self.steps = plan.total_steps(cfg.epochs, None)
        self.batches = [b.to(dev) for b in make_batches(train_ex, plan, self.steps, self.pad_id, cfg.train_on_inputs)]
        self.held_batches = [b.to(dev) for b in make_batches(held_ex, None, 0, self.pad_id, cfg.train_on_inputs,
                                                             batch_size=cfg.eval_batch)]
        self.checkpoint_steps = sorted({max(1, round(self.steps * (i + 1) / cfg.checkpoints))
                                        for i in range(cfg.checkpoints)})
        self.gen_scorer, gen_name = resolve_gen_impl(cfg.gen_impl)
        seen = [i for b in self.batches for i in b.indices]
        self.results.doc["data"] = {
            "train_file": str(cfg.train_path), "eval_dir": str(cfg.eval_path),
            "train_rows": len(train_rows), "heldout_rows": len(held_rows),
            "heldout_ids": [r.get("id") for r in held_rows],
            "heldout_rows_per_task": {t: len(r) for t, r in self.held_by_task.items()},
            "steps": self.steps, "batch_size": cfg.batch_size, "epochs_seen": len(seen) / len(train_ex),
            "distinct_rows_seen": len(set(seen)),
            "train_tokens": sum(b.n_tokens for b in self.batches),
            "scored_tokens": sum(b.n_scored for b in self.batches),
            "answer_word_tokens": sum(b.n_answer for b in self.batches),
            "truncated_train_rows": sum(e.truncated for e in train_ex),
            "max_train_tokens": max(len(e.input_ids) for e in train_ex),
            "first_batch_ids": [train_rows[i].get("id") for i in self.batches[0].indices],
            "test_rows_per_task": {t: len(r) for t, r in self.test.items()},
            "test_rows_are_full_sets": cfg.eval_limit is None,
            "curve_rows_per_task": {t: len(r) for t, r in self.curve.items()},
            "checkpoint_steps": self.checkpoint_steps,
            "separators": sorted({repr(r.get("separator", "\nAnswer: ")) for r in train_rows}),
            "generation_scorer": gen_name,
            "setup_seconds": time.perf_counter() - t,
        }
        self._preflight()
        # Nothing is written before every input has been read and checked.
        self.out.mkdir(parents=True, exist_ok=True)
        self.log.attach(self.out)
        self.results.save()
        d = self.results.doc["data"]
        self.log(f"data: {d['train_rows']} train rows ({self.steps} steps of {cfg.batch_size}), "
                 f"{d['heldout_rows']} held out, test {d['test_rows_per_task']}, "
                 f"{d['train_tokens']} tokens/run ({d['answer_word_tokens']} answer-word)")

    # -- 2. evaluations ----------------------------------------------------------------------------------

    def checkpoint_eval(self, model) -> dict[str, Any]:
        cfg = self.cfg
        held = heldout_losses(model, self.held_batches, self.device)
        acc_h, _ = loglik_eval(model, self.tok, self.held_by_task, self.pad_id, cfg.eval_batch, self.device)
        acc_t, _ = loglik_eval(model, self.tok, self.curve, self.pad_id, cfg.eval_batch, self.device)
        return {"heldout_accuracy": _micro(acc_h), **{f"heldout_{k}": v for k, v in held.items()},
                "test_slice_average": acc_t["average"],
                "test_slice_tasks": {t: e["accuracy"] for t, e in acc_t["tasks"].items()}}

    def test_eval(self, model, gen_rows: dict[str, list[dict]] | None = None) -> dict[str, Any]:
        """Every protocol on the test rows (llm-adapters on ``gen_rows`` when given)."""
        out, cfg = {}, self.cfg
        for protocol in cfg.protocols:
            t = time.perf_counter()
            if protocol == "loglik":
                rows = self.test
                summary, records = loglik_eval(model, self.tok, rows, self.pad_id, cfg.eval_batch, self.device)
            else:
                rows = gen_rows or self.test
                summary, records = llm_adapters_eval(model, self.tok, rows, self.pad_id, cfg, self.device,
                                                     self.gen_scorer)
                summary["examples"] = {task: [r["output"] for r in records if r["task"] == task][:3] for task in rows}
            summary["correct_bits"] = correct_bits(records, list(rows))
            summary["seconds"] = time.perf_counter() - t
            out[protocol] = summary
            self.log(f"  test {protocol}: average {summary['average']:.4f} over {summary['n']} rows; "
                     + " ".join(f"{k}={e['accuracy']:.3f}" for k, e in summary["tasks"].items())
                     + f" ({summary['seconds']:.1f} s)")
        return out

    def _preflight(self) -> None:
        """Both protocols on two rows per task with the base model: a broken scorer fails before any output."""
        few = {t: rows[:2] for t, rows in self.test.items()}
        loglik_eval(self.base, self.tok, few, self.pad_id, self.cfg.eval_batch, self.device)
        if "llm-adapters" in self.cfg.protocols:
            llm_adapters_eval(self.base, self.tok, few, self.pad_id, self.cfg, self.device, self.gen_scorer)

    def base_evals(self) -> None:
        """Step-0 metrics; (``base_eval``) the base model on the test sets, generation on the curve slice only
        (the untrained model rambles to the token limit: the slowest and least informative evaluation)."""
        self.results.doc["step0"] = self.checkpoint_eval(self.base)
        self.results.save()
        if self.cfg.base_eval:
            self.log("base model: test evaluation (llm-adapters on the curve slice)")
            self.results.doc["base"] = {"test": self.test_eval(self.base, gen_rows=self.curve)}
            self.results.save()

    # -- 3. sweep rounds ---------------------------------------------------------------------------------

    def run_one(self, factory: ModelFactory, name: str, index: int, deadline: float) -> dict[str, Any]:
        cfg, spec = self.cfg, method_spec(name)
        lr = cfg.lrs[name][index]
        w0 = time.perf_counter()
        model = factory.build(spec)
        optimizer = make_optimizer(spec, model, lr, cfg)
        log = train_run(model, optimizer, self.batches, cfg, self.device, set(self.checkpoint_steps),
                        lambda step: self.checkpoint_eval(model), deadline)
        entry: dict[str, Any] = {"lr": lr, "index": index, "trainable_params": trainable_numel(model)}
        if spec.kind == "frod":
            entry["lr_s"] = cfg.frod_s_ratio * lr
        last = log.checkpoints[-1] if log.checkpoints and log.checkpoints[-1]["step"] == self.steps else None
        d = log.to_dict()
        entry.update(completed=log.completed, steps=log.steps, train_seconds=log.train_seconds,
                     step_ms=1e3 * log.train_seconds / max(1, log.steps), tokens=log.tokens,
                     scored_tokens=log.scored_tokens, answer_tokens=log.answer_tokens,
                     data_order_sha256=log.data_order_sha256, peak_mem_gb=log.peak_mem_gb,
                     checkpoints=log.checkpoints,
                     heldout=None if last is None else {
                         "accuracy": last["heldout_accuracy"], "loss": last["heldout_loss"],
                         "response_loss": last["heldout_response_loss"], "answer_loss": last["heldout_answer_loss"]},
                     log={k: d[k] for k in ("loss", "response_loss", "answer_loss", "grad_norm", "lr")})
        if log.completed:
            self.states[(name, index)] = trainable_state(model)
        del model, optimizer
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        entry["wall_seconds"] = time.perf_counter() - w0
        h = entry["heldout"] or {}
        self.log(f"{name} lr={lr:g}: {log.steps}/{self.steps} steps, {entry['step_ms']:.1f} ms/step, "
                 f"final answer-word loss {sum(log.answer_loss[-20:]) / max(1, len(log.answer_loss[-20:])):.4f}, "
                 f"held-out acc {h.get('accuracy', float('nan')):.4f} ({entry['wall_seconds']:.1f} s)")
        return entry

    def sweep(self) -> None:
        cfg = self.cfg
        factory = self.factory = ModelFactory(self.base, cfg)
        methods = self.results.doc["methods"]
        for name in cfg.methods:
            spec = method_spec(name)
            methods[name] = {"kind": spec.kind, "rank": spec.rank, "lrs": list(cfg.lrs[name]), "sweep": []}
            if spec.kind == "lora":
                methods[name]["lora_alpha"] = cfg.lora_alpha_ratio * spec.rank
        if "frod" in cfg.methods:
            template = factory.frod_template()
            self._frod_init_check(template)
            methods["frod"]["hjd_seconds"] = factory.hjd_seconds
        reserve = 60 * cfg.eval_reserve_minutes
        walls: dict[str, float] = {}
        n = len(next(iter(cfg.lrs.values())))
        for k, index in enumerate(_sweep_order(n)):
            predicted = sum(walls.get(m, 0.0) for m in cfg.methods)
            if k > 0 and time.perf_counter() + predicted + reserve > self.deadline:
                self.results.warn(f"SWEEP CUT SHORT: round {k + 1}/{n} (predicted {predicted:.0f} s) does not fit "
                                  f"--max-minutes {cfg.max_minutes}; every method has {k} LR(s). Raise --max-minutes "
                                  "or shrink with --train-limit / --eval-limit / --batch-size")
                break
            for name in cfg.methods:
                entry = self.run_one(factory, name, index, self.deadline - reserve)
                walls[name] = entry["wall_seconds"]
                methods[name]["sweep"].append(entry)
                methods[name]["sweep"].sort(key=lambda e: e["lr"])
                self.results.save()
                if not entry["completed"]:
                    self.results.warn(f"RUN STOPPED BY THE TIME BUDGET: {name} lr={entry['lr']:g} after "
                                      f"{entry['steps']}/{self.steps} steps; it is excluded from selection")
                    return
        self.results.doc["timing_note"] = ("step_ms: training time per step, checkpoint evaluations excluded; "
                                           "wall_seconds: the whole run (model copy, training, evaluations)")

    @torch.no_grad()
    def _frod_init_check(self, template) -> None:
        """Max |logit| difference FRoD-at-init vs base on the first held-out batch (fp32, no autocast)."""
        b = self.held_batches[0]
        kw = dict(input_ids=b.input_ids[:4], attention_mask=b.attention_mask[:4], use_cache=False)
        diff = (template(**kw).logits - self.base(**kw).logits).abs().max().item()
        self.results.doc["methods"]["frod"]["init_max_logit_diff_fp32"] = diff
        self.log(f"frod: HJD + apply_frod; init max |logit - base| = {diff:.2e} (fp32)")

    # -- 4. selection and final evaluation ---------------------------------------------------------------

    def select_and_evaluate(self) -> None:
        cfg, methods, factory = self.cfg, self.results.doc["methods"], self.factory
        for name in cfg.methods:
            m = methods[name]
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
            if time.perf_counter() + self.eval_seconds > self.deadline:
                self.results.warn(f"FINAL EVAL SKIPPED: {name} (no time left under --max-minutes {cfg.max_minutes})")
                continue
            self.log(f"{name}: chosen lr={run['lr']:g}; test evaluation")
            spec = method_spec(name)
            model = factory.build(spec)
            load_trainable_state(model, self.states[(name, run["index"])])
            t = time.perf_counter()
            m["test"] = self.test_eval(merged_for_eval(spec, model))
            self.eval_seconds = max(self.eval_seconds, time.perf_counter() - t)
            del model
            self.results.save()

    # -- 5. claim, plots ---------------------------------------------------------------------------------

    def finish(self) -> None:
        doc, cfg = self.results.doc, self.cfg
        loras = [m for m in cfg.methods if method_spec(m).kind == "lora"]
        if "frod" in cfg.methods and loras:
            doc["claim"] = claim(doc["methods"], "frod", loras, smooth_window(self.steps, cfg.smooth_frac), self.steps)
            for name, entry in doc["claim"]["vs"].items():
                if entry.get("available"):
                    a = entry["answer_loss"]
                    self.log(f"claim vs {name}: FRoD reaches LoRA's final answer-word loss at step "
                             f"{a['frod_steps_to_lora_final']} of {self.steps} (ratio {a['ratio']}); "
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


def run_study(cfg: StudyConfig, argv: list[str]) -> Path:
    study = Study(cfg, argv)
    study.log(f"device {study.results.doc['device']}; methods {cfg.methods}; budget {cfg.max_minutes} min")
    study.setup()
    study.base_evals()
    study.sweep()
    study.select_and_evaluate()
    study.finish()
    return study.results.path
