"""Export a frod-ds adapter as a stock PEFT FRoD adapter (``peft.FrodConfig``, the pinned peft 0.21.2).

PEFT rebuilds ``U`` from its own HJD of the base weights, so each member's core is re-expressed in PEFT's basis
(``V_o = V_p G``): ``M_p = diag(λ⁰_p) G⁻ᵀ diag(σ⁰)⁺ M_o Gᵀ``, with G's entries below τ dropped (per category the
sparsest τ of ``TAUS`` whose update error is within ``tol``). The derivation: docs/export.md.
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
from frod_ds.formats.adapter_dir import s_name, sigma_name, support_name
from frod_ds.formats.building import building_dir
from frod_ds.formats.file_digests import FileDigests
from frod_ds.formats.lease import holding
from frod_ds.formats.ownership import check_replaceable
from frod_ds.interop.peft_common import (
    ADAPTER,
    EXPORT_REPORT,
    PEFT_FILES,
    PeftInteropError,
    check_out_dir,
    first_line,
    frod_layers,
    load_base,
    peft_version,
    rel_error,
)

__all__ = [
    "TAUS",
    "CategoryMapping",
    "export_peft",
    "basis_change",
    "core_in_peft_basis",
    "peft_nnz",
    "shared_sparse_rate",
]

EXPORT_KIND = "peft-export"  # the ownership record's kind (frod_ds.formats.output_dir)
EXPORT_FORMAT = "frod-ds-peft-export"
TAUS = (0.5, 1e-2, 1e-3, 1e-4, 1e-5, 0.0)


@dataclass
class CategoryMapping:
    """How one category was written in PEFT's basis (export report)."""

    tau: float  # G's entries below it dropped (0.5: nearest signed permutation)
    nnz_frod: int  # S entries in the frod-ds adapter
    nnz_mapped: int  # off-diagonal entries of the mapped cores (union over members)
    nnz_peft: int  # after padding to the shared sparse_rate
    max_update_error: float  # max over members of ‖ΔW_p − ΔW_o‖ / ‖ΔW_o‖
    max_weight_error: float  # max over members of ‖W'_p − W'_o‖ / ‖W'_o‖


def basis_change(V_o: Tensor, V_p: Tensor) -> Tensor:
    """``G`` with ``V_o = V_p G`` (n, n)."""
    return torch.linalg.solve(V_p, V_o)


def core_in_peft_basis(M_o: Tensor, sigma0: Tensor, lam0: Tensor, G: Tensor) -> Tensor:
    """``M_p = diag(λ⁰) G⁻ᵀ diag(σ⁰)⁺ M_o Gᵀ`` (n, n): with ``U_p = U_o diag(σ⁰) Gᵀ diag(λ⁰)⁻¹`` (both HJDs factor
    the same ``W``), ``U_p M_p V_pᵀ = U_o M_o V_oᵀ``. Zero σ⁰ entries belong to zero ``U_o`` columns (dropped)."""
    inv0 = torch.where(sigma0 > 0, 1 / sigma0, torch.zeros_like(sigma0))
    return lam0[:, None] * torch.linalg.solve(G.T, (inv0[:, None] * M_o) @ G.T)


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
        weight_err = max(weight_err, rel_error(W_p - W_o, W_o))
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
    ``out/frod_export.json``, with the sha256 of PEFT's files). ``tol``: the largest update error a category's
    mapping may have (module docstring)."""
    with holding(out, EXPORT_KIND, "--out", PeftInteropError):  # a second writer of out is refused at once
        from peft import FrodConfig, get_peft_model

        from frod_ds.model.adapter import adapter_sources

        out = Path(out)
        if not (isinstance(tol, (int, float)) and math.isfinite(tol) and tol > 0):
            raise PeftInteropError(f"--peft-tol must be a number > 0, got {tol!r}")
        given = {"--checkpoint": checkpoint_dir, "--base-model": base_model, "--factor-store": factor_store}
        check_out_dir(out, overwrite, EXPORT_KIND, given)
        tensors, config, model_dir, store = adapter_sources(checkpoint_dir, base_model, factor_store)
        inputs = {"--checkpoint": checkpoint_dir, "the base model": model_dir, "the factor store": store.path}
        check_replaceable(
            out, EXPORT_KIND, inputs, error=PeftInteropError
        )  # before building and checking the PEFT model
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
                model = get_peft_model(load_base(model_dir), peft_cfg)
            except ValueError as e:  # e.g. a target that matches no linear layer of this model
                raise PeftInteropError(f"stock PEFT cannot apply FRoD to {model_dir}: {first_line(e)}") from None
            layers = frod_layers(model)
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
            "peft_version": peft_version(),
            "tol": tol,
            "sparse_rate": rate,
            "categories": {c: asdict(r) for c, r in reports.items()},
            "seconds": round(time.perf_counter() - t0, 2),
        }
        with building_dir(out, EXPORT_KIND, inputs, PeftInteropError) as tmp:
            model.save_pretrained(str(tmp))
            report["files"] = FileDigests.of(tmp, list(PEFT_FILES)).files  # checked by --from-peft
            (tmp / EXPORT_REPORT).write_text(json.dumps(report, indent=1) + "\n")
        return report
