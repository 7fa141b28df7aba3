"""What a run records beside each checkpoint (its factor store's identity, its own) and the check that a checkpoint
to resume belongs to this run. The records' formats: ``frod_ds.formats.factor_store``, ``frod_ds.formats.run_identity``.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from pathlib import Path
from typing import Any

from frod_ds.config.ds_config import batch_sizes
from frod_ds.config.recipe import Recipe, recipe_to_dict
from frod_ds.formats.adapter_dir import WEIGHTS
from frod_ds.formats.factor_store import StoreIdentity
from frod_ds.formats.run_identity import (
    BASE_SCOPE,
    RUN_IDENTITY,
    RunIdentity,
    RunIdentityError,
    file_sha256,
    training_hyperparameters,
)
from frod_ds.io.fingerprint import base_names, weights_fingerprint
from frod_ds.io.hf_checkpoint import HFCheckpoint
from frod_ds.runtime.errors import StoreError, note
from frod_ds.train.data import Example, training_file

__all__ = [
    "STORE_IDENTITY",
    "run_identity",
    "examples_sha256",
    "config_sha256",
    "identity_records",
    "check_resume_identity",
]

STORE_IDENTITY = "factor_store.json"  # beside each engine checkpoint: the store it was trained on
# config.json keys that do not change what the model computes in training (the parameter dtype is the recipe's)
_CONFIG_BOOKKEEPING = {"_name_or_path", "transformers_version", "torch_dtype", "dtype", "use_cache"}


def examples_sha256(examples: list[Example]) -> str:
    """sha256 of the token ids and labels the run trains on, in order: what the tokenizer (and its settings), the
    template and ``data.cutoff_len`` make of the rows."""
    h = hashlib.sha256()
    for e in examples:
        h.update(array("q", [len(e.input_ids)]).tobytes())
        h.update(array("q", e.input_ids).tobytes())
        h.update(array("q", e.labels).tobytes())
    return h.hexdigest()


def config_sha256(config: dict[str, Any]) -> str:
    """sha256 of a base model's ``config.json`` values that shape its computation (not its bookkeeping keys)."""
    kept = {k: v for k, v in config.items() if k not in _CONFIG_BOOKKEEPING}
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()


def run_identity(
    recipe: Recipe, base: HFCheckpoint, world_size: int, examples: list[Example], eval_examples: list[Example]
) -> RunIdentity:
    """This run's identity: the fingerprint of the base tensors training reads, the data files' sha256, the
    digests of the token ids (train and eval), of the base config and of ``model.init_adapter``, and the
    hyperparameters that determine the result (the global batch, not its split over ranks)."""
    data = {"train": file_sha256(training_file(recipe.data.train))}
    inputs = {"tokens.train": examples_sha256(examples), "base_config": config_sha256(base.config())}
    if recipe.data.eval:
        data["eval"] = file_sha256(training_file(recipe.data.eval, "data.eval"))
        inputs["tokens.eval"] = examples_sha256(eval_examples)
    if recipe.model.init_adapter:
        inputs["init_adapter"] = file_sha256(Path(recipe.model.init_adapter) / WEIGHTS)
    return RunIdentity(
        base_fingerprint=weights_fingerprint(base, base_names(base.keys(), recipe.model.targets)),
        data_sha256=data,
        hyperparameters=training_hyperparameters(recipe_to_dict(recipe), batch_sizes(recipe, world_size).total),
        base_scope=BASE_SCOPE,
        inputs_sha256=inputs,
    )


def identity_records(store: StoreIdentity, run: RunIdentity) -> dict[str, str]:
    """The files written beside each engine checkpoint: ``{file name: JSON}``."""
    return {STORE_IDENTITY: store.to_json(), RUN_IDENTITY: run.to_json()}


def check_resume_identity(out: Path, tag: str, store: StoreIdentity, run: RunIdentity) -> None:
    """``StoreError`` when checkpoint ``tag`` in ``out`` was trained on another factor store, ``RunIdentityError``
    when it is of a run with another identity; a ``note:`` for each record an older frod-ds did not write."""
    _check_resume_store(out, tag, store)
    _check_resume_run(out, tag, run)


def _checkpoint_record(out: Path, tag: str, name: str, missing_note: str) -> Path | None:
    """The file ``name`` of checkpoint ``tag`` in ``out``; None (with ``note(f"checkpoint <dir> {missing_note}")``)
    when that checkpoint lacks it."""
    recorded = out / "checkpoints" / tag / name
    if not recorded.is_file():
        note(f"checkpoint {recorded.parent} {missing_note}")
        return None
    return recorded


def _check_resume_store(out: Path, tag: str, identity: StoreIdentity) -> None:
    recorded = _checkpoint_record(
        out,
        tag,
        STORE_IDENTITY,
        "does not record its factor store (written by an older frod-ds): "
        f"resuming without checking that {identity.fingerprint[:16]}… is the store it was trained on",
    )
    if recorded is None:
        return
    stored = StoreIdentity.from_json(recorded.read_text(), recorded)
    if stored.categories and set(stored.categories) != set(identity.categories):  # model.targets changed
        raise StoreError(
            f"output_dir {out} holds a run that trains {sorted(stored.categories)}, and model.targets now gives "
            f"{sorted(identity.categories)}; resume it with its targets, or start a new run in another output_dir "
            "(or with train.new_run=true)"
        )
    diffs = stored.differences(identity)
    if diffs:
        raise StoreError(
            f"output_dir {out} holds a run trained on another factor store ({'; '.join(diffs)}); use the factor "
            "store it was trained on, or another output_dir for a new run"
        )


def _check_resume_run(out: Path, tag: str, identity: RunIdentity) -> None:
    recorded = _checkpoint_record(
        out,
        tag,
        RUN_IDENTITY,
        "does not record its run identity (written by an older frod-ds): resuming without checking that it is this run",
    )
    if recorded is None:
        return
    recorded_identity = RunIdentity.from_json(recorded.read_text(), recorded)
    if recorded_identity.inputs_sha256 is None:
        note(
            f"checkpoint {recorded.parent} records no digest of its token ids, base config or init adapter (written "
            "by an older frod-ds): resuming without checking the tokenizer, config.json and model.init_adapter"
        )
    if not recorded_identity.comparable_base(identity):
        note(
            f"checkpoint {recorded.parent} records the fingerprint of all base tensors (written by an older frod-ds): "
            "resuming without checking the base model's weights against it"
        )
    diffs = recorded_identity.differences(identity)
    if diffs:
        batch = recorded_identity.hyperparameters.get("global_batch")
        if all(d.startswith("global_batch:") for d in diffs):  # an elastic resume on another number of ranks
            raise RunIdentityError(
                f"output_dir {out} holds a run of global batch {batch} ({diffs[0]}); to resume it on this number of "
                f"ranks keep train.micro_batch_size × train.grad_accum × ranks = {batch}, or start a new run in "
                "another output_dir (or with train.new_run=true)"
            )
        longer = any(d.startswith("train.max_steps:") for d in diffs)  # the LR schedule is the run's length
        raise RunIdentityError(
            f"output_dir {out} holds another run ({'; '.join(diffs[:4])}{'; …' if len(diffs) > 4 else ''}); "
            "use another output_dir, or pass train.new_run=true to move that run aside and start anew"
            + (
                f" (a run's length sets its LR schedule: to train on, start from model.init_adapter="
                f"{out}/adapter-final)"
                if longer
                else ""
            )
        )
