"""Hierarchical joint decomposition (HJD), FRoD paper §3.1, spec §1: pure, single-process math.

For one category, ``W = [W_1; …; W_L] = Q R`` (thin QR), ``T_pi = (1/L) Σ_i (Q_iᵀQ_i + πI)⁻¹ = Z Λ Zᵀ``,
``V = Rᵀ Z`` completed to ``(n, n)``, ``B_i = Q_i Z``, ``σ_i = ‖B_i[:, j]‖``, ``U_i = B_i diag(σ_i)⁻¹``; then
``W_i = U_i diag(σ_i) Vᵀ``. The Gram route gets the same factors from ``G_i = W_iᵀW_i`` without forming Q.
Eigenvalues ascending and each ``V`` column's largest entry positive, as stock PEFT. The derivations and
rank-deficient stacks: docs/hjd.md#the-algebra. Nothing here knows ranks, devices or configs.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from frod_ds.runtime.errors import HJDError
from frod_ds.runtime.validate import pi_problem, widths_problem

__all__ = [
    "HJDResult",
    "decompose",
    "validate_members",
    "thin_qr",
    "tsqr_combine",
    "t_pi_term",
    "shared_basis",
    "member_factors",
    "gram",
    "gram_factor",
    "gram_t_pi_term",
    "smallest_pi",
    "small_pi_line",
    "t_pi_terms",
    "gram_t_pi",
    "gram_basis",
    "weight_factors",
    "reconstruction_error",
    "reconstruction_error_t",
    "RECONSTRUCTION_TOL",
    "reconstruction_tol",
    "probe_vectors",
    "probe_error",
    "no_tf32",
]

# The largest relative reconstruction error a member may have, by the dtype its factors are held in (U rounded to
# bf16 gives ~2e-3, fp32 HJD ~1e-6) or the quantization of U (NF4 ~0.09, int8 ~0.01 on Gaussian-like weights): HJD
# refuses a store beyond it, and ``frod hjd --verify`` checks against the same numbers.
RECONSTRUCTION_TOL = {
    torch.bfloat16: 2e-2,
    torch.float16: 5e-3,
    torch.float32: 1e-4,
    torch.float64: 1e-8,
    "nf4": 0.2,
    "int8": 3e-2,
}
PROBES = 4  # random probe vectors per category


@dataclass
class HJDResult:
    """Factors of one category. ``W_i ≈ U[i] @ diag(sigma[i]) @ V.T``."""

    V: Tensor  # (n, n), shared by the category
    U: list[Tensor]  # U[i]: (m_i, n)
    sigma: list[Tensor]  # sigma[i]: (n,)
    error: list[float]  # relative Frobenius reconstruction error per member


@contextlib.contextmanager
def no_tf32() -> Iterator[None]:
    """Run fp32 matmuls at full IEEE precision (TF32 would cap reconstruction at ~1e-3)."""
    matmul = torch.get_float32_matmul_precision()
    cudnn = torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(matmul)
        torch.backends.cudnn.allow_tf32 = cudnn


def validate_members(weights: Sequence[Tensor], pi: float, names: Sequence[str] | None = None) -> None:
    """Raise ``HJDError`` naming the problem when a category cannot be decomposed."""
    problem = pi_problem(pi)
    if problem:
        raise HJDError(problem)
    if len(weights) == 0:
        raise HJDError("a category needs at least one weight matrix; got none")
    names = list(names) if names is not None else [f"member {i}" for i in range(len(weights))]
    for name, w in zip(names, weights):
        if w.ndim != 2:
            raise HJDError(f"{name}: expected a 2-D weight (out, in), got shape {tuple(w.shape)}")
    problem = widths_problem([w.shape[1] for w in weights], f"the members {names[0]} … {names[-1]}")
    if problem:
        raise HJDError(problem)
    for name, w in zip(names, weights):
        if not torch.isfinite(w).all():
            raise HJDError(f"{name}: weight contains NaN or Inf; check the checkpoint")


def thin_qr(W: Tensor) -> tuple[Tensor, Tensor]:
    """``W = Q R`` for a (M, n) stack; Q (M, k), R (k, n), k = min(M, n)."""
    Q, R = torch.linalg.qr(W, mode="reduced")
    return Q, R


def tsqr_combine(R_blocks: Sequence[Tensor]) -> tuple[list[Tensor], Tensor]:
    """Tall-skinny QR, second level: ``[R_1; …; R_P] = Q̃ R``.

    Returns Q̃ split into the row blocks of each ``R_p`` (``Q̃_p``: (k_p, k)) and the global R (k, n).
    Member ``i`` of block ``p`` then has ``Q_i = Q_i⁽ᵖ⁾ Q̃_p``.
    """
    R_stack = torch.cat(list(R_blocks), dim=0)  # (Σ k_p, n)
    Q_tilde, R = thin_qr(R_stack)  # (Σ k_p, k), (k, n)
    return list(torch.split(Q_tilde, [r.shape[0] for r in R_blocks], dim=0)), R


def t_pi_term(gram: Tensor, pi: float) -> Tensor:
    """One member's term ``(Q_iᵀ Q_i + π I)⁻¹`` from its Gram matrix ``Q_iᵀ Q_i`` (k, k); all NaN where the Gram is
    not finite or not positive definite in the run's precision (weights past its range), for the caller to name."""
    k = gram.shape[0]
    A = gram + pi * torch.eye(k, dtype=gram.dtype, device=gram.device)
    A = 0.5 * (A + A.T)
    L, info = torch.linalg.cholesky_ex(A)  # SPD: π > 0, unless rounding or an overflow broke it
    if info.item() != 0 or not torch.isfinite(L).all():
        return torch.full_like(A, float("nan"))
    return torch.cholesky_inverse(L)


