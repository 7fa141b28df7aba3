"""The study's evaluations: held-out losses, log-likelihood accuracy, LLM-Adapters' generation protocol.

- loglik: ``frod_ds.eval.evaluation.score_loglik_rows`` (the project's scoring of every choice's tokens after the
  training text's context).
- llm-adapters: LLM-Adapters' ``commonsense_evaluate.py`` — its scoring prompt, beam search (4 beams, 32 new
  tokens), the first regex match of the task's answer words, correct iff equal to the gold answer word; no
  match is wrong. ``--gen-impl project`` calls ``frod_ds.eval.evaluation.score_llm_adapters_rows(model,
  tokenizer, rows, pad_id)`` instead (being added to the project; ``auto`` takes it when it exists) — a
  preflight on a few rows checks whichever is used before any training.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

import frod_ds.eval.evaluation as fe
from bench.study.data import Batch, answer_word
from bench.study.loop import autocast, token_nll
from frod_ds.prep.io import row_separator
from frod_ds.eval.scoring import summarize

__all__ = ["heldout_losses", "loglik_eval", "llm_adapters_eval", "llm_adapters_prompt", "extract_answer_word",
           "resolve_gen_impl", "LLM_ADAPTERS_WORDS"]

_ANSWERS5 = ("answer1", "answer2", "answer3", "answer4", "answer5")
# LLM-Adapters' answer-word alternations per task (its folder names and frod-ds task keys).
LLM_ADAPTERS_WORDS: dict[str, tuple[str, ...]] = {
    "boolq": ("true", "false"),
    "piqa": ("solution1", "solution2"),
    "hellaswag": ("ending1", "ending2", "ending3", "ending4"),
    "winogrande": ("option1", "option2"),
    **{t: _ANSWERS5 for t in ("social_i_qa", "siqa", "ARC-Challenge", "arc_challenge", "ARC-Easy", "arc_easy",
                              "openbookqa", "obqa")},
}

# LLM-Adapters trains on one prompt and scores with a slightly different one (one space after "request."
# instead of two; an empty line instead of a line of 16 spaces before "### Response:").
_TRAIN_TO_SCORE = (("the request.  \n\n", "the request. \n\n"),
                   ("\n                \n                ### Response:", "\n\n                ### Response:"))


@torch.no_grad()
def heldout_losses(model: nn.Module, batches: Sequence[Batch], device: torch.device) -> dict[str, float]:
    """Token-weighted mean NLL over held-out batches: objective, response (answer+EOS), answer word."""
    model.eval()
    sums = torch.zeros(3, device=device, dtype=torch.float64)
    counts = torch.zeros(3, device=device, dtype=torch.float64)
    for batch in batches:
        with autocast(device):
            nll = token_nll(model, batch).double()  # (N,)
        resp, word = batch.response.double(), batch.answer_word.double()
        sums += torch.stack([nll.sum(), (nll * resp).sum(), (nll * word).sum()])
        counts += torch.stack([torch.ones_like(nll).sum(), resp.sum(), word.sum()])
    loss, response, word_loss = (sums / counts).tolist()
    return {"loss": loss, "response_loss": response, "answer_loss": word_loss}


def loglik_eval(model: nn.Module, tok, rows_by_task: dict[str, list[dict]], pad_id: int, batch_size: int,
                device: torch.device) -> tuple[dict, list[dict]]:
    """(``frod_ds.eval.scoring.summarize`` of the records, per-row records) under the log-likelihood protocol."""
    model.eval()
    records = []
    with autocast(device):
        for rows in rows_by_task.values():
            for idx in fe.plan_batches(rows, batch_size):
                records += fe.score_loglik_rows(model, tok, [rows[i] for i in idx], pad_id)
    return summarize(records, list(rows_by_task), "loglik"), records


def llm_adapters_prompt(row: dict) -> str:
    """LLM-Adapters' scoring prompt for a row rendered in its training template, else prompt + separator."""
    prompt = row["prompt"]
    if all(a in prompt for a, _ in _TRAIN_TO_SCORE):
        for a, b in _TRAIN_TO_SCORE:
            prompt = prompt.replace(a, b, 1)
        return prompt
    return prompt + row_separator(row)


def extract_answer_word(task: str, text: str, fallback: Sequence[str]) -> str | None:
    """First match of the task's answer-word alternation in ``text`` (LLM-Adapters' ``extract_answer``)."""
    words = LLM_ADAPTERS_WORDS.get(task, tuple(fallback))
    found = re.findall("|".join(re.escape(w) for w in words), text.strip())
    return found[0] if found else None


@torch.inference_mode()
def score_llm_adapters_local(model: nn.Module, tok, rows: Sequence[dict], pad_id: int, num_beams: int = 4,
                             max_new_tokens: int = 32) -> list[dict[str, Any]]:
    """Prediction records (``task, id, label, answer, pred, prediction, correct, output``) for one batch."""
    from transformers import GenerationConfig

    ids = tok([llm_adapters_prompt(r) for r in rows], add_special_tokens=True)["input_ids"]
    input_ids, attention_mask, _ = fe.left_pad(ids, pad_id)  # (B, T)
    device = next(model.parameters()).device
    config = GenerationConfig(num_beams=num_beams, max_new_tokens=max_new_tokens, do_sample=False,
                              pad_token_id=pad_id, eos_token_id=tok.eos_token_id)
    out = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                         generation_config=config)
    texts = tok.batch_decode(out[:, input_ids.shape[1]:].cpu(), skip_special_tokens=True)
    records = []
    for row, text in zip(rows, texts):
        words = [answer_word(c, row["choices"]) for c in row["choices"]]
        found = extract_answer_word(row["task"], text, words)
        pred = words.index(found) if found in words else None
        records.append({"task": row["task"], "id": row["id"], "label": row["label"], "answer": words[row["label"]],
                        "pred": pred, "prediction": found, "correct": found == words[row["label"]],
                        "output": text})
    return records


def resolve_gen_impl(choice: str) -> tuple[Callable, str]:
    """The generation scorer for ``--gen-impl`` and the name recorded in the results."""
    project = getattr(fe, "score_llm_adapters_rows", None)
    if choice == "project" or (choice == "auto" and project is not None):
        if project is None:
            from bench.study.config import StudyError

            raise StudyError("--gen-impl project: frod_ds.eval.evaluation has no score_llm_adapters_rows yet; "
                             "use --gen-impl local")
        return (lambda model, tok, rows, pad_id, cfg: project(model, tok, rows, pad_id),
                "frod_ds.eval.evaluation.score_llm_adapters_rows")
    return (lambda model, tok, rows, pad_id, cfg: score_llm_adapters_local(
        model, tok, rows, pad_id, cfg.num_beams, cfg.max_new_tokens), "bench.study.evaluate.score_llm_adapters_local")


def llm_adapters_eval(model: nn.Module, tok, rows_by_task: dict[str, list[dict]], pad_id: int, cfg,
                      device: torch.device, scorer: Callable) -> tuple[dict, list[dict]]:
    """(summary, records) under LLM-Adapters' generation protocol; batches of ``cfg.gen_batch`` rows."""
    model.eval()
    records = []
    for rows in rows_by_task.values():
        with autocast(device):
            for idx in fe.plan_batches(rows, cfg.gen_batch):
                records += scorer(model, tok, [rows[i] for i in idx], pad_id, cfg)
    return summarize(records, list(rows_by_task), "generate"), records
