"""Everything training needs that a user can get wrong, checked before anything heavy, as one typed record.

``preflight`` opens the base checkpoint once (one ``HFCheckpoint``: its index, shard headers and config.json are
read once, then handed to the store check, the run's fingerprint, the vocabulary check, the NVMe sizing and the
model build) and takes the DeepSpeed JSON as its caller parsed it (``frod_ds.config.ds_config.load_ds_config``).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from frod_ds.config.ds_config import as_stage2, batch_sizes, nvme_offloads, resolve_ds_config
from frod_ds.config.nvme import NvmeParams, check_aio_build_env, check_nvme_buffer, check_nvme_buffer_count
from frod_ds.config.recipe import Recipe
from frod_ds.config.zero3_layout import check_gather, zero3_layout
from frod_ds.core.sizes import empty_support, support_nnz
from frod_ds.formats.adapter_dir import AdapterConfig
from frod_ds.formats.factor_store import StoreIdentity
from frod_ds.formats.run_identity import RunIdentity
from frod_ds.io.dtypes import FLOAT_DTYPES
from frod_ds.io.hf_checkpoint import HFCheckpoint
from frod_ds.io.model_dir import resolve_model_dir
from frod_ds.model.adapter import check_adapter_store, read_adapter
from frod_ds.model.build import check_store_quant
from frod_ds.model.store_reader import FactorStore, check_store_matches
from frod_ds.runtime import distributed as dist
from frod_ds.runtime.errors import FrodError, StoreError, note
from frod_ds.train.data import Example, check_context, check_vocab, encode_examples, read_training_rows, training_file
from frod_ds.train.identity import check_resume_identity, run_identity
from frod_ds.train.run_dir import check_writable

__all__ = ["InitAdapter", "Inputs", "preflight", "nvme_params", "init_adapter"]


class InitAdapter(NamedTuple):
    """``model.init_adapter`` as read: its σ/S tensors and its config."""

    tensors: dict[str, torch.Tensor]
    config: AdapterConfig


@dataclass(frozen=True)
class Inputs:
    """What ``preflight`` checked and read, each once: the rest of training uses these, never the files again."""

    recipe: Recipe
    ds_config: dict[str, Any]  # resolved against the recipe and world size, for deepspeed.initialize
    base: HFCheckpoint  # the base checkpoint, opened once (index, shard headers, config.json)
    store: FactorStore
    store_identity: StoreIdentity  # what the adapters and checkpoints record of the store
    run_identity: RunIdentity  # what the checkpoints record of the run
    tokenizer: Any
    examples: list[Example]
    eval_examples: list[Example]
    init_adapter: InitAdapter | None  # model.init_adapter, checked against the store and targets
    partition: str | None = None  # a ZeRO-3 JSON's layout (frod_ds.config.zero3_layout); ds_config is then
    # the engine's: stage 2 for "layers"
    user_ds_config: dict[str, Any] | None = None  # the JSON as given, resolved: what the planner's hint reads


def preflight(
    recipe: Recipe, ds_config: Mapping[str, Any], nvme_path: str | None = None, resume_tag: str | None = None
) -> Inputs:
    """Check every input of a run (``FrodError`` on the first problem) and read what training needs of them:
    the DeepSpeed config, the data rows, the factor store against the base model (and against the checkpoint
    ``resume_tag`` of ``output_dir``), the tokenizer, batch and sparsity, ``output_dir``, ``model.init_adapter``,
    and last the run's identity against that checkpoint's (everything it digests has been checked by then)."""
    world = dist.get_world_size()
    ds_cfg = resolve_ds_config(dict(ds_config), recipe, world, nvme_path)
    layout = zero3_layout(ds_cfg, recipe.train.zero3_partition)
    check_gather(ds_cfg, layout, recipe.train.zero3_gather)
    if recipe.train.tensorboard:
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: F401
        except ImportError:
            raise FrodError("train.tensorboard=true needs the tensorboard package: pip install tensorboard") from None
    rows = read_training_rows(recipe.data.train, recipe.data.limit)
    eval_rows = read_training_rows(recipe.data.eval, setting="data.eval") if recipe.data.eval else []
    base, store = _open_base_and_store(recipe)
    store_identity = store.identity(list(recipe.model.targets))
    if "offload_param" in nvme_offloads(ds_cfg):  # the model's parameter sizes are read only when they matter
        params = nvme_params(base, store, list(recipe.model.targets), recipe.model.sparsity)
        check_nvme_buffer(ds_cfg, params.largest_frozen, world)
        check_nvme_buffer_count(ds_cfg, params, world, FLOAT_DTYPES[recipe.model.dtype].itemsize)
    check_aio_build_env(ds_cfg, dict(os.environ))
    if nvme_offloads(ds_cfg):
        from deepspeed.ops.op_builder import AsyncIOBuilder

        from frod_ds.runtime.op_build import check_buildable

        check_buildable(AsyncIOBuilder())
    base.config()  # config.json checked before the tokenizer, which transformers loads with it
    tok = _load_tokenizer(recipe, base.dir)
    examples = encode_examples(tok, rows, recipe.data.cutoff_len, recipe.data.train_on_inputs)
    eval_examples = encode_examples(tok, eval_rows, recipe.data.cutoff_len, False)
    vocab = _vocab_size(base.config())
    if vocab is not None:
        check_vocab(examples + eval_examples, vocab, str(recipe.model.tokenizer or base.dir), base.dir, tok)
    positions = base.config().get("max_position_embeddings")
    if isinstance(positions, int) and not isinstance(positions, bool) and positions > 0:
        check_context(examples + eval_examples, positions, recipe.data.cutoff_len, base.dir)
    _check_batch(recipe, len(examples), len(rows), world)
    _check_sparsity(recipe, store)
    check_writable(Path(recipe.output_dir))
    init = init_adapter(recipe, store, store_identity)
    identity = run_identity(recipe, base, world, examples, eval_examples)
    if resume_tag is not None:
        check_resume_identity(Path(recipe.output_dir), resume_tag, store_identity, identity)
    engine_cfg = as_stage2(ds_cfg) if layout == "layers" else ds_cfg  # σ, S under ZeRO-2; frozen ones by frod-ds
    got = (tok, examples, eval_examples, init, layout, ds_cfg)
    return Inputs(recipe, engine_cfg, base, store, store_identity, identity, *got)


def _open_base_and_store(recipe: Recipe) -> tuple[HFCheckpoint, FactorStore]:
    """The base checkpoint (opened here, once) and the factor store, refused when the store was built from another
    model, lacks a target or holds another quantization."""
    model_dir = resolve_model_dir(recipe.model.base, "model.base")
    store = FactorStore.open(recipe.model.factor_store)
    base = HFCheckpoint(model_dir)
    check_store_matches(store, base)
    base.config()  # HJD needs only the weights; building the model needs the config too
    missing = sorted(set(recipe.model.targets) - set(store.categories))
    if missing:
        raise StoreError(
            f"targets {missing} are not in factor store {store.path} (it has {sorted(store.categories)}); "
            "rebuild it with `frod hjd --targets …` or change model.targets"
        )
    check_store_quant(store, recipe.model.targets, recipe.model.frozen_quant)
    return base, store


def _vocab_size(config: Mapping[str, Any]) -> int | None:
    """``vocab_size`` of the base model's config.json (also under ``text_config``), None when it names none."""
    vocab = config.get("vocab_size", (config.get("text_config") or {}).get("vocab_size"))
    return vocab if isinstance(vocab, int) and not isinstance(vocab, bool) else None


