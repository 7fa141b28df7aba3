"""Quantized frozen weights (bitsandbytes NF4 or int8), held in plain Parameters that ZeRO-2/3 handle as usual.

A quantized frozen weight (a FRoD ``U_i``, or an untargeted linear's under ``model.quantize_base``) is one frozen
Parameter whose 1-D data is a byte blob viewed in the model's dtype, so DeepSpeed partitions and gathers it bit
for bit and never casts it; its ``QuantSpec`` rides on the Parameter as ``p.frod_quant``. ``frozen_dense``
dequantizes it; ``frozen_linear`` computes ``x W̃ᵀ + b`` keeping only the Parameter for the backward. Blob layouts
and costs: docs/layer.md#quantized-frozen-weights. Single-process; bitsandbytes is imported on first use.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from frod_ds.core.names import QUANT_KINDS
from frod_ds.core.sizes import NF4_BLOCKSIZE, blob_nbytes, blob_sections
from frod_ds.runtime.errors import FrodError

__all__ = [
    "QuantError",
    "QUANT_KINDS",
    "NF4_BLOCKSIZE",
    "QuantSpec",
    "check_kind",
    "frozen_dense",
    "frozen_linear",
    "logical_shape",
    "quantized_parameter",
    "spec_of",
    "QuantLinear",
    "quantize_untargeted",
    "roundtrip",
    "is_base_linear_weight",
]


class QuantError(FrodError):
    """Bad quantization settings (an unknown kind, quantize_base without a kind), or bitsandbytes missing."""


_CODES: dict[torch.device, Tensor] = {}


def _bnb():
    """``bitsandbytes.functional``, imported quietly (its CPU backend logs a warning about an optional kernel)."""
    log = logging.getLogger("bitsandbytes.backends.cpu.ops")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        import bitsandbytes.functional as bnbf
    except ImportError as e:  # pragma: no cover - pinned in pyproject
        raise QuantError(f"quantized frozen weights need bitsandbytes (pip install bitsandbytes): {e}") from None
    finally:
        log.setLevel(level)
    return bnbf


def check_kind(kind: str, where: str = "model.frozen_quant") -> str:
    """``kind`` if it is one of ``QUANT_KINDS``, else ``QuantError`` naming ``where`` and the valid values."""
    if kind not in QUANT_KINDS:
        raise QuantError(f"{where} must be one of {', '.join(QUANT_KINDS)}, got {kind!r}")
    return kind


@dataclass(frozen=True)
class QuantSpec:
    """How a dense ``shape`` (m, n) weight is packed into a blob (module docstring)."""

    kind: str  # "nf4" | "int8"
    shape: tuple[int, int]
    blocksize: int = NF4_BLOCKSIZE  # nf4 only

    def __post_init__(self) -> None:
        assert self.kind in ("nf4", "int8"), f"QuantSpec.kind must be nf4 or int8, got {self.kind!r}"
        assert len(self.shape) == 2, f"QuantSpec.shape must be (m, n), got {self.shape}"
        object.__setattr__(self, "shape", (int(self.shape[0]), int(self.shape[1])))

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def sections(self) -> list[tuple[str, torch.dtype, int, int]]:
        """``(name, dtype, count, byte offset)`` of the blob's parts, in order
        (``frod_ds.core.sizes.blob_sections``)."""
        return [
            (name, getattr(torch, dtype), count, offset)
            for name, dtype, count, offset in blob_sections(self.kind, self.shape, self.blocksize)
        ]

    @property
    def nbytes(self) -> int:
        return blob_nbytes(self.kind, self.shape, self.blocksize)

    def storage_numel(self, dtype: torch.dtype) -> int:
        """Elements of a blob viewed in ``dtype`` (the Parameter's length)."""
        return self.nbytes // dtype.itemsize

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "shape": list(self.shape), "blocksize": self.blocksize}

    # -- packing ------------------------------------------------------------------------------------

    @torch.no_grad()
    def pack(self, W: Tensor) -> Tensor:
        """The blob (``nbytes``,) uint8 of ``W`` (m, n), on ``W``'s device."""
        assert tuple(W.shape) == self.shape, f"QuantSpec for {self.shape} given a {tuple(W.shape)} weight"
        bnbf = _bnb()
        W = W.detach().contiguous()
        blob = torch.zeros(self.nbytes, dtype=torch.uint8, device=W.device)
        if self.kind == "nf4":
            src = W if W.dtype in (torch.bfloat16, torch.float16, torch.float32) else W.float()
            codes, state = bnbf.quantize_4bit(
                src.reshape(-1), blocksize=self.blocksize, compress_statistics=False, quant_type="nf4"
            )  # flat: blocks run across rows
            parts = {"codes": codes.reshape(-1), "absmax": state.absmax.float()}
        else:
            CB, SCB, _ = bnbf.int8_vectorwise_quant(W.to(torch.float16))  # as bitsandbytes' Int8Params does
            CB[SCB == 0] = 0  # an all-zero row: 0/0 in the kernel
            parts = {"CB": CB.reshape(-1), "SCB": SCB.float()}
        for name, dt, count, offset in self.sections():
            t = parts[name]
            assert t.dtype == dt and t.numel() == count, (name, t.dtype, t.numel(), dt, count)
            nb = count * t.element_size()
            blob[offset : offset + nb] = t.reshape(-1).view(torch.uint8)
        return blob

    def _part(self, blob: Tensor, name: str) -> Tensor:
        for n_, dt, count, offset in self.sections():
            if n_ == name:
                raw = blob[offset : offset + count * dt.itemsize]
                return raw if dt == torch.uint8 else raw.clone().view(dt)  # clone: aligned for the wider view
        raise KeyError(name)

    def unpack(self, blob: Tensor, dtype: torch.dtype) -> Tensor:
        """The dequantized weight (m, n) in ``dtype`` from a blob (uint8, or any dtype viewed as bytes)."""
        blob = blob.detach().contiguous().reshape(-1)
        if blob.dtype != torch.uint8:
            blob = blob.view(torch.uint8)
        assert blob.numel() == self.nbytes, (
            f"blob has {blob.numel()} bytes, {self.kind} {self.shape} needs {self.nbytes}"
        )
        bnbf = _bnb()
        out_dtype = dtype if dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.float32
        if self.kind == "nf4":
            # A flat shape: bitsandbytes 0.50.2's CPU kernel decodes an (m, n) shape wrongly when n is not a
            # multiple of the block size (48x32: relative error 0.38 instead of 0.09); the blocks are flat anyway.
            state = bnbf.QuantState(
                absmax=self._part(blob, "absmax"),
                shape=torch.Size([self.numel]),
                code=_nf4_code(blob.device),
                blocksize=self.blocksize,
                quant_type="nf4",
                dtype=out_dtype,
            )
            W = bnbf.dequantize_4bit(self._part(blob, "codes"), state).view(self.shape)  # (m, n)
        else:
            CB = self._part(blob, "CB").view(self.shape)
            W = bnbf.int8_vectorwise_dequant(CB, self._part(blob, "SCB"))  # (m, n) fp32
        return W.to(dtype)


