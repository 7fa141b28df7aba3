"""Adapter checkpoints: σ_i, S values and S supports — the only trained state — plus how to rebuild the model.

Layout of ``adapter-<step>/`` and ``adapter-final/``::

    adapter.safetensors    <module>.frod_sigma (n,) fp32, <module>.frod_s (nnz,) fp32,
                           <category>.support (2, nnz) int64 (row, col) of S
    adapter_config.json    format, version, base_model, factor_store, factor_store_fingerprint, targets,
                           sparsity, seed, pi, step, dtype, frozen_quant (none | nf4 | int8; absent = none),
                           quantize_base, categories {category: {members, n, nnz}}
    recipe.yaml            the full training recipe (written by training)

``<module>`` is the module's path in the HF model (``model.layers.3.self_attn.q_proj``), the same names the
factor store uses. Directories are written under a temporary name and renamed, so an adapter that exists is
complete. Under ZeRO-3, ``adapter_state`` gathers σ and S from their partitions on every rank.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from frod_ds.apply import frod_modules
from frod_ds.build import DTYPES, build_frod_model, gathered
from frod_ds.layer import SparseSupport

__all__ = [
    "ADAPTER_FORMAT",
    "ADAPTER_VERSION",
    "adapter_state",
    "write_adapter",
    "save_adapter_from_model",
    "read_adapter",
    "load_adapter_into",
    "is_adapter_checkpoint",
    "load_frod_model",
    "supports_from_adapter",
    "merged_state_dict",
    "adapter_sources",
]

ADAPTER_FORMAT = "frod-ds-adapter"
ADAPTER_VERSION = 1
WEIGHTS = "adapter.safetensors"
CONFIG = "adapter_config.json"


def _category_of(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def adapter_state(model: nn.Module, zero3: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """``(tensors, categories)`` of every FRoD layer, fp32 on CPU (complete on every rank).

    Call on all ranks under ZeRO-3 (gathering is collective).
    """
    tensors: dict[str, torch.Tensor] = {}
    categories: dict[str, dict] = {}
    for name, m in frod_modules(model):
        with gathered([m.frod_sigma, m.frod_s], zero3):
            tensors[f"{name}.frod_sigma"] = m.frod_sigma.detach().float().cpu().clone()
            tensors[f"{name}.frod_s"] = m.frod_s.detach().float().cpu().clone()
        cat = _category_of(name)
        info = categories.setdefault(cat, {"members": [], "n": m.in_features, "nnz": m.support.nnz})
        info["members"].append(name)
        if f"{cat}.support" not in tensors:
            tensors[f"{cat}.support"] = m.support.rows_cols().contiguous()
    return tensors, categories


def _atomic_dir(out_dir: Path) -> Path:
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))


def _publish(tmp: Path, out_dir: Path) -> None:
    """Rename ``tmp`` to ``out_dir``, replacing an older one (moved aside first, then deleted)."""
    old = None
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_adapter(
    out_dir: str | Path,
    tensors: dict[str, torch.Tensor],
    config: dict[str, Any],
    extra_files: dict[str, str] | None = None,
) -> Path:
    """Write an adapter dir atomically. ``config`` gets ``format``/``version`` added."""
    out_dir = Path(out_dir)
    tmp = _atomic_dir(out_dir)
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / WEIGHTS))
        cfg = {"format": ADAPTER_FORMAT, "version": ADAPTER_VERSION, **config}
        (tmp / CONFIG).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        for fname, text in (extra_files or {}).items():
            (tmp / fname).write_text(text)
        _publish(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def save_adapter_from_model(model: nn.Module, out_dir: str | Path, config: dict[str, Any]) -> Path:
    """Single-process convenience: gather nothing, write ``model``'s adapter with ``config`` merged in."""
    tensors, categories = adapter_state(model)
    return write_adapter(out_dir, tensors, {**config, "categories": categories})


def is_adapter_checkpoint(path: str | Path) -> bool:
    p = Path(path)
    if not (p / CONFIG).is_file():
        return False
    try:
        return json.loads((p / CONFIG).read_text()).get("format") == ADAPTER_FORMAT
    except (json.JSONDecodeError, OSError):
        return False


