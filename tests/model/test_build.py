"""Model build from a checkpoint and a factor store (one process): equals plain transformers at init. The factor
stores are built by ``frod hjd``'s ``main`` in the test process (tests/hjd/test_distributed_hjd.py runs it as
processes)."""

from __future__ import annotations

import pytest
import torch

from frod_ds.model.build import build_frod_model, make_supports
from frod_ds.model.store_reader import FactorStore
from tests.support.helpers_ckpt import hjd_in_process, write_tiny_llama

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"]


def _store_for(model_dir, out):
    proc = hjd_in_process(["--model", str(model_dir), "--out", str(out), "--dtype", "float64"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    return FactorStore.open(out)


@pytest.mark.parametrize("tied", [False, True])
def test_built_model_equals_plain_transformers_at_init(tmp_path, tied):
    from transformers import AutoModelForCausalLM

    model_dir = write_tiny_llama(tmp_path / "m", tie_word_embeddings=tied)
    store = _store_for(model_dir, tmp_path / "f")
    model = build_frod_model(model_dir, store, make_supports(store, TARGETS, 0.1, 0), torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, ref(input_ids=ids).logits, atol=1e-5)
    assert {n.rsplit(".", 1)[-1] for n, p in model.named_parameters() if p.requires_grad} == {"frod_sigma", "frod_s"}


def test_built_model_reports_a_damaged_factor_file(tmp_path):
    model_dir = write_tiny_llama(tmp_path / "m")
    store = _store_for(model_dir, tmp_path / "f")
    part = next((tmp_path / "f").glob("k_proj.rank*.safetensors"))
    part.write_bytes(part.read_bytes()[:200])  # truncated after the store was opened
    with pytest.raises(ValueError, match=r"loading model\.layers\.0\.self_attn\.k_proj\.U"):
        build_frod_model(model_dir, store, make_supports(store, TARGETS, 0.1, 0), torch.float32)


def test_bf16_checkpoint_with_fp32_u_is_exact_under_fp32_compute(tmp_path):
    """``--u-dtype float32``: U is stored in fp32 and the FRoD model of a bf16 checkpoint computes, in fp32,
    what the base computes (U rounded to bf16 moves it by bf16's rounding instead); recorded in the manifest,
    and a resume with another U dtype is refused."""
    import json

    from transformers import AutoModelForCausalLM

    model_dir = write_tiny_llama(tmp_path / "m", dtype=torch.bfloat16)
    ref = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    drift = {}
    for u in ("auto", "float32"):
        out = tmp_path / f"f-{u}"
        proc = hjd_in_process(["--model", str(model_dir), "--out", str(out), "--u-dtype", u])
        assert proc.returncode == 0, proc.stderr[-2000:]
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["u_dtype"] == u
        assert {s["u_dtype"] for s in manifest["categories"].values()} == {"bfloat16" if u == "auto" else "float32"}
        store = FactorStore.open(out)
        assert store.load_U("model.layers.0.mlp.up_proj").dtype == (torch.bfloat16 if u == "auto" else torch.float32)
        model = build_frod_model(model_dir, store, make_supports(store, TARGETS, 0.1, 0), torch.float32)
        with torch.no_grad():
            drift[u] = (model(input_ids=ids).logits - ref(input_ids=ids).logits).abs().max().item()
    assert drift["float32"] < 1e-5 < drift["auto"] / 10, drift
    proc = hjd_in_process(["--model", str(model_dir), "--out", str(tmp_path / "f-auto"), "--u-dtype", "float32"])
    assert proc.returncode == 2 and "u_dtype: 'auto' there, 'float32' now" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("targets", [TARGETS, ["q_proj", "v_proj"]])
def test_targeted_dense_weights_are_never_allocated(tmp_path, monkeypatch, targets):
    """The skeleton's targeted linears have no weight when they are swapped (their dense W would be dropped at
    once: at 70B that is two thirds of the model); every other linear has its weight, and the built model still
    equals plain transformers. With q and v targeted, o_proj (q_proj's shape) keeps its weight."""
    from transformers import AutoModelForCausalLM

    import frod_ds.model.build as build

    model_dir = write_tiny_llama(tmp_path / "m")
    store = _store_for(model_dir, tmp_path / "f")
    seen = {}
    swap = build._swap_targets

    def spy(model, *args, **kwargs):
        seen.update({n: m.weight is None for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        return swap(model, *args, **kwargs)

    monkeypatch.setattr(build, "_swap_targets", spy)
    model = build_frod_model(model_dir, store, make_supports(store, targets, 0.1, 0), torch.float32)
    assert seen and {n for n, empty in seen.items() if empty} == {n for n in seen if n.rsplit(".", 1)[-1] in targets}
    assert torch.nn.Linear.__init__.__qualname__ == "Linear.__init__"  # the patch is undone
    ref = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, ref(input_ids=ids).logits, atol=1e-5)


def _built_both_ways(tmp_path, flag: str, holder_type):
    """The tiny model built with ``flag`` (``flat_trainables`` / ``flat_frozen``) off and on, and the on-build's
    holders: one per decoder layer, each holding every target of it; the off-build has none."""
    model_dir = write_tiny_llama(tmp_path / "m")
    store = _store_for(model_dir, tmp_path / "f")
    models = {
        flat: build_frod_model(model_dir, store, make_supports(store, TARGETS, 0.1, 0), torch.float32, **{flag: flat})
        for flat in (False, True)
    }
    holders = [m for m in models[True].modules() if isinstance(m, holder_type)]
    assert len(holders) == models[True].config.num_hidden_layers and len(holders[0].members) == len(TARGETS)
    assert not any(isinstance(m, holder_type) for m in models[False].modules())
    return model_dir, store, models, holders


def _same_loss_backward(models: dict, ids: torch.Tensor) -> None:
    """Each model's loss on ``ids``, backpropagated; the losses are bit for bit equal."""
    losses = {}
    for flat, m in models.items():
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        losses[flat] = loss.detach()
    assert torch.equal(losses[False], losses[True])


def _keeps_holders_not_views(model, params: list) -> None:
    """What autograd keeps for the backward of a forward in either ordering shares no memory with the holder
    Parameters ``params`` except those Parameters themselves (whose data ZeRO-3 swaps on release): a kept view of
    one would hold a gathered layer until the backward."""
    from frod_ds.core.layer import FRoDLinear

    layers = [m for m in model.modules() if isinstance(m, FRoDLinear)]
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        for mode in ("tokens", "weight"):
            for m in layers:
                m.mode = mode
            model(input_ids=torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))).logits.sum()
    for m in layers:
        m.mode = "auto"
    storages = {p.untyped_storage().data_ptr(): p for p in params}
    held = [t for t in kept if t.untyped_storage().data_ptr() in storages]
    assert held and all(any(t is p for p in params) for t in held), [tuple(t.shape) for t in held]


def test_flat_frozen_u_computes_exactly_as_one_parameter_per_member(tmp_path):
    """The dense U_i of a decoder layer held as one frozen Parameter (``FRoDFrozen``, what ZeRO-3 builds) give the
    same logits, loss and σ/S gradients bit for bit as one U Parameter per FRoD layer; each member reads its own
    span; the backward keeps the holder, never a view of it; a quantized U keeps its own Parameter."""
    from frod_ds.core.layer import FRoDFrozen, FRoDLinear

    model_dir, store, models, holders = _built_both_ways(tmp_path, "flat_frozen", FRoDFrozen)
    flat_layers = {n: m for n, m in models[True].named_modules() if isinstance(m, FRoDLinear)}
    for name, m in ((n, m) for n, m in models[False].named_modules() if isinstance(m, FRoDLinear)):
        got = flat_layers[name]
        assert "U" not in got._parameters and got.u_parameter() is got._frozen[0].U and not got.U.requires_grad
        assert torch.equal(got.U, m.U) and torch.equal(got.U, store.load_U(name).float()), name
    assert sum(p.numel() for p in models[True].parameters()) == sum(p.numel() for p in models[False].parameters())
    _keeps_holders_not_views(models[True], [h.U for h in holders])
    from frod_ds.model.adapter import merged_state_dict

    merged = {flat: merged_state_dict(m) for flat, m in models.items()}  # the export's dense weights: the same
    assert list(merged[True]) == list(merged[False]) and all(
        torch.equal(merged[True][k], v) for k, v in merged[False].items()
    )
    _same_loss_backward(models, torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0)))
    for name, m in ((n, m) for n, m in models[False].named_modules() if isinstance(m, FRoDLinear)):
        assert torch.equal(m.frod_s.grad, flat_layers[name].frod_s.grad), name
        assert torch.equal(m.frod_sigma.grad, flat_layers[name].frod_sigma.grad), name
    assert all(h.U.grad is None for h in holders)
    nf4 = build_frod_model(
        model_dir, store, make_supports(store, TARGETS, 0.1, 0), torch.float32, quant="nf4", flat_frozen=True
    )
    assert not any(isinstance(m, FRoDFrozen) for m in nf4.modules())


