"""``frod hjd --verify``: re-check a factor store against its base checkpoint."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from frod_ds.formats.factor_store import member_of_key, sigma_key, u_key, v_key
from frod_ds.hjd.math import reconstruction_error, reconstruction_tol
from frod_ds.io.hf_checkpoint import HFCheckpoint
from frod_ds.io.model_dir import resolve_model_dir
from frod_ds.model.store_reader import FactorStore, check_store_matches
from frod_ds.runtime.errors import StoreError

__all__ = ["verify_store"]


def _check_files(store: FactorStore, category: str) -> tuple[list[str], bool]:
    """Every file the manifest lists for ``category`` has its checksum and holds its keys with the manifest's
    shapes. Returns ``(problems, readable)``: ``readable`` is False when a file cannot be read at all."""
    from safetensors import SafetensorError, safe_open

    record = store.record(category)
    n, problems, readable = record.width, [], True
    for fname in sorted(set(record.files.values())):
        keys = [k for k, f in record.files.items() if f == fname]
        try:
            with safe_open(str(store.path / fname), framework="pt") as f:
                have = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
        except (SafetensorError, OSError) as e:
            problems.append(f"{category}: {fname} is missing or unreadable ({e})")
            readable = False
            continue
        checksum = store.checksum_problem(store.path / fname)
        if checksum is not None:
            problems.append(f"{category}: {checksum}")
        for key in keys:
            want = (
                [n, n]
                if key == v_key(category)
                else [n]
                if key.endswith(".sigma")
                else record.shapes[member_of_key(key)]
            )
            if key.endswith(".U") and record.u_quant is not None:
                want = [store.u_spec(member_of_key(key)).nbytes]  # the quantized blob, (nbytes,) uint8
            if have.get(key) != list(want):
                problems.append(f"{category}: {key} in {fname} has shape {have.get(key)}, manifest says {want}")
                readable = False
    return problems, readable


def _read(store: FactorStore, key: str, dtype: torch.dtype | None, device: str | torch.device) -> torch.Tensor:
    """One tensor straight from its file, checksum or not (a corrupt file's reconstruction is still measured)."""
    from safetensors import safe_open

    with safe_open(str(store.file_of(key)), framework="pt", device="cpu") as f:
        t = f.get_tensor(key)
    return t.to(device=device, dtype=dtype or t.dtype)


def verify_store(
    store_dir: str | Path,
    model: str,
    samples: int = 2,
    seed: int = 0,
    tol: float | None = None,
    device: str | torch.device = "cpu",
) -> list[str]:
    """Re-check a store against a checkpoint; returns the problems found (empty: verified).

    The store is complete and of these weights (``check_store_matches``), every file has its recorded CRC-32 and
    the manifest's keys and shapes, and for ``samples`` members per category (seeded) ``‖W_i − U_i diag(σ_i) Vᵀ‖_F /
    ‖W_i‖_F`` is within ``tol`` (default: ``frod_ds.hjd.math.RECONSTRUCTION_TOL`` of U's dtype or quantization,
    the tolerance HJD itself refuses a store beyond). ``FrodError`` when the store or the model cannot be opened at all.
    """
    store = FactorStore.open(store_dir, allow_incomplete=True)
    ckpt = HFCheckpoint(resolve_model_dir(model))
    problems: list[str] = []
    if not store.complete:
        problems.append(f"factor store {store.path} is incomplete (done: {store.completed_categories})")
    try:
        check_store_matches(store, ckpt)
    except StoreError as e:
        return problems + [str(e)]
    rng = random.Random(seed)
    for category, members in store.categories.items():
        if category not in store.completed_categories:
            continue
        file_problems, readable = _check_files(store, category)
        problems += file_problems
        if not readable:
            continue  # missing, unreadable or misshapen: nothing to reconstruct from
        V = _read(store, v_key(category), torch.float64, device)  # (n, n)
        for member in rng.sample(members, min(samples, len(members))):
            U = _read(store, u_key(member), None, device)  # (m, n), stored dtype; a quantized U's blob
            spec = store.u_spec(member)
            if spec is not None:
                U = spec.unpack(U, torch.float32)  # (m, n) dequantized
            limit = tol if tol is not None else reconstruction_tol(U.dtype, spec.kind if spec is not None else "none")
            W = ckpt.get(member + ".weight", device).double()
            e = reconstruction_error(W, U.double(), _read(store, sigma_key(member), torch.float64, device), V)
            if not e <= limit:
                problems.append(f"{member}: reconstruction error {e:.3e} > tolerance {limit:.1e}")
    return problems
