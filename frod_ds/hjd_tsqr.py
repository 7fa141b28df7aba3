"""One category of the distributed HJD stage on one rank (spec §1, "Distributed HJD").

With ``P`` ranks and ``L`` members, rank ``p`` owns a contiguous run of members (``P > L`` allowed: a rank
without members still joins every collective). Two routes to the same factors (``frod_ds.hjd``):

Gram route (default when the stack has full column rank and is well conditioned): the local QR is a
Cholesky QR, members stream through one at a time and nothing of size ``Σ m_i × n`` is ever formed::

    pass A, member i:  G_i = W_iᵀW_i (fp64), G⁽ᵖ⁾ = Σ G_i        W_i read ahead by MemberReader
    all ranks:         G = Σ_p G⁽ᵖ⁾ (all-reduce);  rank 0: G = RᵀR (Cholesky), cond(R) checked
    pass B, member i:  S += (G_i + πG)⁻¹;  S summed by all-reduce
    rank 0:            T_pi = R S Rᵀ / L;  V, Z, Y = R⁻¹Z          broadcast V, Y
    pass C, member i:  U_i, σ_i from B_i = W_i Y                  written behind by FactorWriter

``W_i`` (checkpoint dtype) and ``G_i`` wait on the device between passes up to ``device_cache_gb``;
beyond it ``G_i`` is recomputed and ``W_i`` read again. If any member's reconstruction error exceeds
``GRAM_MAX_ERROR`` the category is redone by the Householder route.

Householder route (rank-deficient, wide or ill-conditioned stacks, or ``method="householder"``): each
rank splits its members into blocks of at most ``block_gb``::

    block b:  W_b = Q_b R_b                                   thin_qr; W_b (m_b, n) read from the shards
    rank p:   [R_1; …; R_B] = Q̂ R⁽ᵖ⁾                           tsqr_combine (skipped for one block)
    rank 0:   [R⁽¹⁾; …; R⁽ᴾ⁾] = Q̃ R                            gather_rows, tsqr_combine, scatter_rows
    member i: Q_i = Q_b[i] Q̂_b Q̃_p                           (m_i, k), k = min(Σ m_i, n)
    T_pi = (1/L) Σ_i (Q_iᵀQ_i + πI)⁻¹                         local sums + one all-reduce
    rank 0:   V, Z = shared_basis(R, T_pi)                     broadcast
    member i: U_i, σ_i = member_factors(Q_i, Z, n)             written by the rank that owns it

The ``Q_b`` wait between passes on the device up to ``device_cache_gb`` and in host memory beyond, so
peak device memory ≈ min(local Q, cache) + ~3 blocks + a few (n, n). All math is ``frod_ds.hjd``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from tqdm import tqdm

from frod_ds import distributed as D
from frod_ds.hf_checkpoint import HFCheckpoint
from frod_ds.hjd import (
    gram,
    gram_basis,
    gram_factor,
    gram_t_pi,
    gram_t_pi_term,
    member_factors,
    reconstruction_error_t,
    shared_basis,
    t_pi_term,
    thin_qr,
    tsqr_combine,
    weight_factors,
)
from frod_ds.hjd_io import FactorWriter, MemberReader
from frod_ds.hjd_plan import my_members
from frod_ds.quant import QuantSpec
from frod_ds.store import sigma_key, u_key, v_file, v_key

__all__ = ["CategoryResult", "CategoryJob", "make_blocks", "GRAM_MAX_COND", "GRAM_MAX_ERROR"]

GiB = 2**30
# Gram route limits per compute dtype: its rounding error grows like eps·cond(R), Householder's does not.
GRAM_MAX_COND = {torch.float32: 1e3, torch.float64: 1e8}
GRAM_MAX_ERROR = {torch.float32: 1e-5, torch.float64: 1e-10}


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


@dataclass
class CategoryResult:
    """What one rank wrote for a category: ``{key: file}``, errors per member, phase timings, route."""

    files: dict[str, str]
    error: dict[str, float]
    stored_error: dict[str, float]
    phase_seconds: dict[str, float]
    method: str = "gram"
    cond_estimate: float | None = None
    writes: list[Future] = field(default_factory=list, repr=False)

    def wait(self) -> CategoryResult:
        """Wait for this rank's files of the category to be on disk; returns itself without the futures."""
        for f in self.writes:
            f.result()
        self.writes = []
        return self