def _load_tokenizer(recipe: Recipe, model_dir: Path) -> Any:
    from frod_ds.prep.tokens import load_tokenizer

    tok = load_tokenizer(str(recipe.model.tokenizer or model_dir))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token or tok.unk_token
    return tok


def _check_batch(recipe: Recipe, n_examples: int, n_rows: int, world: int) -> None:
    """At least one global batch of training rows."""
    t = recipe.train
    batch = batch_sizes(recipe, world).total
    if n_examples < batch:
        limited = (
            f" (data.limit={recipe.data.limit})"
            if recipe.data.limit is not None and n_rows == recipe.data.limit
            else ""
        )
        raise FrodError(
            f"{training_file(recipe.data.train)} gives {n_examples} training rows{limited}, fewer than "
            f"one global batch ({batch} = micro_batch_size {t.micro_batch_size} x grad_accum "
            f"{t.grad_accum} x {world} rank(s)); use more data{', a larger data.limit' if limited else ''} "
            "or a smaller batch"
        )


def _check_sparsity(recipe: Recipe, store: FactorStore) -> None:
    """``model.sparsity`` gives S at least one entry in every targeted category."""
    for c in recipe.model.targets:
        problem = empty_support(c, store.width(c), recipe.model.sparsity)
        if problem:
            raise FrodError(problem)


