"""Adapter checkpoints: σ_i, S values and S supports — the only trained state — plus how to rebuild the model.

The format (file names, ``AdapterConfig``) is ``frod_ds.formats.adapter_dir``. Directories are written under a
temporary name and renamed, so an adapter that exists is complete. Under ZeRO-3, ``adapter_state`` gathers
σ and S from their partitions on every rank. An adapter records the identity of the factor store it was
trained on; ``adapter_sources`` refuses another store.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from frod_ds.core.layer import FRoDFrozen, FRoDTrainables, SparseSupport
from frod_ds.formats.adapter_dir import (
    ADAPTER_VERSION,
    CONFIG,
    WEIGHTS,
    AdapterCategory,
    AdapterConfig,
    s_name,
    sigma_name,
    support_name,
)
from frod_ds.formats.building import building_dir
from frod_ds.formats.checksum import file_crc32, format_crc32, parse_crc32
from frod_ds.formats.factor_store import StoreIdentity, category_of
from frod_ds.formats.folders import describe_folder, folder_kind, wrong_folder
from frod_ds.formats.lease import holding
from frod_ds.io.dtypes import FLOAT_DTYPES
from frod_ds.model.apply import frod_groups, frod_modules
from frod_ds.model.build import build_frod_model, gathered
from frod_ds.model.store_reader import FactorStore
from frod_ds.runtime.errors import AdapterError, FrodError, note
from frod_ds.runtime.paths import dir_problem, file_problem

__all__ = [
    "adapter_state",
    "write_adapter",
    "save_adapter_from_model",
    "read_adapter",
    "load_adapter_into",
    "is_adapter_checkpoint",
    "not_an_adapter",
    "load_frod_model",
    "supports_from_adapter",
    "check_adapter_store",
    "merged_state_dict",
    "adapter_sources",
]


def adapter_state(
    model: nn.Module,
    zero3: bool = False,
    store: StoreIdentity | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, AdapterCategory]]:
    """``(tensors, categories)`` of every FRoD layer, fp32 on CPU (complete on every rank); ``store``: the
    identity of the factor store the model was built from, recorded per category.

    Call on all ranks under ZeRO-3 (gathering is collective).
    """
    tensors: dict[str, torch.Tensor] = {}
    categories: dict[str, AdapterCategory] = {}
    for params, members in frod_groups(model):
        with gathered(params, zero3):
            for name, m in members:
                tensors[sigma_name(name)] = m.frod_sigma.detach().float().cpu().clone()
                tensors[s_name(name)] = m.frod_s.detach().float().cpu().clone()
    for name, m in frod_modules(model):
        cat = category_of(name)
        if cat not in categories:
            ident = store.categories.get(cat) if store is not None else None
            categories[cat] = AdapterCategory(
                [],
                m.in_features,
                m.support.nnz,
                v_sha256=ident.v_sha256 if ident else None,
                method=ident.method if ident else None,
                u_storage=ident.u_storage if ident else None,
            )
            tensors[support_name(cat)] = m.support.rows_cols().contiguous()
        categories[cat].members.append(name)
    return tensors, categories


def write_adapter(
    out_dir: str | Path,
    tensors: dict[str, torch.Tensor],
    config: AdapterConfig,
    extra_files: dict[str, str] | None = None,
    what: str = "--out",
) -> Path:
    """Write an adapter dir atomically (built under a temporary name, then renamed); the caller holds the lease
    of the folder it writes in (a training run's output_dir); ``what`` names ``out_dir`` in a refusal."""
    out_dir = Path(out_dir)
    bad = nonfinite_tensor(tensors)
    if bad:
        raise AdapterError(f"refusing to write adapter {out_dir}: {bad}; the training diverged")
    with building_dir(out_dir, "adapter", what=what) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / WEIGHTS))
        config = dataclasses.replace(
            config, version=ADAPTER_VERSION, weights_crc32=format_crc32(file_crc32(tmp / WEIGHTS))
        )
        (tmp / CONFIG).write_text(config.to_json())
        for fname, text in (extra_files or {}).items():
            (tmp / fname).write_text(text)
    return out_dir