def _nf4_code(device: torch.device) -> Tensor:
    if device not in _CODES:
        _CODES[device] = _bnb().get_4bit_type("nf4", device=device)
    return _CODES[device]


# ------------------------------------------------------------------------------------- parameters


def spec_of(p: Tensor) -> QuantSpec | None:
    """The ``QuantSpec`` of a quantized frozen Parameter, None for a dense one."""
    return getattr(p, "frod_quant", None)


def logical_shape(p: Tensor) -> tuple[int, int]:
    """(m, n) of a frozen weight, quantized or dense (ZeRO-3 may hold a dense one partitioned)."""
    spec = spec_of(p)
    if spec is not None:
        return spec.shape
    return tuple(getattr(p, "ds_shape", p.shape))  # type: ignore[return-value]


def quantized_parameter(spec: QuantSpec, dtype: torch.dtype, device: torch.device | str | None = None) -> nn.Parameter:
    """An empty frozen Parameter holding ``spec``'s blob in ``dtype`` (filled later with ``pack(W).view(dtype)``)."""
    p = nn.Parameter(torch.zeros(spec.storage_numel(dtype), dtype=dtype, device=device), requires_grad=False)
    p.frod_quant = spec  # type: ignore[attr-defined]
    return p


def frozen_dense(p: Tensor, dtype: torch.dtype) -> Tensor:
    """The frozen weight ``p`` as a dense tensor in ``dtype``: dequantized if quantized, else cast."""
    spec = spec_of(p)
    if spec is None:
        return p.to(dtype)
    return spec.unpack(p.detach(), dtype)


