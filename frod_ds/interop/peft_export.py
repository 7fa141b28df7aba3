"""Interop with stock Hugging Face PEFT's FRoD tuner (``peft.FrodConfig``, the pinned peft 0.21.2).

A PEFT FRoD adapter (``adapter_model.safetensors``) holds, per PEFT category ``<pc>`` (named from the module
path: ``self_attn_q_proj``, ``mlp_up_proj``) and member ``<path>``::

    base_model.frod_V.<pc>                          (n, n)    basis, the base model's dtype
    base_model.frod_s_indices.<pc>                  (2, nnz)  int64 (row, col) support of S, shared by <pc>
    base_model.frod_s_size.<pc>                     (2,)      [n, n]
    base_model.model.<path>.frod_lambda_l           (n,)      σ_i (trained)
    base_model.model.<path>.frod_lambda_s_values    (nnz,)    S_i's values

``U_i`` is not stored. ``PeftModel.from_pretrained`` runs PEFT's own HJD on the base weights (fp32 on the CPU:
Householder QR, ``eigh``), computes ``U_i`` and ``λ⁰_i`` from that *recomputed* basis ``V_p``
(``B_i = W_i V_p⁻ᵀ``, ``λ⁰_i`` its column norms) and only then loads the saved ``V``, support, σ and S values over
its own. One ``sparse_rate`` sets every category's ``nnz = int(n²·rate)``.

Export (frod-ds → PEFT). PEFT's ``U_p`` is tied to its own basis, so the adapter must be written in it. Both
HJDs factor the same weights: ``V_o = V_p G`` with ``G`` a signed permutation up to rounding, except in
near-degenerate eigenspaces of ``T_π``, where fp32 eigenvectors are only defined up to a rotation and ``G``
mixes a few columns (all of them where ``T_π ∝ I``, e.g. two layers of a GQA ``k_proj`` with ``m = n/2``). The
core that reproduces member ``i`` exactly in PEFT's basis is::

    M_p = diag(λ⁰_p) G⁻ᵀ diag(σ⁰)⁺ M_o Gᵀ,    M_o = diag(σ_i) + S_i        (U_p M_p V_pᵀ = U_o M_o V_oᵀ)

It equals ``diag λ⁰_p`` at init whatever ``G`` is, but is dense unless ``G`` is a signed permutation. So
``G``'s entries below τ are dropped, τ from ``TAUS`` (0.5: the nearest signed permutation, S keeps its nnz on a
permuted support), taking per category the largest τ whose update error
``‖ΔW_p − ΔW_o‖_F / ‖ΔW_o‖_F`` (``ΔW = W' − W``, each with its own factorisation of ``W``) is at most ``tol``
for every member. The union of the members' off-diagonal entries is the category's support, padded with zeros
to the one ``nnz`` that ``sparse_rate`` gives each width.

Import (PEFT → frod-ds) is exact: the factor store gets PEFT's saved ``V`` and the ``U_i``, ``λ⁰_i`` that
``PeftModel.from_pretrained`` computes on this base model (``λ⁰`` as the store's σ), the adapter gets the trained
λ, S values and PEFT's support. The base model is checked by comparing the saved ``V`` with the one PEFT
recomputes (they differ when the adapter was made for other weights).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from frod_ds.core.layer import core_matrix
from frod_ds.formats.adapter_dir import AdapterCategory, AdapterConfig, s_name, sigma_name, support_name
from frod_ds.runtime.atomic import building_dir, check_out, check_replaceable, mark_dir
from frod_ds.runtime.errors import FrodError

__all__ = [
    "PeftInteropError",
    "CategoryMapping",
    "export_peft",
    "import_peft",
    "basis_change",
    "core_in_peft_basis",
    "peft_nnz",
    "shared_sparse_rate",
    "TAUS",
]

EXPORT_KIND, IMPORT_KIND = "peft-export", "peft-import"  # the markers' kinds (frod_ds.runtime.atomic)
EXPORT_FORMAT = "frod-ds-peft-export"
IMPORT_FORMAT = "frod-ds-peft-import"
EXPORT_REPORT = "frod_export.json"
IMPORT_REPORT = "frod_import.json"
STORE_DIR, ADAPTER_DIR = "factor-store", "adapter"
ADAPTER = "default"  # PEFT's adapter name
TAUS = (0.5, 1e-2, 1e-3, 1e-4, 1e-5, 0.0)
BASIS_MISMATCH = 1e-2  # relative ‖V_saved − V_recomputed‖ above which the adapter is for other weights


class PeftInteropError(FrodError):
    """Bad input to the PEFT export/import; the message says what to change."""


@dataclass
class CategoryMapping:
    """How one category was written in PEFT's basis (export report)."""

    tau: float  # G's entries below it dropped (0.5: nearest signed permutation)
    nnz_frod: int  # S entries in the frod-ds adapter
    nnz_mapped: int  # off-diagonal entries of the mapped cores (union over members)
    nnz_peft: int  # after padding to the shared sparse_rate
    max_update_error: float  # max over members of ‖ΔW_p − ΔW_o‖ / ‖ΔW_o‖
    max_weight_error: float  # max over members of ‖W'_p − W'_o‖ / ‖W'_o‖