def nvme_params(
    base: HFCheckpoint | str | os.PathLike, store: FactorStore, targets: list[str], sparsity: float
) -> NvmeParams:
    """The FRoD model's parameter sizes per decoder layer (checkpoint tensors, a ``U`` in place of each targeted
    weight), the ``V`` shared per category, the rest, and each layer's trainable σ (n) and S (round(s·n²)):
    what ``check_nvme_buffer_count`` counts. ``base``: the opened checkpoint, or its directory."""
    if not isinstance(base, HFCheckpoint):
        base = HFCheckpoint(resolve_model_dir(str(base)))
    replaced = {f"{m}.weight": math.prod(store.member_shape(m)) for c in targets for m in store.categories[c]}
    layers: dict[int, list[int]] = {}
    trainable: dict[int, list[int]] = {}
    other = []
    for k in sorted(set(base.keys()) | set(replaced)):  # the targeted weights may be gone from the checkpoint
        numel = replaced[k] if k in replaced else math.prod(base.info(k).shape)
        hit = re.search(r"\.layers\.(\d+)\.", k)
        (layers.setdefault(int(hit.group(1)), []) if hit else other).append(numel)
    for c in targets:
        n = store.width(c)
        for m in store.categories[c]:
            hit = re.search(r"\.layers\.(\d+)\.", m + ".")
            trainable.setdefault(int(hit.group(1)), []).extend([n, support_nnz(n, sparsity)])
    return NvmeParams(
        [layers[i] for i in sorted(layers)],
        [store.width(c) ** 2 for c in targets],
        other,
        [trainable.get(i, []) for i in sorted(layers)],
    )


def init_adapter(recipe: Recipe, store: FactorStore, identity: StoreIdentity | None = None) -> InitAdapter | None:
    """``model.init_adapter`` read and checked to belong to the recipe's factor store and targets; None without one.
    A fresh run starts from its values (new optimizer and schedule); resume still wins."""
    path = recipe.model.init_adapter
    if not path:
        return None
    tensors, config = read_adapter(path)
    identity = identity or store.identity(list(recipe.model.targets))
    named = config.factor_store
    if (
        not named
        or Path(named).resolve() != store.path.resolve()
        or config.factor_store_fingerprint != identity.fingerprint
    ):
        raise FrodError(
            f"model.init_adapter {path} belongs to factor store {named}, not model.factor_store "
            f"{store.path}; set model.factor_store={named}"
        )
    if sorted(config.categories) != sorted(recipe.model.targets):
        raise FrodError(
            f"model.init_adapter {path} adapts {sorted(config.categories)}, model.targets "
            f"are {sorted(recipe.model.targets)}; set model.targets to the adapter's"
        )
    check_adapter_store(config, store, path)  # V and HJD route per category, where the adapter records them
    m = recipe.model
    if (config.sparsity, config.seed) != (m.sparsity, m.seed):  # its supports are trained on, not new ones
        note(
            f"model.init_adapter {path} holds S supports of density {config.sparsity:g} (seed {config.seed}): the run "
            f"trains on them, so model.sparsity {m.sparsity:g} and model.seed {m.seed} do not apply"
        )
    return InitAdapter(tensors, config)