def save_adapter_from_model(
    model: nn.Module, out_dir: str | Path, config: AdapterConfig, store: FactorStore | None = None
) -> Path:
    """Single-process convenience: write ``model``'s adapter with ``config``, holding the lease on ``out_dir``
    (``write_adapter`` alone is for writers holding their output's lease); with ``store`` (the one the model was
    built from) its identity is recorded."""
    categories = sorted({category_of(name) for name, _ in frod_modules(model)})
    identity = store.identity(categories) if store is not None else None
    tensors, cats = adapter_state(model, store=identity)
    if identity is not None:
        config = dataclasses.replace(
            config, factor_store_fingerprint=identity.fingerprint, pi=identity.pi, hjd_dtype=identity.hjd_dtype
        )
    with holding(out_dir, "adapter", "adapter directory", AdapterError):
        return write_adapter(out_dir, tensors, dataclasses.replace(config, categories=cats))


def is_adapter_checkpoint(path: str | Path) -> bool:
    p = Path(path)
    if not (p / CONFIG).is_file():
        return False
    try:
        AdapterConfig.read(p / CONFIG)
    except AdapterError as e:  # a damaged frod-ds config is still one: reading it reports the damage
        return "corrupt" in str(e) or (p / WEIGHTS).is_file()
    except (FrodError, OSError):
        return False
    return True


def not_an_adapter(path: str | Path, flag: str = "") -> str:
    """The one line for ``path`` given where an adapter belongs: what it is (a factor store, a model, a training
    run, ...) and where that goes, or why it is no adapter."""
    p = Path(path)
    if not p.is_dir():
        return (
            f"{f'{flag} ' if flag else ''}{dir_problem(p)}: not a frod-ds adapter checkpoint; pass an adapter "
            "directory (adapter-final/ of a run)"
        )
    for name in (CONFIG, WEIGHTS):  # there, but no file it can read: say what it is
        if os.path.lexists(p / name) and file_problem(p / name):
            return f"{f'{flag} ' if flag else ''}{file_problem(p / name)}; the adapter {p} is damaged: copy it again"
    missing = [name for name in (CONFIG, WEIGHTS) if not os.path.lexists(p / name)]
    if folder_kind(p) == "adapter" and missing:  # written as an adapter, a file gone since
        return (
            f"{f'{flag} ' if flag else ''}the adapter {p} has no {' and no '.join(missing)} (removed since it was "
            "written): copy the adapter again, or pass another adapter-<step> of its run"
        )
    return wrong_folder(p, flag, ("adapter",), "a FRoD adapter checkpoint") or (
        f"{f'{flag} ' if flag else ''}{p} is not a frod-ds adapter checkpoint (expected {CONFIG} and {WEIGHTS}); "
        f"it is {describe_folder(p)}"
    )


def nonfinite_tensor(tensors: dict[str, torch.Tensor]) -> str | None:
    """A one-line description of the first tensor holding NaN or inf, or None when all are finite."""
    for name, x in tensors.items():
        if x.is_floating_point() and not bool(torch.isfinite(x).all()):
            n = int((~torch.isfinite(x)).sum())
            return f"{name} holds {n} non-finite value(s) (NaN/inf) of {x.numel()}"
    return None


