"""The FRoD product ``y = U (diag σ + S) Vᵀ x + b`` as autograd Functions, one per ordering (spec §2).

Plain autograd would keep every member's dense ``M = diag σ + S`` (n, n) and, under ZeRO-3, views of the
gathered ``U`` and ``V`` until the backward. ``FRoDTokens`` saves only ``z = Vᵀx`` (or ``x``) and the Parameters,
rebuilds ``M`` in the backward and takes σ and S gradients on the support only; ``FRoDWeight`` (many tokens:
``W = U M Vᵀ`` first) saves ``x`` and ``W``. ``∂S`` is exact either ``dense`` (one GEMM) or ``sampled`` (row
gathers). The forward and backward products with their FLOPs: docs/layer.md#the-two-orders.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import Tensor

from frod_ds.core.quant import frozen_dense

__all__ = [
    "core_matrix",
    "core_matrix_at",
    "core_positions",
    "spans_of",
    "sampled_product",
    "support_grads",
    "FRoDTokens",
    "FRoDWeight",
]

SAMPLED_CHUNK_ELEMS = 1 << 25  # elements of one gathered (chunk, T) block in the sampled ∂S product


def core_matrix(
    sigma: Tensor, s_values: Tensor, support_flat: Tensor, dtype: torch.dtype, device: torch.device | str
) -> Tensor:
    """Dense ``diag σ + S`` (n, n); ``S``'s values at the flat (row·n + col) ``support_flat`` positions."""
    return core_matrix_at(sigma, s_values, core_positions(sigma.shape[0], support_flat, device), dtype)


def core_positions(n: int, support_flat: Tensor, device: torch.device | str) -> Tensor:
    """The flat positions of ``diag σ + S`` in an (n, n) matrix on ``device``: the diagonal's, then the support's
    ((n + nnz,), int64)."""
    return torch.cat([torch.arange(0, n * n, n + 1, device=device), support_flat.to(device)])


def core_matrix_at(sigma: Tensor, s_values: Tensor, positions: Tensor, dtype: torch.dtype) -> Tensor:
    """``core_matrix`` given the flat positions of σ then S, ``positions`` (n + nnz,) on the device it is built on
    (``SparseSupport.core_positions_on`` caches them: the Functions build ``M`` twice a step per member)."""
    n = sigma.shape[0]
    vals = torch.cat([sigma, s_values]).to(device=positions.device, dtype=dtype)  # (n + nnz,)
    return torch.zeros(n * n, dtype=dtype, device=positions.device).scatter_(0, positions, vals).view(n, n)


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)  # fp32 sums for bf16/fp16, fp64 stays fp64


