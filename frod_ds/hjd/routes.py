"""The two routes of one category's HJD on one rank (spec §1, "Distributed HJD"), each a function over a
``MemberSource`` (weights in) and a ``FactorSink`` (factors out). All math is ``frod_ds.hjd.math``.

Gram route (full column rank, well conditioned): a Cholesky QR, members streamed one at a time, redone by the
Householder route when a member's error exceeds ``GRAM_MAX_ERROR``, left to it when ``π`` is too small for its fp64
``G_i + πG``. Householder route (rank-deficient, wide or ill-conditioned stacks): a tall-skinny QR over blocks,
ranks and rank 0. The passes, collectives and memory of each: docs/hjd.md#the-routes-on-one-rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from frod_ds.hjd.category import CategoryResult, FactorSink, MemberSource, Phases
from frod_ds.hjd.math import (
    gram,
    gram_basis,
    gram_factor,
    gram_t_pi,
    gram_t_pi_term,
    member_factors,
    shared_basis,
    small_pi_line,
    t_pi_terms,
    thin_qr,
    tsqr_combine,
    weight_factors,
)
from frod_ds.runtime import distributed as D
from frod_ds.runtime.errors import FrodError

__all__ = [
    "RouteOptions",
    "read_pass",
    "factor_category",
    "gram_route",
    "householder_route",
    "make_blocks",
    "GRAM_MAX_COND",
    "GRAM_MAX_ERROR",
]

# Gram route limits per compute dtype: its rounding error grows like eps·cond(R), Householder's does not.
GRAM_MAX_COND = {torch.float32: 1e3, torch.float64: 1e8}
GRAM_MAX_ERROR = {torch.float32: 1e-5, torch.float64: 1e-10}


@dataclass(frozen=True)
class RouteOptions:
    pi: float  # ridge term of T_pi
    dtype: torch.dtype  # compute dtype, fp32 or fp64
    method: str = "auto"  # "auto" (Gram where it holds) | "householder"
    block_bytes: float = 4 * 2**30  # Householder route: largest stack a rank QRs at once


# ------------------------------------------------------------------------------------------ Gram route


def read_pass(source: MemberSource, sink: FactorSink, phases: Phases) -> Tensor:
    """Pass A: every member read once (kept when the cache has room), ``G⁽ᵖ⁾ = Σ G_i`` (n, n) fp64. NaN or
    Inf in any rank's weights, or a weight of zeros only, stops every rank with the same message."""
    n = source.spec.n
    with phases("read_gram"):
        G = torch.zeros(n, n, dtype=torch.float64, device=source.device)
        flags: list[Tensor] = []
        error = None
        w_left = source.unread_bytes()
        try:
            for i in range(len(source)):
                W = source.weight(i)
                w_left -= W.numel() * W.element_size()
                flags.append(torch.stack([torch.isfinite(W).all(), W.ne(0).any()]))
                source.keep(("W", i), W)
                G_i = gram(W)
                G += G_i
                # A weight saves a read (pass C needs it), a Gram matrix one product: weights first.
                source.keep(("G", i), G_i, headroom=w_left)
                del W, G_i
                sink.bar.update(1)
            error = source.member_problem(flags)
        except FrodError as e:  # a bad shard on this rank: every rank stops with the same message
            error = str(e)
        D.agree_on_error(error)
    return G


def gram_route(
    source: MemberSource,
    sink: FactorSink,
    G: Tensor,
    R_box: list[Tensor],
    cond: float,
    opts: RouteOptions,
    phases: Phases,
) -> CategoryResult | None:
    """Passes B and C of the Gram route from the summed ``G``; rank 0 passes ``R`` in ``R_box``, taken out
    here so that it is freed before pass C. None, on every rank and before anything is written, when a member's
    ``G_i + πG`` is not positive definite in fp64 (a tiny ``--pi``): the Householder route does the category."""
    n, L = source.spec.n, source.spec.L
    R = R_box.pop() if R_box else None
    with phases("t_pi_eigh"):
        source.reread([i for i in range(len(source)) if source.cached(("G", i)) is None])
        S = torch.zeros(n, n, dtype=torch.float64, device=source.device)
        for i in range(len(source)):
            G_i = source.cached(("G", i))
            S += gram_t_pi_term(G_i if G_i is not None else gram(source.weight(i)), G, opts.pi)
        D.all_reduce_sum(S)  # a failed term is NaN on its rank, so NaN in the sum on every rank
        if not torch.isfinite(S).all():
            return None
        V = torch.empty(n, n, dtype=torch.float64, device=source.device)
        Y = torch.empty(n, n, dtype=torch.float64, device=source.device)
        if D.is_main():
            V, _, Y = gram_basis(R, gram_t_pi(R, S, L))
        del S, R
        D.broadcast(V)
        D.broadcast(Y)
    with phases("factors"):
        Y = Y.to(opts.dtype)
        source.reread(range(len(source)))
        out = sink.emit(source, V, lambda i, W: weight_factors(W, Y), "gram", cond, phases.seconds)
    return out