def read_adapter(path: str | Path) -> tuple[dict[str, torch.Tensor], AdapterConfig]:
    """``(tensors, config)``; ``AdapterError`` naming the file when something is missing or malformed."""
    p = Path(path)
    if not (p / CONFIG).is_file() or not (p / WEIGHTS).is_file():
        raise AdapterError(not_an_adapter(p))
    config = AdapterConfig.read(p / CONFIG)
    if config.weights_crc32 is None:  # versions 1-2 (a version 3 without one is refused by the reader)
        note(
            f"{p / CONFIG} is of adapter version {config.version}, which records no checksum of {WEIGHTS}: its "
            "weights are read unchecked (an adapter trained by today's frod-ds records one)"
        )
    elif parse_crc32(config.weights_crc32) != file_crc32(p / WEIGHTS):
        raise AdapterError(
            f"{p / WEIGHTS} does not match the checksum its {CONFIG} records; the adapter file was "
            "changed or damaged after it was written: use another adapter (e.g. an earlier "
            "adapter-<step>) or retrain"
        )
    try:
        tensors = load_file(str(p / WEIGHTS))
    except (SafetensorError, OSError) as e:
        raise AdapterError(f"{p / WEIGHTS} cannot be read ({e}); the adapter file is damaged") from None
    held = sorted(k.removesuffix(".support") for k in tensors if k == support_name(k.removesuffix(".support")))
    if held != sorted(config.categories):  # the config was edited (its targets are no part of the checksum)
        raise AdapterError(
            f"{p / CONFIG} names the categories {sorted(config.categories)}, but {WEIGHTS} holds supports of "
            f"{held}; the config was changed after the adapter was written: use the adapter as written, or retrain"
        )
    missing = [
        k
        for c, info in config.categories.items()
        for k in [support_name(c)] + [f(m) for m in info.members for f in (sigma_name, s_name)]
        if k not in tensors
    ]
    if missing:
        raise AdapterError(
            f"{p / WEIGHTS} has no tensor {missing[0]!r} ({len(missing)} missing); the adapter is damaged"
        )
    bad = nonfinite_tensor(tensors)
    if bad:
        raise AdapterError(
            f"adapter {p} cannot be used: {bad}; its training diverged, use an earlier adapter or retrain"
        )
    return tensors, config


def supports_from_adapter(tensors: dict[str, torch.Tensor], config: AdapterConfig) -> dict[str, SparseSupport]:
    """Each category's S support, validated (``FrodError`` for indices off the matrix, on the diagonal or twice)."""
    return {
        cat: SparseSupport.from_rows_cols(info.n, tensors[support_name(cat)]) for cat, info in config.categories.items()
    }


@torch.no_grad()
def load_adapter_into(model: nn.Module, tensors: dict[str, torch.Tensor], zero3: bool = False) -> None:
    """Copy σ and S values into a model whose FRoD layers have the adapter's supports."""
    for name, m in frod_modules(model):
        for key in (sigma_name(name), s_name(name)):
            if key not in tensors:
                raise AdapterError(f"adapter has no tensor {key!r}; it was trained on other targets")
        sup = tensors.get(support_name(category_of(name)))
        if sup is not None and not torch.equal(sup.long(), m.support.rows_cols()):
            raise AdapterError(f"{name}: the adapter's S support differs from the model's")
    for params, members in frod_groups(model):
        with gathered(params, zero3, modifier_rank=0):
            for name, m in members:
                m.frod_sigma.copy_(tensors[sigma_name(name)].to(m.frod_sigma.dtype))
                m.frod_s.copy_(tensors[s_name(name)].to(m.frod_s.dtype))


def check_adapter_store(config: AdapterConfig, store: FactorStore, where: str | Path) -> None:
    """``AdapterError`` unless ``store`` is the factor store the adapter was trained on (as far as its
    config records: base weights' fingerprint, π, and per category V's sha256 and the HJD route)."""
    missing = [c for c in config.categories if c not in store.categories]
    if missing:
        raise AdapterError(
            f"adapter {where} has category {missing[0]!r}, which factor store {store.path} does not "
            f"have (it has {sorted(store.categories)}); pass --factor-store with the store it was trained on"
        )
    if config.records_store_identity:
        found = store.identity(list(config.categories))
    else:
        note(
            f"adapter {where} does not record the identity of its factor store (adapter version {config.version}, "
            f"written by an older frod-ds): only the base weights and pi of {store.path} are checked"
        )
        found = StoreIdentity(store.fingerprint, store.pi, {})
    diffs = config.store_identity().differences(found)
    if diffs:
        raise AdapterError(
            f"adapter {where} was trained on another factor store than {store.path} ({'; '.join(diffs)}); pass "
            f"--factor-store with the store it was trained on (its adapter_config.json names {config.factor_store})"
        )