def sampled_product(a: Tensor, b: Tensor, rows: Tensor, cols: Tensor, chunk_elems: int = SAMPLED_CHUNK_ELEMS) -> Tensor:
    """``out[k] = Σ_t a[t, rows[k]] · b[t, cols[k]]``: the (rows, cols) entries of ``aᵀ b`` without forming it.

    ``a``, ``b``: (T, n); ``rows``, ``cols``: (nnz,) int64. Returns (nnz,) in fp32 (fp64 for fp64 inputs).
    """
    T = a.shape[0]
    acc = _accumulation_dtype(a.dtype)
    aT, bT = a.t().contiguous(), b.t().contiguous()  # (n, T): each support entry reads two contiguous rows
    out = torch.empty(rows.numel(), dtype=acc, device=a.device)  # (nnz,)
    step = max(1, chunk_elems // max(T, 1))
    for s in range(0, rows.numel(), step):
        out[s : s + step] = (aT[rows[s : s + step]] * bT[cols[s : s + step]]).sum(1, dtype=acc)  # (chunk, T) → (chunk,)
    return out


def support_grads(a: Tensor, b: Tensor, support, dense: bool) -> tuple[Tensor, Tensor]:
    """``(∂σ, ∂S values)`` for ``∂M = aᵀ b`` (a, b: (K, n)): the diagonal and the support entries of ``aᵀ b``."""
    device = a.device
    if dense:
        G = a.t() @ b  # (n, n), transient
        return G.diagonal().clone(), G.view(-1)[support.on(device)]  # copies: G is freed on return
    rows, cols = support.rows_cols_on(device)
    g_sigma = (a * b).sum(0, dtype=_accumulation_dtype(a.dtype))  # (n,)
    return g_sigma, sampled_product(a, b, rows, cols)


def autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    """Autocast disabled for ``device_type``: ``torch.autocast(enabled=False)`` where autocast is on, else nothing
    (entering and leaving an autocast context is host work, twice per FRoD layer and pass)."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def _as(t: Tensor, dtype: torch.dtype) -> Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def member_of(U: Tensor, span: tuple[int, int, int, int] | None) -> Tensor:
    """``U`` itself (``span`` None), or the ``(m, n)`` view of elements ``[a, b)`` of a flat holder Parameter ``U``
    (``span = (a, b, m, n)``, ``frod_ds.core.layer.FRoDFrozen``). The Functions take the holder and the span, keep
    the holder for the backward and take the view again there: a kept view would hold the gathered buffer alive
    after ZeRO-3 released the layer (it only swaps the Parameter's ``data``)."""
    if span is None:
        return U
    a, b, m, n = span
    return U[a:b].view(m, n)


Held = tuple[Tensor, tuple[int, int], Tensor, tuple[int, int]]  # σ holder, this layer's span, S holder, its span


def _kept_trainables(sigma: Tensor, s_values: Tensor, held: Held | None) -> tuple[Tensor, Tensor]:
    """What the backward keeps of σ and S: the tensors themselves, or (``held``) the Parameters of a decoder layer's
    ``FRoDTrainables`` that they are spans of, never the views (``member_of``'s reason)."""
    return (sigma, s_values) if held is None else (held[0], held[2])


def spans_of(sigma: Tensor, s_values: Tensor, held: Held | None) -> tuple[Tensor, Tensor]:
    """σ and S (this layer's) from the tensors themselves, or (``held``) from its decoder layer's holders: what
    ``_kept_trainables`` kept, or the holders before a forward."""
    if held is None:
        return sigma, s_values
    (a, b), (c, d) = held[1], held[3]
    return sigma[a:b], s_values[c:d]


class FRoDTokens(torch.autograd.Function):
    """``y = U (diag σ + S) Vᵀ x + b`` for ``x`` (T, n) in the token order, saving ``z`` or ``x`` but never ``M``.

    ``U``, ``V`` and ``bias`` are frozen Parameters passed whole: the Function keeps references to the
    Parameter objects (not views or casts), so under ZeRO-3 the backward reads what the module's pre-backward
    hook has gathered again. ``u_span`` (a, b, m, n): ``U`` is a flat holder and this layer's U is that view of it
    (``member_of``), taken in each pass; ``held``: σ and S are spans of a decoder layer's Parameters, which are what
    is kept (``_kept_trainables``). All arithmetic runs in ``x``'s dtype; σ and S gradients come back in theirs.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        sigma: Tensor,
        s_values: Tensor,
        U: Tensor,
        V: Tensor,
        bias: Tensor | None,
        support,
        save_z: bool,
        dense_grad: bool,
        u_span: tuple[int, int, int, int] | None = None,
        held: Held | None = None,
    ) -> Tensor:
        assert not (U.requires_grad or V.requires_grad or (bias is not None and bias.requires_grad)), (
            "FRoDTokens takes no gradient of U, V or the bias; FRoDLinear uses plain autograd when they train"
        )
        dt, device = x.dtype, x.device
        M = core_matrix_at(sigma, s_values, support.core_positions_on(device), dt)  # (n, n), dropped after the forward
        z = x @ _as(V, dt)  # (T, n)
        h = z @ M.t()  # (T, n)
        Uc = frozen_dense(member_of(U, u_span), dt)
        y = h @ Uc.t() if bias is None else torch.addmm(_as(bias, dt), h, Uc.t())  # (T, m)
        ctx.save_for_backward(z if save_z else x, *_kept_trainables(sigma, s_values, held), U, V)
        ctx.support, ctx.save_z, ctx.dense_grad, ctx.u_span, ctx.held = support, save_z, dense_grad, u_span, held
        return y

    @staticmethod
    def backward(ctx: Any, g_y: Tensor):
        saved, sigma, s_values, U, V = ctx.saved_tensors
        U, (sigma, s_values) = member_of(U, ctx.u_span), spans_of(sigma, s_values, ctx.held)
        dt, device = saved.dtype, saved.device
        need_x, need_sigma, need_s = ctx.needs_input_grad[:3]
        g_x = g_sigma = g_s = None
        with autocast_off(device.type):
            g_y = _as(g_y, dt)
            Vc = _as(V, dt)
            M = core_matrix_at(sigma.detach(), s_values.detach(), ctx.support.core_positions_on(device), dt)  # rebuilt
            g_h = g_y @ frozen_dense(U, dt)  # (T, n)
            if need_x:
                g_x = (g_h @ M) @ Vc.t()  # (T, n)
            if need_sigma or need_s:
                z = saved if ctx.save_z else saved @ Vc  # (T, n)
                gs, gS = support_grads(g_h, z, ctx.support, ctx.dense_grad)
                g_sigma = gs.to(sigma.dtype) if need_sigma else None
                g_s = gS.to(s_values.dtype) if need_s else None
        return g_x, g_sigma, g_s, None, None, None, None, None, None, None, None


class FRoDWeight(torch.autograd.Function):
    """``y = x (U M Vᵀ)ᵀ + b`` for ``x`` (T, n) in the weight order, saving ``x`` and ``W = U M Vᵀ`` (m, n).

    Same contract as ``FRoDTokens``: Parameter objects, never views of them, are kept for the backward (``u_span``
    as there).
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        sigma: Tensor,
        s_values: Tensor,
        U: Tensor,
        V: Tensor,
        bias: Tensor | None,
        support,
        dense_grad: bool,
        u_span: tuple[int, int, int, int] | None = None,
        held: Held | None = None,
    ) -> Tensor:
        assert not (U.requires_grad or V.requires_grad or (bias is not None and bias.requires_grad)), (
            "FRoDWeight takes no gradient of U, V or the bias; FRoDLinear uses plain autograd when they train"
        )
        dt, device = x.dtype, x.device
        M = core_matrix_at(sigma, s_values, support.core_positions_on(device), dt)  # (n, n)
        W = (frozen_dense(member_of(U, u_span), dt) @ M) @ _as(V, dt).t()  # (m, n)
        y = x @ W.t() if bias is None else torch.addmm(_as(bias, dt), x, W.t())  # (T, m)
        ctx.save_for_backward(x, W, *_kept_trainables(sigma, s_values, held), U, V)
        ctx.support, ctx.dense_grad, ctx.u_span, ctx.held = support, dense_grad, u_span, held
        return y

    @staticmethod
    def backward(ctx: Any, g_y: Tensor):
        x, W, sigma, s_values, U, V = ctx.saved_tensors
        U, (sigma, s_values) = member_of(U, ctx.u_span), spans_of(sigma, s_values, ctx.held)
        dt = x.dtype
        need_x, need_sigma, need_s = ctx.needs_input_grad[:3]
        g_x = g_sigma = g_s = None
        with autocast_off(x.device.type):
            g_y = _as(g_y, dt)
            if need_x:
                g_x = g_y @ W  # (T, n)
            if need_sigma or need_s:
                g_A = (g_y.t() @ x) @ _as(V, dt)  # (m, n): ∂(U M) = ∂W V
                gs, gS = support_grads(frozen_dense(U, dt), g_A, ctx.support, ctx.dense_grad)  # ∂M = Uᵀ ∂(U M)
                g_sigma = gs.to(sigma.dtype) if need_sigma else None
                g_s = gS.to(s_values.dtype) if need_s else None
        return g_x, g_sigma, g_s, None, None, None, None, None, None, None
