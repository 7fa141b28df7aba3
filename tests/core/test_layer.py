"""FRoDLinear and apply_frod (spec §2): exact at init, dense-reference gradients, shared frozen V."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from frod_ds import FRoDLinear, SparseSupport, apply_frod, decompose, frod_param_groups
from frod_ds.core.layer import support_seed
from frod_ds.model.apply import DEFAULT_TARGETS


def _layer(m=12, n=10, density=0.2, seed=0, dtype=torch.float64, bias=True):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(m, n, generator=g, dtype=dtype)
    b = torch.randn(m, generator=g, dtype=dtype) if bias else None
    res = decompose([W])
    V = nn.Parameter(res.V, requires_grad=False)
    layer = FRoDLinear(res.U[0], V, res.sigma[0], SparseSupport.random(n, density, seed), b)
    return layer, W, b


def _dense_reference(layer):
    """U (diag σ + S) Vᵀ built entry by entry from the support's (row, col) pairs."""
    n = layer.in_features
    S = torch.zeros(n, n, dtype=layer.frod_s.dtype)
    for (r, c), v in zip(layer.support.rows_cols().T.tolist(), layer.frod_s):
        S = S + torch.zeros(n, n, dtype=S.dtype).index_put((torch.tensor(r), torch.tensor(c)), v)
    return layer.U @ (torch.diag(layer.frod_sigma) + S) @ layer.V.T


@pytest.mark.parametrize("mode", ["tokens", "weight", "auto"])
def test_frod_linear_matches_base_at_init(mode):
    layer, W, b = _layer()
    layer.mode = mode
    x = torch.randn(3, 5, 10, dtype=torch.float64)
    assert torch.allclose(layer(x), x @ W.T + b, atol=1e-12)
    assert torch.allclose(layer.merged_weight(), W, atol=1e-12)


@pytest.mark.parametrize("mode", ["tokens", "weight"])
def test_frod_gradients_equal_dense_reference(mode):
    layer, _, _ = _layer()
    layer.mode = mode
    with torch.no_grad():  # random σ and S so the check is not at a special point
        layer.frod_sigma.copy_(torch.randn_like(layer.frod_sigma))
        layer.frod_s.copy_(torch.randn_like(layer.frod_s))
    x = torch.randn(7, 10, dtype=torch.float64)
    target = torch.randn(7, 12, dtype=torch.float64)

    loss = ((layer(x) - target) ** 2).sum()
    g_sigma, g_s = torch.autograd.grad(loss, [layer.frod_sigma, layer.frod_s])

    W_ref = _dense_reference(layer)
    ref_loss = ((x @ W_ref.T + layer.bias - target) ** 2).sum()
    r_sigma, r_s = torch.autograd.grad(ref_loss, [layer.frod_sigma, layer.frod_s])
    assert torch.allclose(loss, ref_loss, rtol=1e-12)
    assert torch.allclose(g_sigma, r_sigma, rtol=1e-9, atol=1e-10)
    assert torch.allclose(g_s, r_s, rtol=1e-9, atol=1e-10)
    assert layer.U.grad is None and layer.V.grad is None


def test_frod_merged_weight_equals_dense_reference():
    layer, _, _ = _layer()
    with torch.no_grad():
        layer.frod_s.normal_()
        layer.frod_sigma.mul_(1.5)
    assert torch.allclose(layer.merged_weight(), _dense_reference(layer), atol=1e-12)


def test_frod_auto_mode_picks_cheaper_ordering_and_both_agree():
    layer, _, _ = _layer(m=8, n=6)
    with torch.no_grad():
        layer.frod_s.normal_()
    few, many = torch.randn(2, 6, dtype=torch.float64), torch.randn(40, 6, dtype=torch.float64)
    for x in (few, many):
        outs = []
        for mode in ("tokens", "weight", "auto"):
            layer.mode = mode
            outs.append(layer(x))
        assert torch.allclose(outs[0], outs[1], atol=1e-12) and torch.allclose(outs[0], outs[2], atol=1e-12)


