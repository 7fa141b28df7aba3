"""How far a FRoD update rotates the weight: ``tan α = ‖ΔW_off‖_F / ‖ΔW_on‖_F`` per category (FRoD paper §3).

``ΔW_on = U_i diag(σ_i − σ⁰_i) Vᵀ`` (the rescaling of the shared directions) and ``ΔW_off = U_i S_i Vᵀ`` (S starts at
zero, so S itself is its update). Per category (``q_proj``, ...) the squared norms are summed over the layers before
the ratio, so a category's value weighs each layer by its update. frod-ds' layers give their norms themselves
(``FRoDLinear.update_norms_sq``); stock PEFT's FRoD layers are read through the same formula from their ``frod_U``,
``frod_V``, λ (= σ) and COO S. σ⁰ is each model's own at initialisation (``initial_sigmas`` before training): the
injected PEFT model starts from frod-ds' σ⁰, stock PEFT from its own λ⁰.
"""

from __future__ import annotations

import torch
from torch import nn

from frod_ds.core.layer import FRoDLinear, tan_alpha

__all__ = ["initial_sigmas", "rotation_by_category"]


def _category(path: str) -> str:
    return path.rsplit(".", 1)[-1]


def _strip(path: str) -> str:
    """A module path without PEFT's wrapper prefix, so both implementations name a layer alike."""
    return path.removeprefix("base_model.model.")


def _is_peft_frod(m: nn.Module) -> bool:
    return "default" in getattr(m, "frod_lambda_s_values", {})


def initial_sigmas(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{module path: σ⁰ (n,)}`` of a frod-ds or stock PEFT FRoD model at initialisation (CPU copies; PEFT: λ⁰)."""
    out = {}
    for n, m in model.named_modules():
        if isinstance(m, FRoDLinear):
            out[_strip(n)] = m.frod_sigma.detach().to("cpu", copy=True)
        elif _is_peft_frod(m):
            out[_strip(n)] = m.frod_lambda_l["default"].detach().to("cpu", copy=True)
    return out


@torch.no_grad()
def _peft_norms_sq(layer: nn.Module, sigma0: torch.Tensor) -> tuple[float, float]:
    """``(‖ΔW_on‖², ‖ΔW_off‖²)`` of one stock PEFT FRoD layer (adapter ``default``), in fp32, on the device of its
    trainable λ (PEFT keeps the frozen projections on the host)."""
    lam = layer.frod_lambda_l["default"].float()  # (n,)
    dev = lam.device
    U = layer.frod_U["default"].to(dev, torch.float32)  # (m, n)
    V = layer.frod_V["default"].to(dev, torch.float32)  # (n, n)
    idx = layer.frod_s_indices["default"].to(dev, torch.long)  # (2, nnz)
    n = V.shape[0]
    S = torch.zeros(n, n, device=dev).index_put_(
        (idx[0], idx[1]), layer.frod_lambda_s_values["default"].float(), accumulate=True
    )  # (n, n)
    on = torch.linalg.matrix_norm((U * (lam - sigma0.to(dev))) @ V.T) ** 2
    off = torch.linalg.matrix_norm((U @ S) @ V.T) ** 2
    return float(on), float(off)


@torch.no_grad()
def rotation_by_category(model: nn.Module, sigma0: dict[str, torch.Tensor]) -> dict[str, float] | None:
    """``{category: tan α}`` of a frod-ds or stock PEFT FRoD model; None for a model with neither layer kind."""
    sums: dict[str, list[float]] = {}
    for name, m in model.named_modules():
        path = _strip(name)
        if isinstance(m, FRoDLinear):
            on, off = m.update_norms_sq(sigma0[path])
        elif _is_peft_frod(m):
            on, off = _peft_norms_sq(m, sigma0[path])
        else:
            continue
        acc = sums.setdefault(_category(path), [0.0, 0.0])
        acc[0] += on
        acc[1] += off
    return {c: tan_alpha(on, off) for c, (on, off) in sorted(sums.items())} or None
