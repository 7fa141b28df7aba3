"""Rows → the project's tokens and loss mask (``frod_ds.train.data.encode_examples``) → pre-collated batches.

Training text: ``prompt + separator + answer + EOS`` (``frod_ds.prep.rows.row_separator``: LLM-Adapters' template
has ``""``, the paper's ``"\\nAnswer: "``). The loss mask is the project's: the answer tokens and EOS
(``train_on_inputs``: every token).

Answer-word tokens: the tokens of the word that tells the choices apart (``true``, ``answer3``), i.e. the
answer after the longest common prefix of the row's choices, backed off to the last whitespace in that
prefix ("the correct answer is answer3" → "answer3"). They are the last ``k`` tokens before EOS, where
``k`` is the length of the training text's tokens past their common prefix with the tokens of the text cut
at the word (so a piece that joins the word to its leading space counts as the word's).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from frod_ds.eval.predict import EvalError, common_prefix_len
from frod_ds.prep.rows import read_rows, row_separator, training_text
from frod_ds.prep.tasks import DataPrepError
from frod_ds.train.data import IGNORE_INDEX, BatchPlan, DataError, encode_examples, read_training_rows
from studies.config import StudyError

__all__ = [
    "answer_word_start",
    "answer_word",
    "StudyExample",
    "encode_study_examples",
    "Batch",
    "make_batches",
    "split_rows",
    "load_test_rows",
]


def answer_word_start(answer: str, choices: Sequence[str] | None) -> int:
    """Character offset of the answer word in ``answer`` (0 when the choices share no word-level prefix)."""
    if not choices or len(choices) < 2 or answer not in choices:
        return 0
    prefix = os.path.commonprefix(list(choices))
    cut = max(prefix.rfind(" "), prefix.rfind("\n"), prefix.rfind("\t")) + 1
    return cut if cut < len(answer) else 0


def answer_word(answer: str, choices: Sequence[str] | None) -> str:
    return answer[answer_word_start(answer, choices) :]


@dataclass
class StudyExample:
    input_ids: list[int]
    labels: list[int]  # IGNORE_INDEX on the context; the answer tokens and EOS otherwise
    n_answer_word: int  # the last n tokens before EOS are the answer word's
    truncated: bool


def _strip_eos(ids: list[int], eos: int) -> list[int]:
    return ids[:-1] if ids and ids[-1] == eos else ids


def encode_study_examples(tokenizer, rows: list[dict], cutoff: int) -> list[StudyExample]:
    """The project's examples (``encode_examples``, answer-only labels), with answer-word counts; checked.

    Every example that fits ``cutoff`` must equal ``tokenize(prompt + separator + answer) + [EOS]``.
    """
    eos = tokenizer.eos_token_id
    try:
        examples = encode_examples(tokenizer, rows, cutoff, False)
    except (DataError, EvalError) as e:
        raise StudyError(str(e)) from None
    cuts = [answer_word_start(r["answer"], r.get("choices")) for r in rows]
    word_texts = [r["prompt"] + row_separator(r) + r["answer"][:c] for r, c in zip(rows, cuts)]
    full = tokenizer([training_text(r) for r in rows], add_special_tokens=True)["input_ids"]
    word = tokenizer(word_texts, add_special_tokens=True)["input_ids"]
    out = []
    for row, e, f, w in zip(rows, examples, full, word):
        f, w = _strip_eos(list(f), eos), _strip_eos(list(w), eos)
        truncated = len(f) + 1 > cutoff
        assert truncated or e.input_ids == f + [eos], (
            f"row {row.get('id')!r}: the project's tokens are not tokenize(prompt + separator + answer) + EOS"
        )
        n_label = sum(1 for t in e.labels if t != IGNORE_INDEX) - 1  # answer tokens, EOS excluded
        k = min(len(f) - common_prefix_len(w, f), n_label)
        assert k >= 1, (
            f"row {row.get('id')!r}: its answer word {answer_word(row['answer'], row.get('choices'))!r} has no tokens"
        )
        out.append(StudyExample(e.input_ids, e.labels, k, truncated))
    return out


@dataclass
class Batch:
    """One optimizer step's examples, right-padded, with the flat positions whose next token is scored.

    ``pos`` (N,) indexes the flattened (B·T) hidden states; ``target`` (N,) the token each predicts;
    ``response`` / ``answer_word`` (N,) bool masks of the answer+EOS and answer-word targets.
    """

    input_ids: torch.Tensor  # (B, T)
    attention_mask: torch.Tensor  # (B, T)
    pos: torch.Tensor  # (N,)
    target: torch.Tensor  # (N,)
    response: torch.Tensor  # (N,) bool
    answer_word: torch.Tensor  # (N,) bool
    indices: list[int]  # example indices, in batch order
    n_tokens: int  # real (unpadded) tokens
    n_scored: int  # targets of the objective
    n_answer: int  # answer-word targets
    digest: str  # sha256 of the ids, so runs can prove they saw the same data

    def to(self, device: torch.device) -> Batch:
        move = {
            k: getattr(self, k).to(device)
            for k in ("input_ids", "attention_mask", "pos", "target", "response", "answer_word")
        }
        return Batch(
            **move,
            indices=self.indices,
            n_tokens=self.n_tokens,
            n_scored=self.n_scored,
            n_answer=self.n_answer,
            digest=self.digest,
        )


def make_batch(examples: Sequence[StudyExample], indices: list[int], pad_id: int, train_on_inputs: bool) -> Batch:
    chosen = [examples[i] for i in indices]
    width = max(len(e.input_ids) for e in chosen)
    ids = torch.full((len(chosen), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(chosen), width), dtype=torch.long)
    pos, target, response, word = [], [], [], []
    for b, e in enumerate(chosen):
        n = len(e.input_ids)
        ids[b, :n] = torch.tensor(e.input_ids)
        mask[b, :n] = 1
        word_lo = n - 1 - e.n_answer_word  # first answer-word token; EOS is token n-1
        for t in range(n - 1):  # position t predicts token t+1
            is_response = e.labels[t + 1] != IGNORE_INDEX
            if is_response or train_on_inputs:
                pos.append(b * width + t)
                target.append(e.input_ids[t + 1])
                response.append(is_response)
                word.append(word_lo <= t + 1 < n - 1)
    digest = hashlib.sha256(ids.numpy().tobytes() + mask.numpy().tobytes()).hexdigest()
    return Batch(
        ids,
        mask,
        torch.tensor(pos),
        torch.tensor(target),
        torch.tensor(response),
        torch.tensor(word),
        list(indices),
        int(mask.sum()),
        len(pos),
        sum(word),
        digest,
    )


def make_batches(
    examples: Sequence[StudyExample],
    plan: BatchPlan | None,
    steps: int,
    pad_id: int,
    train_on_inputs: bool,
    batch_size: int | None = None,
) -> list[Batch]:
    """Training batches of ``plan`` for ``steps`` steps, or (``plan`` None) the examples in order in chunks."""
    if plan is not None:
        return [make_batch(examples, plan.micro_batches(s)[0], pad_id, train_on_inputs) for s in range(steps)]
    assert batch_size
    return [
        make_batch(examples, list(range(i, min(i + batch_size, len(examples)))), pad_id, train_on_inputs)
        for i in range(0, len(examples), batch_size)
    ]


def split_rows(
    path: Path, heldout: int, seed: int, train_limit: int | None, heldout_file: Path | None = None
) -> tuple[list[dict], list[dict]]:
    """(train rows, held-out rows): a seeded permutation's first ``heldout`` rows are held out for LR selection,
    or (``heldout_file``) every training row is trained on and the held-out rows are that file's."""
    try:
        rows = read_training_rows(path)
        if heldout_file is not None:  # generated tasks: the held-out rows are a split of their own
            return (rows[:train_limit] if train_limit else rows), read_training_rows(heldout_file)
    except DataError as e:
        raise StudyError(str(e)) from None
    if heldout >= len(rows):
        raise StudyError(f"--heldout {heldout} leaves no training rows out of {len(rows)} in {path}; lower it")
    perm = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
    held = [rows[i] for i in perm[:heldout]]
    train = [rows[i] for i in sorted(perm[heldout:])]  # file order (data_prep shuffles); the plan permutes
    return (train[:train_limit] if train_limit else train), held


def load_test_rows(eval_dir: Path, limit: int | None) -> dict[str, list[dict]]:
    """``{task: rows}`` from ``eval_dir/<task>.jsonl``, the first ``limit`` rows of each (file order)."""
    out = {}
    for path in sorted(eval_dir.glob("*.jsonl")):
        try:
            rows = read_rows(path, limit=limit)
        except DataPrepError as e:
            raise StudyError(str(e)) from None
        if rows:
            out.setdefault(rows[0]["task"], []).extend(rows)
    if not out:
        raise StudyError(f"no test rows in {eval_dir}/*.jsonl")
    return out
