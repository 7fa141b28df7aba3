"""A ridge term ``π`` so small that ``G_i + πG`` is not positive definite in fp64 (a member of fewer rows than
columns): the Gram route leaves the category to the Householder route, whose factors match the reference; where
``π`` is too small for the compute precision itself, one line names the category, ``--pi`` and a usable value,
and no store is left."""

from __future__ import annotations

import pytest
import torch

from frod_ds.hjd.math import decompose, gram, gram_t_pi_term
from frod_ds.io.hf_checkpoint import HFCheckpoint
from frod_ds.model.store_reader import FactorStore
from frod_ds.runtime.errors import HJDError
from launch.hjd import main
from tests.support.helpers_ckpt import write_tiny_llama

PI = 1e-14
# k_proj 8×32 per layer, 4 layers: each member rank 8, the stack (32×32) of full column rank, so "auto" starts
# on the Gram route, where G_i + 1e-14·G is not positive definite in fp64
SHAPE = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=1, num_hidden_layers=4)


@pytest.fixture
def model(tmp_path):
    return write_tiny_llama(tmp_path / "model", **SHAPE)


def _k_proj(model) -> tuple[list[str], list[torch.Tensor]]:
    ckpt = HFCheckpoint(model)
    names = sorted((k for k in ckpt.keys() if k.endswith("k_proj.weight")), key=lambda k: int(k.split(".")[2]))
    return names, [ckpt.get(n) for n in names]


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.strip() and not line.lstrip().startswith(("HJD ", "k_proj L"))]


def test_the_gram_route_cannot_take_this_pi(model):
    """The premise: at this π a member's Gram term is not positive definite in fp64 (the route would fail)."""
    _, Ws = _k_proj(model)
    G_s = [gram(W) for W in Ws]
    terms = [gram_t_pi_term(G_i, sum(G_s), PI) for G_i in G_s]
    assert not all(torch.isfinite(t).all() for t in terms)


def test_a_tiny_pi_in_float64_takes_the_householder_route_and_reproduces_the_weights(model, tmp_path, capsys):
    out = tmp_path / "store"
    argv = ["--model", str(model), "--out", str(out), "--device", "cpu", "--targets", "k_proj"]
    assert main([*argv, "--pi", str(PI), "--dtype", "float64", "--u-dtype", "float32"]) == 0, capsys.readouterr().err
    store = FactorStore.open(out)
    assert store.record("k_proj").method == "householder"
    names, Ws = _k_proj(model)
    V = store.load_V("k_proj", dtype=torch.float64)  # at this π, T_pi's eigenvalues cluster: V is one basis of many
    assert torch.linalg.matrix_rank(V) == V.shape[0]
    for name, W in zip(names, Ws):
        member = name.removesuffix(".weight")
        U, s = store.load_U(member, dtype=torch.float64), store.load_sigma(member, dtype=torch.float64)
        rel = float(((U * s) @ V.T - W.double()).norm() / W.double().norm())
        assert rel < 1e-6, (member, rel)  # U stored in float32


def test_a_pi_too_small_for_the_compute_precision_is_one_line_and_leaves_no_store(model, tmp_path, capsys):
    out = tmp_path / "store"
    argv = ["--model", str(model), "--out", str(out), "--device", "cpu", "--targets", "k_proj", "--pi", str(PI)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err and "LinAlgError" not in err, err
    assert lines[0] == (
        "error: k_proj: --pi 1e-14 is too small for HJD in float32: a member's Q_iᵀQ_i + πI is not positive definite "
        "at that precision; use --pi 1e-5 or more, or compute in float64 (from 1e-14)"
    )
    assert not out.exists()


def test_decompose_names_a_pi_too_small_instead_of_a_linalg_error(model):
    _, Ws = _k_proj(model)
    with pytest.raises(HJDError, match=r"the Gram route cannot compute with pi 1e-14: .*use method='householder'"):
        decompose(Ws, pi=PI, dtype=torch.float64, method="gram")
    with pytest.raises(HJDError, match=r"pi 1e-14 is too small for HJD in float32: .* use pi 1e-5 or more"):
        decompose(Ws, pi=PI, dtype=torch.float32, method="householder")
    res = decompose(Ws, pi=PI, dtype=torch.float64, method="householder")
    assert max(res.error) < 1e-10


def test_two_ranks_agree_on_the_householder_route_and_on_the_error(model, tmp_path):
    """Each rank sums its own members' terms: a failed one (NaN) reaches every rank through the sum, so all leave
    the Gram route together, and all stop on the same line where π is too small for float32."""
    from tests.support.helpers_ckpt import run_hjd

    out = tmp_path / "store"
    base = ["--model", str(model), "--out", str(out), "--device", "cpu", "--targets", "k_proj", "--pi", str(PI)]
    res = run_hjd([*base, "--dtype", "float64"], nproc=2)
    assert res.returncode == 0, res.stderr[-3000:]
    assert FactorStore.open(out).record("k_proj").method == "householder"
    res = run_hjd([*base, "--overwrite"], nproc=2)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-3000:]
    lines = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "k_proj: --pi 1e-14 is too small for HJD in float32" in lines[0], res.stderr[-3000:]