class _Cache:
    """Per-member tensors kept on the compute device between passes, up to a byte budget."""

    def __init__(self, budget_bytes: float):
        self.budget, self.used = budget_bytes, 0
        self._items: dict[Any, Tensor] = {}

    def put(self, key: Any, t: Tensor, headroom: float = 0.0) -> None:
        """Keep ``t`` if it fits with ``headroom`` bytes of the budget still free afterwards."""
        nbytes = t.numel() * t.element_size()
        if key not in self._items and self.used + nbytes + headroom <= self.budget:
            self._items[key] = t
            self.used += nbytes

    def get(self, key: Any) -> Tensor | None:
        return self._items.get(key)

    def __contains__(self, key: Any) -> bool:
        return key in self._items

    def clear(self) -> None:
        self._items.clear()
        self.used = 0


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


class CategoryJob:
    """This rank's share of one category. The stage calls ``gram_pass`` (all reads of the category), then
    ``finish`` (the rest; writes go on in the background: ``CategoryResult.wait``), and ``close`` in any case."""

    def __init__(self, ckpt: HFCheckpoint, category: str, members: list[str], *, reader: MemberReader,
                 writer: FactorWriter, pi: float, dtype: torch.dtype, device: torch.device, block_gb: float,
                 device_cache_gb: float, method: str = "auto", u_dtype: torch.dtype | None = None,
                 quant: str = "none"):
        self.ckpt, self.category, self.L = ckpt, category, len(members)
        self.reader, self.writer = reader, writer
        self.pi, self.dtype, self.device, self.method = pi, dtype, device, method
        self.block_gb, self.cache_bytes = block_gb, device_cache_gb * GiB
        self.n = ckpt.shape(members[0] + ".weight")[1]
        self.u_dtype = u_dtype or ckpt.dtype(members[0] + ".weight")  # U as stored (or as quantized from)
        self.quant = quant  # "none", or U_i written as a frod_ds.quant blob of this kind
        self.mine = my_members(members, D.get_rank(), D.get_world_size())
        self.cache = _Cache(self.cache_bytes)
        self.phase: dict[str, float] = {}
        self.bar = tqdm(total=2 * len(self.mine), desc=f"{category} L={self.L} n={self.n}", unit="member",
                        disable=not D.is_main(), dynamic_ncols=True, file=sys.stderr)

    # -- weights

    def _fetch(self, i: int) -> Tensor:
        """Member ``i``'s weight on the device, in the checkpoint dtype: from the cache or read."""
        W = self.cache.get(("W", i))
        if W is None:
            W = self.reader.take(self.mine[i])
        return W

    def _reread(self, indices: Sequence[int]) -> None:
        """Schedule reads, ahead of anything else queued, of the members in ``indices`` not in the cache."""
        self.reader.schedule([self.mine[i] for i in indices if ("W", i) not in self.cache], first=True)

    def _timed(self, name: str, t0: float) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.phase[name] = round(time.perf_counter() - t0, 3)

    def _check_finite(self, flags: list[Tensor], indices: Sequence[int]) -> str | None:
        if not flags:
            return None
        ok = torch.stack(flags).cpu()
        for j, good in zip(indices, ok.tolist()):
            if not good:
                name = self.mine[j] + ".weight"
                return f"{name} in {self.ckpt.info(name).file} contains NaN or Inf; check the checkpoint"
        return None

    # -- Gram route

    def gram_pass(self) -> None:
        """Pass A: every member read once (cached when room), ``G⁽ᵖ⁾ = Σ G_i``."""
        t0 = time.perf_counter()
        n = self.n
        self.G = torch.zeros(n, n, dtype=torch.float64, device=self.device)
        flags: list[Tensor] = []
        error = None
        w_left = sum(self.ckpt.info(m + ".weight").nbytes for m in self.mine)  # weights not read yet
        try:
            for i in range(len(self.mine)):
                W = self._fetch(i)
                w_left -= W.numel() * W.element_size()
                flags.append(torch.isfinite(W).all())
                self.cache.put(("W", i), W)
                G_i = gram(W)
                self.G += G_i
                # A weight saves a read (pass C needs it), a Gram matrix one product: weights first.
                self.cache.put(("G", i), G_i, headroom=w_left)
                del W, G_i
                self.bar.update(1)
            error = self._check_finite(flags, range(len(self.mine)))
        except ValueError as e:  # bad weights on this rank: every rank stops with the same message
            error = str(e)
        D.agree_on_error(error)
        self._timed("read_gram", t0)

    def finish(self) -> CategoryResult:
        """Everything after pass A; returns with this rank's writes still in flight."""
        D.all_reduce_sum(self.G)
        decision = None
        if D.is_main():
            R, cond = gram_factor(self.G) if self.method != "householder" else (None, float("nan"))
            self.R = R
            ok = R is not None and cond <= GRAM_MAX_COND[self.dtype]
            decision = (ok, None if R is None else cond)
        ok, cond = D.broadcast_object(decision)
        result = None
        if ok:
            result = self._gram_factors(cond)
            worst = max(D.all_gather_object(max(result.error.values(), default=0.0)))
            if worst > GRAM_MAX_ERROR[self.dtype]:  # rounding got the better of it: redo the careful way
                result.wait()
                result = None
        if result is None:
            result = self._householder(cond)
        return result

    def close(self) -> None:
        """Drop the cached tensors and end the progress bar (also on errors, before anything is printed)."""
        self.cache.clear()
        self.bar.close()

    def _gram_factors(self, cond: float) -> CategoryResult:
        t0 = time.perf_counter()
        n = self.n
        self._reread([i for i in range(len(self.mine)) if ("G", i) not in self.cache])
        S = torch.zeros(n, n, dtype=torch.float64, device=self.device)
        for i in range(len(self.mine)):
            G_i = self.cache.get(("G", i))
            S += gram_t_pi_term(G_i if G_i is not None else gram(self._fetch(i)), self.G, self.pi)
        D.all_reduce_sum(S)
        V = torch.empty(n, n, dtype=torch.float64, device=self.device)
        Y = torch.empty(n, n, dtype=torch.float64, device=self.device)
        if D.is_main():
            V, _, Y = gram_basis(self.R, gram_t_pi(self.R, S, self.L))
            self.R = None
        del S
        D.broadcast(V)
        D.broadcast(Y)
        self._timed("t_pi_eigh", t0)
        t0 = time.perf_counter()
        Y = Y.to(self.dtype)
        self._reread(range(len(self.mine)))
        out = self._emit_all(V, (lambda i, W: weight_factors(W, Y)), "gram", cond)
        self._timed("factors", t0)
        return out

    # -- output (both routes)

    def _emit_all(self, V: Tensor, factors, method: str, cond: float | None) -> CategoryResult:
        """``factors(i, W_i) -> (U_i, σ_i)`` per member: errors measured, U/σ written; V by rank 0."""
        dtype = self.dtype
        V_c = V.to(dtype)
        V32 = V.float()
        V_stored = V32.to(dtype)  # (n, n): V as the store holds it, in the compute dtype
        exact_store = dtype == torch.float32 and self.u_dtype == torch.float32 and self.quant == "none"
        err: dict[str, Tensor] = {}
        stored: dict[str, Tensor] = {}
        n = self.n
        specs = {m: QuantSpec(self.quant, (self.ckpt.shape(m + ".weight")[0], n)) for m in self.mine} \
            if self.quant != "none" else {}
        self.writer.begin(self.category, D.get_rank(), [
            (m, [(u_key(m), torch.uint8, (specs[m].nbytes,)) if specs else
                 (u_key(m), self.u_dtype, (self.ckpt.shape(m + ".weight")[0], n)), (sigma_key(m), torch.float32, (n,))])
            for m in self.mine])
        for i, member in enumerate(self.mine):
            W = self._fetch(i)
            U_i, sigma_i = factors(i, W)  # (m_i, n), (n,) in the compute dtype
            err[member] = reconstruction_error_t(W, U_i, sigma_i, V_c)
            U_s, sigma_s = U_i.to(self.u_dtype), sigma_i.float()
            if specs:  # quantized from U in u_dtype, as load-time quantization of a dense store would
                blob = specs[member].pack(U_s)  # (nbytes,) uint8
                U_s = specs[member].unpack(blob, self.u_dtype)  # (m_i, n): what training will compute with
            stored[member] = err[member] if exact_store else reconstruction_error_t(
                W, U_s.to(dtype), sigma_s.to(dtype), V_stored)
            self.writer.add(u_key(member), blob if specs else U_s)
            self.writer.add(sigma_key(member), sigma_s)
            del W, U_i, U_s
            self.bar.update(1)
        if D.is_main():
            self.writer.write_file(v_file(self.category), {v_key(self.category): V32})
        files, writes = self.writer.finish()
        e = {m: float(x) for m, x in zip(err, torch.stack(list(err.values())).tolist())} if err else {}
        s = {m: float(x) for m, x in zip(stored, torch.stack(list(stored.values())).tolist())} if stored else {}
        self.bar.set_postfix_str(f"{method}, max err {max(e.values()) if e else 0:.1e}")
        return CategoryResult(files, e, s, self.phase, method, cond, writes)

    # -- Householder route

    def _householder(self, cond: float | None) -> CategoryResult:
        self.phase = {}
        itemsize = torch.finfo(self.dtype).bits // 8
        heights = [self.ckpt.shape(m + ".weight")[0] for m in self.mine]
        self.offsets = [0]
        for h in heights:
            self.offsets.append(self.offsets[-1] + h)
        self.blocks = make_blocks(heights, self.n, itemsize, self.block_gb * GiB)
        self.qcache = _QCache(self.device, max(0.0, self.cache_bytes - self.cache.used))
        V, Z = self._hh_basis(*self._hh_combine(self._hh_local_qr()))
        t0 = time.perf_counter()
        self._reread(range(len(self.mine)))
        block_of = {i: b for b, block in enumerate(self.blocks) for i in block}
        current: dict[int, Tensor] = {}

        def factors(i: int, W: Tensor) -> tuple[Tensor, Tensor]:
            b = block_of[i]
            if b not in current:
                current.clear()
                current[b] = self.qcache.pop(b)
            return member_factors(current[b][self._rows(self.blocks[b], i)], Z, self.n)

        out = self._emit_all(V, factors, "householder", cond)
        self._timed("factors", t0)
        return out

    def _rows(self, block: range, i: int) -> slice:
        base = self.offsets[block.start]
        return slice(self.offsets[i] - base, self.offsets[i + 1] - base)

    def _hh_local_qr(self) -> list[Tensor]:
        """``W_b = Q_b R_b`` per block; keeps ``Q_b`` (m_b, k_b), returns the ``R_b`` (k_b, n)."""
        t0 = time.perf_counter()
        self._reread(range(len(self.mine)))
        R_blocks: list[Tensor] = []
        for b, block in enumerate(self.blocks):
            rows = self.offsets[block.stop] - self.offsets[block.start]
            W_b = torch.empty(rows, self.n, dtype=self.dtype, device=self.device)  # (m_b, n)
            for i in block:
                W_b[self._rows(block, i)].copy_(self._fetch(i))
            Q_b, R_b = thin_qr(W_b)  # (m_b, k_b), (k_b, n)
            del W_b
            self.qcache.put(b, Q_b)
            R_blocks.append(R_b)
            del Q_b
        self._timed("read_qr", t0)
        return R_blocks

    def _hh_combine(self, R_blocks: list[Tensor]) -> tuple[list[Tensor], Tensor | None]:
        """Both TSQR levels. Returns ``M_b = Q̂_b Q̃_p`` (k_b, k) per block, and R (k, n) on rank 0."""
        t0 = time.perf_counter()
        if not R_blocks:
            Q_hat: list[Tensor] | None = []
            R_p = torch.zeros(0, self.n, dtype=self.dtype, device=self.device)
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
        Q_tilde_p = D.scatter_rows(Q_tilde, like=torch.empty(0, dtype=self.dtype, device=self.device))  # (k_p, k)
        M = [Q_tilde_p] if Q_hat is None else [Q_hat_b @ Q_tilde_p for Q_hat_b in Q_hat]
        del Q_hat, Q_tilde
        self.k = int(Q_tilde_p.shape[1])
        self._timed("combine", t0)
        return M, R

    def _hh_basis(self, M: list[Tensor], R: Tensor | None) -> tuple[Tensor, Tensor]:
        """``Q_b ← Q_b M_b`` (rows of the global Q), ``T_pi`` summed over ranks, ``V, Z`` from rank 0."""
        t0 = time.perf_counter()
        T_pi = torch.zeros(self.k, self.k, dtype=self.dtype, device=self.device)
        for b, block in enumerate(self.blocks):
            Q_g = self.qcache.pop(b) @ M[b]  # (m_b, k)
            for i in block:
                Q_i = Q_g[self._rows(block, i)]  # (m_i, k)
                T_pi += t_pi_term(Q_i.T @ Q_i, self.pi)
            self.qcache.put(b, Q_g)
            del Q_g
        del M
        D.all_reduce_sum(T_pi)
        T_pi /= self.L
        V = torch.empty(self.n, self.n, dtype=self.dtype, device=self.device)
        Z = torch.empty(self.k, self.k, dtype=self.dtype, device=self.device)
        if D.is_main():
            assert R is not None, "rank 0 holds the global R"
            V, Z = shared_basis(R, T_pi)  # (n, n), (k, k)
        D.broadcast(Z)
        D.broadcast(V)
        self._timed("t_pi_eigh", t0)
        return V, Z
