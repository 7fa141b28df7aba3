"""HJD (spec §1): every member reconstructs; V is what stock PEFT computes; bad input is refused."""

from __future__ import annotations

import pytest
import torch

from frod_ds.hjd.math import decompose, reconstruction_error


def _members(shapes, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=dtype) for s in shapes]


def _dense_check(Ws, res, tol):
    """Independent check: rebuild each W_i from the factors with plain matmuls."""
    n = Ws[0].shape[1]
    assert res.V.shape == (n, n)
    for W, U, s, err in zip(Ws, res.U, res.sigma, res.error):
        assert U.shape == W.shape and s.shape == (n,)
        rebuilt = U @ torch.diag(s) @ res.V.T
        rel = (torch.linalg.norm(rebuilt - W.to(U.dtype)) / torch.linalg.norm(W)).item()
        assert rel < tol, rel
        assert err == pytest.approx(rel, rel=1e-3, abs=1e-15)


CASES = {
    "tall": [(40, 16)] * 4,
    "wide": [(3, 16), (5, 16)],  # Σ m_i = 8 < n = 16
    "gqa_kv_heights": [(16, 16), (8, 16), (16, 16), (8, 16)],
    "single_member": [(20, 12)],
}


@pytest.mark.parametrize("case", list(CASES))
def test_hjd_reconstructs_every_member_fp64(case):
    Ws = _members(CASES[case])
    _dense_check(Ws, decompose(Ws, dtype=torch.float64), 1e-9)


@pytest.mark.parametrize("case", list(CASES))
def test_hjd_reconstructs_every_member_fp32(case):
    Ws = _members(CASES[case], dtype=torch.float32)
    _dense_check(Ws, decompose(Ws, dtype=torch.float32), 1e-5)


def test_hjd_member_with_zero_column_and_zero_member():
    Ws = _members([(24, 10)] * 3)
    Ws[1][:, 4] = 0.0  # one member has a zero column
    Ws.append(torch.zeros(6, 10, dtype=torch.float64))  # a member that is all zeros
    res = decompose(Ws)
    _dense_check(Ws[:3], res, 1e-9)
    assert torch.all(torch.isfinite(torch.stack([s for s in res.sigma])))
    assert torch.count_nonzero(res.U[3]) == 0 and torch.count_nonzero(res.sigma[3]) == 0
    assert res.error[3] == 0.0


def test_hjd_rank_deficient_stack_reconstructs():
    g = torch.Generator().manual_seed(1)
    basis = torch.randn(3, 12, generator=g, dtype=torch.float64)  # every row in a 3-dim subspace
    Ws = [torch.randn(10, 3, generator=g, dtype=torch.float64) @ basis for _ in range(3)]
    Ws[0][:, 7] = 0.0
    _dense_check(Ws, decompose(Ws), 1e-9)


def test_hjd_wide_zero_sigma_directions_have_zero_u_columns():
    Ws = _members([(2, 9), (3, 9)])
    res = decompose(Ws)
    # k = 5 < n = 9: the completion directions carry sigma = 0 and zero U columns.
    for U, s in zip(res.U, res.sigma):
        assert torch.all(s[5:] == 0) and torch.count_nonzero(U[:, 5:]) == 0


def test_hjd_v_is_full_rank_and_completion_orthonormal():
    res = decompose(_members([(2, 9), (3, 9)]))
    assert torch.linalg.matrix_rank(res.V) == 9
    N = res.V[:, 5:]
    assert torch.allclose(N.T @ N, torch.eye(4, dtype=N.dtype), atol=1e-12)


def test_hjd_v_matches_stock_peft_projection():
    """External oracle: PEFT's FrodConfig computes V on the same weights (fp32 there, fp64 here)."""
    from peft.tuners.frod.model import _projection_from_weights

    Ws = _members([(48, 16)] * 3 + [(24, 16)], dtype=torch.float32)
    ours = decompose(Ws, pi=1e-3, dtype=torch.float64).V
    theirs = _projection_from_weights([w.float() for w in Ws], 1e-3).double()
    # Convention: columns in ascending eigenvalue order of T_pi (both); each column only up to sign.
    signs = torch.sign((ours * theirs).sum(0))
    assert torch.allclose(ours, theirs * signs, rtol=1e-4, atol=1e-4 * ours.abs().max().item())


def test_hjd_v_matches_stock_peft_through_get_peft_model(llama_factory):
    """Same oracle through PEFT's public API on a tiny LLaMA's q_proj category."""
    from peft import FrodConfig, get_peft_model

    model = llama_factory(num_hidden_layers=4, hidden_size=16, intermediate_size=24, num_attention_heads=2)
    Ws = [layer.self_attn.q_proj.weight.detach().clone() for layer in model.model.layers]
    ours = decompose(Ws).V
    peft_model = get_peft_model(model, FrodConfig(target_modules=["q_proj"], sparse_rate=0.02))
    buffers = {k: v for k, v in peft_model.named_buffers() if "frod_V" in k}
    assert buffers, "PEFT FRoD exposes V as buffers"
    theirs = next(iter(buffers.values())).double()
    signs = torch.sign((ours * theirs).sum(0))
    assert torch.allclose(ours, theirs * signs, rtol=1e-4, atol=1e-4 * ours.abs().max().item())


