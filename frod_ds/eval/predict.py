"""Zero-shot scoring of multiple-choice rows with a causal LM: log-likelihood, greedy generation and
LLM-Adapters' generation protocol.

Single-process and rank-free: every function maps a model, a tokenizer and rows (``{"prompt", "choices",
"label", ...}``, ``frod data build``'s eval JSONL) to numbers or strings; ``frod eval`` decides which rank scores
which batch. Each mode conditions on exactly the tokens that precede the answer in the training text
(`encode_row`). The modes (loglik, generate, llm-adapters) and their rules: docs/eval.md.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from frod_ds.prep.rows import ANSWER_SEPARATOR, row_separator
from frod_ds.runtime.errors import FrodError

__all__ = [
    "ANSWER_SEPARATOR",
    "common_prefix_len",
    "EvalError",
    "EncodedRow",
    "encode_row",
    "encode_rows",
    "left_pad",
    "loglik_scores",
    "generate_outputs",
    "match_choice",
    "plan_batches",
    "score_loglik_rows",
    "score_generate_rows",
    "LLM_ADAPTERS_WORDS",
    "LLM_ADAPTERS_NUM_BEAMS",
    "LLM_ADAPTERS_MAX_NEW_TOKENS",
    "RESPONSE_MARKER",
    "llm_adapters_row_problem",
    "llm_adapters_response",
    "extract_answer_word",
    "prompt_ids",
    "score_llm_adapters_rows",
]


class EvalError(FrodError):
    """A user-facing evaluation failure; the message is one line saying what to change."""


@dataclass(frozen=True)
class EncodedRow:
    """Token ids of one row: the shared context and one continuation per choice.

    ``context + continuations[j]`` is exactly the tokenization of the training text
    ``prompt + separator + choices[j]`` (special tokens included, no EOS).
    """

    context: list[int]  # (Tc,) BOS + prompt + separator, possibly less its trailing pieces
    continuations: list[list[int]]  # n_choices x (Tj,)


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading items ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _strip_eos(ids: list[int], eos_id: int | None) -> list[int]:
    # Tokenizers configured with add_eos_token append EOS; the scored text has none.
    return ids[:-1] if eos_id is not None and ids and ids[-1] == eos_id else ids


def encode_rows(
    tokenizer: Any, prompts: Sequence[str], choices: Sequence[Sequence[str]], separators: Sequence[str] | None = None
) -> list[EncodedRow]:
    """Tokenize rows into a shared context and per-choice continuations (see `encode_row`).

    ``separators[i]`` is the text between prompt ``i`` and its answers (``frod_ds.prep.rows.row_separator``
    of the row); None means `ANSWER_SEPARATOR` for every row.
    """
    eos = getattr(tokenizer, "eos_token_id", None)
    if separators is None:
        separators = [ANSWER_SEPARATOR] * len(prompts)
    texts: list[str] = []
    for prompt, row_choices, sep in zip(prompts, choices, separators, strict=True):
        texts.append(prompt + sep)
        texts.extend(prompt + sep + c for c in row_choices)
    ids = [_strip_eos(list(x), eos) for x in tokenizer(texts, add_special_tokens=True)["input_ids"]]

    encoded, at = [], 0
    for prompt, row_choices in zip(prompts, choices):
        context, fulls = ids[at], ids[at + 1 : at + 1 + len(row_choices)]
        at += 1 + len(row_choices)
        # Split at the longest token prefix shared by the context and every full text: with
        # SentencePiece (LLaMA) "...Answer: " ends in a lone "▁" piece while "...Answer: true"
        # ends "...", ":", "▁true", so the character boundary is not a token boundary.
        cut = min([len(context)] + [common_prefix_len(context, full) for full in fulls])
        if cut == 0:
            raise EvalError(
                f"prompt {prompt[:40]!r} leaves no context token before the answer; "
                "use a tokenizer that adds a BOS token"
            )
        conts = [full[cut:] for full in fulls]
        empty = [c for c, cont in zip(row_choices, conts) if not cont]
        if empty:
            raise EvalError(f"choice {empty[0]!r} of prompt {prompt[:40]!r} tokenizes to no tokens")
        encoded.append(EncodedRow(context=context[:cut], continuations=conts))
    return encoded


def encode_row(tokenizer: Any, prompt: str, choices: Sequence[str], separator: str = ANSWER_SEPARATOR) -> EncodedRow:
    """Context ids and one continuation per choice, split where the training text's tokens split.

    The context is the longest token prefix shared by ``tok(prompt + separator)`` and every
    ``tok(prompt + separator + choice)`` (tokenized as training does: BOS, no EOS); each continuation is the rest
    of its full text, so a separator's trailing space that joins the answer's first token is scored with it
    (docs/eval.md). Raises EvalError if nothing precedes the answer or a choice adds no tokens.
    """
    return encode_rows(tokenizer, [prompt], [choices], [separator])[0]


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-pad id lists to one tensor.

    Returns ``input_ids`` (B, T), ``attention_mask`` (B, T) and ``position_ids`` (B, T) that count
    real tokens from 0, so every sequence sees the positions it would see unpadded.
    """
    assert seqs and all(seqs), "left_pad needs non-empty sequences"
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)  # (B, T)
    attention_mask = torch.zeros((len(seqs), width), dtype=torch.long)  # (B, T)
    for i, s in enumerate(seqs):
        input_ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
        attention_mask[i, width - len(s) :] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # (B, T)
    return input_ids, attention_mask, position_ids