def test_ordering_picks_the_fewer_multiply_adds():
    from frod_ds.core.layer import ordering

    def flops(mode, T, m, n, grad, recompute):  # counted GEMM by GEMM, independently of ordering()'s formula
        if mode == "tokens":
            fwd = [T * n * n, T * n * n, T * m * n]  # z = xV, h = zMᵀ, y = hUᵀ
            bwd = [T * m * n, T * n * n, T * n * n, T * n * n]  # dh, dM, dz, dx
            bwd += [T * n * n] if recompute else []  # z = xV again from the saved x
        else:
            fwd = [m * n * n, m * n * n, T * m * n]  # UM, (UM)Vᵀ, y = xWᵀ
            bwd = [T * m * n, T * m * n, m * n * n, m * n * n]  # dW, dx, d(UM), dM
        return sum(fwd) + (sum(bwd) if grad else 0)

    for T in (1, 512, 2048, 4096, 8192, 20000, 65536):
        for m, n in ((4096, 4096), (11008, 4096), (1024, 8192), (28672, 8192)):
            for grad, rec in ((True, False), (True, True), (False, False)):
                cheaper = flops("weight", T, m, n, grad, rec) < flops("tokens", T, m, n, grad, rec)
                assert ordering(T, m, n, grad, recompute=rec) == ("weight" if cheaper else "tokens"), (T, m, n, grad)
    assert ordering(4096, 11008, 4096, True) == "tokens", "gate/up at T = n: the weight order costs more"
    assert ordering(2048, 4096, 4096, True, recompute=True) == "tokens", "LLaMA-7B q at 4x512 tokens"


def test_frod_linear_casts_frozen_tensors_to_the_input_dtype():
    layer, W, b = _layer(dtype=torch.float32)
    layer.to(torch.bfloat16)
    x = torch.randn(4, 10)  # fp32 input into a bf16 layer with a bias
    assert layer(x).dtype == torch.float32


def test_sparse_support_rejects_duplicates():
    with pytest.raises(ValueError, match="duplicate"):
        SparseSupport.from_rows_cols(4, torch.tensor([[0, 0], [1, 1]]))


def test_frod_frozen_factors_are_parameters_not_buffers():
    layer, _, _ = _layer()
    names = dict(layer.named_parameters())
    assert {"U", "V", "frod_sigma", "frod_s", "bias"} <= set(names)
    assert not names["U"].requires_grad and not names["V"].requires_grad and not names["bias"].requires_grad
    assert list(layer.buffers()) == []


def test_sparse_support_is_off_diagonal_with_exact_nnz_and_reproducible():
    for n, s in [(10, 0.2), (64, 0.02), (33, 0.5)]:
        sup = SparseSupport.random(n, s, seed=7)
        rows, cols = sup.rows_cols()
        assert sup.nnz == round(s * n * n)
        assert torch.all(rows != cols)
        assert torch.unique(sup.flat).numel() == sup.nnz, "no duplicate positions"
        assert torch.equal(SparseSupport.random(n, s, seed=7).flat, sup.flat)
        assert not torch.equal(SparseSupport.random(n, s, seed=8).flat, sup.flat)
        assert torch.equal(SparseSupport.from_rows_cols(n, sup.rows_cols()).flat, sup.flat)


def test_sparse_support_covers_the_off_diagonal_uniformly():
    counts = torch.zeros(8, 8)
    for seed in range(400):
        r, c = SparseSupport.random(8, 0.25, seed).rows_cols()
        counts[r, c] += 1
    off = counts[~torch.eye(8, dtype=torch.bool)]
    assert counts.diagonal().sum() == 0
    expected = 400 * 16 / 56
    assert off.min() > 0.6 * expected and off.max() < 1.4 * expected


@pytest.mark.parametrize("s", [0.0, 1.0, -0.1, 1.5, float("nan")])
def test_sparse_support_rejects_density_outside_unit_interval(s):
    with pytest.raises(ValueError, match="sparsity"):
        SparseSupport.random(8, s, 0)


def test_support_seed_depends_on_seed_and_category():
    assert support_seed(0, "q_proj") == support_seed(0, "q_proj")
    assert support_seed(0, "q_proj") != support_seed(0, "k_proj")
    assert support_seed(0, "q_proj") != support_seed(1, "q_proj")


# ---- apply_frod on a tiny LLaMA ----------------------------------------------------------------


