"""The FRoD autograd Functions (frod_ds/frod_function.py) against a dense fp64 reference: outputs and gradients
of x, σ and the S values in both orderings, both ∂S paths, both saved tensors, with and without bias, 3-D
inputs; what they keep for the backward; ZeRO-3's release and re-gather of parameters between the passes;
reentrant and non-reentrant gradient checkpointing; autocast to bf16; a whole tiny LLaMA."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from frod_ds import FRoDLinear, SparseSupport, apply_frod, decompose
from frod_ds.core.frod_function import sampled_product
from frod_ds.model.apply import frod_modules

# Every (ordering, saved tensor, ∂S path) the Functions take; "weight" has no save option.
PATHS = [("tokens", save, dgrad) for save, dgrad in itertools.product(("z", "x"), ("dense", "sampled"))] + [
    ("weight", "z", "dense"),
    ("weight", "z", "sampled"),
]


def _layer(m=12, n=10, density=0.2, seed=0, dtype=torch.float64, bias=True, random_core=True):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(m, n, generator=g, dtype=dtype)
    b = torch.randn(m, generator=g, dtype=dtype) if bias else None
    res = decompose([W])
    layer = FRoDLinear(
        res.U[0], nn.Parameter(res.V, requires_grad=False), res.sigma[0], SparseSupport.random(n, density, seed), b
    )
    if random_core:  # away from the special point S = 0
        with torch.no_grad():
            layer.frod_sigma.copy_(torch.randn(n, generator=g, dtype=dtype))
            layer.frod_s.copy_(torch.randn(layer.support.nnz, generator=g, dtype=dtype))
    return layer


def _set_path(layer, mode, save, dgrad, impl="function"):
    layer.mode, layer.save, layer.dgrad, layer.impl = mode, save, dgrad, impl


def _dense_reference(layer, x):
    """``x (U (diag σ + S) Vᵀ)ᵀ + b`` through plain autograd; S put together entry by entry."""
    n = layer.in_features
    rows, cols = layer.support.rows_cols()
    S = torch.zeros(n, n, dtype=layer.frod_s.dtype).index_put((rows, cols), layer.frod_s, accumulate=True)
    W = layer.U @ (torch.diag(layer.frod_sigma) + S) @ layer.V.T
    y = x @ W.T
    return y if layer.bias is None else y + layer.bias


def _grads(layer, fn, x, g_y):
    """``(y, ∂x, ∂σ, ∂S)`` of ``⟨fn(x), g_y⟩`` through ``.backward()`` (reentrant checkpointing refuses ``.grad()``)."""
    x = x.detach().clone().requires_grad_(True)
    layer.frod_sigma.grad = layer.frod_s.grad = None
    y = fn(x)
    y.backward(g_y)
    out = y.detach(), x.grad, layer.frod_sigma.grad, layer.frod_s.grad
    layer.frod_sigma.grad = layer.frod_s.grad = None
    return out


@pytest.mark.parametrize("mode, save, dgrad", PATHS)
@pytest.mark.parametrize("bias", [True, False])
def test_function_outputs_and_gradients_equal_dense_reference(mode, save, dgrad, bias):
    layer = _layer(bias=bias)
    _set_path(layer, mode, save, dgrad)
    x = torch.randn(3, 7, 10, dtype=torch.float64)  # 3-D: (B, L, n)
    g_y = torch.randn(3, 7, 12, dtype=torch.float64)
    got = _grads(layer, layer, x, g_y)
    want = _grads(layer, lambda t: _dense_reference(layer, t), x, g_y)
    for name, a, b in zip(("y", "x", "sigma", "S"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-11), (name, (a - b).abs().max())
    assert layer.U.grad is None and layer.V.grad is None and (layer.bias is None or layer.bias.grad is None)


def test_sampled_product_equals_the_dense_product_at_the_support():
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(37, 16, generator=g, dtype=torch.float64), torch.randn(37, 16, generator=g, dtype=torch.float64)
    rows, cols = SparseSupport.random(16, 0.3, 1).rows_cols()
    want = (a.T @ b)[rows, cols]
    for chunk in (37, 5 * 37, 1 << 20):  # one support entry per chunk, several, all at once
        assert torch.allclose(sampled_product(a, b, rows, cols, chunk_elems=chunk), want, rtol=1e-12, atol=1e-12)


def _saved_numels_after_release(layer, x):
    """Forward with every saved tensor recorded, then release the parameters' storage as ZeRO-3 does after a
    module's forward (``param.data = empty``): what the recorded tensors still hold is memory kept for the
    backward that ZeRO-3 cannot free."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = layer(x)
    params = [layer.U, layer.V, layer.frod_sigma, layer.frod_s, layer.bias]
    kept = [p.data for p in params]
    for p in params:
        p.data = torch.empty(0, dtype=p.dtype)
    numels = sorted(t.numel() for t in saved)
    return y, numels, params, kept