def _device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.inference_mode()
def loglik_scores(
    model: nn.Module, contexts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]], pad_id: int
) -> list[float]:
    """``sum_t log p(continuation_t | context, continuation_<t)`` for each (context, continuation) pair.

    One left-padded forward pass; only the last ``max_j len(continuation_j) + 1`` positions'
    logits are computed (all continuations end at the last column), and log-softmax runs in fp32.
    """
    seqs = [list(c) + list(y) for c, y in zip(contexts, continuations, strict=True)]
    input_ids, attention_mask, position_ids = left_pad(seqs, pad_id)
    device = _device_of(model)
    keep = max(len(y) for y in continuations) + 1
    logits = model(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        position_ids=position_ids.to(device),
        use_cache=False,
        logits_to_keep=keep,
    ).logits  # (B, keep, V): positions T-keep .. T-1
    logprobs = logits.float().log_softmax(-1)  # (B, keep, V)
    # Token y_t sits at column T-len(y)+t and is predicted by column T-len(y)+t-1, i.e. kept column
    # keep-len(y)-1+t. The tokens are gathered on the device: only B numbers leave it, not B·keep·V.
    targets = torch.zeros(len(seqs), keep - 1, dtype=torch.long)  # (B, keep-1)
    scored = torch.zeros(len(seqs), keep - 1, dtype=torch.bool)  # (B, keep-1)
    for i, y in enumerate(continuations):
        targets[i, keep - 1 - len(y) :] = torch.tensor(y)
        scored[i, keep - 1 - len(y) :] = True
    picked = logprobs[:, :-1].gather(-1, targets.to(device).unsqueeze(-1)).squeeze(-1)  # (B, keep-1)
    return torch.where(scored.to(device), picked, 0.0).sum(-1).tolist()


@torch.inference_mode()
def generate_outputs(
    model: nn.Module,
    tokenizer: Any,
    contexts: Sequence[Sequence[int]],
    max_new_tokens: int,
    pad_id: int,
    num_beams: int = 1,
) -> list[str]:
    """Decode up to ``max_new_tokens`` after each left-padded context; return the new text.

    Greedy for ``num_beams=1``, else beam search (no sampling, length penalty 1, no early stopping:
    transformers' defaults, pinned here so a model's own ``generation_config.json`` cannot change
    them). Decoding stops at EOS; the text is the new tokens up to (not including) the first EOS,
    special tokens skipped. Each row's output does not depend on the rest of its batch (left
    padding with an attention mask and positions counted from the first real token).
    """
    from transformers import GenerationConfig

    eos = tokenizer.eos_token_id
    input_ids, attention_mask, _ = left_pad(contexts, pad_id)
    device = _device_of(model)
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        min_length=0,
        do_sample=False,
        num_beams=num_beams,
        num_return_sequences=1,
        length_penalty=1.0,
        early_stopping=False,
        repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        pad_token_id=pad_id,
        eos_token_id=eos,
    )
    out = model.generate(
        input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), generation_config=config
    )
    new = out[:, input_ids.shape[1] :].cpu().tolist()  # (B, <= max_new_tokens)
    texts = []
    for ids in new:
        if eos is not None and eos in ids:
            ids = ids[: ids.index(eos)]
        texts.append(tokenizer.decode(ids, skip_special_tokens=True))
    return texts


def match_choice(output: str, choices: Sequence[str]) -> int | None:
    """Index of the choice found earliest in ``output`` (case-sensitive substring), or None.

    Ties at the same start position go to the longest string (so ``"Option A"`` beats ``"Option"``),
    then to the lowest index.
    """
    best: tuple[int, int, int] | None = None  # (start, -len, index)
    for j, choice in enumerate(choices):
        start = output.find(choice) if choice else -1
        if start >= 0 and (best is None or (start, -len(choice), j) < best):
            best = (start, -len(choice), j)
    return None if best is None else best[2]