def test_flat_trainables_train_exactly_as_one_parameter_per_layer(tmp_path):
    """σ and S held per decoder layer (``FRoDTrainables``, what DeepSpeed's ZeRO builds) give the same loss, the same
    gradients element for element, the same AdamW steps and the same adapter as one Parameter per FRoD layer."""
    from frod_ds.core.layer import FRoDLinear, FRoDTrainables
    from frod_ds.model.adapter import adapter_state
    from frod_ds.model.apply import frod_param_groups

    model_dir, store, models, holders = _built_both_ways(tmp_path, "flat_trainables", FRoDTrainables)
    assert sum(p.requires_grad for p in models[True].parameters()) == 2 * len(holders)
    _keeps_holders_not_views(models[True], [p for h in holders for p in (h.frod_sigma, h.frod_s)])
    opts = {
        flat: torch.optim.AdamW(frod_param_groups(m, lr_sigma=1e-2, lr_s=1e-3), foreach=False)
        for flat, m in models.items()
    }
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        _same_loss_backward(models, torch.randint(0, 64, (2, 9), generator=g))
        flat_layers = dict((n, m) for n, m in models[True].named_modules() if isinstance(m, FRoDLinear))
        for name, m in ((n, m) for n, m in models[False].named_modules() if isinstance(m, FRoDLinear)):
            holder, i = flat_layers[name]._flat
            (a, b), (c, d) = holder.sigma_spans[i], holder.s_spans[i]
            assert torch.equal(m.frod_sigma.grad, holder.frod_sigma.grad[a:b]), name
            assert torch.equal(m.frod_s.grad, holder.frod_s.grad[c:d]), name
        for opt in opts.values():
            opt.step()
            opt.zero_grad()
    ref, got = adapter_state(models[False])[0], adapter_state(models[True])[0]
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)
    assert any(
        not torch.equal(
            v,
            adapter_state(build_frod_model(model_dir, store, make_supports(store, TARGETS, 0.1, 0), torch.float32))[0][
                k
            ],
        )
        for k, v in got.items()
        if k.endswith("frod_s")
    ), "the steps moved S"


