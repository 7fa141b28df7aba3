"""One category of the distributed HJD stage on one rank: what it owns, where its weights come from (a
member source) and where its factors go (a factor sink). The routes (``frod_ds.hjd.routes``) are functions
over a source and a sink.

``MemberSource`` hands out this rank's weights ``W_i`` on the compute device in the checkpoint dtype: read
ahead by ``MemberReader``, kept between passes up to a byte budget (weights first, then Gram matrices);
beyond it a pass reads a weight again. ``FactorSink`` measures each member's reconstruction error, writes
``U_i``, ``σ_i`` (and, on rank 0, ``V``) through ``FactorWriter`` and returns a ``CategoryResult`` whose
writes finish in the background.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from tqdm import tqdm

from frod_ds.core.quant import QuantSpec
from frod_ds.formats.checksum import format_crc32
from frod_ds.formats.factor_store import sigma_key, u_key, v_file, v_key
from frod_ds.hjd.math import probe_error, probe_vectors, reconstruction_error_t, reconstruction_tol
from frod_ds.hjd.sharding import my_members
from frod_ds.hjd.streaming import FactorWriter, MemberReader
from frod_ds.io.dtypes import dtype_name
from frod_ds.io.hf_checkpoint import HFCheckpoint
from frod_ds.runtime import distributed as D

__all__ = ["CategorySpec", "CategoryResult", "Phases", "MemberSource", "FactorSink", "open_category"]

Factors = Callable[[int, Tensor], tuple[Tensor, Tensor]]  # (i, W_i) -> (U_i, σ_i) in the compute dtype


@dataclass(frozen=True)
class CategorySpec:
    """A category as one rank sees it: all its members (``L``), this rank's contiguous share, their shapes."""

    name: str
    members: list[str]  # all members, layer order
    mine: list[str]  # this rank's share
    heights: list[int]  # m_i of ``mine``
    n: int
    u_dtype: torch.dtype  # U is stored in it (or quantized from it): the checkpoint's dtype or --u-dtype
    quant: str = "none"  # "none", or U_i written as a frod_ds.core.quant blob of this kind (--quant)

    @property
    def L(self) -> int:
        return len(self.members)


@dataclass
class CategoryResult:
    """What one rank wrote for a category: ``{key: file}``, errors per member, phase timings, route, and
    (once written) ``{file: checksum}``."""

    files: dict[str, str]
    error: dict[str, float]
    stored_error: dict[str, float]
    phase_seconds: dict[str, float]
    method: str = "gram"
    cond_estimate: float | None = None
    writes: list[Future] = field(default_factory=list, repr=False)
    checksums: dict[str, str] = field(default_factory=dict)
    # per member: the probe errors (``hjd.math.probe_error``) of the factors as computed and as stored
    probe: dict[str, tuple[float, float]] = field(default_factory=dict)
    # per member: its largest |entry| (a weight far out of scale breaks the shared V of every member)
    peak: dict[str, float] = field(default_factory=dict)

    def probe_problem(
        self, spec: CategorySpec, dtype: torch.dtype, peaks: dict[str, float] | None = None
    ) -> str | None:
        """The line for this rank's first member whose factors, as computed (tolerance of the compute ``dtype``) or
        as stored (of U's dtype or quantization), miss the probe tolerance; None when every member holds. With the
        whole category's ``peaks`` (largest |entry| per member), a member far out of scale is named as the cause."""
        limits = (reconstruction_tol(dtype), reconstruction_tol(spec.u_dtype, spec.quant))
        held = (dtype_name(dtype), spec.quant if spec.quant != "none" else dtype_name(spec.u_dtype))
        for member, e in [*self.error.items(), *self.stored_error.items()]:  # both: a dict merge keeps one
            if not math.isfinite(e):  # the fp64 probe may hold, but the run's precision cannot carry the member
                peak = (peaks or self.peak).get(member, float("nan"))
                return (
                    f"HJD of {spec.name}: the reconstruction error of {member}.weight (entries up to {peak:.1e}) "
                    f"overflows in {held[0]} ({e}), so its factors can be neither checked nor trained in that "
                    f"precision; {_out_of_scale(peaks or self.peak)}"
                )
        for member, errors in self.probe.items():
            for what, e, limit, kind in zip(("computed", "stored"), errors, limits, held):
                if not e <= limit:  # NaN too
                    return (
                        f"HJD of {spec.name} does not reconstruct {member}.weight: its {what} factors are off by "
                        f"{e:.1e} (relative, on random probe vectors), more than the {limit:.0e} {kind} factors may "
                        f"be; {_out_of_scale(peaks or self.peak)}"
                    )
        return None

    def wait(self) -> CategoryResult:
        """Wait for this rank's files of the category to be on disk; returns itself without the futures."""
        for f in self.writes:
            fname, crc = f.result()
            self.checksums[fname] = format_crc32(crc)
        self.writes = []
        return self


