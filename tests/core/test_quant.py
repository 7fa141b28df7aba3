"""Quantized frozen weights: the exactness contract of the quantized FRoD layer, on CPU.

Exact (to fp32/fp64 rounding): the blob decodes to an independent NF4 table lookup / int8 rescale; FRoD with a
quantized U computes ``Ũ (diag σ + S) Vᵀ x + b`` with ``Ũ`` that decoded U, forward and σ/S/x gradients, in both
orderings; a model built from a quantized store equals one quantized at load time, bit for bit.
Within the quantization error: the output moves from the dense model's by ``(Ũ − U) h`` only, and ``‖Ũ − U‖`` is
NF4's / int8's size. Bad input: one-line errors.
"""

from __future__ import annotations

import pytest
import torch

from frod_ds.core.layer import FRoDLinear, SparseSupport
from frod_ds.core.quant import (
    QuantLinear,
    QuantSpec,
    frozen_dense,
    frozen_linear,
    quantized_parameter,
    roundtrip,
    spec_of,
)

# bitsandbytes' NF4 code book (QLoRA, appendix E), written out so the decoding below does not use bitsandbytes.
NF4 = torch.tensor(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ],
    dtype=torch.float64,
)


def _decode_nf4(blob: torch.Tensor, shape: tuple[int, int], blocksize: int = 64) -> torch.Tensor:
    """Independent NF4 decoder: high nibble first, fp32 absmax per block of ``blocksize``, both 8-aligned."""
    numel = shape[0] * shape[1]
    nb = -(-numel // 2)
    codes = blob[:nb].long()
    idx = torch.stack([codes >> 4, codes & 15], 1).reshape(-1)[:numel]
    off = -(-nb // 8) * 8
    absmax = blob[off : off + 4 * -(-numel // blocksize)].clone().view(torch.float32).double()
    return (NF4[idx] * absmax.repeat_interleave(blocksize)[:numel]).view(shape)


def _decode_int8(blob: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    m, n = shape
    CB = blob[: m * n].view(torch.int8).double().view(m, n)
    off = -(-(m * n) // 8) * 8
    SCB = blob[off : off + 4 * m].clone().view(torch.float32).double()
    return CB * SCB[:, None] / 127


DECODE = {"nf4": _decode_nf4, "int8": _decode_int8}


def _weight(m: int, n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(m, n, generator=torch.Generator().manual_seed(seed)) * 0.05


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_blob_decodes_to_independent_dequantization(kind):
    m, n = 24, 40  # 960 elements: 15 NF4 blocks; int8 rows of 40
    W = _weight(m, n)
    W[3] = 0.0  # an all-zero row (int8: 0/0 in the kernel) stays zero
    spec = QuantSpec(kind, (m, n))
    blob = spec.pack(W)
    assert blob.dtype == torch.uint8 and blob.numel() == spec.nbytes and spec.nbytes % 8 == 0
    ref = DECODE[kind](blob, (m, n))
    for dtype in (torch.float32, torch.bfloat16):
        p = quantized_parameter(spec, dtype)
        p.data.copy_(blob.view(dtype))
        assert p.numel() == spec.nbytes // p.element_size()
        got = frozen_dense(p, torch.float32).double()
        assert torch.allclose(got, ref, rtol=2e-7, atol=0), (kind, dtype, (got - ref).abs().max())
    assert ref[3].abs().max() == 0
    if kind == "nf4":  # each element took the nearest code of its block's scale (the quantizer, checked too)
        absmax = W.reshape(-1, 64).abs().amax(1, keepdim=True).double()
        x = (W.reshape(-1, 64).double() / absmax).reshape(-1)
        chosen = ref.reshape(-1, 64).div(absmax).reshape(-1)
        best = (x[:, None] - NF4[None]).abs().min(1).values
        assert torch.all((x - chosen).abs() <= best + 1e-6)
    else:
        CB = blob[: m * n].view(torch.int8).view(m, n).double()
        scale = W.abs().amax(1, keepdim=True).double()
        want = torch.where(scale > 0, torch.round(W.double().half().double() * 127 / scale), torch.zeros_like(CB))
        assert (CB - want).abs().max() <= 1  # fp16 input rounding may move a tie by one step


@pytest.mark.parametrize("kind,lo,hi", [("nf4", 0.05, 0.15), ("int8", 2e-3, 2e-2)])
def test_quantization_error_has_the_expected_size(kind, lo, hi):
    """‖Ũ − U‖/‖U‖ for a Gaussian matrix: NF4 about 0.09 (bitsandbytes' own figure), int8 about 0.007."""
    W = _weight(128, 256, seed=1)
    e = float((roundtrip(W, kind) - W).norm() / W.norm())
    assert lo < e < hi, e


def _quant_layer(kind: str, m: int, n: int, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    U = torch.randn(m, n, generator=g, dtype=torch.float64) / n**0.5
    V = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))[0]
    sigma = torch.rand(n, generator=g, dtype=torch.float64) + 0.5
    support = SparseSupport.random(n, 0.1, seed)
    bias = torch.randn(m, generator=g, dtype=torch.float64) * 0.1
    spec = QuantSpec(kind, (m, n))
    blob = spec.pack(U.to(dtype))
    Uq = quantized_parameter(spec, dtype)
    Uq.data.copy_(blob.view(dtype))
    layer = FRoDLinear(
        Uq, torch.nn.Parameter(V.to(dtype), requires_grad=False), sigma.to(dtype), support, bias.to(dtype)
    )
    with torch.no_grad():
        layer.frod_s.copy_(torch.randn(support.nnz, generator=g) * 0.05)
    dense = FRoDLinear(
        U.to(dtype), torch.nn.Parameter(V.to(dtype), requires_grad=False), sigma.to(dtype), support, bias.to(dtype)
    )
    with torch.no_grad():
        dense.frod_s.copy_(layer.frod_s)
    return layer, dense, DECODE[kind](blob, (m, n)), V, bias


def _reference(Ut, V, layer, bias, x):
    """``y = Ũ (diag σ + S) Vᵀ x + b`` in fp64 from independent tensors; σ and S as leaves for their gradients."""
    n = V.shape[0]
    sigma = layer.frod_sigma.detach().double().requires_grad_(True)
    s = layer.frod_s.detach().double().requires_grad_(True)
    M = torch.diag(sigma) + torch.zeros(n * n, dtype=torch.float64).index_put((layer.support.flat,), s).view(n, n)
    return x @ (Ut @ M @ V.T).T + bias, sigma, s


@pytest.mark.parametrize("kind", ["nf4", "int8"])
@pytest.mark.parametrize("mode", ["tokens", "weight"])
def test_quantized_frod_equals_dequantized_dense_reference(kind, mode):
    """Forward and the σ, S, x gradients of FRoD with a quantized U equal ``Ũ (diag σ + S) Vᵀ x + b`` (fp32)."""
    m, n, T = 48, 32, 10
    layer, _, Ut, V, bias = _quant_layer(kind, m, n)
    layer.mode = mode
    x = torch.randn(2, T // 2, n, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    xq = x.float().requires_grad_(True)
    y = layer(xq)
    xr = x.clone().requires_grad_(True)
    y_ref, sigma, s = _reference(Ut, V, layer, bias, xr)
    assert torch.allclose(y.double(), y_ref, rtol=1e-5, atol=1e-6), (y.double() - y_ref).abs().max()
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    (y.double() * g).sum().backward()
    (y_ref * g).sum().backward()
    assert torch.allclose(layer.frod_sigma.grad.double(), sigma.grad, rtol=1e-4, atol=1e-6)
    assert torch.allclose(layer.frod_s.grad.double(), s.grad, rtol=1e-4, atol=1e-6)
    assert torch.allclose(xq.grad.double(), xr.grad, rtol=1e-4, atol=1e-6)
    assert layer.U.grad is None and spec_of(layer.U).kind == kind


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_quantized_frod_differs_from_dense_only_by_the_quantization_of_u(kind):
    """``y_q − y = (Ũ − U) h`` with ``h = (diag σ + S) Vᵀ x``: bounded by ‖Ũ − U‖₂‖h‖, and of NF4/int8 size."""
    m, n = 48, 32
    layer, dense, Ut, V, bias = _quant_layer(kind, m, n)
    x = torch.randn(7, n, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        yq, y = layer(x).double(), dense(x).double()
        U = dense.U.double()
        h = (x.double() @ V) @ layer.core(torch.float64).T  # (T, n)
        diff = torch.linalg.matrix_norm(Ut - U, ord=2)
    assert torch.allclose(yq - y, h @ (Ut - U).T, rtol=1e-4, atol=1e-5)
    assert ((yq - y).norm(dim=1) <= diff * h.norm(dim=1) * (1 + 1e-5) + 1e-6).all()
    rel = float((yq - y).norm() / (y - bias.double()).norm())
    assert rel < (0.2 if kind == "nf4" else 0.03), rel


def test_quantized_u_keeps_no_dense_copy_for_the_backward():
    """The token order saves the blob Parameter, not a dequantized (m, n) U (memory: ~2 bytes/weight per layer)."""
    m, n = 96, 32
    layer, _, _, _, _ = _quant_layer("nf4", m, n)
    layer.mode = "tokens"
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    x = torch.randn(5, n, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x)
    assert (m, n) not in shapes and (n, m) not in shapes, shapes
    y.sum().backward()
    assert layer.frod_sigma.grad is not None


def test_quant_linear_equals_linear_of_dequantized_weight():
    W = _weight(40, 24, seed=2)
    spec = QuantSpec("nf4", (40, 24))
    lin = QuantLinear(spec, torch.float32, torch.nn.Parameter(torch.randn(40), requires_grad=False))
    lin.weight.data.copy_(spec.pack(W).view(torch.float32))
    Wt = _decode_nf4(spec.pack(W), (40, 24)).float()
    x = torch.randn(3, 24, requires_grad=True)
    xr = x.detach().clone().requires_grad_(True)
    y, y_ref = lin(x), torch.nn.functional.linear(xr, Wt, lin.bias)
    assert torch.allclose(y, y_ref, atol=1e-6)
    y.square().sum().backward()
    y_ref.square().sum().backward()
    assert torch.allclose(x.grad, xr.grad, atol=1e-5)
    assert frozen_linear(x, Wt).shape == (3, 40)  # dense weights go through F.linear unchanged


# ---- model level: store-time = load-time quantization -------------------------------------------------


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    from tests.support.helpers_ckpt import hjd_in_process, write_tiny_llama

    root = tmp_path_factory.mktemp("quant")
    model_dir = write_tiny_llama(root / "m", dtype=torch.bfloat16)
    out = {}
    for kind in ("none", "nf4"):
        proc = hjd_in_process(["--model", str(model_dir), "--out", str(root / kind), "--quant", kind])
        assert proc.returncode == 0, proc.stderr[-2000:]
        out[kind] = root / kind
    return model_dir, out


def test_quantized_store_equals_load_time_quantization(stores):
    """``launch/hjd.py --quant nf4`` stores exactly the blobs that quantizing the bf16 store at load time makes,
    so both give the same model; the quantized store's load_U is the dequantized U; its manifest says nf4."""
    from frod_ds.formats.factor_store import QuantRecord
    from frod_ds.model.build import build_frod_model, make_supports
    from frod_ds.model.store_reader import FactorStore

    model_dir, paths = stores
    dense, nf4 = FactorStore.open(paths["none"]), FactorStore.open(paths["nf4"])
    assert nf4.manifest.u_quant == QuantRecord(kind="nf4", blocksize=64) and dense.manifest.u_quant is None
    assert all(r.u_quant == nf4.manifest.u_quant for r in nf4.manifest.categories.values())
    assert '"u_quant"' not in (paths["none"] / "manifest.json").read_text()  # dense stores: format unchanged
    member = dense.categories["gate_proj"][1]
    assert torch.equal(nf4.load_U(member), roundtrip(dense.load_U(member), "nf4"))
    assert nf4.load_U(member).dtype == torch.bfloat16
    targets = list(dense.categories)
    sup = make_supports(dense, targets, 0.1, 0)
    a = build_frod_model(model_dir, dense, sup, torch.float32, quant="nf4", quantize_base=True)
    b = build_frod_model(model_dir, nf4, sup, torch.float32, quant="nf4", quantize_base=True)
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for k in pa:
        assert torch.equal(pa[k], pb[k]) or torch.equal(pa[k].view(torch.int32), pb[k].view(torch.int32)), k
    assert isinstance(a.model.layers[0].mlp.down_proj, QuantLinear)
    assert spec_of(a.lm_head.weight) is None, "lm_head stays dense, as in QLoRA"
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(a(input_ids=ids).logits, b(input_ids=ids).logits)


def test_quantized_store_needs_the_same_frozen_quant(stores):
    from frod_ds.model.build import build_frod_model, make_supports
    from frod_ds.model.store_reader import FactorStore
    from frod_ds.runtime.errors import StoreError

    model_dir, paths = stores
    nf4 = FactorStore.open(paths["nf4"])
    sup = make_supports(nf4, ["q_proj"], 0.1, 0)
    for quant in ("none", "int8"):
        with pytest.raises(StoreError) as e:
            build_frod_model(model_dir, nf4, sup, torch.float32, quant=quant)
        msg = str(e.value)
        assert "\n" not in msg and "nf4-quantized U" in msg and "model.frozen_quant=nf4" in msg, msg


def test_recipe_rejects_unknown_frozen_quant():
    from frod_ds.config.recipe import RecipeError, load_recipe

    base = ["model.base=m", "model.factor_store=f", "data.train=t.jsonl"]
    with pytest.raises(RecipeError) as e:
        load_recipe(None, base + ["model.frozen_quant=nf5"])
    assert "\n" not in str(e.value)
    assert "model.frozen_quant must be one of none, int8, nf4, got 'nf5'" in str(e.value)
    with pytest.raises(RecipeError, match="model.quantize_base=true needs model.frozen_quant"):
        load_recipe(None, base + ["model.quantize_base=true"])
    assert load_recipe(None, base + ["model.frozen_quant=int8", "model.quantize_base=true"]).model.quantize_base


def test_bad_quant_settings_are_user_errors():
    """An unknown kind or quantize_base without a kind is a ``FrodError`` (one ``error:`` line at the entry)."""
    from frod_ds.core.quant import QuantError, check_kind
    from frod_ds.model.build import build_frod_model
    from frod_ds.runtime.errors import FrodError

    assert issubclass(QuantError, FrodError)
    with pytest.raises(QuantError, match="model.frozen_quant must be one of none, int8, nf4, got 'nf5'"):
        check_kind("nf5")
    with pytest.raises(QuantError, match="model.quantize_base=true needs"):
        build_frod_model("unused", _NoQuantStore(), {}, torch.float32, quant="none", quantize_base=True)


class _NoQuantStore:
    def u_quant(self, category: str) -> str:
        return "none"
