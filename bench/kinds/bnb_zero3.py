"""bitsandbytes ``Linear4bit`` under ZeRO-3 without a second copy of the quantized model (QLoRA in the step kind).

Why: bitsandbytes 0.50's ``MatMul4Bit.forward`` (``bitsandbytes/autograd/_functions.py``, ``B = B.view(-1, 1)`` then
``ctx.tensors = (None, B)``) keeps a *view* of the weight for the backward. Under ZeRO-3 the weight's data is the
gathered full tensor while its module runs; DeepSpeed releases it after the module's forward by pointing the
Parameter at an empty tensor (``free_param``), but the view in ``ctx`` still owns the gathered storage, and the
autograd graph keeps every ``ctx`` until the step's backward is done. So every NF4 weight whose input needs a
gradient (all of them after the first LoRA product) stays gathered in full from its forward to the end of the step:
each rank holds its partition plus the whole quantized model, although DeepSpeed's own status says one module.

``keep_linear4bit_weights_partitioned`` gives each ``Linear4bit`` a forward that computes the same product with the same
kernels (``bnb.matmul_4bit`` without grad: the
``gemm_4bit`` op; backward ``grad_x = grad_y · dequantize_4bit(W)``, as ``MatMul4Bit.backward``) but saves the
Parameter itself with ``save_for_backward``: a saved leaf is the variable, so the backward sees the data DeepSpeed
gathers again before the module's backward, and nothing outlives the module's release.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["zero3_class", "keep_linear4bit_weights_partitioned"]


class _Matmul4bitKeepParam(torch.autograd.Function):
    """``y = x W̃ᵀ + b`` for a bitsandbytes 4-bit ``W`` (``Params4bit``), ``x`` (..., n) → (..., m); the gradient
    for ``x`` only (the weight and bias are frozen)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        import bitsandbytes as bnb

        quant_state = weight.quant_state
        y = bnb.matmul_4bit(x, weight, bias=bias, quant_state=quant_state)  # grad is off here: gemm_4bit, no ctx
        ctx.save_for_backward(weight)  # the Parameter, whose .data ZeRO-3 swaps; not a view of today's storage
        ctx.quant_state = quant_state  # absmax and shape: not a parameter, the same object on every call
        return y

    @staticmethod
    def backward(ctx: Any, g_y: Tensor):
        from bitsandbytes.functional import dequantize_4bit

        if not ctx.needs_input_grad[0]:
            return None, None, None
        (weight,) = ctx.saved_tensors
        assert weight.numel() > 0, "the 4-bit weight is not gathered in its module's backward"
        W = dequantize_4bit(weight.view(-1, 1), ctx.quant_state).to(g_y.dtype)  # (m, n), dropped after the product
        return g_y @ W, None, None


def _linear4bit_cls():
    import bitsandbytes as bnb

    return bnb.nn.Linear4bit


def _forward(self: nn.Module, x: Tensor) -> Tensor:
    """``bnb.nn.Linear4bit.forward`` (training path) through ``_Matmul4bitKeepParam``."""
    from bitsandbytes.nn.modules import fix_4bit_weight_quant_state_from_module

    fix_4bit_weight_quant_state_from_module(self)
    if not self.compute_type_is_set:
        self.set_compute_type(x)
        self.compute_type_is_set = True
    inp_dtype = x.dtype
    if self.compute_dtype is not None:
        x = x.to(self.compute_dtype)
    bias = self.bias
    assert bias is None or not bias.requires_grad, "a 4-bit linear's bias is frozen"
    if bias is not None:
        bias = bias.to(x.dtype)
    return _Matmul4bitKeepParam.apply(x, self.weight, bias).to(inp_dtype)


_SUBCLASSES: dict[type, type] = {}


def zero3_class(cls: type) -> type:
    """The subclass of a ``Linear4bit`` class (``Linear4bit``, ``LinearNF4``, ...) whose forward keeps the
    Parameter, not a view of its gathered storage, for the backward."""
    if cls not in _SUBCLASSES:
        _SUBCLASSES[cls] = type(f"Zero{cls.__name__}", (cls,), {"forward": _forward})
    return _SUBCLASSES[cls]


def keep_linear4bit_weights_partitioned(model: nn.Module) -> int:
    """Give every bitsandbytes ``Linear4bit`` of ``model`` the ZeRO-3-safe forward (in place); returns how many."""
    base = _linear4bit_cls()
    n = 0
    for m in model.modules():
        if isinstance(m, base) and type(m) not in _SUBCLASSES.values():
            m.__class__ = zero3_class(type(m))
            n += 1
    return n
