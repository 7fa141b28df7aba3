"""Export a FRoD adapter as a plain Hugging Face checkpoint that stock ``transformers`` loads (no frod-ds).

Every targeted weight becomes ``W'_i = U_i (diag σ_i + S_i) Vᵀ`` (spec §2, "Merge/export"; with ``Ũ_i``, the
dequantized ``U_i``, for an adapter trained on quantized frozen weights); every other tensor is copied. The export
streams one tensor at a time into shards of about ``shard_gb`` (a 70B export fits one host) and appears only when
complete, beside the base checkpoint's side files and ``frod_export.json``. Details: docs/export.md.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from frod_ds.core.layer import core_matrix
from frod_ds.core.quant import is_base_linear_weight, roundtrip
from frod_ds.formats.adapter_dir import s_name, sigma_name
from frod_ds.formats.building import building_dir
from frod_ds.formats.lease import holding
from frod_ds.formats.ownership import check_out
from frod_ds.io.dtypes import FLOAT_DTYPES, dtype_from_name, dtype_name
from frod_ds.io.hf_checkpoint import INDEX_NAME, HFCheckpoint
from frod_ds.io.safetensors_io import save_tensors_atomic
from frod_ds.model.adapter import adapter_sources, supports_from_adapter
from frod_ds.runtime.errors import ExportError

__all__ = ["export_transformers", "side_files"]

KIND = "hf-export"  # the ownership record's kind: --overwrite replaces only an earlier merged export
OUT_DTYPES = ("bfloat16", "float16", "float32")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".npz", ".onnx")
WRITTEN_HERE = ("frod_export.json", "frod_convert.json")  # provenance of this export / of another artefact
MODEL_FILES = ("config.json", "generation_config.json")  # the model's, never a separate tokenizer directory's


def side_files(directory: Path, *, tokenizer_only: bool = False) -> list[Path]:
    """The files of a checkpoint directory an export carries over: every top-level file that is not a weight,
    a weight index or provenance (hidden files skipped). ``tokenizer_only``: without the model's configs,
    for a tokenizer directory given apart from the base model."""
    out = []
    for p in sorted(directory.iterdir()):
        name = p.name
        if not p.is_file() or name.startswith(".") or name in WRITTEN_HERE or name.endswith(".index.json"):
            continue
        if name.endswith(WEIGHT_SUFFIXES) or (tokenizer_only and name in MODEL_FILES):
            continue
        out.append(p)
    return out


def _frozen_U(store, member: str, quant: str, device: torch.device) -> torch.Tensor:
    """``U_i`` as the trained model computed with it, in fp32 (fp64 for an fp64 store): dequantized if the
    store holds it quantized, quantized and dequantized if training quantized it at load time."""
    if store.u_spec(member) is not None:
        return store.load_U(member, torch.float32, device)
    U = store.load_U(member, device=device)
    return roundtrip(U, quant, torch.float64 if U.dtype == torch.float64 else torch.float32)


def _merged(
    store,
    member: str,
    sigma: torch.Tensor,
    s_values: torch.Tensor,
    support_flat: torch.Tensor,
    V: torch.Tensor,
    device: torch.device,
    quant: str = "none",
) -> torch.Tensor:
    U = _frozen_U(store, member, quant, device)
    cdt = U.dtype
    M = core_matrix(sigma, s_values, support_flat, cdt, device)  # (n, n)
    return (U.to(cdt) @ M) @ V.to(device=device, dtype=cdt).T  # (m, n)


def _merged_dtypes(ckpt, store, member_of: dict[str, tuple[str, str]], out_dtype) -> dict[str, torch.dtype]:
    """The dtype of each merged weight: ``--dtype``, else its base weight's; for a weight the checkpoint no longer
    holds (deleted after HJD), the checkpoint dtype the store recorded (its ``u_dtype`` unless ``--u-dtype`` was
    given). ``ExportError`` when that is not known."""
    out = {}
    for name, (category, _) in member_of.items():
        if out_dtype is not None or name in ckpt:
            out[name] = out_dtype or ckpt.dtype(name)
        elif store.manifest.u_dtype == "auto":
            out[name] = FLOAT_DTYPES[store.record(category).u_dtype]
        else:
            raise ExportError(
                f"{ckpt.dir} has no {name} (deleted after HJD) and the store was built with --u-dtype "
                f"{store.manifest.u_dtype}, so its dtype is not recorded; pass --dtype"
            )
    return out


def export_transformers(
    checkpoint_dir: str | Path,
    out: str | Path,
    *,
    base_model: str | None = None,
    factor_store: str | None = None,
    dtype: str = "auto",
    shard_gb: float = 5.0,
    device: str | torch.device = "cpu",
    overwrite: bool = False,
) -> Path:
    """Write the merged model of adapter ``checkpoint_dir`` to ``out``; returns ``out``.

    ``dtype``: ``auto`` keeps each tensor's dtype (a merged weight gets its base weight's), or one of
    ``bfloat16``/``float16``/``float32`` for every floating tensor. ``FrodError`` on bad input.
    """
    with holding(out, KIND, "--out", ExportError):  # a second writer of out is refused at once
        out = Path(out)
        out_dtype = None if dtype == "auto" else dtype_from_name(dtype, OUT_DTYPES, "--dtype (or auto)")
        if not shard_gb > 0:
            raise ExportError(f"--shard-gb must be > 0, got {shard_gb}")
        given = {"--checkpoint": checkpoint_dir, "--base-model": base_model, "--factor-store": factor_store}
        check_out(out, KIND, given, overwrite, error=ExportError)  # before reading anything
        tensors, config, model_dir, store = adapter_sources(checkpoint_dir, base_model, factor_store)
        inputs = {
            "--checkpoint": checkpoint_dir,
            "the base model": model_dir,
            "the factor store": store.path,
            "the tokenizer": config.tokenizer,
        }
        ckpt = HFCheckpoint(model_dir)
        ckpt.config()  # an export whose config.json is unusable or of other sizes would be no transformers checkpoint
        device = torch.device(device)
        supports = {c: sup.flat for c, sup in supports_from_adapter(tensors, config).items()}
        quant, quantize_base = config.frozen_quant, config.quantize_base
        member_of = {m + ".weight": (c, m) for c, members in store.categories.items() for m in members}
        missing = [m for c, m in member_of.values() if sigma_name(m) not in tensors]
        if missing:
            raise ExportError(
                f"adapter {checkpoint_dir} has no σ for {missing[0]} (of {len(missing)}); it was trained "
                "with other targets than the factor store's"
            )
        weight_dtype = _merged_dtypes(ckpt, store, member_of, out_dtype)

        t0 = time.perf_counter()
        with building_dir(out, KIND, inputs, ExportError) as tmp:
            shards: list[dict[str, torch.Tensor | None]] = [{}]
            size, total_size, limit = 0, 0, shard_gb * 2**30
            V_of: dict[str, torch.Tensor] = {}  # fp32 as stored; layers interleave the categories
            with torch.no_grad():
                for name in ckpt.keys() + [n for n in member_of if n not in ckpt]:  # targeted weights may be deleted
                    if name in member_of:
                        category, member = member_of[name]
                        if category not in V_of:
                            V_of[category] = store.load_V(category, torch.float32, device)
                        W = _merged(
                            store,
                            member,
                            tensors[sigma_name(member)],
                            tensors[s_name(member)],
                            supports[category],
                            V_of[category],
                            device,
                            quant,
                        ).to(weight_dtype[name])
                    elif quantize_base and is_base_linear_weight(name, ckpt.shape(name)):
                        W = ckpt.get(name, device)
                        W = roundtrip(W, quant, torch.float32).to(out_dtype or W.dtype)  # as training saw it
                    else:
                        W = ckpt.get(name)
                        if out_dtype is not None and W.is_floating_point():
                            W = W.to(out_dtype)
                    if W.is_floating_point() and not bool(torch.isfinite(W).all()):  # train and eval refuse it too
                        where = (
                            f"merged from the factor store {store.path} and the adapter"
                            if name in member_of
                            else f"in the base checkpoint {model_dir}"
                        )
                        cast = name in member_of or out_dtype is not None
                        if cast and W.dtype == torch.float16 and not bool(torch.isnan(W).any()):
                            raise ExportError(  # finite before the cast: float16's range, not the files, is short
                                f"{name} does not fit float16: {int(torch.isinf(W).sum())} of its values "
                                f"({where.removeprefix('in ')}) pass float16's largest, "
                                f"{torch.finfo(torch.float16).max:.0f}; export with --dtype bfloat16 (float32's "
                                "range) or without --dtype"
                            )
                        raise ExportError(
                            f"{name} holds {int((~torch.isfinite(W)).sum())} non-finite value(s) (NaN/inf) {where}: "
                            "a damaged file; use an intact copy of it"
                        )
                    W = W.cpu().contiguous()
                    nbytes = W.numel() * W.element_size()
                    if shards[-1] and size + nbytes > limit:
                        _write_shard(tmp, len(shards), shards[-1])
                        shards[-1] = dict.fromkeys(shards[-1])  # names only from here on
                        shards.append({})
                        size = 0
                    shards[-1][name] = W
                    size += nbytes
                    total_size += nbytes
                _write_shard(tmp, len(shards), shards[-1])
            weight_map: dict[str, str] = {}
            for i, shard in enumerate(shards, start=1):
                final = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                (tmp / f"shard-{i:05d}.safetensors").rename(tmp / final)
                weight_map.update(dict.fromkeys(shard, final))
            index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
            (tmp / INDEX_NAME).write_text(json.dumps(index, indent=1) + "\n")
            _copy_side_files(model_dir, Path(config.tokenizer) if config.tokenizer else None, tmp, out_dtype)
            provenance: dict[str, Any] = {
                "format": "frod-ds-export",
                "adapter": str(checkpoint_dir),
                "base_model": str(Path(model_dir).resolve()),  # the base merged into (--base-model when given)
                "trained_on": config.base_model,  # the base the adapter records
                "factor_store": str(store.path),
                "factor_store_fingerprint": store.fingerprint,
                "step": config.step,
                "merged": sorted(m for _, m in member_of.values()),
                "dtype": dtype,
                "frozen_quant": quant,
                "quantize_base": quantize_base,
                "seconds": round(time.perf_counter() - t0, 2),
            }
            (tmp / "frod_export.json").write_text(json.dumps(provenance, indent=1) + "\n")
        return out


def _write_shard(tmp: Path, index: int, tensors: dict[str, torch.Tensor | None]) -> None:
    save_tensors_atomic(tmp / f"shard-{index:05d}.safetensors", tensors, fsync=True)  # type: ignore[arg-type]


def _copy_side_files(model_dir: Path, tokenizer_dir: Path | None, tmp: Path, out_dtype: torch.dtype | None) -> None:
    """``side_files`` of the base checkpoint, then the tokenizer directory's (its files win where both have one)."""
    sources = side_files(model_dir)
    if tokenizer_dir is not None and tokenizer_dir.is_dir() and tokenizer_dir.resolve() != model_dir.resolve():
        sources += side_files(tokenizer_dir, tokenizer_only=True)
    for src in sources:
        shutil.copyfile(src, tmp / src.name)
    cfg_path = tmp / "config.json"
    if out_dtype is not None and cfg_path.is_file():
        cfg = json.loads(cfg_path.read_text())
        for key in ("torch_dtype", "dtype"):
            if key in cfg:
                cfg[key] = dtype_name(out_dtype)
        cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