def _sign_columns(V: Tensor) -> Tensor:
    """Flip each column so its largest-magnitude entry is positive; returns the signs (k,)."""
    idx = V.abs().argmax(dim=0)
    signs = torch.sign(V.gather(0, idx[None, :]).squeeze(0))
    return torch.where(signs == 0, torch.ones_like(signs), signs)


def shared_basis(R: Tensor, T_pi: Tensor) -> tuple[Tensor, Tensor]:
    """``T_pi = Z Λ Zᵀ``, ``V = Rᵀ Z`` completed to (n, n). Returns ``(V, Z)``; Z (k, k) sign-fixed."""
    k, n = R.shape
    _, Z = torch.linalg.eigh(0.5 * (T_pi + T_pi.T))  # ascending eigenvalues, Z (k, k)
    V_r = R.T @ Z  # (n, k)
    signs = _sign_columns(V_r)
    Z = Z * signs
    V_r = V_r * signs
    if k == n:
        return V_r, Z
    # Wide stack: complete with an orthonormal basis of the complement of span(Rᵀ).
    Q_full, _ = torch.linalg.qr(R.T, mode="complete")  # (n, n)
    N = Q_full[:, k:]  # (n, n - k)
    N = N * _sign_columns(N)
    return torch.cat([V_r, N], dim=1), Z