# ------------------------------------------------------------------------------------ Householder route


def make_blocks(heights: Sequence[int], n: int, itemsize: int, block_bytes: float) -> list[range]:
    """Contiguous member index ranges whose stacks stay under ``block_bytes`` (at least one member each)."""
    blocks: list[range] = []
    start, rows = 0, 0
    for i, m in enumerate(heights):
        if i > start and (rows + m) * n * itemsize > block_bytes:
            blocks.append(range(start, i))
            start, rows = i, 0
        rows += m
    if start < len(heights):
        blocks.append(range(start, len(heights)))
    return blocks


class _Blocks:
    """This rank's members in QR blocks, and each member's rows in its block's stack."""

    def __init__(self, heights: Sequence[int], n: int, itemsize: int, block_bytes: float):
        self.ranges = make_blocks(heights, n, itemsize, block_bytes)
        self.offsets = [0]
        for h in heights:
            self.offsets.append(self.offsets[-1] + h)
        self.block_of = {i: b for b, block in enumerate(self.ranges) for i in block}

    def height(self, b: int) -> int:
        return self.offsets[self.ranges[b].stop] - self.offsets[self.ranges[b].start]

    def rows(self, b: int, i: int) -> slice:
        base = self.offsets[self.ranges[b].start]
        return slice(self.offsets[i] - base, self.offsets[i + 1] - base)


