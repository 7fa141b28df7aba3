"""The study's evaluations: held-out losses, log-likelihood accuracy, LLM-Adapters' generation protocol.

- loglik: ``frod_ds.eval.predict.score_loglik_rows`` (the project's scoring of every choice's tokens after the
  training text's context).
- llm-adapters: ``frod_ds.eval.predict.score_llm_adapters_rows``, the library's implementation of LLM-Adapters'
  ``commonsense_evaluate.py`` (its scoring prompt as the rows store it, beam search with 4 beams and 32 new
  tokens, the text after ``### Response:``, the first regex match of the task's answer words, correct iff it is
  the gold word; no match is wrong). The study keeps no scorer of its own: its numbers are the library's.
- exact: greedy decoding (``fe.generate_outputs``, up to ``exact_max_new_tokens``, stopping at EOS) after the
  context the log-likelihood protocol scores from; correct iff the first line of the output, stripped, is the
  row's answer. For generated tasks whose answer is a number or a word (``studies.tasks``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

import frod_ds.eval.predict as fe
from frod_ds.eval.accuracy import summarize
from studies.data import Batch
from studies.loop import autocast, token_nll

__all__ = ["heldout_losses", "loglik_eval", "llm_adapters_eval", "exact_answer", "exact_eval", "GENERATION_SCORER"]

# The name the study records for its generation scorer (``data.generation_scorer`` of real_study.json).
GENERATION_SCORER = f"{fe.score_llm_adapters_rows.__module__}.{fe.score_llm_adapters_rows.__qualname__}"


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


def loglik_eval(
    model: nn.Module, tok, rows_by_task: dict[str, list[dict]], pad_id: int, batch_size: int, device: torch.device
) -> tuple[dict, list[dict]]:
    """(``frod_ds.eval.accuracy.summarize`` of the records, per-row records) under the log-likelihood protocol."""
    model.eval()
    records = []
    with autocast(device):
        for rows in rows_by_task.values():
            for idx in fe.plan_batches(rows, batch_size):
                records += fe.score_loglik_rows(model, tok, [rows[i] for i in idx], pad_id)
    return summarize(records, list(rows_by_task), "loglik"), records


def llm_adapters_eval(
    model: nn.Module, tok, rows_by_task: dict[str, list[dict]], pad_id: int, gen_batch: int, device: torch.device
) -> tuple[dict, list[dict]]:
    """(summary, records) under LLM-Adapters' generation protocol (``fe.score_llm_adapters_rows``); batches of
    ``gen_batch`` rows (a row's output does not depend on its batch)."""
    model.eval()
    records = []
    for rows in rows_by_task.values():
        with autocast(device):
            for idx in fe.plan_batches(rows, gen_batch):
                records += fe.score_llm_adapters_rows(model, tok, [rows[i] for i in idx], pad_id)
    return summarize(records, list(rows_by_task), "generate"), records


def exact_answer(output: str) -> str:
    """What a greedy output answers: its first line, stripped (the answer's leading space may be generated)."""
    return output.strip().split("\n", 1)[0].strip()


def exact_eval(
    model: nn.Module,
    tok,
    rows_by_task: dict[str, list[dict]],
    pad_id: int,
    batch_size: int,
    max_new_tokens: int,
    device: torch.device,
) -> tuple[dict, list[dict]]:
    """(summary in ``summarize``'s shape, records) of exact match of a greedy answer to each row's ``answer``."""
    from frod_ds.prep.rows import row_separator

    model.eval()
    records = []
    with autocast(device):
        for rows in rows_by_task.values():
            for idx in fe.plan_batches(rows, batch_size):
                batch = [rows[i] for i in idx]
                enc = fe.encode_rows(
                    tok, [r["prompt"] for r in batch], [[r["answer"]] for r in batch], [row_separator(r) for r in batch]
                )
                outs = fe.generate_outputs(model, tok, [e.context for e in enc], max_new_tokens, pad_id)
                records += [
                    {
                        "task": r["task"],
                        "id": r["id"],
                        "answer": r["answer"],
                        "output": o,
                        "pred": exact_answer(o),
                        "correct": exact_answer(o) == r["answer"],
                    }
                    for r, o in zip(batch, outs)
                ]
    return summarize(records, list(rows_by_task), "generate"), records