def _normalize_columns(B_i: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """``σ = ‖B_i[:, j]‖``, ``U = B_i diag(σ)⁻¹`` (zero columns: σ = 0, U column 0), padded to ``n`` columns."""
    sigma = torch.linalg.vector_norm(B_i, dim=0)  # (k,)
    safe = torch.where(sigma > 0, sigma, torch.ones_like(sigma))
    U_i = torch.where(sigma > 0, B_i / safe, torch.zeros_like(B_i))  # (m_i, k)
    k = B_i.shape[1]
    if k < n:
        U_i = torch.cat([U_i, U_i.new_zeros(U_i.shape[0], n - k)], dim=1)  # (m_i, n)
        sigma = torch.cat([sigma, sigma.new_zeros(n - k)])  # (n,)
    return U_i, sigma


def member_factors(Q_i: Tensor, Z: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """``B_i = Q_i Z``, ``σ_i = ‖B_i[:, j]‖``, ``U_i = B_i diag(σ_i)⁻¹`` padded to ``n`` columns.

    Zero columns of ``B_i`` (and the completion directions of a wide stack) get ``σ = 0`` and a zero
    ``U`` column.
    """
    return _normalize_columns(Q_i @ Z, n)  # B_i: (m_i, k)


def gram(W: Tensor) -> Tensor:
    """``Wᵀ W`` (n, n) in fp64."""
    W64 = W.to(torch.float64)
    return W64.T @ W64


def gram_factor(G: Tensor) -> tuple[Tensor | None, float]:
    """Upper-triangular ``R`` with ``RᵀR = G`` (Cholesky, fp64), and ``max(diag R) / min(diag R)`` (a lower
    bound of ``cond(R)``). ``(None, inf)`` when ``G`` is not positive definite (rank-deficient stack)."""
    L, info = torch.linalg.cholesky_ex(0.5 * (G + G.T))
    if int(info) != 0:
        return None, float("inf")
    d = L.diagonal()
    return L.T, float(d.max() / d.min())


def gram_t_pi_term(G_i: Tensor, G: Tensor, pi: float) -> Tensor:
    """``(G_i + πG)⁻¹`` (n, n): member ``i``'s term of ``T_pi`` before the congruence by ``R``. All NaN where
    ``G_i + πG`` is not positive definite in fp64 (a π so small that rounding in ``G_i`` outweighs it, for a
    member of fewer rows than columns): the caller takes the Householder route, which does not form ``G_i``."""
    A = G_i + pi * G
    A = 0.5 * (A + A.T)
    L, info = torch.linalg.cholesky_ex(A)
    if info.item() != 0 or not torch.isfinite(L).all():
        return torch.full_like(A, float("nan"))
    return torch.cholesky_inverse(L)


def smallest_pi(n: int, dtype: torch.dtype) -> str:
    """A π that the Householder route computes with in ``dtype`` for width ``n``, as ``1e-K``: ``n·eps`` rounded up
    to a power of ten (the rounding of ``Q_iᵀQ_i`` stays below it), for the error that names a π too small."""
    return f"1e{math.ceil(math.log10(n * torch.finfo(dtype).eps))}"


def small_pi_line(category: str, pi: float, dtype: torch.dtype, n: int, name: str = "pi") -> str:
    """The line for a ``π`` too small for ``dtype``: a member's ``Q_iᵀQ_i + πI`` is not positive definite there."""
    wider = "" if dtype == torch.float64 else f", or compute in float64 (from {smallest_pi(n, torch.float64)})"
    return (
        f"{category}: {name} {pi:g} is too small for HJD in {str(dtype).removeprefix('torch.')}: a member's "
        f"Q_iᵀQ_i + πI is not positive definite at that precision; use {name} {smallest_pi(n, dtype)} or more{wider}"
    )


def t_pi_terms(Q_blocks: Sequence[Tensor], pi: float) -> tuple[Tensor, bool]:
    """``Σ_i (Q_iᵀQ_i + πI)⁻¹`` (k, k) over ``Q_blocks`` (NaN where a term is, see :func:`t_pi_term`), and whether
    a term failed although its ``Q_iᵀQ_i`` is finite: then π, not the weights, is out of the precision's reach."""
    total, small = None, False
    for Q_i in Q_blocks:
        G_q = Q_i.T @ Q_i
        term = t_pi_term(G_q, pi)
        small = small or bool(torch.isfinite(G_q).all() and not torch.isfinite(term).all())
        total = term if total is None else total + term
    assert total is not None, "a category has members"
    return total, small


def gram_t_pi(R: Tensor, S: Tensor, L: int) -> Tensor:
    """``T_pi = R S Rᵀ / L`` from ``S = Σ_i (G_i + πG)⁻¹``."""
    return (R @ S @ R.T) / L


def gram_basis(R: Tensor, T_pi: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``V, Z`` as :func:`shared_basis` (same sign convention) and ``Y = R⁻¹ Z`` with ``B_i = W_i Y``."""
    V, Z = shared_basis(R, T_pi)
    Y = torch.linalg.solve_triangular(R, Z, upper=True)
    return V, Z, Y


def weight_factors(W_i: Tensor, Y: Tensor) -> tuple[Tensor, Tensor]:
    """``B_i = W_i Y`` normalised into ``U_i, σ_i`` (Gram route), in ``Y``'s dtype."""
    return _normalize_columns(W_i.to(Y.dtype) @ Y, Y.shape[1])


def reconstruction_error_t(W_i: Tensor, U_i: Tensor, sigma_i: Tensor, V: Tensor) -> Tensor:
    """:func:`reconstruction_error` as a 0-dim tensor on the factors' device (no host sync)."""
    W_i = W_i.to(U_i.dtype)
    diff = torch.linalg.matrix_norm(W_i - (U_i * sigma_i) @ V.T)
    ref = torch.linalg.matrix_norm(W_i)
    return torch.where(ref > 0, diff / torch.where(ref > 0, ref, torch.ones_like(ref)), diff)


def reconstruction_error(W_i: Tensor, U_i: Tensor, sigma_i: Tensor, V: Tensor) -> float:
    """``‖W_i − U_i diag(σ_i) Vᵀ‖_F / ‖W_i‖_F`` (absolute error when ``W_i = 0``), in U's dtype."""
    return float(reconstruction_error_t(W_i, U_i, sigma_i, V))


def reconstruction_tol(dtype: torch.dtype, quant: str = "none") -> float:
    """``RECONSTRUCTION_TOL`` of factors held in ``dtype`` (quantized: of the quantization kind)."""
    return RECONSTRUCTION_TOL[quant] if quant != "none" else RECONSTRUCTION_TOL.get(dtype, 1e-8)


def probe_vectors(n: int, seed: int, k: int = PROBES) -> Tensor:
    """``X`` (n, k) fp64 standard normal from its own generator (the global RNG is left alone)."""
    return torch.randn(n, k, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def probe_error(W_i: Tensor, U_i: Tensor, sigma_i: Tensor, V: Tensor, X: Tensor, block: int = 2**24) -> Tensor:
    """``‖W_i X − U_i (σ_i ⊙ Vᵀ X)‖_F / ‖W_i X‖_F`` (absolute when ``W_i X = 0``) for probe vectors ``X`` (n, k), as a
    0-dim fp64 tensor: the layer's own product on random inputs, in fp64 row blocks of ``block`` elements (no square
    of an extreme weight overflows, no fp64 copy of a whole ``W_i``). NaN or inf factors give NaN or inf."""
    X = X.to(device=U_i.device, dtype=torch.float64)  # (n, k)
    Z = sigma_i.to(torch.float64)[:, None] * (V.to(torch.float64).T @ X)  # (n, k)
    rows = max(1, block // max(1, W_i.shape[1]))
    num = torch.zeros((), dtype=torch.float64, device=U_i.device)
    den = torch.zeros((), dtype=torch.float64, device=U_i.device)
    for r in range(0, W_i.shape[0], rows):
        Y = W_i[r : r + rows].to(torch.float64) @ X  # (rows, k)
        num += (Y - U_i[r : r + rows].to(torch.float64) @ Z).square().sum()
        den += Y.square().sum()
    return torch.where(den > 0, (num / torch.where(den > 0, den, torch.ones_like(den))).sqrt(), num.sqrt())


def decompose(
    weights: Sequence[Tensor],
    pi: float = 1e-3,
    dtype: torch.dtype = torch.float64,
    names: Sequence[str] | None = None,
    method: str = "householder",
) -> HJDResult:
    """HJD of one category on the members' device, computed in ``dtype`` (fp32: TF32 off).

    Args:
        weights: ``W_i`` of shape ``(m_i, n)``, same ``n`` for all; ``names`` name them in errors.
        pi: ridge term ``π > 0`` of ``T_pi``; dtype: ``torch.float64`` (default) or ``torch.float32``.
        method: ``"householder"`` (thin QR of the stack; the reference) or ``"gram"`` (Gram matrices, Cholesky and
            ``n × n`` algebra in fp64, ``B_i = W_i Y`` in ``dtype``; needs a stack of full column rank).
    Returns ``HJDResult`` with ``V`` (n, n), ``U[i]`` (m_i, n), ``sigma[i]`` (n,), all in ``dtype``.
    """
    validate_members(weights, pi, names)
    if dtype not in (torch.float32, torch.float64):
        raise HJDError(f"HJD dtype must be torch.float32 or torch.float64, got {dtype}")
    if method not in ("householder", "gram"):
        raise HJDError(f"HJD method must be 'householder' or 'gram', got {method!r}")
    with no_tf32():
        Ws = [w.detach().to(dtype) for w in weights]
        n = Ws[0].shape[1]
        if method == "gram":
            Gs = [gram(w) for w in weights]
            G = sum(Gs)
            R, _ = gram_factor(G)
            if R is None:
                raise HJDError(
                    "the Gram route needs a stack of full column rank (sum of m_i >= n, no null "
                    "direction); use method='householder'"
                )
            S = sum(gram_t_pi_term(G_i, G, pi) for G_i in Gs)
            if not torch.isfinite(S).all():
                raise HJDError(
                    f"the Gram route cannot compute with pi {pi:g}: a member's G_i + πG is not positive definite "
                    "in float64; use method='householder' or a larger pi"
                )
            T_pi = gram_t_pi(R, S, len(Ws))
            V, _, Y = gram_basis(R, T_pi)
            V, Y = V.to(dtype), Y.to(dtype)
            factors = [weight_factors(W_i, Y) for W_i in Ws]
        else:
            Q, R = thin_qr(torch.cat(Ws, dim=0))  # (M, k), (k, n)
            Q_blocks = torch.split(Q, [w.shape[0] for w in Ws], dim=0)  # Q_i: (m_i, k)
            S, small = t_pi_terms(Q_blocks, pi)
            if small:
                who = f"the members {names[0]} … {names[-1]}" if names else "the category"
                raise HJDError(small_pi_line(who, pi, dtype, n))
            T_pi = S / len(Ws)  # (k, k)
            V, Z = shared_basis(R, T_pi)
            factors = [member_factors(Q_i, Z, n) for Q_i in Q_blocks]
        U, sigma, error = [], [], []
        for W_i, (U_i, s_i) in zip(Ws, factors):
            U.append(U_i)
            sigma.append(s_i)
            error.append(reconstruction_error(W_i, U_i, s_i, V))
    return HJDResult(V=V, U=U, sigma=sigma, error=error)
