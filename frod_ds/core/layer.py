"""The FRoD layer, spec §2: ``y = U (diag σ + S) Vᵀ x + b`` with U, V frozen and σ, S trainable.

One flat module: frozen factors are frozen Parameters (never buffers, so ZeRO-3 partitions them), ``V`` one
Parameter shared by a category, trainable tensors prefixed ``frod_``. ``S`` is a value vector over a fixed
off-diagonal support; each call scatters ``M = diag σ + S`` once and runs dense GEMMs in the cheaper of two exact
orders. A quantized ``U`` (``frod_ds.core.quant``) is read through ``frozen_dense`` / ``frozen_linear``.
Design and algebra: docs/layer.md.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from frod_ds.core.frod_function import (
    FRoDTokens,
    FRoDWeight,
    autocast_off,
    core_matrix,
    core_matrix_at,
    core_positions,
    member_of,
    spans_of,
)
from frod_ds.core.quant import frozen_dense, frozen_linear, logical_shape
from frod_ds.core.sizes import ordering, support_nnz, trainable_numel  # noqa: F401 (trainable_numel: its 0.1 home)
from frod_ds.runtime.errors import FrodError
from frod_ds.runtime.validate import sparsity_problem

__all__ = [
    "SparseSupport",
    "FRoDLinear",
    "FRoDTrainables",
    "FRoDFrozen",
    "core_matrix",
    "support_seed",
    "ordering",
    "support_nnz",
]

TRAINABLE_PREFIX = "frod_"


def support_seed(seed: int, category: str) -> int:
    """The support seed of a category: stable across processes, Python versions and category order."""
    return (int(seed) * 1_000_003 + zlib.crc32(category.encode())) % (2**63 - 1)


class SparseSupport:
    """A fixed strictly off-diagonal support of ``S`` for an ``(n, n)`` matrix, shared by a category.

    ``flat`` holds sorted row-major indices ``row * n + col`` (int64). Not a buffer and not a module, so
    ``Module.to`` never duplicates it per member; ``on(device)`` caches one copy per device.
    """

    def __init__(self, n: int, flat: Tensor):
        assert flat.dtype == torch.int64 and flat.ndim == 1, "support indices must be a 1-D int64 tensor"
        self.n = int(n)
        self.flat = flat.cpu()
        self._cache: dict[torch.device, Tensor] = {}
        self._rc_cache: dict[torch.device, tuple[Tensor, Tensor]] = {}
        self._core_cache: dict[torch.device, Tensor] = {}

    @classmethod
    def random(cls, n: int, sparsity: float, seed: int) -> SparseSupport:
        """``nnz = round(sparsity·n²)`` positions off the diagonal, uniformly without replacement; ``sparsity``
        is the density of S (the recipe's ``model.sparsity``)."""
        problem = sparsity_problem(sparsity, "sparsity s")
        if problem:
            raise FrodError(problem)
        nnz = support_nnz(n, sparsity)
        if nnz > n * (n - 1):
            raise FrodError(
                f"sparsity s={sparsity} asks for {nnz} off-diagonal entries but an {n}x{n} matrix has only "
                f"{n * (n - 1)}; use s <= {1 - 1 / n:.4g}"
            )
        g = torch.Generator(device="cpu").manual_seed(int(seed))
        j = torch.randperm(n * (n - 1), generator=g)[:nnz]  # index among the off-diagonal positions
        row, c = j // (n - 1), j % (n - 1)
        col = c + (c >= row).long()  # skip the diagonal
        return cls(n, torch.sort(row * n + col).values)

    @classmethod
    def from_rows_cols(cls, n: int, rows_cols: Tensor) -> SparseSupport:
        """From a ``(2, nnz)`` (row, col) tensor as stored in adapter checkpoints; validated."""
        rows, cols = rows_cols.long()
        if rows.numel() and (rows.min() < 0 or cols.min() < 0 or rows.max() >= n or cols.max() >= n):
            raise FrodError(f"S support has indices outside an {n}x{n} matrix")
        if (rows == cols).any():
            raise FrodError("S support must be strictly off-diagonal")
        flat = rows * n + cols
        if torch.unique(flat).numel() != flat.numel():
            raise FrodError("S support has duplicate (row, col) entries")
        return cls(n, flat)

    @property
    def nnz(self) -> int:
        return self.flat.numel()

    def rows_cols(self) -> Tensor:
        """``(2, nnz)`` (row, col), the on-disk layout."""
        return torch.stack([self.flat // self.n, self.flat % self.n])

    def on(self, device: torch.device) -> Tensor:
        if device not in self._cache:
            self._cache[device] = self.flat.to(device)
        return self._cache[device]

    def core_positions_on(self, device: torch.device) -> Tensor:
        """The flat positions of ``diag σ + S`` in an (n, n) matrix, the diagonal's then the support's ((n + nnz,),
        int64), cached per device (``frod_ds.core.frod_function.core_matrix_at``)."""
        if device not in self._core_cache:
            self._core_cache[device] = core_positions(self.n, self.flat, device)
        return self._core_cache[device]

    def rows_cols_on(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """``(rows, cols)`` (nnz,) each on ``device``, cached (the sampled ∂S product reads them)."""
        if device not in self._rc_cache:
            rows, cols = self.rows_cols().to(device)
            self._rc_cache[device] = (rows, cols)
        return self._rc_cache[device]


class FRoDTrainables(nn.Module):
    """σ and S values of several FRoD layers (the members of one decoder layer) as two flat Parameters,
    ``frod_sigma`` (Σ n) and ``frod_s`` (Σ nnz), in ``members`` order; each member's ``frod_sigma`` / ``frod_s`` is a
    view of its span. Values, gradients and AdamW's arithmetic are unchanged; DeepSpeed's per-parameter host work
    then runs for 2 tensors instead of 12 per 7B layer (docs/layer.md#one-flat-module). The adapter and checkpoint
    formats keep one σ and one S per member (``spans``; ``frod_ds.train.trainable_state`` splits and joins by it).
    """

    def __init__(self, members: list[tuple[str, int, int]], dtype: torch.dtype, device: torch.device | None = None):
        """``members``: ``(name relative to the owning module, n, nnz)`` each, in the model's module order."""
        super().__init__()
        self.members = [name for name, _, _ in members]
        self.sigma_spans: list[tuple[int, int]] = []
        self.s_spans: list[tuple[int, int]] = []
        a = b = 0
        for _, n, nnz in members:
            self.sigma_spans.append((a, a + n))
            self.s_spans.append((b, b + nnz))
            a, b = a + n, b + nnz
        self.frod_sigma = nn.Parameter(torch.empty(a, dtype=dtype, device=device))
        self.frod_s = nn.Parameter(torch.zeros(b, dtype=dtype, device=device))

    def spans(self, leaf: str) -> list[tuple[int, int]]:
        """Each member's ``(start, end)`` in the Parameter ``leaf`` (``frod_sigma`` or ``frod_s``)."""
        return self.sigma_spans if leaf == "frod_sigma" else self.s_spans

    def extra_repr(self) -> str:
        return f"members={len(self.members)}, sigma={self.sigma_spans[-1][1]}, s={self.s_spans[-1][1]}"


class FRoDFrozen(nn.Module):
    """The frozen ``U_i`` of several FRoD layers (the members of one decoder layer) as one flat frozen Parameter
    ``U`` (Σ m·n elements, the members' in ``members`` order, each row-major); each member's ``U`` is an ``(m, n)``
    view of its span. What a ZeRO-3 fetch of the layer handles is then one frozen tensor instead of one per member:
    DeepSpeed's host work per gather, release and re-partition is per Parameter (on one GPU, where nothing crosses a
    link, that work is ZeRO-3's cost), while the elements gathered are the same. Dense ``U`` only: a quantized ``U``
    keeps its own Parameter, whose spec says how to read its bytes.

    Frozen and never saved (checkpoints exclude frozen parameters; adapters hold σ and S): no on-disk format sees it.
    """

    def __init__(self, members: list[tuple[str, int, int]], dtype: torch.dtype, device: torch.device | None = None):
        """``members``: ``(name relative to the owning module, m, n)`` each, in the model's module order."""
        super().__init__()
        self.members = [name for name, _, _ in members]
        self.shapes: list[tuple[int, int]] = []
        self.spans: list[tuple[int, int]] = []
        a = 0
        for _, m, n in members:
            self.shapes.append((m, n))
            self.spans.append((a, a + m * n))
            a += m * n
        self.U = nn.Parameter(torch.empty(a, dtype=dtype, device=device), requires_grad=False)

    def span(self, i: int) -> tuple[int, int, int, int]:
        """Member ``i``'s ``(start, end, m, n)`` in ``U`` (``frod_ds.core.frod_function.member_of``)."""
        return (*self.spans[i], *self.shapes[i])

    def member(self, i: int) -> Tensor:
        """Member ``i``'s ``U`` (m, n): a view of the flat Parameter (ZeRO-3: valid while gathered)."""
        return member_of(self.U, self.span(i))

    def extra_repr(self) -> str:
        return f"members={len(self.members)}, numel={self.spans[-1][1]}"


class FRoDLinear(nn.Module):
    """``y = U (diag σ + S) Vᵀ x + b``: a drop-in for an ``nn.Linear`` of shape ``(m, n)``; ``(..., n)`` → ``(..., m)``.

    Args:
        U: frozen ``(m, n)`` factor, or a quantized one (``frod_ds.core.quant.quantized_parameter``); V: frozen
            ``(n, n)`` Parameter shared by the category (kept as the same object).
        sigma: ``(n,)`` initial strengths ``σ_i`` from HJD; support: the category's ``SparseSupport``; bias: the
            base layer's ``(m,)`` or None, kept frozen. flat, frozen: ``(holder, i)``: σ and S (``FRoDTrainables``)
            or ``U`` (``FRoDFrozen``) are member ``i`` of a holder that owns them (``sigma`` resp. ``U`` ignored).
    """

    def __init__(
        self,
        U: Tensor | None,
        V: nn.Parameter,
        sigma: Tensor,
        support: SparseSupport,
        bias: Tensor | None = None,
        flat: tuple[FRoDTrainables, int] | None = None,
        frozen: tuple[FRoDFrozen, int] | None = None,
    ):
        super().__init__()
        m, n = frozen[0].shapes[frozen[1]] if frozen is not None else logical_shape(U)
        v_shape = tuple(getattr(V, "ds_shape", V.shape))  # ZeRO-3 may already have partitioned a shared V
        assert v_shape == (n, n), f"V must be ({n}, {n}) for U of shape {(m, n)}, got {v_shape}"
        assert sigma.shape == (n,), f"sigma must be ({n},), got {tuple(sigma.shape)}"
        assert support.n == n, f"support is for n={support.n}, layer has n={n}"
        assert isinstance(V, nn.Parameter), "V must be an nn.Parameter shared by the category"
        self.in_features, self.out_features = n, m
        object.__setattr__(self, "_frozen", frozen)  # not a submodule: the holder belongs to the decoder layer
        if frozen is None:
            self.U = U if isinstance(U, nn.Parameter) else nn.Parameter(U, requires_grad=False)
        u = self.u_parameter()
        u.requires_grad_(False)
        self.V = V
        self.V.requires_grad_(False)
        object.__setattr__(self, "_flat", flat)  # not a submodule either
        if flat is None:
            self.frod_sigma = nn.Parameter(sigma.detach().clone().to(u.dtype))
            self.frod_s = nn.Parameter(torch.zeros(support.nnz, dtype=u.dtype, device=u.device))
        else:
            holder, i = flat
            (a, b), (c, d) = holder.sigma_spans[i], holder.s_spans[i]
            assert b - a == n and d - c == support.nnz, (
                f"holder span {i} is ({b - a}, {d - c}), not ({n}, {support.nnz})"
            )
        if bias is not None and not isinstance(bias, nn.Parameter):
            bias = nn.Parameter(bias.detach().clone())
        self.bias = bias  # the base layer's own Parameter (ZeRO-3 may hold it partitioned), frozen
        if bias is not None:
            bias.requires_grad_(False)
        self.support = support
        # "auto": the cheaper exact ordering per call (``ordering``); "tokens" / "weight" force one (benchmarks).
        self.mode = "auto"
        # "function": the autograd Functions of frod_function.py; "autograd": the same products through plain
        # autograd, which keeps M (token order) for the backward — the reference they are measured against.
        self.impl = "function"
        # What the token order keeps for the backward: "z" (= Vᵀx, T·n per member) or "x" (shared by the
        # members reading the same input, e.g. q/k/v; z is recomputed: T·n² more multiply-adds).
        self.save = "z"
        # How ∂σ, ∂S are taken: "dense" (one n×n GEMM, gathered) or "sampled" (support entries only).
        self.dgrad = "dense"

    # -- the frozen and trainable tensors ----------------------------------------------------------------

    @property
    def U(self) -> Tensor:
        """U (m, n): this module's Parameter, or its span of the holder's (a view; ZeRO-3: valid while gathered)."""
        if self._frozen is None:
            return _own(self, "U")
        holder, i = self._frozen
        return holder.member(i)

    def u_parameter(self) -> nn.Parameter:
        """The Parameter holding this module's U (its own, or its holder's): what a ZeRO-3 gather needs."""
        return _own(self, "U") if self._frozen is None else self._frozen[0].U

    @property
    def frod_sigma(self) -> Tensor:
        """σ (n,): this module's Parameter, or its span of the holder's (a view; ZeRO-3: valid while gathered)."""
        return self._trainable("frod_sigma")

    @property
    def frod_s(self) -> Tensor:
        """S values (nnz,): this module's Parameter, or its span of the holder's."""
        return self._trainable("frod_s")

    def _trainable(self, leaf: str) -> Tensor:
        if self._flat is None:
            return _own(self, leaf)
        holder, i = self._flat
        a, b = holder.spans(leaf)[i]
        return getattr(holder, leaf)[a:b]

    def frod_parameters(self) -> list[nn.Parameter]:
        """The Parameters holding this module's σ and S (its own, or its holder's): what a ZeRO-3 gather needs."""
        if self._flat is None:
            return [self._parameters["frod_sigma"], self._parameters["frod_s"]]
        holder = self._flat[0]
        return [holder.frod_sigma, holder.frod_s]

    # -- the math ------------------------------------------------------------------------------------

    def core(self, dtype: torch.dtype | None = None, device: torch.device | None = None) -> Tensor:
        """``M = diag σ + S`` as a dense ``(n, n)`` matrix (differentiable in σ and the S values)."""
        sigma = self.frod_sigma
        return core_matrix_at(
            sigma, self.frod_s, self.support.core_positions_on(device or sigma.device), dtype or sigma.dtype
        )

    def forward(self, x: Tensor) -> Tensor:
        """``x`` (..., n) → (..., m), by the cheaper of two exact orderings (``ordering``)."""
        n, m = self.in_features, self.out_features
        assert (
            self.save in ("z", "x") and self.dgrad in ("dense", "sampled") and self.impl in ("function", "autograd")
        ), (self.save, self.dgrad, self.impl)
        dt = _compute_dtype(x)
        mode = self.mode
        if mode == "auto":
            mode = ordering(x.numel() // n, m, n, torch.is_grad_enabled(), recompute=self.save == "x")
        assert mode in ("tokens", "weight"), f"FRoDLinear.mode must be auto|tokens|weight, got {mode!r}"
        # Each Parameter read once per call: under ZeRO-3 every attribute read of one runs DeepSpeed's Python
        u, V, bias = self.u_parameter(), self.V, self.bias
        frozen_train = u.requires_grad or V.requires_grad or getattr(bias, "requires_grad", False)
        if self.impl == "function" and not frozen_train:
            xt = x.reshape(-1, n).to(dt)  # (T, n)
            # the holders of U, σ and S and this layer's spans of them: the Functions keep holders, never views
            span = None if self._frozen is None else self._frozen[0].span(self._frozen[1])
            if self._flat is None:
                sigma, s_values, held = self.frod_sigma, self.frod_s, None
            else:
                holder, i = self._flat
                held = (holder.frod_sigma, holder.sigma_spans[i], holder.frod_s, holder.s_spans[i])
                sigma, s_values = spans_of(held[0], held[2], held)
            with autocast_off(x.device.type):  # the Functions run in dt, forward and backward
                if mode == "tokens":
                    y = FRoDTokens.apply(
                        xt,
                        sigma,
                        s_values,
                        u,
                        V,
                        bias,
                        self.support,
                        self.save == "z",
                        self.dgrad == "dense",
                        span,
                        held,
                    )  # (T, m)
                else:
                    y = FRoDWeight.apply(
                        xt, sigma, s_values, u, V, bias, self.support, self.dgrad == "dense", span, held
                    )  # (T, m)
            return y.view(*x.shape[:-1], m)
        # Plain autograd (the reference, and the route when a frozen factor trains): keeps M or W, and views
        # of U and V, for the backward; a quantized U is dequantized per use (frozen_dense / frozen_linear).
        M = self.core(x.dtype, x.device)  # (n, n)
        V, bias = self.V.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype)
        if mode == "weight":
            W = F.linear(frozen_dense(self.U, x.dtype) @ M, V)  # (m, n) = U M Vᵀ
            return F.linear(x, W, bias)
        z = x @ V  # (..., n)   z = Vᵀx
        h = F.linear(z, M)  # (..., n)   h = M z
        return frozen_linear(h, self.U, bias)  # (..., m)

    @torch.no_grad()
    def merged_weight(self, dtype: torch.dtype | None = None) -> Tensor:
        """``W' = U (diag σ + S) Vᵀ`` (m, n), computed in fp32 (or ``dtype`` if wider), returned in U's dtype
        (a quantized U: dequantized first)."""
        cdt = dtype or (torch.float64 if self.U.dtype == torch.float64 else torch.float32)
        W = (frozen_dense(self.U, cdt) @ self.core(cdt)) @ self.V.to(cdt).T
        return W.to(self.U.dtype)

    @torch.no_grad()
    def update_norms_sq(self, sigma0: Tensor) -> tuple[float, float]:
        """``(‖ΔW_on‖²_F, ‖ΔW_off‖²_F)`` with ``ΔW_on = U diag(σ−σ⁰) Vᵀ``, ``ΔW_off = U S Vᵀ`` (spec §2)."""
        U, V = frozen_dense(self.U, torch.float32), self.V.float()
        d = self.frod_sigma.float() - sigma0.to(U.device).float()
        on = torch.linalg.matrix_norm((U * d) @ V.T) ** 2
        n = self.in_features
        S = torch.zeros(n * n, device=U.device).scatter(0, self.support.on(U.device), self.frod_s.float()).view(n, n)
        off = torch.linalg.matrix_norm((U @ S) @ V.T) ** 2
        return float(on), float(off)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"nnz={self.support.nnz}, bias={self.bias is not None}"
        )


def _own(module: nn.Module, name: str) -> nn.Parameter:
    p = module._parameters.get(name)
    if p is None:  # AttributeError, as for any missing attribute (nn.Module's registration asks hasattr first)
        raise AttributeError(f"{type(module).__name__} has no parameter {name!r} yet")
    return p


def _compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype matmuls on ``x`` run in: the autocast dtype where autocast is on for its device, else x's."""
    if x.is_floating_point() and torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def tan_alpha(on_sq: float, off_sq: float) -> float:
    """Rotation angle ``tan α = ‖ΔW_off‖ / ‖ΔW_on‖`` (``inf`` when only S moved, 0 when nothing did)."""
    if on_sq == 0:
        return 0.0 if off_sq == 0 else math.inf
    return math.sqrt(off_sq / on_sq)
