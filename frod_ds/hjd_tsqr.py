"""One category of the distributed HJD stage on one rank: tall-skinny QR over blocks and ranks (spec §1).

With ``P`` ranks and ``L`` members, rank ``p`` owns a contiguous run of members (``P > L`` allowed: a rank
without members still joins every collective) and splits it into blocks of at most ``block_gb``::

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
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import Tensor
from tqdm import tqdm

from frod_ds import distributed as D
from frod_ds.hf_checkpoint import HFCheckpoint
from frod_ds.hjd import member_factors, reconstruction_error, shared_basis, t_pi_term, thin_qr, tsqr_combine
from frod_ds.store import part_file, save_tensors_atomic, sigma_key, u_key, v_file, v_key

__all__ = ["CategoryResult", "split_counts", "make_blocks", "run_category"]

GiB = 2**30
T = TypeVar("T")


def split_counts(n_items: int, parts: int) -> list[int]:
    """Contiguous split sizes, ``numpy.array_split`` style: the first ``n_items % parts`` get one more."""
    return [n_items // parts + (1 if p < n_items % parts else 0) for p in range(parts)]


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
    """What one rank wrote for a category: ``{key: file}``, errors per member, phase timings."""

    files: dict[str, str]
    error: dict[str, float]
    stored_error: dict[str, float]
    phase_seconds: dict[str, float]


def _prefetch(fn: Callable[[Any], T], items: Sequence[Any], pool: ThreadPoolExecutor) -> Iterator[T]:
    """``fn(item)`` for each item, the next one computed in ``pool`` while the caller works on this one."""
    nxt: Future | None = pool.submit(fn, items[0]) if items else None
    for j in range(len(items)):
        assert nxt is not None
        cur = nxt.result()
        nxt = pool.submit(fn, items[j + 1]) if j + 1 < len(items) else None
        yield cur


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



class _CategoryJob:
    """This rank's share of one category: its members, their blocks, and the three passes over them."""

    def __init__(self, ckpt: HFCheckpoint, category: str, members: list[str], *, pi: float, dtype: torch.dtype,
                 device: torch.device, out: Path, block_gb: float, device_cache_gb: float, fsync: bool,
                 part_mb: float,
                 loader: ThreadPoolExecutor, writer: ThreadPoolExecutor):
        rank, world = D.get_rank(), D.get_world_size()
        self.ckpt, self.category, self.L = ckpt, category, len(members)
        self.pi, self.dtype, self.device, self.out, self.fsync = pi, dtype, device, out, fsync
        self.loader, self.writer = loader, writer
        self.part_bytes = part_mb * 2**20  # target size of one part file
        self.n = ckpt.shape(members[0] + ".weight")[1]
        self.u_dtype = ckpt.dtype(members[0] + ".weight")
        counts = split_counts(self.L, world)
        first = sum(counts[:rank])
        self.mine = members[first : first + counts[rank]]
        self.offsets = [0]  # row offsets of this rank's members in its local stack
        for m in self.mine:
            self.offsets.append(self.offsets[-1] + ckpt.shape(m + ".weight")[0])
        heights = [b - a for a, b in zip(self.offsets, self.offsets[1:])]
        self.blocks = make_blocks(heights, self.n, torch.finfo(dtype).bits // 8, block_gb * GiB)
        self.cache = _QCache(device, device_cache_gb * GiB)
        self.phase: dict[str, float] = {}
        self.bar = tqdm(total=2 * len(self.mine), desc=f"{category} L={self.L} n={self.n}", unit="member",
                        disable=not D.is_main(), dynamic_ncols=True, file=sys.stderr)

    # -- reading

    def _read(self, block: range) -> list[Tensor]:
        """In the loader thread: this block's weights as CPU tensors in the checkpoint dtype."""
        return [self.ckpt.get(self.mine[i] + ".weight") for i in block]

    def _rows(self, block: range, i: int) -> slice:
        base = self.offsets[block.start]
        return slice(self.offsets[i] - base, self.offsets[i + 1] - base)

    def _stack(self, block: range, Ws: list[Tensor]) -> Tensor:
        rows = self.offsets[block.stop] - self.offsets[block.start]
        W_b = torch.empty(rows, self.n, dtype=self.dtype, device=self.device)  # (m_b, n)
        for i, W in zip(block, Ws):
            W_b[self._rows(block, i)].copy_(W.to(self.device))  # ship in the checkpoint dtype, convert there
            if not torch.isfinite(W_b[self._rows(block, i)]).all():
                name = self.mine[i] + ".weight"
                raise ValueError(f"{name} in {self.ckpt.info(name).file} contains NaN or Inf; check the checkpoint")
        return W_b

    def _timed(self, name: str, t0: float) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.phase[name] = round(time.perf_counter() - t0, 3)

    # -- the passes

    def local_qr(self) -> list[Tensor]:
        """Pass 1: ``W_b = Q_b R_b`` per block; keeps ``Q_b`` (m_b, k_b), returns the ``R_b`` (k_b, n)."""
        t0 = time.perf_counter()
        R_blocks: list[Tensor] = []
        error = None
        try:
            for b, Ws in enumerate(_prefetch(self._read, self.blocks, self.loader)):
                W_b = self._stack(self.blocks[b], Ws)
                del Ws
                Q_b, R_b = thin_qr(W_b)  # (m_b, k_b), (k_b, n)
                del W_b
                self.cache.put(b, Q_b)
                R_blocks.append(R_b)
                del Q_b
                self.bar.update(len(self.blocks[b]))
        except ValueError as e:  # bad weights on this rank: every rank stops with the same message
            error = str(e)
        D.agree_on_error(error)
        self._timed("read_qr", t0)
        return R_blocks

    def combine(self, R_blocks: list[Tensor]) -> tuple[list[Tensor], Tensor | None]:
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

    def basis(self, M: list[Tensor], R: Tensor | None) -> tuple[Tensor, Tensor]:
        """Pass 2: ``Q_b ← Q_b M_b`` (rows of the global Q), ``T_pi`` summed over ranks, ``V, Z`` from rank 0."""
        t0 = time.perf_counter()
        T_pi = torch.zeros(self.k, self.k, dtype=self.dtype, device=self.device)
        for b, block in enumerate(self.blocks):
            Q_g = self.cache.pop(b) @ M[b]  # (m_b, k)
            for i in block:
                Q_i = Q_g[self._rows(block, i)]  # (m_i, k)
                T_pi += t_pi_term(Q_i.T @ Q_i, self.pi)
            self.cache.put(b, Q_g)
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

    def factors(self, V: Tensor, Z: Tensor) -> CategoryResult:
        """Pass 3: ``U_i, σ_i`` per member, checked against the weights read again, written per block."""
        t0 = time.perf_counter()
        rank, dtype, n = D.get_rank(), self.dtype, self.n
        V32 = V.float()
        V_stored = V32.to(dtype)  # (n, n): V as the store holds it, in the compute dtype
        exact_store = dtype == torch.float32 and self.u_dtype == torch.float32
        files: dict[str, str] = {}
        err: dict[str, float] = {}
        stored_err: dict[str, float] = {}
        pending: list[Future] = []
        tensors: dict[str, Tensor] = {}
        part = 0

        def flush() -> None:
            # Part files of about part_mb MiB, written while the next members are computed; at most one write
            # in flight keeps host memory bounded.
            nonlocal tensors, part
            if not tensors:
                return
            fname = part_file(self.category, rank, part)
            files.update(dict.fromkeys(tensors, fname))
            while pending:
                pending.pop().result()
            pending.append(self.writer.submit(save_tensors_atomic, self.out / fname, tensors, self.fsync))
            tensors, part = {}, part + 1

        for b, Ws in enumerate(_prefetch(self._read, self.blocks, self.loader)):
            block = self.blocks[b]
            Q_g = self.cache.pop(b)  # (m_b, k)
            for i, W_cpu in zip(block, Ws):
                member = self.mine[i]
                W_i = W_cpu.to(self.device).to(dtype)  # (m_i, n); a blocking H2D copy_ would convert on the CPU
                U_i, sigma_i = member_factors(Q_g[self._rows(block, i)], Z, n)  # (m_i, n), (n,)
                err[member] = reconstruction_error(W_i, U_i, sigma_i, V)
                U_s, sigma_s = U_i.to(self.u_dtype), sigma_i.float()
                stored_err[member] = err[member] if exact_store else reconstruction_error(
                    W_i, U_s.to(dtype), sigma_s.to(dtype), V_stored)
                tensors[u_key(member)] = U_s.cpu()
                tensors[sigma_key(member)] = sigma_s.cpu()
                del W_i, U_i, U_s
                self.bar.update(1)
                if sum(t.numel() * t.element_size() for t in tensors.values()) >= self.part_bytes:
                    flush()
            del Q_g, Ws
        flush()
        if D.is_main():
            files[v_key(self.category)] = v_file(self.category)
            pending.append(self.writer.submit(save_tensors_atomic, self.out / v_file(self.category),
                                              {v_key(self.category): V32.cpu()}, self.fsync))
        for f in pending:
            f.result()
        self._timed("factors_write", t0)
        self.bar.set_postfix_str(f"max err {max(err.values()) if err else 0:.1e}")
        return CategoryResult(files, err, stored_err, self.phase)


def run_category(ckpt: HFCheckpoint, category: str, members: list[str], **kwargs: Any) -> CategoryResult:
    """HJD of one category across all ranks (every rank calls it). Writes this rank's part files, and
    ``V`` on rank 0; returns what the manifest records for this rank. ``kwargs``: see ``_CategoryJob``."""
    job = _CategoryJob(ckpt, category, members, **kwargs)
    try:
        V, Z = job.basis(*job.combine(job.local_qr()))  # no frame keeps the R_b or M_b alive
        return job.factors(V, Z)
    finally:
        job.bar.close()