def test_hjd_fp32_path_is_independent_of_tf32_setting():
    Ws = _members([(40, 16)] * 3, dtype=torch.float32)
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        res = decompose(Ws, dtype=torch.float32)
        assert torch.get_float32_matmul_precision() == "medium", "setting restored"
    finally:
        torch.set_float32_matmul_precision(prev)
    assert max(res.error) < 1e-5


@pytest.mark.parametrize(
    "weights, pi, match",
    [
        (lambda: _members([(4, 4)]), 0.0, "pi"),
        (lambda: _members([(4, 4)]), -1.0, "pi"),
        (lambda: _members([(4, 4)]), float("nan"), "pi"),
        (lambda: [], 1e-3, "at least one"),
        (lambda: _members([(4, 4), (4, 5)]), 1e-3, "input width"),
        (lambda: [torch.tensor([[1.0, float("nan")]])], 1e-3, "NaN or Inf"),
        (lambda: [torch.tensor([[1.0, float("inf")]])], 1e-3, "NaN or Inf"),
        (lambda: [torch.ones(3)], 1e-3, "2-D"),
    ],
)
def test_hjd_bad_input_raises_value_error(weights, pi, match):
    with pytest.raises(ValueError, match=match):
        decompose(weights(), pi=pi)


def test_reconstruction_error_is_relative():
    W = torch.eye(3, dtype=torch.float64)
    assert reconstruction_error(W, W, torch.ones(3, dtype=torch.float64), W) == 0.0
    assert reconstruction_error(W, W, 2 * torch.ones(3, dtype=torch.float64), W) == pytest.approx(1.0)


@pytest.mark.parametrize("case", ["tall", "gqa_kv_heights"])
def test_gram_route_equals_householder_fp64(case):
    """The Gram route (Cholesky of Σ W_iᵀW_i, T_pi from (G_i + πG)⁻¹, B_i = W_i R⁻¹Z) gives the
    Householder factors: same V, σ and U to fp64 rounding (times eigenvector conditioning)."""
    Ws = _members(CASES[case], seed=3)
    ref = decompose(Ws, dtype=torch.float64)
    got = decompose(Ws, dtype=torch.float64, method="gram")
    _dense_check(Ws, got, tol=1e-12)
    rel = lambda a, b: (torch.linalg.norm(a - b) / torch.linalg.norm(b)).item()  # noqa: E731
    assert rel(got.V, ref.V) < 1e-8
    for a, b, sa, sb in zip(got.U, ref.U, got.sigma, ref.sigma):
        assert rel(sa, sb) < 1e-8 and rel(a, b) < 1e-8


def test_gram_route_fp32_reconstructs_mixed_scale_members():
    """fp32: the Gram route keeps per-member error at fp32 level also when members differ in scale by 50x
    (the Householder route's error grows with ‖W‖/‖W_i‖ there)."""
    Ws = [w * 0.02 for w in _members([(48, 32)] * 5, seed=1, dtype=torch.float32)] + _members(
        [(20, 32)], seed=2, dtype=torch.float32
    )
    got = decompose(Ws, dtype=torch.float32, method="gram")
    _dense_check([w.double() for w in Ws], got, tol=1e-6)


def test_gram_route_refuses_a_wide_stack():
    with pytest.raises(ValueError, match="full column rank"):
        decompose(_members(CASES["wide"]), method="gram")
    with pytest.raises(ValueError, match="method"):
        decompose(_members(CASES["tall"]), method="qr")


def test_probe_error_is_the_layers_relative_error_on_the_probes():
    """``probe_error`` against a dense fp64 computation of ‖W X − U diag σ Vᵀ X‖ / ‖W X‖, for factors that are right
    (tiny), off by a known perturbation, zero, and non-finite; row blocks do not change the value."""
    from frod_ds.hjd.math import probe_error, probe_vectors

    Ws = _members([(24, 16), (8, 16)], seed=3, dtype=torch.float32)
    res = decompose(Ws, dtype=torch.float32, method="householder")
    X = probe_vectors(16, seed=7)
    assert X.shape == (16, 4) and torch.equal(X, probe_vectors(16, seed=7))  # its own generator: reproducible
    W, U, s = Ws[0].double(), res.U[0], res.sigma[0]

    def dense(U_):
        return float(
            torch.linalg.norm(W @ X - U_.double() @ torch.diag(s.double()) @ res.V.double().T @ X) / (W @ X).norm()
        )

    assert float(probe_error(Ws[0], U, s, res.V, X)) == pytest.approx(dense(U), rel=1e-6) and dense(U) < 1e-5
    off = U + 1e-2 * torch.randn(U.shape, generator=torch.Generator().manual_seed(1))
    got = float(probe_error(Ws[0], off, s, res.V, X, block=16 * 5))  # 5 rows a block
    assert got == pytest.approx(dense(off), rel=1e-9) and got > 1e-3
    assert float(probe_error(Ws[0], torch.zeros_like(U), s, res.V, X)) == pytest.approx(1.0)
    assert float(probe_error(torch.zeros_like(Ws[0]), torch.zeros_like(U), s, res.V, X)) == 0.0  # a zero member
    nan = U.clone()
    nan[0, 0] = float("nan")
    assert torch.isnan(probe_error(Ws[0], nan, s, res.V, X))
