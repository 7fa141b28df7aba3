"""The identity of a training run: what determines its result, recorded beside every engine checkpoint
(``run_identity.json``) so that re-running into an ``output_dir`` resumes only the same run.

It holds the base tensors' fingerprint (all but the targeted weights), the data files' sha256, the digests of what
else changes the numbers (the token ids the run trains on: tokenizer, template, cutoff; the base model's config;
``model.init_adapter``) and the training hyperparameters; it leaves out the world size, the micro-batch split and
the ZeRO layout (elastic resume changes them), paths and bookkeeping (docs/formats.md#engine-checkpoints).
Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from frod_ds.formats.file_digests import file_sha256
from frod_ds.formats.records import changed_keys, parse_json, record_from_dict, record_to_json
from frod_ds.runtime.errors import FrodError

__all__ = [
    "RUN_IDENTITY",
    "BASE_SCOPE",
    "INPUTS",
    "RunIdentityError",
    "RunIdentity",
    "file_sha256",
    "training_hyperparameters",
]

RUN_IDENTITY = "run_identity.json"

# recipe keys that do not change the trained adapter (or whose content is recorded instead of the path)
_NOT_IDENTITY = {
    "output_dir",
    "model.base",
    "model.factor_store",
    "model.tokenizer",
    "model.gradient_checkpointing",
    "model.init_adapter",
    "data.train",
    "data.eval",
    "train.micro_batch_size",
    "train.grad_accum",
    "train.zero3_partition",
    "train.zero3_gather",
    "train.log_every",
    "train.save_every",
    "train.eval_every",
    "train.rotation_every",
    "train.keep_checkpoints",
    "train.tensorboard",
    "train.phase_times",
    "train.profile_step",
    "train.max_nonfinite_steps",
    "train.new_run",
}


class RunIdentityError(FrodError):
    """``output_dir`` holds another run, or its identity record is unreadable."""


def training_hyperparameters(recipe_dict: dict[str, Any], global_batch: int) -> dict[str, Any]:
    """The recipe's keys that determine the result, flattened (``train.lr_sigma``), plus the global batch."""
    flat: dict[str, Any] = {}
    for section, value in recipe_dict.items():
        if isinstance(value, dict):
            flat.update({f"{section}.{k}": v for k, v in value.items()})
        else:
            flat[section] = value
    out = {k: (list(v) if isinstance(v, tuple) else v) for k, v in sorted(flat.items()) if k not in _NOT_IDENTITY}
    out["global_batch"] = global_batch
    return out


BASE_SCOPE = "untargeted"  # base_fingerprint covers the tensors the run reads (before it: "all" tensors)

# inputs_sha256's keys, as a difference names them
INPUTS = {
    "tokens.train": "the token ids of data.train (another tokenizer, or other tokenizer settings)",
    "tokens.eval": "the token ids of data.eval (another tokenizer, or other tokenizer settings)",
    "base_config": "the base model's config.json",
    "init_adapter": "model.init_adapter content",
}


@dataclass
class RunIdentity:
    base_fingerprint: str
    data_sha256: dict[str, str]  # "train" / "eval" → sha256 of the file's bytes
    hyperparameters: dict[str, Any] = field(default_factory=dict)
    base_scope: str = "all"  # which tensors base_fingerprint covers: "all" (older records) or BASE_SCOPE
    inputs_sha256: dict[str, str] | None = None  # INPUTS' keys → digest; None in records of older frod-ds

    def differences(self, other: RunIdentity) -> list[str]:
        """What differs between the run recorded (``self``) and the one asked for now (``other``); the base
        fingerprints are compared when they cover the same tensors (``comparable_base``), the other inputs when
        both record them (a key of ``_NOT_IDENTITY`` an older record holds is not compared)."""
        out = []
        if self.comparable_base(other) and self.base_fingerprint != other.base_fingerprint:
            out.append("base model weights")
        data = changed_keys(self.data_sha256, other.data_sha256)
        out += [f"data.{k} content" for k in data]
        if self.inputs_sha256 is not None and other.inputs_sha256 is not None:
            changed = changed_keys(self.inputs_sha256, other.inputs_sha256)
            out += [INPUTS.get(k, k) for k in changed if k.removeprefix("tokens.") not in data]
        mine, theirs = (
            {k: v for k, v in h.items() if k not in _NOT_IDENTITY}
            for h in (self.hyperparameters, other.hyperparameters)
        )
        out += [f"{k}: {mine.get(k)!r} there, {theirs.get(k)!r} now" for k in changed_keys(mine, theirs)]
        return out

    def comparable_base(self, other: RunIdentity) -> bool:
        return self.base_scope == other.base_scope

    def to_json(self) -> str:
        return record_to_json(self)

    @classmethod
    def from_json(cls, text: str, where: str | Path) -> RunIdentity:
        hint = "; pass train.new_run=true to start a new run in this output_dir"
        return record_from_dict(cls, parse_json(text, where, RunIdentityError, hint), str(where), RunIdentityError)