def _out_of_scale(peaks: dict[str, float], factor: float = 100.0) -> str:
    """What to check: the member whose largest |entry| exceeds ``factor`` × the members' median, if one does."""
    if len(peaks) > 1:
        worst = max(peaks, key=lambda m: (not math.isfinite(peaks[m]), peaks[m]))
        others = sorted(v for m, v in peaks.items() if m != worst)
        median = others[len(others) // 2]
        if not peaks[worst] <= factor * median:
            return (
                f"{worst}.weight is out of scale (entries up to {peaks[worst]:.1e}, the category's other members "
                f"{median:.1e} in median): check that tensor in the checkpoint"
            )
    return (
        "the weights hold values the decomposition cannot represent (extreme or mismatched scales): check the "
        "checkpoint"
    )


class Phases:
    """Wall time per named phase (the device synchronised at the end of each), into ``seconds``."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.seconds[name] = round(time.perf_counter() - t0, 3)


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


class MemberSource:
    """This rank's weights of one category on the compute device (see the module docstring).

    ``weight(i)`` is member ``mine[i]``'s ``W_i`` (from the cache, else read); ``keep`` offers a tensor to the
    cache (``("W", i)``: a weight, ``("G", i)``: its Gram matrix); ``reread`` schedules the reads a pass is
    about to need, ahead of anything else queued."""

    def __init__(
        self, spec: CategorySpec, ckpt: HFCheckpoint, reader: MemberReader, device: torch.device, cache_bytes: float
    ):
        self.spec, self.ckpt, self.reader, self.device = spec, ckpt, reader, device
        self.cache_bytes = cache_bytes
        self.cache = _Cache(cache_bytes)

    def __len__(self) -> int:
        return len(self.spec.mine)

    def weight(self, i: int) -> Tensor:
        W = self.cache.get(("W", i))
        return W if W is not None else self.reader.take(self.spec.mine[i])

    def keep(self, key: tuple[str, int], t: Tensor, headroom: float = 0.0) -> None:
        self.cache.put(key, t, headroom)

    def cached(self, key: tuple[str, int]) -> Tensor | None:
        return self.cache.get(key)

    def reread(self, indices: Sequence[int]) -> None:
        self.reader.schedule([self.spec.mine[i] for i in indices if ("W", i) not in self.cache], first=True)

    def unread_bytes(self) -> int:
        """Bytes of this rank's weights of the category (all of them are still to be read in pass A)."""
        return sum(self.ckpt.info(m + ".weight").nbytes for m in self.spec.mine)

    def spare_cache_bytes(self) -> float:
        return max(0.0, self.cache_bytes - self.cache.used)

    def member_problem(self, flags: list[Tensor]) -> str | None:
        """The message for the first member whose flags (``isfinite(W_i).all()``, ``W_i.ne(0).any()``) are not
        both true, or ``None``. A weight of zeros decomposes exactly, but into a zero ``U_i``: FRoD could never
        move that layer, and no trained checkpoint holds one."""
        if not flags:
            return None
        for j, (finite, nonzero) in enumerate(torch.stack(flags).cpu().tolist()):
            name = self.spec.mine[j] + ".weight"
            if not finite:
                return f"{name} in {self.ckpt.info(name).file} contains NaN or Inf; check the checkpoint"
            if not nonzero:
                return (
                    f"{name} in {self.ckpt.info(name).file} is all zeros: its factor U_i would be zero and FRoD "
                    "could never train that layer; check the checkpoint (no trained model holds such a weight)"
                )
        return None

    def close(self) -> None:
        self.cache.clear()


class FactorSink:
    """Where a route's factors go (see the module docstring); also the category's progress bar."""

    def __init__(self, spec: CategorySpec, writer: FactorWriter, dtype: torch.dtype):
        self.spec, self.writer, self.dtype = spec, writer, dtype
        self.bar = tqdm(
            total=2 * len(spec.mine),
            desc=f"{spec.name} L={spec.L} n={spec.n}",
            unit="member",
            disable=not D.is_main(),
            dynamic_ncols=True,
            file=sys.stderr,
        )

    def emit(
        self,
        source: MemberSource,
        V: Tensor,
        factors: Factors,
        method: str,
        cond: float | None,
        phase_seconds: dict[str, float],
    ) -> CategoryResult:
        """``factors(i, W_i) -> (U_i, σ_i)`` per member: errors measured, U/σ written; V by rank 0."""
        spec, dtype, n = self.spec, self.dtype, self.spec.n
        V_c = V.to(dtype)
        V32 = V.float()
        V_stored = V32.to(dtype)  # (n, n): V as the store holds it, in the compute dtype
        exact_store = dtype == torch.float32 and spec.u_dtype == torch.float32 and spec.quant == "none"
        err: dict[str, Tensor] = {}
        stored: dict[str, Tensor] = {}
        probe: dict[str, Tensor] = {}
        peak: dict[str, Tensor] = {}
        X = probe_vectors(n, zlib.crc32(spec.name.encode())).to(source.device)  # (n, PROBES), same on every rank
        qspecs = (
            {m: QuantSpec(spec.quant, (h, n)) for m, h in zip(spec.mine, spec.heights)} if spec.quant != "none" else {}
        )
        self.writer.begin(
            spec.name,
            D.get_rank(),
            [
                (
                    m,
                    [
                        (u_key(m), torch.uint8, (qspecs[m].nbytes,)) if qspecs else (u_key(m), spec.u_dtype, (h, n)),
                        (sigma_key(m), torch.float32, (n,)),
                    ],
                )
                for m, h in zip(spec.mine, spec.heights)
            ],
        )
        for i, member in enumerate(spec.mine):
            W = source.weight(i)
            lo, hi = torch.aminmax(W)
            peak[member] = torch.maximum(-lo, hi).float()
            U_i, sigma_i = factors(i, W)  # (m_i, n), (n,) in the compute dtype
            err[member] = reconstruction_error_t(W, U_i, sigma_i, V_c)
            U_s, sigma_s = U_i.to(spec.u_dtype), sigma_i.float()
            if qspecs:  # quantized from U in u_dtype, as load-time quantization of a dense store would
                blob = qspecs[member].pack(U_s)  # (nbytes,) uint8
                U_s = qspecs[member].unpack(blob, spec.u_dtype)  # (m_i, n): what training will compute with
            stored[member] = (
                err[member] if exact_store else reconstruction_error_t(W, U_s.to(dtype), sigma_s.to(dtype), V_stored)
            )
            probe[member] = torch.stack([probe_error(W, U_i, sigma_i, V_c, X), probe_error(W, U_s, sigma_s, V32, X)])
            self.writer.add(u_key(member), blob if qspecs else U_s)
            self.writer.add(sigma_key(member), sigma_s)
            del W, U_i, U_s
            self.bar.update(1)
        if D.is_main():
            self.writer.write_file(v_file(spec.name), {v_key(spec.name): V32})
        files, writes = self.writer.finish()
        e = {m: float(x) for m, x in zip(err, torch.stack(list(err.values())).tolist())} if err else {}
        s = {m: float(x) for m, x in zip(stored, torch.stack(list(stored.values())).tolist())} if stored else {}
        p = {m: tuple(x) for m, x in zip(probe, torch.stack(list(probe.values())).tolist())} if probe else {}
        top = dict(zip(peak, torch.stack(list(peak.values())).tolist())) if peak else {}
        self.bar.set_postfix_str(f"{method}, max err {max(e.values()) if e else 0:.1e}")
        return CategoryResult(files, e, s, phase_seconds, method, cond, writes, probe=p, peak=top)

    def close(self) -> None:
        self.bar.close()


def open_category(
    ckpt: HFCheckpoint,
    category: str,
    members: list[str],
    reader: MemberReader,
    writer: FactorWriter,
    device: torch.device,
    dtype: torch.dtype,
    u_dtype: torch.dtype | None,
    cache_bytes: float,
    quant: str = "none",
) -> tuple[MemberSource, FactorSink]:
    """This rank's source and sink of ``category`` (close both when done, also on errors). ``u_dtype``: the
    dtype U is stored in (None: the checkpoint's); ``quant``: nf4 | int8 stores U quantized from it."""
    mine = my_members(members, D.get_rank(), D.get_world_size())
    spec = CategorySpec(
        category,
        list(members),
        mine,
        [ckpt.shape(m + ".weight")[0] for m in mine],
        ckpt.shape(members[0] + ".weight")[1],
        u_dtype or ckpt.dtype(members[0] + ".weight"),
        quant,
    )
    return MemberSource(spec, ckpt, reader, device, cache_bytes), FactorSink(spec, writer, dtype)