class _QuantizedLinear(torch.autograd.Function):
    """``y = x W̃ᵀ + b`` for a quantized frozen ``W``; saves the Parameter (not ``W̃``), dequantizes again in
    the backward. Gradient for ``x`` only (the weight and bias are frozen)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        W = frozen_dense(weight, x.dtype)  # (m, n), dropped after the product
        ctx.save_for_backward(weight)
        return F.linear(x, W, None if bias is None else bias.to(x.dtype))

    @staticmethod
    def backward(ctx: Any, g_y: Tensor):
        (weight,) = ctx.saved_tensors
        g_x = g_y @ frozen_dense(weight, g_y.dtype) if ctx.needs_input_grad[0] else None  # (..., n)
        return g_x, None, None


def frozen_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x Wᵀ + b`` with a frozen ``weight`` (m, n), quantized or dense; ``x`` (..., n) → (..., m)."""
    if spec_of(weight) is None:
        return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
    assert not (bias is not None and bias.requires_grad), "a quantized linear's bias is frozen"
    return _QuantizedLinear.apply(x, weight, bias)


def roundtrip(W: Tensor, kind: str, dtype: torch.dtype | None = None, blocksize: int = NF4_BLOCKSIZE) -> Tensor:
    """``dequantize(quantize(W))`` in ``dtype`` (default W's): what a quantized model computes with in place of W."""
    if kind == "none":
        return W.to(dtype or W.dtype)
    spec = QuantSpec(kind, tuple(W.shape), blocksize)
    return spec.unpack(spec.pack(W), dtype or W.dtype)


# ------------------------------------------------------------------------------- untargeted linears


class QuantLinear(nn.Module):
    """A frozen ``nn.Linear`` whose weight is quantized (``model.quantize_base``): ``y = x W̃ᵀ + b``."""

    def __init__(self, spec: QuantSpec, dtype: torch.dtype, bias: nn.Parameter | None = None):
        super().__init__()
        self.out_features, self.in_features = spec.shape
        self.weight = quantized_parameter(spec, dtype)
        self.bias = bias
        if bias is not None:
            bias.requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:
        return frozen_linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        spec = spec_of(self.weight)
        return f"in_features={self.in_features}, out_features={self.out_features}, quant={spec.kind if spec else None}"


def quantize_untargeted(model: nn.Module, kind: str, dtype: torch.dtype, blocksize: int = NF4_BLOCKSIZE) -> list[str]:
    """Swap every ``nn.Linear`` inside the decoder layers for an empty ``QuantLinear`` (weights loaded later).

    Like QLoRA, the embeddings, the final norm and ``lm_head`` stay in ``dtype``. Returns the swapped names.
    """
    swapped = []
    for name, module in list(model.named_modules()):
        if type(module) is nn.Linear and ".layers." in f".{name}":
            spec = QuantSpec(kind, (module.out_features, module.in_features), blocksize)
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, QuantLinear(spec, dtype, module.bias))
            swapped.append(name)
    return swapped


def is_base_linear_weight(key: str, shape) -> bool:
    """Whether checkpoint tensor ``key`` is the weight of a linear that ``quantize_untargeted`` swaps (a 2-D
    ``….layers.<i>.….weight``; LLaMA's norms inside the layers are 1-D). Used where no model is built (export)."""
    return len(shape) == 2 and key.endswith(".weight") and ".layers." in f".{key}"
