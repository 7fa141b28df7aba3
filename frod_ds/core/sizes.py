"""Sizes and costs of the FRoD layer's tensors that need no torch: the planner (``frod plan``) reads them
without importing it, and the layer and the quantized blobs (``frod_ds.core.layer``, ``frod_ds.core.quant``)
build on the same definitions."""

from __future__ import annotations

__all__ = [
    "NF4_BLOCKSIZE",
    "BLOB_ALIGN",
    "blob_sections",
    "blob_nbytes",
    "ordering",
    "support_nnz",
    "trainable_numel",
    "empty_support",
]

NF4_BLOCKSIZE = 64  # QLoRA's block size
BLOB_ALIGN = 8  # byte offsets and the total of a quantized blob (frod_ds.core.quant's module docstring)

# a blob's parts per kind: (name, dtype name, bytes per element, count from (numel, rows, blocksize))
_PARTS = {
    "nf4": (
        ("codes", "uint8", 1, lambda numel, rows, bs: -(-numel // 2)),
        ("absmax", "float32", 4, lambda numel, rows, bs: -(-numel // bs)),
    ),
    "int8": (("CB", "int8", 1, lambda numel, rows, bs: numel), ("SCB", "float32", 4, lambda numel, rows, bs: rows)),
}


def _align(nbytes: int) -> int:
    return -(-nbytes // BLOB_ALIGN) * BLOB_ALIGN


def blob_sections(kind: str, shape: tuple[int, int], blocksize: int = NF4_BLOCKSIZE) -> list[tuple[str, str, int, int]]:
    """``(name, dtype name, count, byte offset)`` of the parts of a ``kind`` blob of a dense ``shape`` weight."""
    rows, numel = int(shape[0]), int(shape[0]) * int(shape[1])
    out, offset = [], 0
    for name, dtype, itemsize, count in _PARTS[kind]:
        n = count(numel, rows, blocksize)
        out.append((name, dtype, n, offset))
        offset = _align(offset + n * itemsize)
    return out


def blob_nbytes(kind: str, shape: tuple[int, int], blocksize: int = NF4_BLOCKSIZE) -> int:
    """Bytes of a ``kind`` blob of a dense ``shape`` weight, padded to ``BLOB_ALIGN``."""
    _, _, count, offset = blob_sections(kind, shape, blocksize)[-1]
    return _align(offset + count * _PARTS[kind][-1][2])


def ordering(tokens: int, m: int, n: int, grad: bool, recompute: bool = False) -> str:
    """The cheaper exact ordering of ``U M Vᵀ x`` for ``tokens`` inputs, U (m, n), by multiply-adds.

    tokens ``U (M (Vᵀ x))``: forward 2Tn² + Tmn; with backward 5Tn² + 2Tmn (+ Tn² with ``recompute``:
                             the backward rebuilds z = Vᵀx from the saved x)
    weight ``(U M Vᵀ) x``:   forward 2mn² + Tmn; with backward 4mn² + 3Tmn
    """
    if grad:
        cost_tokens = (6 if recompute else 5) * tokens * n * n + 2 * tokens * m * n
        cost_weight = 4 * m * n * n + 3 * tokens * m * n
    else:
        cost_tokens, cost_weight = 2 * tokens * n * n + tokens * m * n, 2 * m * n * n + tokens * m * n
    return "weight" if cost_weight < cost_tokens else "tokens"


def support_nnz(n: int, sparsity: float) -> int:
    """Entries of an n×n S at density ``sparsity``: ``round(s·n²)``."""
    return int(round(sparsity * n * n))


def empty_support(category: str, n: int, sparsity: float) -> str | None:
    """Why ``sparsity`` cannot train ``category`` of width ``n`` (S without a single entry), or None."""
    if support_nnz(n, sparsity) > 0:
        return None
    return (
        f"model.sparsity={sparsity:g} gives S no entries for {category} (width {n}: round(s*n^2) = 0); "
        f"use model.sparsity >= {0.5 / (n * n):.3g}"
    )


def trainable_numel(n: int, sparsity: float) -> int:
    """Trainable parameters per member: ``n + round(s·n²)``."""
    return n + support_nnz(n, sparsity)