def plan_batches(rows: Sequence[dict[str, Any]], batch_size: int) -> list[list[int]]:
    """Row indices grouped into batches, longest rows first (less padding; OOM shows up at once).

    Depends only on the rows and ``batch_size``, never on the number of ranks: ranks take whole
    batches, so every row is scored in the same padded batch, hence with the same numbers, for
    any world size.
    """
    assert batch_size >= 1, f"batch_size must be >= 1, got {batch_size}"
    size = [len(r["prompt"]) + max(len(c) for c in r["choices"]) for r in rows]
    order = sorted(range(len(rows)), key=lambda i: (-size[i], i))
    return [order[k : k + batch_size] for k in range(0, len(order), batch_size)]


def _argmax(values: Sequence[float]) -> int:
    return max(range(len(values)), key=lambda j: values[j])  # first index on ties


def _record(row: dict[str, Any], pred: int | None) -> dict[str, Any]:
    return {
        "task": row["task"],
        "id": row["id"],
        "label": row["label"],
        "answer": row["choices"][row["label"]],
        "pred": pred,
        "prediction": None if pred is None else row["choices"][pred],
        "correct": pred == row["label"],
    }


def score_loglik_rows(
    model: nn.Module, tokenizer: Any, rows: Sequence[dict[str, Any]], pad_id: int
) -> list[dict[str, Any]]:
    """Loglik prediction records for one batch of rows; all choices of all rows in one forward pass.

    Each record: ``task, id, label, answer, pred, prediction, correct`` plus ``pred_norm``,
    ``correct_norm``, ``scores`` (summed log-probs), ``scores_norm`` (per character) and
    ``n_tokens`` (scored tokens per choice).
    """
    encoded = encode_rows(
        tokenizer, [r["prompt"] for r in rows], [r["choices"] for r in rows], [row_separator(r) for r in rows]
    )
    contexts = [e.context for e in encoded for _ in e.continuations]
    conts = [y for e in encoded for y in e.continuations]
    flat = loglik_scores(model, contexts, conts, pad_id)
    records, at = [], 0
    for row, enc in zip(rows, encoded):
        scores = flat[at : at + len(enc.continuations)]
        at += len(enc.continuations)
        norm = [s / len(c) for s, c in zip(scores, row["choices"])]
        record = _record(row, _argmax(scores))
        record["pred_norm"] = _argmax(norm)
        record["correct_norm"] = record["pred_norm"] == row["label"]
        record.update(scores=scores, scores_norm=norm, n_tokens=[len(y) for y in enc.continuations])
        records.append(record)
    return records


def score_generate_rows(
    model: nn.Module, tokenizer: Any, rows: Sequence[dict[str, Any]], pad_id: int, max_new_tokens: int
) -> list[dict[str, Any]]:
    """Generate-mode prediction records for one batch: ``task, id, label, answer, pred, prediction,
    correct, output``; ``pred`` is None (wrong) when no answer string occurs in ``output``."""
    encoded = encode_rows(
        tokenizer, [r["prompt"] for r in rows], [r["choices"] for r in rows], [row_separator(r) for r in rows]
    )
    texts = generate_outputs(model, tokenizer, [e.context for e in encoded], max_new_tokens, pad_id)
    records = []
    for row, text in zip(rows, texts):
        record = _record(row, match_choice(text, row["choices"]))
        record["output"] = text
        records.append(record)
    return records


# --- LLM-Adapters' commonsense protocol (commonsense_evaluate.py of AGI-Edgerunners/LLM-Adapters) ---

LLM_ADAPTERS_NUM_BEAMS = 4
LLM_ADAPTERS_MAX_NEW_TOKENS = 32
RESPONSE_MARKER = "### Response:"

_ANSWER_N = tuple(f"answer{k}" for k in range(1, 6))
# The words searched for, per task, in the order of LLM-Adapters' regex alternation; choice i of a row
# is word i (its gold word is words[label]). SIQA, OBQA and ARC share one list of five: a SIQA output
# "answer4" is a match (no choice of the row, so wrong), not "unmatched".
LLM_ADAPTERS_WORDS: dict[str, tuple[str, ...]] = {
    "boolq": ("true", "false"),
    "piqa": ("solution1", "solution2"),
    "siqa": _ANSWER_N,
    "hellaswag": tuple(f"ending{k}" for k in range(1, 5)),
    "winogrande": ("option1", "option2"),
    "obqa": _ANSWER_N,
    "arc_easy": _ANSWER_N,
    "arc_challenge": _ANSWER_N,
}
_WORD_PATTERNS = {task: re.compile("|".join(map(re.escape, words))) for task, words in LLM_ADAPTERS_WORDS.items()}


