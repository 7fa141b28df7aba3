"""What one training run or one final evaluation needs, in the main process or in a worker process.

``RunContext`` holds the tokenizer, the base model on the device, the pre-collated batches, the held-out and
test rows; ``train_one`` trains one (method, LR) run with checkpoint evaluations and ``final_test`` scores a
trained run on the test sets. ``save``/``load`` move everything but the model through one file (CPU
tensors), so worker processes train on exactly the batches the main process built.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from studies.config import StudyConfig, method_spec
from studies.data import Batch
from studies.evaluate import GENERATION_SCORER, exact_eval, heldout_losses, llm_adapters_eval, loglik_eval
from studies.loop import fp32_only, train_run
from studies.models import (
    ModelFactory,
    load_base,
    load_trainable_state,
    make_optimizer,
    merged_for_eval,
    trainable_numel,
    trainable_state,
)
from studies.report import correct_bits
from studies.rotation import initial_sigmas, rotation_by_category

__all__ = ["RunContext"]


def _validation_curve(light: list[dict], checkpoints: list[dict]) -> list[dict]:
    """``[{"step", "loss", "response_loss", "answer_loss"}]`` of every validation evaluation, by step."""
    keys = ("loss", "response_loss", "answer_loss")
    points = [{"step": c["step"], **{k: c[f"heldout_{k}"] for k in keys}} for c in light + checkpoints]
    return sorted(points, key=lambda p: p["step"])


def _micro(summary: dict) -> float:
    tasks = summary["tasks"].values()
    return sum(e["correct"] for e in tasks) / sum(e["n"] for e in tasks)


@dataclass
class RunContext:
    cfg: StudyConfig
    device: torch.device
    tok: Any
    base: torch.nn.Module
    batches: list[Batch]
    held_batches: list[Batch]
    held_by_task: dict[str, list[dict]]
    curve: dict[str, list[dict]]
    test: dict[str, list[dict]]
    steps: int
    checkpoint_steps: list[int]
    log: Callable[[str], None] = print
    templates: dict | None = None  # a worker's factored models, kept across its studies (``ModelFactory``)
    factory: ModelFactory = field(init=False)

    def __post_init__(self) -> None:
        self.pad_id = self.tok.pad_token_id
        self.gen_name = GENERATION_SCORER
        self.factory = ModelFactory(self.base, self.cfg, self.templates)

    # -- transport to worker processes -------------------------------------------------------------------

    def save(self, path: Path) -> None:
        cpu = torch.device("cpu")
        torch.save(
            {
                "cfg": self.cfg,
                "batches": [b.to(cpu) for b in self.batches],
                "held_batches": [b.to(cpu) for b in self.held_batches],
                "held_by_task": self.held_by_task,
                "curve": self.curve,
                "test": self.test,
                "steps": self.steps,
                "checkpoint_steps": self.checkpoint_steps,
            },
            path,
        )

    @classmethod
    def load(cls, path: Path, device: torch.device, log: Callable[[str], None] = print, cache=None) -> RunContext:
        """The context saved at ``path`` on ``device``; ``cache``: a worker's dict kept across studies, holding
        the base model and the factored templates while the model path stays the same (the base is never
        trained: every method builds on a copy)."""
        d = torch.load(path, weights_only=False)
        cache = {} if cache is None else cache
        if cache.get("model") != d["cfg"].model:
            cache.clear()
            cache.update(model=d["cfg"].model, base=load_base(d["cfg"].model, device), templates={})
        base, tok = cache["base"]
        return cls(
            cfg=d["cfg"],
            device=device,
            tok=tok,
            base=base,
            batches=[b.to(device) for b in d["batches"]],
            held_batches=[b.to(device) for b in d["held_batches"]],
            held_by_task=d["held_by_task"],
            curve=d["curve"],
            test=d["test"],
            steps=d["steps"],
            checkpoint_steps=d["checkpoint_steps"],
            log=log,
            templates=cache["templates"],
        )

    # -- evaluations -------------------------------------------------------------------------------------

    def checkpoint_eval(self, model) -> dict[str, Any]:
        """Held-out losses and accuracy, test-slice accuracy (log-likelihood)."""
        cfg = self.cfg
        held = heldout_losses(model, self.held_batches, self.device)
        acc_h, _ = loglik_eval(model, self.tok, self.held_by_task, self.pad_id, cfg.eval_batch, self.device)
        acc_t, _ = loglik_eval(model, self.tok, self.curve, self.pad_id, cfg.eval_batch, self.device)
        return {
            "heldout_accuracy": _micro(acc_h),
            **{f"heldout_{k}": v for k, v in held.items()},
            "test_slice_average": acc_t["average"],
            "test_slice_tasks": {t: e["accuracy"] for t, e in acc_t["tasks"].items()},
        }

    def test_eval(self, model, gen_rows: dict[str, list[dict]] | None = None, label: str = "") -> dict[str, Any]:
        """Every protocol on the test rows (llm-adapters on ``gen_rows`` when given)."""
        out, cfg = {}, self.cfg
        for protocol in cfg.protocols:
            t = time.perf_counter()
            if protocol == "loglik":
                rows = self.test
                summary, records = loglik_eval(model, self.tok, rows, self.pad_id, cfg.eval_batch, self.device)
            elif protocol == "exact":
                rows = self.test
                summary, records = exact_eval(
                    model, self.tok, rows, self.pad_id, cfg.eval_batch, cfg.exact_max_new_tokens, self.device
                )
                summary["examples"] = {task: [r["output"] for r in records if r["task"] == task][:3] for task in rows}
            else:
                rows = gen_rows or self.test
                summary, records = llm_adapters_eval(model, self.tok, rows, self.pad_id, cfg.gen_batch, self.device)
                summary["examples"] = {task: [r["output"] for r in records if r["task"] == task][:3] for task in rows}
            summary["correct_bits"] = correct_bits(records, list(rows))
            summary["seconds"] = time.perf_counter() - t
            out[protocol] = summary
            self.log(
                f"  {label} test {protocol}: average {summary['average']:.4f} over {summary['n']} rows; "
                + " ".join(f"{k}={e['accuracy']:.3f}" for k, e in summary["tasks"].items())
                + f" ({summary['seconds']:.1f} s)"
            )
        return out

    def preflight(self) -> None:
        """Both protocols on two rows per task with the base model: a broken scorer fails before any output."""
        few = {t: rows[:2] for t, rows in self.test.items()}
        loglik_eval(self.base, self.tok, few, self.pad_id, self.cfg.eval_batch, self.device)
        if "llm-adapters" in self.cfg.protocols:
            llm_adapters_eval(self.base, self.tok, few, self.pad_id, self.cfg.gen_batch, self.device)
        if "exact" in self.cfg.protocols:
            exact_eval(
                self.base, self.tok, few, self.pad_id, self.cfg.eval_batch, self.cfg.exact_max_new_tokens, self.device
            )

    # -- one run -----------------------------------------------------------------------------------------

    def train_one(self, name: str, lr: float, deadline: float) -> tuple[dict[str, Any], dict | None]:
        """(the run's fields of a ``RunRecord``, its trainable state or None if it stopped early) of method
        ``name`` at LR ``lr`` (FRoD: the σ LR). Training stops at ``deadline`` (a ``time.time()``)."""
        cfg, spec = self.cfg, method_spec(name)
        w0 = time.perf_counter()
        model = self.factory.build(spec)
        optimizer = make_optimizer(spec, model, lr, cfg)
        # FRoD kinds: how far the update rotates each category's weights, at every checkpoint (paper §3)
        sigma0 = initial_sigmas(model) if spec.kind in ("frod", "peftfrod", "peftfrod_inj") else None

        def on_checkpoint(step: int, model: torch.nn.Module = model) -> dict[str, Any]:
            out = self.checkpoint_eval(model)
            if sigma0 is not None:
                out["tan_alpha"] = rotation_by_category(model, sigma0)
            return out

        def on_validation(step: int, model: torch.nn.Module = model) -> dict[str, Any]:
            return {f"heldout_{k}": v for k, v in heldout_losses(model, self.held_batches, self.device).items()}

        every = cfg.val_every
        fp32 = spec.fp32 or (cfg.peft_frod_fp32 and spec.kind in ("peftfrod", "peftfrod_inj"))
        with fp32_only() if fp32 else contextlib.nullcontext():
            log = self._train(model, optimizer, deadline, on_checkpoint, on_validation)
        last = log.checkpoints[-1] if log.checkpoints and log.checkpoints[-1]["step"] == self.steps else None
        d = log.to_dict()
        entry: dict[str, Any] = dict(
            lr=lr,
            lr_s=spec.s_ratio(cfg.frod_s_ratio) * lr if spec.two_rates else None,
            trainable_params=trainable_numel(model),
            completed=log.completed,
            steps=log.steps,
            train_seconds=log.train_seconds,
            step_ms=1e3 * log.train_seconds / max(1, log.steps),
            tokens=log.tokens,
            scored_tokens=log.scored_tokens,
            answer_tokens=log.answer_tokens,
            data_order_sha256=log.data_order_sha256,
            peak_mem_gb=log.peak_mem_gb,
            checkpoints=log.checkpoints,
            heldout=None
            if last is None
            else {
                "accuracy": last["heldout_accuracy"],
                "loss": last["heldout_loss"],
                "response_loss": last["heldout_response_loss"],
                "answer_loss": last["heldout_answer_loss"],
            },
            log={k: d[k] for k in ("loss", "response_loss", "answer_loss", "grad_norm", "lr")},
            validation=_validation_curve(log.validation, log.checkpoints) if every else None,
        )
        state = trainable_state(model) if log.completed else None
        del model, optimizer, on_checkpoint
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        entry["wall_seconds"] = time.perf_counter() - w0
        return entry, state

    def _train(self, model, optimizer, deadline, on_checkpoint, on_validation):
        every = self.cfg.val_every
        return train_run(
            model,
            optimizer,
            self.batches,
            self.cfg,
            self.device,
            set(self.checkpoint_steps),
            on_checkpoint,
            deadline,
            validation_steps=set(range(every, self.steps + 1, every)) if every else set(),
            on_validation=on_validation,
        )

    def final_test(self, name: str, state: dict) -> dict[str, Any]:
        """A trained run (its trainable ``state``), merged into a plain model, on the test sets."""
        spec = method_spec(name)
        model = self.factory.build(spec)
        load_trainable_state(model, state)
        out = self.test_eval(merged_for_eval(spec, model), label=name)
        del model
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return out