def adapter_sources(checkpoint_dir: str | Path, base_model: str | None = None, factor_store: str | None = None):
    """``(tensors, config, model_dir, store)`` of an adapter: its σ/S tensors and config, the base checkpoint
    directory and the factor store (from the adapter's config unless given), checked to belong together."""
    from frod_ds.io.hf_checkpoint import HFCheckpoint
    from frod_ds.io.model_dir import resolve_model_dir
    from frod_ds.model.store_reader import check_store_matches

    tensors, config = read_adapter(checkpoint_dir)
    base = base_model or config.base_model
    store_path = factor_store or config.factor_store
    if not base:
        raise AdapterError(f"{checkpoint_dir}: adapter names no base model; pass --base-model")
    if factor_store and not Path(factor_store).is_dir():  # the user's own flag: not the adapter's doing
        problem = dir_problem(Path(factor_store)) or f"{factor_store} is not a directory"
        raise AdapterError(f"--factor-store {problem}; pass the directory written by frod hjd for this base model")
    if not store_path or not Path(store_path).is_dir():
        raise AdapterError(
            f"factor store {store_path!r} named by {checkpoint_dir} not found; pass --factor-store DIR "
            "(the directory written by frod hjd for this base model)"
        )
    store = FactorStore.open(store_path)
    if not base_model and base.startswith(("/", ".", "~")) and not os.path.lexists(os.path.expanduser(base)):
        raise AdapterError(
            f"the base model {base} that {Path(checkpoint_dir) / CONFIG} names does not exist (moved?); pass "
            "--base-model DIR, or re-point base_model in that file (its paths may be edited)"
        )
    model_dir = resolve_model_dir(base, "--base-model" if base_model else f"base model of {checkpoint_dir}")
    check_store_matches(store, HFCheckpoint(model_dir))
    check_adapter_store(config, store, checkpoint_dir)
    return tensors, config, model_dir, store


def load_frod_model(
    checkpoint_dir: str | Path,
    base_model: str | None = None,
    factor_store: str | None = None,
    dtype: torch.dtype | str | None = None,
    device: str | torch.device = "cpu",
):
    """A plain (one-process) HF causal LM with FRoD layers from an adapter dir, and its tokenizer.

    The base model and factor store come from the adapter's config unless given. Raises ``FrodError``
    with a clear message if either is missing or the store belongs to another model or adapter.
    """
    from frod_ds.prep.tokens import load_tokenizer, tokenizer_sha256

    tensors, config, model_dir, store = adapter_sources(checkpoint_dir, base_model, factor_store)
    if isinstance(dtype, str):
        dtype = FLOAT_DTYPES[dtype]
    dtype = dtype or FLOAT_DTYPES.get(config.dtype, torch.float32)
    model = build_frod_model(
        model_dir,
        store,
        supports_from_adapter(tensors, config),
        dtype,
        quant=config.frozen_quant,
        quantize_base=config.quantize_base,
    )
    load_adapter_into(model, tensors)
    source = str(config.tokenizer or model_dir)
    tokenizer = load_tokenizer(source)
    if config.tokenizer_sha256 is None:
        note(f"adapter {checkpoint_dir} records no digest of its tokenizer (older frod-ds): {source}'s is not checked")
    elif tokenizer_sha256(tokenizer) != config.tokenizer_sha256:  # same size, other ids: every score would shift
        raise AdapterError(
            f"the tokenizer in {source} is not the one adapter {checkpoint_dir} was trained with (its vocabulary or "
            "special tokens differ); pass the base model whose tokenizer it was trained with"
        )
    return model.to(device).eval(), tokenizer


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with each FRoD layer replaced by ``<module>.weight = U (diag σ + S) Vᵀ``."""
    out: dict[str, torch.Tensor] = {}
    frod = dict(frod_modules(model))
    # σ, S and U held per decoder layer: in the merged weights
    flat = {n for n, m in model.named_modules() if isinstance(m, (FRoDTrainables, FRoDFrozen))}
    for name, t in model.state_dict().items():
        mod, _, leaf = name.rpartition(".")
        if mod in flat:
            continue
        if mod in frod:  # its merged weight where its first tensor was (V: every member has one)
            if f"{mod}.weight" not in out:
                out[f"{mod}.weight"] = frod[mod].merged_weight().contiguous()
            if leaf == "bias":
                out[name] = t
            continue
        out[name] = t
    return out