def llm_adapters_row_problem(row: dict[str, Any]) -> str | None:
    """Why LLM-Adapters' protocol cannot score ``row`` (unknown task, more choices than answer words), or None."""
    words = LLM_ADAPTERS_WORDS.get(row["task"])
    if words is None:
        return f"task {row['task']!r} has no LLM-Adapters answer words (known: {', '.join(LLM_ADAPTERS_WORDS)})"
    if len(row["choices"]) > len(words):
        return (
            f"row {row['id']!r} has {len(row['choices'])} choices but {row['task']} has "
            f"{len(words)} LLM-Adapters answer words ({'/'.join(words)})"
        )
    return None


def llm_adapters_response(prompt: str, output: str) -> str:
    """The text LLM-Adapters searches for the answer: in ``prompt + output``, what lies between the first
    ``"### Response:"`` and the next one (or the end), stripped of surrounding whitespace.

    LLM-Adapters decodes prompt and generation together and splits at the marker; its scoring prompt
    ends with the marker and whitespace, so this is the generated text cut at any marker the model
    writes itself. With no marker anywhere (a row built with another template) it is the whole output.
    """
    parts = (prompt + output).split(RESPONSE_MARKER)
    return (parts[1] if len(parts) > 1 else output).strip()


def extract_answer_word(text: str, task: str) -> str | None:
    """The first (leftmost) of ``task``'s answer words in ``text``, or None.

    Case-sensitive substring search, as LLM-Adapters' ``re.findall(...)[0]``: ``"Answer1"`` does not match,
    ``"answer12"`` matches ``answer1``; at one position the earlier word of the list wins.
    """
    m = _WORD_PATTERNS[task].search(text)
    return None if m is None else m.group(0)


def prompt_ids(tokenizer: Any, prompts: Sequence[str]) -> list[list[int]]:
    """Token ids of each prompt as the model reads it before generating: special tokens added (BOS for
    LLaMA), a trailing EOS dropped. Raises EvalError for a prompt that gives no tokens."""
    eos = getattr(tokenizer, "eos_token_id", None)
    ids = [_strip_eos(list(x), eos) for x in tokenizer(list(prompts), add_special_tokens=True)["input_ids"]]
    empty = [p for p, x in zip(prompts, ids) if not x]
    if empty:
        raise EvalError(f"prompt {empty[0][:40]!r} gives no tokens; use a tokenizer that adds a BOS token")
    return ids


def score_llm_adapters_rows(
    model: nn.Module, tokenizer: Any, rows: Sequence[dict[str, Any]], pad_id: int
) -> list[dict[str, Any]]:
    """LLM-Adapters-protocol records for one batch of rows (any mix of tasks).

    Beam search (`LLM_ADAPTERS_NUM_BEAMS` beams, `LLM_ADAPTERS_MAX_NEW_TOKENS` new tokens) after each row's
    ``prompt`` exactly as stored (LLM-Adapters' scoring prompt for rows of its template; the paper's prompt without
    its separator otherwise). Each record: ``task, id, label, answer`` (the gold word), ``pred`` (index of the
    matched word, None when none matched), ``prediction`` (the word), ``correct`` and ``output`` (the searched text).
    """
    problems = [p for p in map(llm_adapters_row_problem, rows) if p]
    if problems:
        raise EvalError(problems[0])
    contexts = prompt_ids(tokenizer, [r["prompt"] for r in rows])
    texts = generate_outputs(
        model, tokenizer, contexts, LLM_ADAPTERS_MAX_NEW_TOKENS, pad_id, num_beams=LLM_ADAPTERS_NUM_BEAMS
    )
    records = []
    for row, text in zip(rows, texts):
        words = LLM_ADAPTERS_WORDS[row["task"]]
        response = llm_adapters_response(row["prompt"], text)
        word = extract_answer_word(response, row["task"])
        pred = None if word is None else words.index(word)
        records.append(
            {
                "task": row["task"],
                "id": row["id"],
                "label": row["label"],
                "answer": words[row["label"]],
                "pred": pred,
                "prediction": word,
                "correct": pred == row["label"],
                "output": response,
            }
        )
    return records