@pytest.mark.parametrize("mode, save, dgrad", PATHS)
def test_function_keeps_no_core_matrix_and_survives_zero3_release_and_regather(mode, save, dgrad):
    layer = _layer(m=14, n=10)
    _set_path(layer, mode, save, dgrad)
    x = torch.randn(2, 9, 10, dtype=torch.float64, requires_grad=True)
    g_y = torch.randn(2, 9, 14, dtype=torch.float64)
    _, gx_ref, gs_ref, gS_ref = _grads(layer, lambda t: _dense_reference(layer, t), x, g_y)

    y, numels, params, kept = _saved_numels_after_release(layer, x)
    T, n, m = 18, 10, 14
    expect = {"tokens": [T * n], "weight": [m * n, T * n]}[mode]  # z or x; weight order: x and W = U M Vᵀ
    assert [k for k in numels if k] == sorted(expect), numels
    for p, data in zip(params, kept):  # ZeRO-3's pre-backward hook gathers into new storage
        p.data = data.clone()
    gx, gs, gS = torch.autograd.grad(y, [x, layer.frod_sigma, layer.frod_s], g_y)
    for a, b in ((gx, gx_ref), (gs, gs_ref), (gS, gS_ref)):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-11)


def test_autograd_reference_path_keeps_core_matrix_and_factor_views():
    """The measurement the Functions are built against: plain autograd keeps M and views of U, V."""
    layer = _layer(m=14, n=10)
    _set_path(layer, "tokens", "z", "dense", impl="autograd")
    _, numels, _, _ = _saved_numels_after_release(layer, torch.randn(18, 10, dtype=torch.float64, requires_grad=True))
    assert 10 * 10 in numels and 14 * 10 in numels, numels


def _checkpointed_grads(layer, mode, save, dgrad, use_reentrant):
    _set_path(layer, mode, save, dgrad)
    x = torch.randn(4, 6, 10, dtype=torch.float64)
    g_y = torch.randn(4, 6, 12, dtype=torch.float64)
    plain = _grads(layer, layer, x, g_y)
    ckpt = _grads(layer, lambda t: checkpoint(layer, t, use_reentrant=use_reentrant), x, g_y)
    return plain, ckpt


@pytest.mark.parametrize("mode, save, dgrad", [PATHS[0], PATHS[3], PATHS[4]])
def test_function_under_reentrant_checkpointing_gives_the_same_gradients(mode, save, dgrad):
    plain, ckpt = _checkpointed_grads(_layer(), mode, save, dgrad, use_reentrant=True)
    for a, b in zip(plain, ckpt):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode, save, dgrad", [PATHS[0], PATHS[3], PATHS[4]])
def test_function_under_nonreentrant_checkpointing_gives_the_same_gradients(mode, save, dgrad):
    """The trainer's checkpointing (``frod_ds.train.trainer.enable_gradient_checkpointing``)."""
    plain, ckpt = _checkpointed_grads(_layer(), mode, save, dgrad, use_reentrant=False)
    for a, b in zip(plain, ckpt):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode, save, dgrad", [PATHS[0], PATHS[3], PATHS[4]])
def test_function_under_autocast_bf16_matches_reference_at_bf16_precision(mode, save, dgrad):
    """fp32 parameters, fp32 input, CPU autocast to bf16: bf16 output like F.linear's, fp32 gradients, all within
    bf16 rounding of the fp64 reference and of plain autograd under the same autocast."""
    layer = _layer(m=48, n=32, density=0.1, dtype=torch.float64)
    x = torch.randn(4, 16, 32, dtype=torch.float64)
    g_y = torch.randn(4, 16, 48, dtype=torch.float64)
    want = _grads(layer, lambda t: _dense_reference(layer, t), x, g_y)
    layer.float()
    runs = {}
    for impl in ("function", "autograd"):
        _set_path(layer, mode, save, dgrad, impl)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            runs[impl] = _grads(layer, layer, x.float(), g_y.bfloat16())
    y, gx, gs, gS = runs["function"]
    assert y.dtype == torch.bfloat16 and gx.dtype == torch.float32 and gs.dtype == gS.dtype == torch.float32
    for impl, got in runs.items():
        for name, a, b in zip(("y", "x", "sigma", "S"), got, want):
            rel = ((a.double() - b).norm() / b.norm()).item()
            assert rel < 3e-2, (impl, name, rel)


def test_function_in_bf16_parameters_matches_autograd_in_bf16():
    """The DeepSpeed bf16 setting: bf16 parameters and input, no autocast."""
    layer = _layer(m=48, n=32, density=0.1).to(torch.bfloat16)
    x = torch.randn(64, 32, dtype=torch.bfloat16)
    g_y = torch.randn(64, 48, dtype=torch.bfloat16)
    runs = {}
    for impl in ("function", "autograd"):
        _set_path(layer, "tokens", "z", "dense", impl)
        runs[impl] = _grads(layer, layer, x, g_y)
    for name, a, b in zip(("y", "x", "sigma", "S"), runs["function"], runs["autograd"]):
        assert a.dtype == b.dtype == torch.bfloat16, name
        assert ((a.float() - b.float()).norm() / b.float().norm()).item() < 2e-2, name


def test_tiny_llama_gradients_agree_across_every_path(llama_factory):
    """All σ/S gradients of a whole (fp64) tiny LLaMA: each Function path equals plain autograd."""
    model = apply_frod(llama_factory(), sparsity=0.2).double()
    for _, m in frod_modules(model):
        with torch.no_grad():
            m.frod_s.normal_()
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    params = [p for p in model.parameters() if p.requires_grad]

    def grads(mode, save, dgrad, impl):
        for _, m in frod_modules(model):
            _set_path(m, mode, save, dgrad, impl)
        return torch.autograd.grad(model(input_ids=ids, labels=ids).loss, params)

    ref = grads("tokens", "z", "dense", "autograd")
    for path in PATHS:
        for a, b in zip(grads(*path, "function"), ref):
            assert torch.allclose(a, b, rtol=1e-9, atol=1e-12), path
