"""Import a stock PEFT FRoD adapter as a frod-ds factor store and adapter, exactly.

The store gets PEFT's saved ``V`` and the ``U_i``, ``λ⁰_i`` (as σ) that ``PeftModel.from_pretrained`` computes on this
base model; the adapter gets the trained λ, S values and PEFT's support. The saved ``V`` against the one PEFT
recomputes tells whether the adapter was made for this base model. Details: docs/export.md.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from frod_ds.core.layer import core_matrix
from frod_ds.formats.adapter_dir import AdapterCategory, AdapterConfig, support_name
from frod_ds.formats.building import building_dir
from frod_ds.formats.file_digests import FileDigests
from frod_ds.formats.folders import wrong_folder
from frod_ds.formats.lease import holding
from frod_ds.formats.ownership import check_replaceable, inventory, mark_dir
from frod_ds.interop.peft_common import (
    ADAPTER,
    EXPORT_REPORT,
    PEFT_FILES,
    PeftInteropError,
    check_out_dir,
    first_line,
    frod_layers,
    group_by_leaf,
    load_base,
    peft_version,
    rel_error,
)
from frod_ds.runtime.errors import note
from frod_ds.runtime.paths import dir_problem
from frod_ds.runtime.strict_json import loads

__all__ = ["import_peft"]

IMPORT_KIND = "peft-import"  # the ownership record's kind (frod_ds.formats.output_dir)
IMPORT_FORMAT = "frod-ds-peft-import"
IMPORT_REPORT = "frod_import.json"
STORE_DIR, ADAPTER_DIR = "factor-store", "adapter"
BASIS_MISMATCH = 1e-2  # relative ‖V_saved − V_recomputed‖ above which the adapter is for other weights


def _read_peft_config(peft_dir: Path) -> dict[str, Any]:
    cfg_path = peft_dir / "adapter_config.json"
    if not peft_dir.is_dir():
        raise PeftInteropError(
            f"--from-peft {dir_problem(peft_dir)}: not a PEFT adapter directory; pass the one save_pretrained wrote"
        )
    wrong = wrong_folder(peft_dir, "--from-peft", ("peft-adapter", "peft-export"), "a PEFT adapter")
    if wrong:
        raise PeftInteropError(wrong)
    if not cfg_path.is_file():
        raise PeftInteropError(f"--from-peft {peft_dir} is not a PEFT adapter directory (no adapter_config.json)")
    try:
        cfg = loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PeftInteropError(f"{cfg_path} is corrupt ({e}); save the adapter again") from None
    if not isinstance(cfg, dict):
        raise PeftInteropError(
            f"{cfg_path} is not a JSON object (a {type(cfg).__name__}): not a PEFT adapter's config; save the "
            "adapter again"
        )
    if "peft_type" not in cfg:
        raise PeftInteropError(f"{cfg_path} has no peft_type: not a PEFT adapter's config; save the adapter again")
    if cfg["peft_type"] != "FROD":
        raise PeftInteropError(
            f"--from-peft {peft_dir} is a PEFT {cfg['peft_type']!r} adapter, not a FRoD one (peft_type FROD)"
        )
    if not (peft_dir / "adapter_model.safetensors").is_file():
        raise PeftInteropError(
            f"--from-peft {peft_dir} has no adapter_model.safetensors; save it with "
            "save_pretrained(safe_serialization=True)"
        )
    unsupported = [
        f"{k}={cfg.get(k)!r}" for k, ok in (("bias", "none"), ("fan_in_fan_out", False)) if cfg.get(k, ok) != ok
    ]
    if cfg.get("modules_to_save"):
        unsupported.append(f"modules_to_save={cfg['modules_to_save']}")
    if unsupported:
        raise PeftInteropError(
            f"--from-peft {peft_dir} uses {', '.join(unsupported)}; frod-ds adapters train only σ "
            "and S (no biases, no extra modules), so it cannot be imported"
        )
    return cfg


def _check_files(peft_dir: Path) -> dict[str, str]:
    """The sha256 of the PEFT files to import; ``PeftInteropError`` when a frod-ds export recorded others (they
    were changed since). A stock PEFT adapter records none; an export of an older frod-ds gets a ``note:``."""
    report = peft_dir / EXPORT_REPORT
    recorded = FileDigests.read(report, PeftInteropError, "export the adapter again", required=False)
    if recorded is None and report.is_file():
        note(
            f"{report} records no checksum of the adapter's files (written by an older frod-ds, or edited "
            "since): imported unchecked"
        )
    for name in recorded.files if recorded is not None else ():
        if recorded.changed(peft_dir, name):
            raise PeftInteropError(
                f"{peft_dir / name} was changed after frod export --format peft wrote it (its sha256 is not the one "
                f"{EXPORT_REPORT} records); export the adapter again"
            )
    return FileDigests.of(peft_dir, list(PEFT_FILES)).files


def _fold_support(n: int, idx: Tensor, values: Tensor, lam: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """PEFT's COO (coalesced: duplicates summed) as frod-ds' sorted strictly off-diagonal support; diagonal entries
    are added to λ. Returns ``(flat, values, lam)``."""
    flat, inv = torch.unique(idx[0].long() * n + idx[1].long(), return_inverse=True)  # sorted
    vals = torch.zeros(flat.numel(), dtype=torch.float64).index_add_(0, inv, values.double())
    diag = flat // n == flat % n
    lam = lam.double().clone().index_add_(0, flat[diag] // n, vals[diag])
    return flat[~diag], vals[~diag].float(), lam.float()


def import_peft(
    peft_dir: str | Path, out: str | Path, *, base_model: str | None = None, overwrite: bool = False
) -> dict[str, Any]:
    """Write ``out/factor-store`` and ``out/adapter`` from a stock PEFT FRoD adapter; returns the report (also
    ``out/frod_import.json``). The adapter loads with ``frod_ds.model.adapter.load_frod_model`` and trains further
    with ``model.init_adapter``."""
    with holding(out, IMPORT_KIND, "--out", PeftInteropError):  # a second writer of out is refused at once
        from peft import PeftConfig, get_peft_model

        from frod_ds.io.hf_checkpoint import HFCheckpoint
        from frod_ds.io.model_dir import resolve_model_dir

        peft_dir, out = Path(peft_dir), Path(out)
        cfg = _read_peft_config(peft_dir)
        peft_files = _check_files(peft_dir)
        base = base_model or cfg.get("base_model_name_or_path")
        if not base:
            raise PeftInteropError(f"{peft_dir}/adapter_config.json names no base model; pass --base-model")
        check_out_dir(out, overwrite, IMPORT_KIND, {"--from-peft": peft_dir})
        model_dir = resolve_model_dir(base)
        inputs = {"--from-peft": peft_dir, "the base model": model_dir}
        check_replaceable(out, IMPORT_KIND, inputs, error=PeftInteropError)
        t0 = time.perf_counter()
        with torch.no_grad():
            try:
                model = get_peft_model(load_base(model_dir), PeftConfig.from_pretrained(str(peft_dir)))
            except ValueError as e:  # e.g. target_modules that match nothing in this model
                raise PeftInteropError(f"stock PEFT cannot apply {peft_dir} to {base}: {first_line(e)}") from None
            layers = frod_layers(model)
            if not layers:
                raise PeftInteropError(f"the adapter's target_modules match no linear layer of {base}")
            cats = group_by_leaf(layers)
            lam0 = {m: layer.frod_lambda_l[ADAPTER].detach().clone() for m, layer in layers.items()}
            v_rec = {c: layers[ms[0]].frod_V[ADAPTER].clone() for c, ms in cats.items()}
            try:
                result = model.load_adapter(str(peft_dir), ADAPTER)
            except Exception as e:  # noqa: BLE001 - size mismatch (another architecture), damaged file: both end here
                raise PeftInteropError(
                    f"stock PEFT cannot load {peft_dir} onto {base} ({type(e).__name__}: "
                    f"{first_line(e)}); pass the base model it was trained on"
                ) from None
            missing = [k for k in result.missing_keys if ".frod_" in k]
            if missing:
                raise PeftInteropError(
                    f"{peft_dir}/adapter_model.safetensors lacks {missing[0]} ({len(missing)} tensors)"
                )
            ckpt = HFCheckpoint(model_dir)
            report_cats: dict[str, Any] = {}
            store_cats: dict[str, dict[str, Tensor]] = {}
            adapter: dict[str, Tensor] = {}
            adapter_cats: dict[str, AdapterCategory] = {}
            weight_err = 0.0
            for cat, members in cats.items():
                V = layers[members[0]].frod_V[ADAPTER].float()
                drift = rel_error(V - v_rec[cat].float(), v_rec[cat].float())
                if drift > BASIS_MISMATCH:
                    raise PeftInteropError(
                        f"{peft_dir}: the saved {cat} basis differs from the one stock PEFT computes from {base} "
                        f"(relative difference {drift:.2g}); the adapter was made for another base model"
                    )
                n = V.shape[0]
                u_dtype = ckpt.dtype(members[0] + ".weight")
                idx = layers[members[0]].frod_s_indices[ADAPTER]
                factors = {"V": V}
                for m in members:
                    layer = layers[m]
                    flat, vals, lam = _fold_support(
                        n, idx, layer.frod_lambda_s_values[ADAPTER].detach(), layer.frod_lambda_l[ADAPTER].detach()
                    )
                    if not (torch.isfinite(vals).all() and torch.isfinite(lam).all()):
                        raise PeftInteropError(f"{peft_dir}: {m} has non-finite σ or S values; it cannot be imported")
                    U = layer.frod_U[ADAPTER].float()
                    factors[f"{m}.U"], factors[f"{m}.sigma"] = U, lam0[m].float()
                    adapter[f"{m}.frod_sigma"], adapter[f"{m}.frod_s"] = lam, vals
                    # PEFT's own forward on the identity gives its W'ᵀ; frod-ds' W' from what is written
                    # (U rounded as stored)
                    bias = layer.get_base_layer().bias
                    W_peft = (layer(torch.eye(n)) - (0 if bias is None else bias)).T.float()  # (m, n)
                    W_ours = (U.to(u_dtype).float() @ core_matrix(lam, vals, flat, torch.float32, "cpu")) @ V.T
                    weight_err = max(weight_err, rel_error(W_ours - W_peft, W_peft))
                adapter[support_name(cat)] = torch.stack([flat // n, flat % n])
                adapter_cats[cat] = AdapterCategory(members, n, int(flat.numel()))
                store_cats[cat] = factors
                peft_cat = next(k for k, v in model.base_model.frod_V.items() if v is layers[members[0]].frod_V)
                report_cats[cat] = {
                    "peft_category": peft_cat,
                    "members": len(members),
                    "n": n,
                    "nnz": int(flat.numel()),
                    "basis_drift": drift,
                }
        with building_dir(out, IMPORT_KIND, inputs, PeftInteropError) as tmp:
            errors = _write_store(tmp / STORE_DIR, store_cats, ckpt, base, float(cfg.get("regularization_alpha", 1e-3)))
            store = _open_store(tmp / STORE_DIR)
            report = {
                "format": IMPORT_FORMAT,
                "peft_adapter": str(peft_dir),
                "base_model": base,
                "peft_version": peft_version(),
                "peft_files": peft_files,  # the sha256 of what was imported
                "peft_config": {
                    k: cfg.get(k)
                    for k in (
                        "target_modules",
                        "sparse_rate",
                        "projection_prng_key",
                        "regularization_alpha",
                        "save_projection",
                        "frod_dropout",
                        "layers_to_transform",
                    )
                },
                "categories": report_cats,
                "max_reconstruction_error": max(errors.values()),
                "max_weight_error": weight_err,
                "seconds": round(time.perf_counter() - t0, 2),
            }
            identity = store.identity(sorted(cats))
            for cat, info in adapter_cats.items():  # the store's identity, as training records it
                ident = identity.categories[cat]
                info.v_sha256, info.method, info.u_storage = ident.v_sha256, ident.method, ident.u_storage
            adapter_config = AdapterConfig(
                base_model=str(Path(base).resolve()) if Path(base).exists() else base,
                factor_store=str((out / STORE_DIR).resolve()),
                factor_store_fingerprint=identity.fingerprint,
                tokenizer=None,
                targets=sorted(cats),
                sparsity=float(cfg.get("sparse_rate") or 0.0),
                seed=int(cfg.get("projection_prng_key") or 0),
                pi=identity.pi,
                hjd_dtype=identity.hjd_dtype,
                dtype="float32",
                step=None,
                categories=adapter_cats,
            )
            _write_adapter(tmp / ADAPTER_DIR, adapter, adapter_config)
            (tmp / IMPORT_REPORT).write_text(json.dumps(report, indent=1) + "\n")
        return report


def _open_store(path: Path):
    from frod_ds.model.store_reader import FactorStore

    return FactorStore.open(path)


def _write_adapter(path: Path, tensors: dict[str, Tensor], config: AdapterConfig) -> None:
    from frod_ds.model.adapter import write_adapter

    write_adapter(path, tensors, config)


def _write_store(path: Path, categories: dict[str, dict[str, Tensor]], ckpt, base: str, pi: float) -> dict[str, float]:
    """A complete factor store (one part file per category) of PEFT's factors: a ``store_format.Manifest`` with
    ``CategoryRecord`` checksums as the HJD stage writes them, ``method`` ``"peft"``, marked as frod-ds output.
    ``U`` is stored in the checkpoint's dtype, as the HJD stage does. Returns each member's reconstruction error
    ``‖W_i − U_i diag(λ⁰_i) Vᵀ‖ / ‖W_i‖`` (fp32 U)."""
    import sys

    import safetensors

    import frod_ds
    from frod_ds.formats.checksum import file_crc32, format_crc32
    from frod_ds.formats.factor_store import (
        MANIFEST,
        CategoryRecord,
        Manifest,
        part_file,
        sigma_key,
        u_key,
        v_file,
        v_key,
    )
    from frod_ds.hjd.math import reconstruction_error
    from frod_ds.io.dtypes import dtype_name
    from frod_ds.io.fingerprint import FINGERPRINT_METHOD, weights_fingerprint
    from frod_ds.io.safetensors_io import save_tensors_atomic
    from frod_ds.runtime.atomic import atomic_write_text

    path.mkdir()
    members_all = [m for factors in categories.values() for m in factors if m.endswith(".U")]
    names = [m.removesuffix(".U") + ".weight" for m in members_all]
    errors: dict[str, float] = {}
    records: dict[str, CategoryRecord] = {}
    for cat, factors in categories.items():
        members = [k.removesuffix(".U") for k in factors if k.endswith(".U")]
        u_dtype = ckpt.dtype(members[0] + ".weight")
        V = factors["V"]
        save_tensors_atomic(path / v_file(cat), {v_key(cat): V.contiguous()}, fsync=False)
        part = {}
        err, stored = {}, {}
        for m in members:
            U, sigma = factors[f"{m}.U"], factors[f"{m}.sigma"]
            W = ckpt.get(m + ".weight").double()
            err[m] = reconstruction_error(W, U.double(), sigma.double(), V.double())
            stored[m] = reconstruction_error(W, U.to(u_dtype).double(), sigma.double(), V.double())
            part[u_key(m)], part[sigma_key(m)] = U.to(u_dtype).contiguous(), sigma.contiguous()
        save_tensors_atomic(path / part_file(cat, 0, 0), part, fsync=False)
        errors.update(err)
        files = {v_key(cat): v_file(cat), **{k: part_file(cat, 0, 0) for k in part}}
        records[cat] = CategoryRecord(
            members=members,
            shapes={m: list(ckpt.shape(m + ".weight")) for m in members},
            width=int(V.shape[0]),
            u_dtype=dtype_name(u_dtype),
            complete=True,
            files=files,
            checksums={f: format_crc32(file_crc32(path / f)) for f in sorted(set(files.values()))},
            error=err,
            stored_error=stored,
            max_error=max(err.values()),
            max_stored_error=max(stored.values()),
            world_size=1,
            method="peft",
        )
    manifest = Manifest(
        complete=True,
        completed_categories=list(categories),
        base_model=base,
        fingerprint=weights_fingerprint(ckpt, names),
        fingerprint_method=FINGERPRINT_METHOD,
        model_config=None,
        targets=list(categories),
        pi=pi,
        hjd_dtype="float32",
        u_dtype="auto",
        categories=records,
        world_size=1,
        versions={
            "frod_ds": frod_ds.__version__,
            "torch": torch.__version__,
            "safetensors": safetensors.__version__,
            "python": sys.version.split()[0],
            "peft": peft_version(),
        },
    )
    atomic_write_text(path / MANIFEST, manifest.to_json())
    mark_dir(path, "factor-store", inventory(path))
    return errors