def test_fixed_parameter_walks_replay_the_walk_and_follow_a_copy(tmp_path):
    """``fetch_per_layer`` makes the model's and each decoder layer's ``named_parameters`` replay one walk
    (``FixedParameters``): the same names and Parameter objects as nn.Module's own walk for every argument
    combination; a deep copy replays its own Parameters; ``forget`` walks again."""
    import copy

    from frod_ds.model.build import FixedParameters, fetch_per_layer

    model_dir = write_tiny_llama(tmp_path / "m")
    store = _store_for(model_dir, tmp_path / "f")
    model = build_frod_model(model_dir, store, make_supports(store, TARGETS, 0.1, 0), torch.float32)
    fetch_per_layer(model)
    fixed = [m for m in model.modules() if isinstance(m.__dict__.get("named_parameters"), FixedParameters)]
    assert len(fixed) == model.config.num_hidden_layers + 1 and fixed[0] is model

    def walks(m):
        return [
            [(n, id(p)) for n, p in f(prefix=pre, recurse=rec)]
            for f in (m.named_parameters, lambda **k: type(m).named_parameters(m, **k))
            for pre in ("", "x")
            for rec in (True, False)
        ]

    for m in fixed:
        got = walks(m)
        assert got[:4] == got[4:] and got[0], type(m).__name__
        assert [id(p) for p in m.parameters()] == [id(p) for p in type(m).parameters(m)]
    twin = copy.deepcopy(model)
    mine, theirs = dict(model.named_parameters()), dict(twin.named_parameters())
    assert list(mine) == list(theirs) and not any(mine[k] is theirs[k] for k in mine)
    assert all(theirs[n] is p for n, p in type(twin).named_parameters(twin))
    layer = fixed[1]
    layer.register_parameter("extra", torch.nn.Parameter(torch.zeros(1)))
    assert "extra" not in dict(layer.named_parameters())  # the contract: no Parameter is added afterwards...
    layer.named_parameters.forget()
    assert "extra" in dict(layer.named_parameters())  # ...or the lists are dropped