def read_adapter(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(tensors, config)``; ``ValueError`` naming the file when something is missing or malformed."""
    p = Path(path)
    if not (p / CONFIG).is_file() or not (p / WEIGHTS).is_file():
        raise ValueError(f"{p} is not a frod-ds adapter checkpoint (expected {CONFIG} and {WEIGHTS})")
    try:
        config = json.loads((p / CONFIG).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{p / CONFIG} is not valid JSON: {e}") from None
    if config.get("format") != ADAPTER_FORMAT:
        raise ValueError(f"{p / CONFIG}: format is {config.get('format')!r}, expected {ADAPTER_FORMAT!r}")
    if config.get("version", 0) > ADAPTER_VERSION:
        raise ValueError(f"{p}: adapter version {config['version']} is newer than this frod-ds; upgrade frod-ds")
    try:
        tensors = load_file(str(p / WEIGHTS))
    except Exception as e:  # noqa: BLE001 - safetensors raises several types for a bad file
        raise ValueError(f"{p / WEIGHTS} cannot be read ({e}); the adapter file is damaged") from None
    return tensors, config


def supports_from_adapter(tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, SparseSupport]:
    return {
        cat: SparseSupport.from_rows_cols(info["n"], tensors[f"{cat}.support"])
        for cat, info in config["categories"].items()
    }


@torch.no_grad()
def load_adapter_into(model: nn.Module, tensors: dict[str, torch.Tensor], zero3: bool = False) -> None:
    """Copy σ and S values into a model whose FRoD layers have the adapter's supports."""
    layers = dict(frod_modules(model))
    for name, m in layers.items():
        for key in (f"{name}.frod_sigma", f"{name}.frod_s"):
            if key not in tensors:
                raise ValueError(f"adapter has no tensor {key!r}; it was trained on other targets")
        sup = tensors.get(f"{_category_of(name)}.support")
        if sup is not None and not torch.equal(sup.long(), m.support.rows_cols()):
            raise ValueError(f"{name}: the adapter's S support differs from the model's")
        with gathered([m.frod_sigma, m.frod_s], zero3, modifier_rank=0):
            m.frod_sigma.copy_(tensors[f"{name}.frod_sigma"].to(m.frod_sigma.dtype))
            m.frod_s.copy_(tensors[f"{name}.frod_s"].to(m.frod_s.dtype))


def adapter_sources(checkpoint_dir: str | Path, base_model: str | None = None, factor_store: str | None = None):
    """``(tensors, config, model_dir, store)`` of an adapter: its σ/S tensors and config, the base checkpoint
    directory and the factor store (from the adapter's config unless given), checked to belong together."""
    from frod_ds.hf_checkpoint import HFCheckpoint, resolve_model_dir
    from frod_ds.store import FactorStore, check_store_matches

    tensors, config = read_adapter(checkpoint_dir)
    base = base_model or config.get("base_model")
    store_path = factor_store or config.get("factor_store")
    if not base:
        raise ValueError(f"{checkpoint_dir}: adapter names no base model; pass --base-model")
    if not store_path or not Path(store_path).is_dir():
        raise ValueError(
            f"factor store {store_path!r} named by {checkpoint_dir} not found; pass --factor-store DIR "
            "(the directory written by launch/hjd.py for this base model)"
        )
    store = FactorStore.open(store_path)
    model_dir = resolve_model_dir(base)
    check_store_matches(store, HFCheckpoint(model_dir))
    return tensors, config, model_dir, store


def load_frod_model(
    checkpoint_dir: str | Path,
    base_model: str | None = None,
    factor_store: str | None = None,
    dtype: torch.dtype | str | None = None,
    device: str | torch.device = "cpu",
):
    """A plain (one-process) HF causal LM with FRoD layers from an adapter dir, and its tokenizer.

    The base model and factor store come from the adapter's config unless given. Raises ``ValueError``
    with a clear message if either is missing or the store belongs to another model.
    """
    from transformers import AutoTokenizer

    tensors, config, model_dir, store = adapter_sources(checkpoint_dir, base_model, factor_store)
    if isinstance(dtype, str):
        dtype = DTYPES[dtype]
    dtype = dtype or DTYPES.get(config.get("dtype", "float32"), torch.float32)
    model = build_frod_model(model_dir, store, supports_from_adapter(tensors, config), dtype,
                             quant=config.get("frozen_quant", "none"), quantize_base=bool(config.get("quantize_base")))
    load_adapter_into(model, tensors)
    tokenizer = AutoTokenizer.from_pretrained(str(config.get("tokenizer") or model_dir))
    return model.to(device).eval(), tokenizer


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with each FRoD layer replaced by ``<module>.weight = U (diag σ + S) Vᵀ``."""
    out: dict[str, torch.Tensor] = {}
    frod = dict(frod_modules(model))
    for name, t in model.state_dict().items():
        mod, _, leaf = name.rpartition(".")
        if mod in frod:
            if leaf == "U":
                out[f"{mod}.weight"] = frod[mod].merged_weight().contiguous()
            elif leaf == "bias":
                out[name] = t
            continue
        out[name] = t
    return out