# ------------------------------------------------------------------------------------------------ math


def basis_change(V_o: Tensor, V_p: Tensor) -> Tensor:
    """``G`` with ``V_o = V_p G`` (n, n)."""
    return torch.linalg.solve(V_p, V_o)


def core_in_peft_basis(M_o: Tensor, sigma0: Tensor, lam0: Tensor, G: Tensor) -> Tensor:
    """``M_p = diag(λ⁰) G⁻ᵀ diag(σ⁰)⁺ M_o Gᵀ`` (n, n): with ``U_p = U_o diag(σ⁰) Gᵀ diag(λ⁰)⁻¹`` (both HJDs factor
    the same ``W``), ``U_p M_p V_pᵀ = U_o M_o V_oᵀ``. Zero σ⁰ entries belong to zero ``U_o`` columns (dropped)."""
    inv0 = torch.where(sigma0 > 0, 1 / sigma0, torch.zeros_like(sigma0))
    return lam0[:, None] * torch.linalg.solve(G.T, (inv0[:, None] * M_o) @ G.T)


def _rel(num: Tensor, den: Tensor) -> float:
    d = float(torch.linalg.matrix_norm(den))
    n = float(torch.linalg.matrix_norm(num))
    return 0.0 if n == 0 else (math.inf if d == 0 else n / d)


def peft_nnz(n: int, rate: float) -> int:
    """The nnz PEFT's ``_init_frod_projections`` gives an (n, n) category at ``sparse_rate``."""
    off = n * (n - 1)
    nnz = min(int(n * n * rate), off)
    return max(1, nnz) if rate > 0 and off > 0 else nnz


def shared_sparse_rate(needs: dict[str, tuple[int, int]]) -> float:
    """The smallest ``sparse_rate`` (of the ``(k + ½)/n²`` candidates) giving every category ``c`` with
    ``needs[c] = (n, k)`` at least ``k`` entries; PEFT has one rate for all categories."""
    rate = max((k + 0.5) / (n * n) for n, k in needs.values())
    assert all(peft_nnz(n, rate) >= min(k, n * (n - 1)) for n, k in needs.values()), needs
    return rate