class _QCache:
    """``Q`` blocks between the passes: on the device up to a byte budget, in host memory beyond."""

    def __init__(self, device: torch.device, budget_bytes: float):
        self.device, self.budget, self.on_device = device, budget_bytes, 0
        self._blocks: dict[int, Tensor] = {}

    def put(self, b: int, t: Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        if t.device.type != "cpu" and self.on_device + nbytes > self.budget:
            t = t.cpu()
        elif t.device.type != "cpu":
            self.on_device += nbytes
        self._blocks[b] = t

    def pop(self, b: int) -> Tensor:
        t = self._blocks.pop(b)
        if t.device.type != "cpu":
            self.on_device -= t.numel() * t.element_size()
            return t
        return t.to(self.device)


def _local_qr(source: MemberSource, blocks: _Blocks, qcache: _QCache, dtype: torch.dtype) -> list[Tensor]:
    """``W_b = Q_b R_b`` per block; keeps ``Q_b`` (m_b, k_b), returns the ``R_b`` (k_b, n)."""
    source.reread(range(len(source)))
    R_blocks: list[Tensor] = []
    for b, block in enumerate(blocks.ranges):
        W_b = torch.empty(blocks.height(b), source.spec.n, dtype=dtype, device=source.device)  # (m_b, n)
        for i in block:
            W_b[blocks.rows(b, i)].copy_(source.weight(i))
        Q_b, R_b = thin_qr(W_b)  # (m_b, k_b), (k_b, n)
        del W_b
        qcache.put(b, Q_b)
        R_blocks.append(R_b)
        del Q_b
    return R_blocks


def _combine(
    R_blocks: list[Tensor],
    n: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[list[Tensor], Tensor | None, int]:
    """Both TSQR levels. Returns ``M_b = Q̂_b Q̃_p`` (k_b, k) per block, R (k, n) on rank 0, and k."""
    if not R_blocks:
        Q_hat: list[Tensor] | None = []
        R_p = torch.zeros(0, n, dtype=dtype, device=device)
    elif len(R_blocks) == 1:
        Q_hat, R_p = None, R_blocks[0]
    else:
        Q_hat, R_p = tsqr_combine(R_blocks)  # Q̂_b (k_b, k_p), R⁽ᵖ⁾ (k_p, n)
    R_all = D.gather_rows(R_p)  # rank 0: [R⁽¹⁾; …; R⁽ᴾ⁾]
    del R_p, R_blocks
    R = Q_tilde = None
    if R_all is not None:
        Q_tilde, R = tsqr_combine(R_all)  # Q̃_p (k_p, k), R (k, n)
        del R_all
    Q_tilde_p = D.scatter_rows(Q_tilde, like=torch.empty(0, dtype=dtype, device=device))  # (k_p, k)
    M = [Q_tilde_p] if Q_hat is None else [Q_hat_b @ Q_tilde_p for Q_hat_b in Q_hat]
    return M, R, int(Q_tilde_p.shape[1])


def _basis(
    blocks: _Blocks,
    qcache: _QCache,
    M: list[Tensor],
    R: Tensor | None,
    k: int,
    opts: RouteOptions,
    n: int,
    L: int,
    device: torch.device,
    category: str,
) -> tuple[Tensor, Tensor]:
    """``Q_b ← Q_b M_b`` (rows of the global Q), ``T_pi`` summed over ranks, ``V, Z`` from rank 0."""
    T_pi = torch.zeros(k, k, dtype=opts.dtype, device=device)
    small = torch.zeros((), dtype=opts.dtype, device=device)  # members whose term failed for π alone
    for b, block in enumerate(blocks.ranges):
        Q_g = qcache.pop(b) @ M[b]  # (m_b, k)
        if block:
            S_b, small_b = t_pi_terms([Q_g[blocks.rows(b, i)] for i in block], opts.pi)  # Q_i: (m_i, k)
            T_pi += S_b
            small += float(small_b)
        qcache.put(b, Q_g)
        del Q_g
    del M
    D.all_reduce_sum(T_pi)
    D.all_reduce_sum(small)
    D.agree_on_error(_basis_problem(T_pi, small, opts, category, n))
    T_pi /= L
    V = torch.empty(n, n, dtype=opts.dtype, device=device)
    Z = torch.empty(k, k, dtype=opts.dtype, device=device)
    if D.is_main():
        assert R is not None, "rank 0 holds the global R"
        V, Z = shared_basis(R, T_pi)  # (n, n), (k, k)
    D.broadcast(Z)
    D.broadcast(V)
    return V, Z


def _basis_problem(T_pi: Tensor, small: Tensor, opts: RouteOptions, category: str, n: int) -> str | None:
    """Why the summed ``T_pi`` is unusable: ``--pi`` too small for the compute dtype (``small``: members whose
    ``Q_iᵀQ_i`` is finite but ``Q_iᵀQ_i + πI`` not positive definite), or weights past its range; None when fine."""
    if torch.isfinite(T_pi).all():
        return None
    if small.item() > 0:
        return small_pi_line(category, opts.pi, opts.dtype, n, name="--pi")
    return (
        f"{category}: a member's weights hold values past what the decomposition can carry in "
        f"{str(opts.dtype).removeprefix('torch.')} (entries so large that their squares overflow, or extreme scales): "
        f"check the checkpoint's {category} weights"
    )


def householder_route(
    source: MemberSource, sink: FactorSink, cond: float | None, opts: RouteOptions, phases: Phases
) -> CategoryResult:
    """The Householder TSQR route for this rank's members (see the module docstring)."""
    spec = source.spec
    blocks = _Blocks(spec.heights, spec.n, torch.finfo(opts.dtype).bits // 8, opts.block_bytes)
    qcache = _QCache(source.device, source.spare_cache_bytes())
    with phases("read_qr"):
        R_blocks = _local_qr(source, blocks, qcache, opts.dtype)
    with phases("combine"):
        M, R, k = _combine(R_blocks, spec.n, opts.dtype, source.device)
        del R_blocks
    with phases("t_pi_eigh"):
        V, Z = _basis(blocks, qcache, M, R, k, opts, spec.n, spec.L, source.device, spec.name)
        del M, R
    with phases("factors"):
        source.reread(range(len(source)))
        current: dict[int, Tensor] = {}

        def factors(i: int, W: Tensor) -> tuple[Tensor, Tensor]:
            b = blocks.block_of[i]
            if b not in current:
                current.clear()
                current[b] = qcache.pop(b)
            return member_factors(current[b][blocks.rows(b, i)], Z, spec.n)

        out = sink.emit(source, V, factors, "householder", cond, phases.seconds)
    return out


# ------------------------------------------------------------------------------------------- the choice


def factor_category(
    source: MemberSource, sink: FactorSink, G: Tensor, phases: Phases, opts: RouteOptions
) -> CategoryResult:
    """Everything after ``read_pass``: the Gram route where ``G`` says it holds (checked again on the
    errors), the Householder route otherwise; ``CollectiveError`` on every rank when a member's factors miss the
    probe tolerance (``CategoryResult.probe_problem``). Returns with this rank's writes still in flight."""
    D.all_reduce_sum(G)
    decision, R_box = None, []
    if D.is_main():
        R, cond = gram_factor(G) if opts.method != "householder" else (None, float("nan"))
        ok = R is not None and cond <= GRAM_MAX_COND[opts.dtype]
        decision = (ok, None if R is None else cond)
        R_box = [R] if ok else []
        del R
    ok, cond = D.broadcast_object(decision)
    result = None
    if ok:
        result = gram_route(source, sink, G, R_box, cond, opts, phases)  # None: a tiny π, nothing written
        worst = max(D.all_gather_object(max(result.error.values(), default=0.0) if result else 0.0))
        if result is not None and not worst <= GRAM_MAX_ERROR[opts.dtype]:  # rounding (or NaN) won: redo
            result.wait()
            result = None
    if result is None:
        result = householder_route(source, sink, cond, opts, Phases(source.device))
    # every member's factors reproduce its weight on random inputs, or no rank records the category
    peaks = {m: v for part in D.all_gather_object(result.peak) for m, v in part.items()}  # a float per member
    D.agree_on_error(result.probe_problem(source.spec, opts.dtype, peaks))
    return result
