"""The FRoD layer, spec §2: ``y = U (diag σ + S) Vᵀ x + b`` with U, V frozen and σ, S trainable.

One flat module, no adapter hierarchy. Frozen factors are ``nn.Parameter`` with ``requires_grad=False``
(never buffers: ZeRO-3 partitions and offloads parameters, buffers are replicated on every GPU). ``V`` is
one Parameter object shared by every member of a category. Trainable tensors share the prefix ``frod_``.

The sparse ``S`` is a dense 1-D vector of values over a fixed strictly off-diagonal support (a flat index
tensor shared by the category). The forward never gathers ``z`` per token: it scatters σ and the S
values into a dense ``(n, n)`` matrix ``M = diag σ + S`` once per call and runs dense GEMMs, choosing
between two exact orderings by FLOPs (see ``FRoDLinear.forward``).

``U`` may be quantized (``frod_ds.quant``: NF4 or int8 bytes in a Parameter of the model's dtype); every
read of it goes through ``frozen_dense`` / ``frozen_linear``, which dequantize, so the layer computes
``Ũ (diag σ + S) Vᵀ x + b`` with ``Ũ`` the dequantized ``U``. V, σ and S are never quantized.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from frod_ds.quant import frozen_dense, frozen_linear, logical_shape

__all__ = ["SparseSupport", "FRoDLinear", "core_matrix", "support_seed", "ordering"]

TRAINABLE_PREFIX = "frod_"


def support_seed(seed: int, category: str) -> int:
    """The support seed of a category: stable across processes, Python versions and category order."""
    return (int(seed) * 1_000_003 + zlib.crc32(category.encode())) % (2**63 - 1)


def core_matrix(sigma: Tensor, s_values: Tensor, support_flat: Tensor, dtype: torch.dtype,
                device: torch.device | str) -> Tensor:
    """Dense ``diag σ + S`` (n, n); ``S``'s values at the flat (row·n + col) ``support_flat`` positions."""
    n = sigma.shape[0]
    diag = torch.arange(0, n * n, n + 1, device=device)
    idx = torch.cat([diag, support_flat.to(device)])  # (n + nnz,)
    vals = torch.cat([sigma, s_values]).to(device=device, dtype=dtype)  # (n + nnz,)
    return torch.zeros(n * n, dtype=dtype, device=device).scatter(0, idx, vals).view(n, n)


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

    @classmethod
    def random(cls, n: int, density: float, seed: int) -> SparseSupport:
        """``nnz = round(density·n²)`` positions off the diagonal, uniformly without replacement."""
        if not (isinstance(density, (int, float)) and 0 < density < 1):
            raise ValueError(f"sparsity s must be in (0, 1), got {density!r}")
        nnz = int(round(density * n * n))
        if nnz > n * (n - 1):
            raise ValueError(
                f"sparsity s={density} asks for {nnz} off-diagonal entries but an {n}x{n} matrix has only "
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
            raise ValueError(f"S support has indices outside an {n}x{n} matrix")
        if (rows == cols).any():
            raise ValueError("S support must be strictly off-diagonal")
        flat = rows * n + cols
        if torch.unique(flat).numel() != flat.numel():
            raise ValueError("S support has duplicate (row, col) entries")
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


class FRoDLinear(nn.Module):
    """``y = U (diag σ + S) Vᵀ x + b`` — a drop-in for an ``nn.Linear`` of shape ``(m, n)``.

    Args:
        U: frozen ``(m, n)`` factor (a Parameter or a tensor, made a frozen Parameter), or a quantized one
            (``frod_ds.quant.quantized_parameter``: its ``frod_quant`` spec gives (m, n)).
        V: frozen ``(n, n)`` Parameter shared by the category (kept as the same object).
        sigma: ``(n,)`` initial strengths ``σ_i`` from HJD.
        support: the category's ``SparseSupport``.
        bias: the base layer's bias ``(m,)`` or None, kept frozen.
    Input ``(..., n)`` → output ``(..., m)``.
    """

    def __init__(self, U: Tensor, V: nn.Parameter, sigma: Tensor, support: SparseSupport, bias: Tensor | None = None):
        super().__init__()
        m, n = logical_shape(U)
        v_shape = tuple(getattr(V, "ds_shape", V.shape))  # ZeRO-3 may already have partitioned a shared V
        assert v_shape == (n, n), f"V must be ({n}, {n}) for U of shape {tuple(U.shape)}, got {v_shape}"
        assert sigma.shape == (n,), f"sigma must be ({n},), got {tuple(sigma.shape)}"
        assert support.n == n, f"support is for n={support.n}, layer has n={n}"
        assert isinstance(V, nn.Parameter), "V must be an nn.Parameter shared by the category"
        self.in_features, self.out_features = n, m
        self.U = U if isinstance(U, nn.Parameter) else nn.Parameter(U, requires_grad=False)
        self.U.requires_grad_(False)
        self.V = V
        self.V.requires_grad_(False)
        self.frod_sigma = nn.Parameter(sigma.detach().clone().to(U.dtype))
        self.frod_s = nn.Parameter(torch.zeros(support.nnz, dtype=U.dtype, device=U.device))
        if bias is not None and not isinstance(bias, nn.Parameter):
            bias = nn.Parameter(bias.detach().clone())
        self.bias = bias  # the base layer's own Parameter (ZeRO-3 may hold it partitioned), frozen
        if bias is not None:
            bias.requires_grad_(False)
        self.support = support
        # "auto": the cheaper exact ordering per call (``ordering``); "tokens" / "weight" force one (benchmarks).
        self.mode = "auto"

    # -- the math ------------------------------------------------------------------------------------

    def core(self, dtype: torch.dtype | None = None, device: torch.device | None = None) -> Tensor:
        """``M = diag σ + S`` as a dense ``(n, n)`` matrix (differentiable in σ and the S values)."""
        device = device or self.frod_sigma.device
        return core_matrix(self.frod_sigma, self.frod_s, self.support.on(device), dtype or self.frod_sigma.dtype, device)

    def forward(self, x: Tensor) -> Tensor:
        """``x`` (..., n) → (..., m), by the cheaper of two exact orderings (``ordering``)."""
        M = self.core(x.dtype, x.device)  # (n, n)
        tokens = x.numel() // self.in_features
        mode = self.mode
        if mode == "auto":
            mode = ordering(tokens, self.out_features, self.in_features, torch.is_grad_enabled())
        # The frozen factors go into the ops whole (no .T views): autograd then keeps the Parameter objects,
        # whose storage ZeRO-3 may release after the forward and gather again for the backward.
        # A quantized U is dequantized per use (frozen_dense / frozen_linear); its dense copy is not kept.
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


def ordering(tokens: int, m: int, n: int, grad: bool) -> str:
    """The cheaper exact ordering of ``U M Vᵀ x`` for ``tokens`` inputs, U (m, n), by multiply-adds.

        tokens ``U (M (Vᵀ x))``: forward 2Tn² + Tmn; with backward 5Tn² + 2Tmn
        weight ``(U M Vᵀ) x``:   forward 2mn² + Tmn; with backward 4mn² + 3Tmn
    """
    if grad:
        cost_tokens, cost_weight = 5 * tokens * n * n + 2 * tokens * m * n, 4 * m * n * n + 3 * tokens * m * n
    else:
        cost_tokens, cost_weight = 2 * tokens * n * n + tokens * m * n, 2 * m * n * n + tokens * m * n
    return "weight" if cost_weight < cost_tokens else "tokens"


def trainable_numel(n: int, density: float) -> int:
    """Trainable parameters per member: ``n + round(s·n²)``."""
    return n + int(round(density * n * n))


def tan_alpha(on_sq: float, off_sq: float) -> float:
    """Rotation angle ``tan α = ‖ΔW_off‖ / ‖ΔW_on‖`` (``inf`` when only S moved, 0 when nothing did)."""
    if on_sq == 0:
        return 0.0 if off_sq == 0 else math.inf
    return math.sqrt(off_sq / on_sq)