def _pad(flat: Tensor, n: int, nnz: int) -> Tensor:
    """``flat`` (sorted off-diagonal row·n+col) with zero-valued positions added, seeded, up to ``nnz``."""
    if flat.numel() >= nnz:
        return flat
    g = torch.Generator().manual_seed(0)
    cand = torch.randperm(n * n, generator=g)
    cand = cand[(cand // n != cand % n) & ~torch.isin(cand, flat)]
    return torch.sort(torch.cat([flat, cand[: nnz - flat.numel()]])).values


# ---------------------------------------------------------------------------------------- output dirs


def _check_out(out: Path, overwrite: bool, kind: str, inputs: dict[str, Any]) -> None:
    """Refuse an existing ``--out`` unless ``overwrite`` and the marker rule (``frod_ds.runtime.atomic``) allow a
    command writing ``kind`` from ``inputs`` to replace it."""
    check_out(out, kind, inputs, overwrite, error=PeftInteropError)


# -------------------------------------------------------------------------------------------- PEFT side


def _peft_version() -> str:
    import peft

    return peft.__version__


def _frod_layers(peft_model) -> dict[str, Any]:
    """``{module path in the HF model: PEFT FRoD layer}``."""
    from peft.tuners.frod import FrodLayer

    out = {}
    for name, module in peft_model.named_modules():
        if isinstance(module, FrodLayer) and ADAPTER in module.frod_lambda_l:
            out[name.removeprefix("base_model.model.")] = module
    return out


def _first_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return next((line for line in lines if "size mismatch" in line), lines[0] if lines else "")


def _load_base(model_dir: Path):
    """The base model in fp32 (PEFT's HJD and U run in fp32 whatever the dtype; the comparison is clean)."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    except (OSError, ValueError) as e:
        raise PeftInteropError(f"cannot load base model {model_dir}: {_first_line(e)}") from None


def _group_by_leaf(layers: dict[str, Any]) -> dict[str, list[str]]:
    """frod-ds categories (the module's last name) of PEFT's layers, members in model order; each must map to
    one PEFT category (one shared ``V``)."""
    cats: dict[str, list[str]] = {}
    for path in layers:
        cats.setdefault(path.rsplit(".", 1)[-1], []).append(path)
    for cat, members in cats.items():
        if len({id(layers[m].frod_V) for m in members}) != 1:
            raise PeftInteropError(
                f"PEFT splits the {cat} modules over several bases; frod-ds shares one basis per "
                "module name, so this adapter cannot be expressed"
            )
    return cats


# ---------------------------------------------------------------------------------------------- export


def _update_error(dW_p: Tensor, dW_o: Tensor, W_o: Tensor) -> float:
    """``‖ΔW_p − ΔW_o‖ / ‖ΔW_o‖``, the denominator floored at 1e-6·‖W'_o‖ (an unchanged member is not 0/0)."""
    den = max(float(torch.linalg.matrix_norm(dW_o)), 1e-6 * float(torch.linalg.matrix_norm(W_o)))
    return float(torch.linalg.matrix_norm(dW_p - dW_o)) / den


def _map_category(
    members: list[str],
    tensors: dict[str, Tensor],
    support: Tensor,
    n: int,
    store,
    layers,
    tol: float,
    device: torch.device,
    quant: str = "none",
) -> tuple[CategoryMapping, dict[str, tuple[Tensor, Tensor, Tensor]]]:
    """Choose τ and map every member's core into PEFT's basis; returns the report and ``{member: (λ_p (n,),
    flat off-diagonal positions, their values)}`` (fp32, CPU). The reported errors compare PEFT's weights with
    the trained model's: ``Ũ_i M_i Vᵀ`` with ``Ũ_i`` the dequantized ``U_i`` when training held it quantized
    (``quant``), which PEFT, building ``U`` from the dense base, cannot reproduce."""
    from frod_ds.interop.hf_export import _frozen_U

    f64 = torch.float64
    V_o = store.load_V(store.category_of(members[0]), f64, device)
    V_p = layers[members[0]].frod_V[ADAPTER].to(device, f64)
    G = basis_change(V_o, V_p)
    data = {}
    for m in members:
        data[m] = (
            store.load_U(m, f64, device),
            store.load_sigma(m, f64, device),
            core_matrix(tensors[sigma_name(m)], tensors[s_name(m)], support, f64, device),
            layers[m].frod_U[ADAPTER].to(device, f64),
            layers[m].frod_lambda_l[ADAPTER].detach().to(device, f64),
        )
    best: tuple[float, float, Tensor] | None = None  # (worst update error, tau, G with τ applied)
    for tau in TAUS:
        Gs = G if tau == 0 else torch.where(G.abs() >= tau, G, torch.zeros_like(G))
        if torch.linalg.matrix_rank(Gs) < n:
            continue
        worst = 0.0
        for U_o, s0, M_o, U_p, lam0 in data.values():
            M_p = core_in_peft_basis(M_o, s0, lam0, Gs)
            dW_o = (U_o @ (M_o - torch.diag(s0))) @ V_o.T  # (m, n)
            dW_p = (U_p @ (M_p - torch.diag(lam0))) @ V_p.T
            worst = max(worst, _update_error(dW_p, dW_o, (U_o @ M_o) @ V_o.T))
            if worst > tol:
                break  # this τ fails; a partial worst is a lower bound, enough to rank it below any that passes
        if best is None or worst < best[0]:
            best = (worst, tau, Gs)
        if worst <= tol:
            break
    assert best is not None, "G = V_p⁻¹V_o is singular: a basis is not invertible"
    _, tau, Gs = best
    worst, weight_err, nnz, out = 0.0, 0.0, set(), {}
    for m, (U_o, s0, M_o, U_p, lam0) in data.items():
        M_p = core_in_peft_basis(M_o, s0, lam0, Gs)  # (n, n)
        U_t = U_o if quant == "none" else _frozen_U(store, m, quant, device).to(f64)  # (m, n) as trained
        W_o, W_p = (U_t @ M_o) @ V_o.T, (U_p @ M_p) @ V_p.T
        worst = max(worst, _update_error(W_p - (U_p * lam0) @ V_p.T, W_o - (U_o * s0) @ V_o.T, W_o))
        weight_err = max(weight_err, _rel(W_p - W_o, W_o))
        off = (M_p - torch.diag(torch.diagonal(M_p))).flatten()
        flat = torch.nonzero(off.abs() > 1e-12 * M_p.abs().max()).flatten()
        nnz.update(flat.tolist())
        out[m] = (torch.diagonal(M_p).float().cpu(), flat.cpu(), off[flat].float().cpu())
    return CategoryMapping(tau, int(support.numel()), len(nnz), 0, worst, weight_err), out


def _tol_that_passes(err: float) -> float:
    """``err`` rounded up to two significant digits (a ``--peft-tol`` that accepts it)."""
    step = 10.0 ** (math.floor(math.log10(err)) - 1)
    return math.ceil(err / step * (1 - 1e-12)) * step


def _check_tol(reports: dict[str, CategoryMapping], tol: float, quant: str) -> None:
    """``PeftInteropError`` naming the worst category, its measured update error and the ``--peft-tol`` that
    would pass, when a category's mapping is worse than ``tol``: PEFT would load a different model, exit 0."""
    cat, worst = max(((c, r.max_update_error) for c, r in reports.items()), key=lambda cw: cw[1])
    if not worst > tol:  # a NaN error fails too
        return
    why = f" (training held U {quant}-quantized; stock PEFT rebuilds U from the dense base)" if quant != "none" else ""
    accept = f"pass --peft-tol {_tol_that_passes(worst):.2g} to accept that, or " if math.isfinite(worst) else ""
    raise PeftInteropError(
        f"--peft-tol {tol:g} cannot be met: the {cat} updates in PEFT's basis differ from the "
        f"trained ones by {worst:.2e} (relative){why}; {accept}export with --format hf (exact); "
        "nothing was written"
    )


def export_peft(
    checkpoint_dir: str | Path,
    out: str | Path,
    *,
    base_model: str | None = None,
    factor_store: str | None = None,
    tol: float = 1e-3,
    device: str | torch.device = "cpu",
    overwrite: bool = False,
) -> dict[str, Any]:
    """Write adapter ``checkpoint_dir`` as a stock PEFT FRoD adapter in ``out``; returns the report (also written to
    ``out/frod_export.json``). ``tol``: the largest update error a category's mapping may have (module docstring)."""
    from peft import FrodConfig, get_peft_model

    from frod_ds.model.adapter import adapter_sources

    out = Path(out)
    if not (isinstance(tol, (int, float)) and math.isfinite(tol) and tol > 0):
        raise PeftInteropError(f"--peft-tol must be a number > 0, got {tol!r}")
    _check_out(out, overwrite, EXPORT_KIND, {"--checkpoint": checkpoint_dir})
    tensors, config, model_dir, store = adapter_sources(checkpoint_dir, base_model, factor_store)
    inputs = {"--checkpoint": checkpoint_dir, "the base model": model_dir, "the factor store": store.path}
    check_replaceable(out, EXPORT_KIND, inputs, error=PeftInteropError)  # before building and checking the PEFT model
    bad = [k for k, t in tensors.items() if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:
        raise PeftInteropError(f"adapter {checkpoint_dir} has non-finite values in {bad[0]}; it cannot be exported")
    if config.quantize_base:
        raise PeftInteropError(
            f"adapter {checkpoint_dir} was trained with model.quantize_base (the untargeted linears "
            f"{config.frozen_quant}-quantized), which a PEFT adapter cannot express: PEFT loads them "
            "from the dense base model; export with --format hf instead"
        )
    categories = config.categories
    t0 = time.perf_counter()
    peft_cfg = FrodConfig(
        target_modules=sorted(categories),
        sparse_rate=float(config.sparsity or 0.02),
        regularization_alpha=store.pi,
        progressbar=False,
        task_type="CAUSAL_LM",
    )
    with torch.no_grad():
        try:
            model = get_peft_model(_load_base(model_dir), peft_cfg)
        except ValueError as e:  # e.g. a target that matches no linear layer of this model
            raise PeftInteropError(f"stock PEFT cannot apply FRoD to {model_dir}: {_first_line(e)}") from None
        layers = _frod_layers(model)
        members = {m for info in categories.values() for m in info.members}
        if set(layers) != members:
            extra = sorted(set(layers) ^ members)
            raise PeftInteropError(
                f"PEFT targets {len(layers)} modules, the adapter {len(members)} (first difference "
                f"{extra[0]!r}); the base model does not match the adapter's"
            )
        device = torch.device(device)
        reports, mapped = {}, {}
        for cat, info in categories.items():
            n = info.n
            rows, cols = tensors[support_name(cat)].long()
            reports[cat], mapped[cat] = _map_category(
                info.members, tensors, rows * n + cols, n, store, layers, tol, device, config.frozen_quant
            )
        _check_tol(reports, tol, config.frozen_quant)
        rate = shared_sparse_rate({c: (i.n, reports[c].nnz_mapped) for c, i in categories.items()})
        for cat, info in categories.items():
            n = info.n
            union = torch.unique(torch.cat([flat for _, flat, _ in mapped[cat].values()]))  # sorted
            flat = _pad(union, n, peft_nnz(n, rate))
            reports[cat].nnz_peft = int(flat.numel())
            layers[info.members[0]].frod_s_indices[ADAPTER] = torch.stack([flat // n, flat % n])  # the category's
            for m, (lam, nz, vals) in mapped[cat].items():
                values = torch.zeros(n * n).index_copy_(0, nz, vals)[flat]  # (nnz_peft,)
                layers[m].frod_lambda_l[ADAPTER].data = lam
                layers[m].frod_lambda_s_values[ADAPTER] = torch.nn.Parameter(values)
    saved_cfg = model.peft_config[ADAPTER]
    saved_cfg.sparse_rate, saved_cfg.base_model_name_or_path = rate, config.base_model
    report = {
        "format": EXPORT_FORMAT,
        "adapter": str(checkpoint_dir),
        "base_model": config.base_model,
        "factor_store": str(store.path),
        "factor_store_fingerprint": store.fingerprint,
        "step": config.step,
        "peft_version": _peft_version(),
        "tol": tol,
        "sparse_rate": rate,
        "categories": {c: asdict(r) for c, r in reports.items()},
        "seconds": round(time.perf_counter() - t0, 2),
    }
    with building_dir(out, EXPORT_KIND, inputs, PeftInteropError) as tmp:
        model.save_pretrained(str(tmp))
        (tmp / EXPORT_REPORT).write_text(json.dumps(report, indent=1) + "\n")
    return report


# ---------------------------------------------------------------------------------------------- import


def _read_peft_config(peft_dir: Path) -> dict[str, Any]:
    cfg_path = peft_dir / "adapter_config.json"
    if not peft_dir.is_dir() or not cfg_path.is_file():
        raise PeftInteropError(f"--from-peft {peft_dir} is not a PEFT adapter directory (no adapter_config.json)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PeftInteropError(f"{cfg_path} is corrupt ({e}); save the adapter again") from None
    if not isinstance(cfg, dict) or cfg.get("peft_type") != "FROD":
        kind = cfg.get("peft_type") if isinstance(cfg, dict) else None
        raise PeftInteropError(f"--from-peft {peft_dir} is a PEFT {kind} adapter, not a FRoD one (peft_type FROD)")
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
    from peft import PeftConfig, get_peft_model

    from frod_ds.io.hf_checkpoint import HFCheckpoint, resolve_model_dir

    peft_dir, out = Path(peft_dir), Path(out)
    cfg = _read_peft_config(peft_dir)
    base = base_model or cfg.get("base_model_name_or_path")
    if not base:
        raise PeftInteropError(f"{peft_dir}/adapter_config.json names no base model; pass --base-model")
    _check_out(out, overwrite, IMPORT_KIND, {"--from-peft": peft_dir})
    model_dir = resolve_model_dir(base)
    inputs = {"--from-peft": peft_dir, "the base model": model_dir}
    check_replaceable(out, IMPORT_KIND, inputs, error=PeftInteropError)
    t0 = time.perf_counter()
    with torch.no_grad():
        try:
            model = get_peft_model(_load_base(model_dir), PeftConfig.from_pretrained(str(peft_dir)))
        except ValueError as e:  # e.g. target_modules that match nothing in this model
            raise PeftInteropError(f"stock PEFT cannot apply {peft_dir} to {base}: {_first_line(e)}") from None
        layers = _frod_layers(model)
        if not layers:
            raise PeftInteropError(f"the adapter's target_modules match no linear layer of {base}")
        cats = _group_by_leaf(layers)
        lam0 = {m: layer.frod_lambda_l[ADAPTER].detach().clone() for m, layer in layers.items()}
        v_rec = {c: layers[ms[0]].frod_V[ADAPTER].clone() for c, ms in cats.items()}
        try:
            result = model.load_adapter(str(peft_dir), ADAPTER)
        except Exception as e:  # noqa: BLE001 - size mismatch (another architecture), damaged file: both end here
            raise PeftInteropError(
                f"stock PEFT cannot load {peft_dir} onto {base} ({type(e).__name__}: "
                f"{_first_line(e)}); pass the base model it was trained on"
            ) from None
        missing = [k for k in result.missing_keys if ".frod_" in k]
        if missing:
            raise PeftInteropError(f"{peft_dir}/adapter_model.safetensors lacks {missing[0]} ({len(missing)} tensors)")
        ckpt = HFCheckpoint(model_dir)
        report_cats: dict[str, Any] = {}
        store_cats: dict[str, dict[str, Tensor]] = {}
        adapter: dict[str, Tensor] = {}
        adapter_cats: dict[str, AdapterCategory] = {}
        weight_err = 0.0
        for cat, members in cats.items():
            V = layers[members[0]].frod_V[ADAPTER].float()
            drift = _rel(V - v_rec[cat].float(), v_rec[cat].float())
            if drift > BASIS_MISMATCH:
                raise PeftInteropError(
                    f"{peft_dir}: the saved {cat} basis differs from the one stock PEFT computes from {base} (relative "
                    f"difference {drift:.2g}); the adapter was made for another base model"
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
                weight_err = max(weight_err, _rel(W_ours - W_peft, W_peft))
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
            "peft_version": _peft_version(),
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
            info.v_sha256, info.method = identity.categories[cat].v_sha256, identity.categories[cat].method
        adapter_config = AdapterConfig(
            base_model=str(Path(base).resolve()) if Path(base).exists() else base,
            factor_store=str((out / STORE_DIR).resolve()),
            factor_store_fingerprint=identity.fingerprint,
            tokenizer=None,
            targets=sorted(cats),
            sparsity=float(cfg.get("sparse_rate") or 0.0),
            seed=int(cfg.get("projection_prng_key") or 0),
            pi=identity.pi,
            dtype="float32",
            step=None,
            categories=adapter_cats,
        )
        _write_adapter(tmp / ADAPTER_DIR, adapter, adapter_config)
        (tmp / IMPORT_REPORT).write_text(json.dumps(report, indent=1) + "\n")
    return report


# ------------------------------------------------------------------------- frod-ds formats (one place each)


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
            "peft": _peft_version(),
        },
    )
    atomic_write_text(path / MANIFEST, manifest.to_json())
    mark_dir(path, "factor-store")
    return errors