def _logits(model, seed=0):
    ids = torch.randint(0, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def test_apply_frod_keeps_logits_of_tiny_llama_fp32(llama_factory):
    model = llama_factory()
    before = _logits(model)
    apply_frod(model)
    after = _logits(model)
    assert torch.allclose(before, after, atol=1e-4, rtol=1e-4), (before - after).abs().max()


def test_apply_frod_bf16_init_drift_is_at_bf16_level(llama_factory, record_property):
    """U stored in bf16 rounds the factorisation: report the drift; it must stay at bf16 rounding level."""
    ref = llama_factory(dtype=torch.float32)
    model = llama_factory(dtype=torch.bfloat16)
    base_bf16 = _logits(model)
    apply_frod(model)
    frod_bf16 = _logits(model)
    exact = _logits(ref)
    drift = ((frod_bf16 - exact).norm() / exact.norm()).item()
    base_drift = ((base_bf16 - exact).norm() / exact.norm()).item()
    record_property("bf16_init_drift", drift)
    record_property("bf16_base_rounding_drift", base_drift)
    print(f"bf16 init drift: FRoD {drift:.3e} vs plain bf16 rounding {base_drift:.3e}")
    assert drift < 5e-2 and drift < 10 * max(base_drift, 1e-3)


def test_apply_frod_shares_v_and_keeps_no_copy_of_w(llama_factory):
    model = llama_factory()
    n_orig = sum(p.numel() for p in model.parameters())
    cfg = model.config
    apply_frod(model, sparsity=0.1)
    for target in DEFAULT_TARGETS:
        layers = [
            getattr(getattr(decoder, "mlp" if target in ("gate_proj", "up_proj") else "self_attn"), target)
            for decoder in model.model.layers
        ]
        assert all(isinstance(x, FRoDLinear) for x in layers)
        assert all(x.V is layers[0].V for x in layers), f"{target}: one V object per category"
        assert all(x.support is layers[0].support for x in layers)
        assert not any(hasattr(x, "weight") for x in layers), "base weight dropped"
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    n = cfg.hidden_size
    one_v_per_category = len(DEFAULT_TARGETS) * n * n
    assert frozen == n_orig + one_v_per_category
    trainable = {name.rsplit(".", 1)[-1] for name, p in model.named_parameters() if p.requires_grad}
    assert trainable == {"frod_sigma", "frod_s"}
    n_members = cfg.num_hidden_layers * len(DEFAULT_TARGETS)
    per_member = n + round(0.1 * n * n)
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == n_members * per_member


def test_apply_frod_param_groups_hold_sigma_and_s(llama_factory):
    model = apply_frod(llama_factory())
    groups = frod_param_groups(model, lr_sigma=1e-4, lr_s=1e-5)
    assert [g["name"] for g in groups] == ["sigma", "s"]
    assert [g["lr"] for g in groups] == [1e-4, 1e-5]
    n_members = model.config.num_hidden_layers * len(DEFAULT_TARGETS)
    assert len(groups[0]["params"]) == len(groups[1]["params"]) == n_members
    opt = torch.optim.AdamW(groups)
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {
        id(p) for p in model.parameters() if p.requires_grad
    }


def test_apply_frod_training_step_moves_only_sigma_and_s(llama_factory):
    model = apply_frod(llama_factory())
    frozen_before = {k: v.clone() for k, v in model.named_parameters() if not v.requires_grad}
    opt = torch.optim.AdamW(frod_param_groups(model, 1e-2, 1e-3))
    ids = torch.randint(0, 128, (2, 9))
    model.train()
    loss0 = model(input_ids=ids, labels=ids).loss
    loss0.backward()
    opt.step()
    for k, v in model.named_parameters():
        if not v.requires_grad:
            assert torch.equal(v, frozen_before[k]), k
    assert model(input_ids=ids, labels=ids).loss < loss0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(sparsity=0.0), "sparsity"),
        (dict(sparsity=1.0), "sparsity"),
        (dict(pi=0.0), "pi"),
        (dict(targets=("nope_proj",)), "nope_proj"),
        (dict(targets=()), "targets"),
    ],
)
def test_apply_frod_bad_input_raises_value_error(llama_factory, kwargs, match):
    with pytest.raises(ValueError, match=match):
        apply_frod(llama_factory(), **kwargs)


def test_apply_frod_refuses_non_finite_weights(llama_factory):
    model = llama_factory()
    with torch.no_grad():
        model.model.layers[1].self_attn.q_proj.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.q_proj.*NaN"):
        apply_frod(model)


def test_apply_frod_refuses_mixed_widths_in_a_category():
    model = nn.Module()
    model.a = nn.Module()
    model.a.proj = nn.Linear(4, 3)
    model.b = nn.Module()
    model.b.proj = nn.Linear(5, 3)
    with pytest.raises(ValueError, match="mixes input widths"):
        apply_frod(model, targets=("proj",))
