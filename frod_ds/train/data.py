"""Training data: ``frod data build`` JSONL rows → token ids with answer-only labels → deterministic rank batches.

The text is ``prompt + separator + answer + EOS`` with the evaluator's context/answer boundary (docs/data.md);
with ``train_on_inputs=False`` the loss covers the answer and EOS only. ``BatchPlan`` takes one seeded permutation
per epoch and gives step ``k`` the same global batch however it is split over ranks, so a position is ``(epoch,
step)`` and resuming replays no data (docs/training.md, Outputs and resume).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from frod_ds.config.ds_config import BatchSizes
from frod_ds.eval.predict import encode_rows
from frod_ds.formats.file_digests import DATA_MANIFEST, FileDigests
from frod_ds.formats.folders import wrong_folder
from frod_ds.formats.ownership import marker_kind
from frod_ds.prep.build_records import FORMAT as BUILD_FORMAT
from frod_ds.prep.rows import MAX_ROW_CHARS, label_problem, read_rows, repeated_id, row_separator, text_problem
from frod_ds.prep.tasks import DataPrepError
from frod_ds.runtime.errors import FrodError, note
from frod_ds.runtime.paths import file_problem

__all__ = [
    "DataError",
    "training_file",
    "read_training_rows",
    "check_vocab",
    "Example",
    "encode_examples",
    "collate",
    "BatchPlan",
]

IGNORE_INDEX = -100
# MAX_ROW_CHARS (frod_ds.prep.rows): a training row (prompt + answer) longer than this is refused, not truncated


class DataError(FrodError):
    """Training data that cannot be used; the message names the file, line and field."""


def training_file(path: str | Path, setting: str = "data.train") -> Path:
    """The JSONL file ``data.train`` / ``data.eval`` (``setting``, named in every refusal) names: the file itself, or
    ``train.jsonl`` of a ``frod data build`` output directory (the recipe allows both; everything that reads or
    records the data goes through here)."""
    p, what = Path(path), f"{'evaluation' if setting == 'data.eval' else 'training'} data ({setting})"
    if p.is_dir():
        wrong = wrong_folder(p, what, ("data-build",), "a data build or a JSONL file")
        if wrong:
            raise DataError(wrong)
        if not (p / "train.jsonl").exists() and marker_kind(p) != "data-build":
            raise DataError(
                f"{what} {p} is a directory but not a frod data build (no train.jsonl in it); point {setting} at a "
                "JSONL file or at the --out of `frod data build`"
            )
        build, p = p, p / "train.jsonl"
    else:
        build = p.parent if marker_kind(p.parent) == "data-build" else None
    if os.path.lexists(p) and file_problem(p):  # a named pipe, a link loop, unreadable: not "not found"
        raise DataError(f"{what} {file_problem(p)}")
    if not p.is_file():
        raise DataError(f"{what} {p} not found; fix {setting}, or build it with `frod data build --out DIR`")
    if build is not None:
        _check_built(build, p.name)
    return p


def _check_built(build: Path, name: str) -> None:
    """``DataError`` when file ``name`` of data build ``build`` is not what the build wrote (its manifest's sha256):
    the run would train on rows the build's manifest, and so the run's record of its data, do not describe."""
    built = FileDigests.read(
        build / DATA_MANIFEST, DataError, "build the data again with frod data build", False, BUILD_FORMAT
    )
    if built is not None and name in built.files and built.changed(build, name):
        raise DataError(
            f"training data {build / name} was changed after frod data build wrote it (its sha256 is not the one "
            f"{build / DATA_MANIFEST} records); build the data again, or copy the file out of the build to train on "
            "it as it is"
        )


def _check_training_row(row) -> str | None:
    if not isinstance(row, dict):
        return "expected a JSON object"
    for key in ("prompt", "answer"):
        if not isinstance(row.get(key), str):
            return (
                f"field {key!r} missing or not a string; rows need "
                '{"prompt": str, "answer": str} (the output of `frod data build`)'
            )
    if "separator" in row and not isinstance(row["separator"], str):
        return "field 'separator' must be a string when present"
    if not row["answer"].strip():
        return "field 'answer' is empty: there is nothing to train on; fix or drop the row"
    if "choices" in row or "label" in row:  # a multiple-choice row: the build's rules, whoever wrote the file
        return text_problem(row) or label_problem(row)
    return text_problem({k: row[k] for k in ("prompt", "separator", "answer") if k in row})


def read_training_rows(path: str | Path, limit: int | None = None, setting: str = "data.train") -> list[dict]:
    """Rows with string ``prompt`` and ``answer``, optional string ``separator`` (other data_prep fields are
    kept, not required); ``setting``: the recipe key that names ``path``, for the refusals."""
    p = training_file(path, setting)
    try:
        rows = read_rows(p, check=_check_training_row, limit=limit)
    except DataPrepError as e:
        raise DataError(str(e)) from None
    if not rows:
        raise DataError(f"{p} has no rows")
    for i, row in enumerate(rows, start=1):
        length = len(row["prompt"]) + len(row["answer"])
        if length > MAX_ROW_CHARS:
            raise DataError(
                f"{p} row {i}: {length} characters, more than any sensible prompt ({MAX_ROW_CHARS}); "
                "remove it or fix the data build"
            )
    twice = repeated_id(rows)
    if twice:
        raise DataError(
            f"{p} rows {twice[0]} and {twice[1]} have the same id {twice[2]!r}; duplicated rows would be "
            "trained on twice, deduplicate the data"
        )
    return rows


@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]


def _prompt_only_lead(tokenizer, texts: list[str], boundaries: list[int], enc) -> list[int]:
    """How many leading continuation tokens of each row hold no answer character.

    ``encode_rows`` splits context and answer where the tokens of ``prompt + separator`` and of the full text
    part; a token straddling that point stays on the answer side. Where a separator or prompt ends in
    whitespace (LLM-Adapters' prompt ends in 16 spaces, separator ``""``), a byte-level BPE tokenizer's
    ``"\\n" + 15 spaces`` token — all prompt — lands there too. With a fast tokenizer the character offsets
    tell such tokens apart, so the loss starts at the first token that contains an answer character; without
    offsets (slow tokenizers) the split stays where ``encode_rows`` puts it (lead 0).
    """
    if not getattr(tokenizer, "is_fast", False):
        return [0] * len(texts)
    batch = tokenizer(texts, add_special_tokens=True, return_offsets_mapping=True)
    leads = []
    for ids, offsets, boundary, e in zip(batch["input_ids"], batch["offset_mapping"], boundaries, enc):
        cont = e.continuations[0]
        assert list(ids[: len(e.context) + len(cont)]) == list(e.context) + list(cont), (
            "same tokenization as encode_rows"
        )
        lead = 0
        while lead < len(cont) - 1 and offsets[len(e.context) + lead][1] <= boundary:
            lead += 1
        leads.append(lead)
    return leads


def check_vocab(
    examples: list[Example], vocab_size: int, tokenizer_name: str, model_dir: str | Path, tokenizer: Any = None
) -> None:
    """``DataError`` when a token id the tokenizer produced, or one of its special tokens (pad, unk, ...: the same
    check as eval's), has no row in the model's embedding (a tokenizer of another model, or a special token its
    vocabulary lacks): the forward would fail mid-run, or eval of the trained adapter would refuse it."""
    from frod_ds.prep.tokens import token_past

    specials = [t for t in getattr(tokenizer, "all_special_ids", None) or () if isinstance(t, int)]
    pad = getattr(tokenizer, "pad_token_id", None)
    specials += [pad] if isinstance(pad, int) else []
    top = max([max(e.input_ids) for e in examples if e.input_ids] + specials + [-1])
    if top >= vocab_size:  # a special token the vocabulary lacks is named with its file; else the tokenizer is
        raise DataError(
            token_past(tokenizer, vocab_size)
            or f"the tokenizer {tokenizer_name} produces token id {top}, but the model {model_dir} has "
            f"vocab_size {vocab_size} (config.json); use the model's own tokenizer (model.tokenizer) "
            "or a model whose embedding holds every id"
        )


def check_context(examples: list[Example], max_positions: int, cutoff_len: int, model_dir: str | Path) -> None:
    """``DataError`` when an example is longer than the model's ``max_position_embeddings``: it would train and
    score positions the model never saw, with nothing said (the rotary embedding computes them all the same). A
    cutoff past the positions that cuts nothing is said in a note."""
    longest = max((len(e.input_ids) for e in examples), default=0)
    if longest > max_positions:
        raise DataError(
            f"training examples reach {longest} tokens (data.cutoff_len {cutoff_len}), but the model {model_dir} "
            f"has max_position_embeddings {max_positions} (config.json): positions past it were never trained; "
            f"set data.cutoff_len to at most {max_positions}"
        )
    if cutoff_len > max_positions:
        note(
            f"data.cutoff_len {cutoff_len} is past the model's max_position_embeddings {max_positions} (config.json); "
            f"the longest example is {longest} tokens, so none is cut, but an example longer than {max_positions} "
            f"would be refused: set data.cutoff_len to at most {max_positions} to cut it instead"
        )


def encode_examples(tokenizer, rows: list[dict], cutoff_len: int, train_on_inputs: bool) -> list[Example]:
    """Tokenize ``prompt + separator + answer + EOS``; labels are -100 outside the answer unless ``train_on_inputs``.

    The answer's tokens are those from the first token that holds an answer character (with a fast
    tokenizer; see `_prompt_only_lead`). Examples longer than ``cutoff_len`` are truncated from the left of
    the prompt, so the answer and EOS (what the loss is on) survive; the BOS token is kept.
    """
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError("the tokenizer has no EOS token; training needs one to end answers")
    out = []
    for start in range(0, len(rows), 256):
        chunk = rows[start : start + 256]
        contexts = [r["prompt"] + row_separator(r) for r in chunk]
        enc = encode_rows(
            tokenizer, [r["prompt"] for r in chunk], [[r["answer"]] for r in chunk], [row_separator(r) for r in chunk]
        )
        leads = _prompt_only_lead(
            tokenizer, [c + r["answer"] for c, r in zip(contexts, chunk)], [len(c) for c in contexts], enc
        )
        for e, lead in zip(enc, leads):
            cont = list(e.continuations[0])
            ctx, ans = list(e.context) + cont[:lead], cont[lead:] + [eos]
            keep = cutoff_len - len(ans)
            if keep < 1:
                ans = ans[: cutoff_len - 1]
                keep = 1
            if len(ctx) > keep:
                ctx = ctx[:1] + ctx[len(ctx) - keep + 1 :] if keep > 1 else ctx[:1]
            labels = list(ctx) if train_on_inputs else [IGNORE_INDEX] * len(ctx)
            out.append(Example(ctx + ans, labels + ans))
    return out


def collate(examples: list[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest example: ``input_ids``/``labels``/``attention_mask`` (B, T)."""
    width = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        ids[i, :n] = torch.tensor(e.input_ids)
        labels[i, :n] = torch.tensor(e.labels)
        mask[i, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


@dataclass
class BatchPlan:
    """Which examples rank ``rank`` uses at each micro-step; stateless, so resume is just a position."""

    n_examples: int
    micro: int
    accum: int
    world: int
    rank: int
    seed: int

    @property
    def global_batch(self) -> int:
        return BatchSizes(self.micro, self.accum, self.world).total

    @property
    def steps_per_epoch(self) -> int:
        steps = self.n_examples // self.global_batch
        if steps == 0:
            raise DataError(
                f"{self.n_examples} training rows are fewer than one global batch of {self.global_batch} "
                f"(micro {self.micro} x accum {self.accum} x world {self.world}); lower the batch size"
            )
        return steps

    def total_steps(self, epochs: float, max_steps: int | None) -> int:
        return max_steps if max_steps is not None else max(1, math.ceil(epochs * self.steps_per_epoch))

    def _perm(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        return torch.randperm(self.n_examples, generator=g)

    def micro_batches(self, step: int) -> list[list[int]]:
        """Example indices of this rank's ``accum`` micro-batches at global optimizer ``step``."""
        epoch, in_epoch = divmod(step, self.steps_per_epoch)
        perm = self._perm(epoch)
        base = in_epoch * self.global_batch
        return [
            perm[
                base + (a * self.world + self.rank) * self.micro : base + (a * self.world + self.rank + 1) * self.micro
            ].tolist()
            for a in range(self.accum)
        ]
