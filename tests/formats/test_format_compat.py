"""A factor store and an adapter written by frod-ds format 1 (``tests/fixtures/format_v1``: a 2-layer toy
model, its store, an adapter with σ and S moved) still load, build, verify and export. The reference is
computed from the raw safetensors files with plain tensor algebra, not through frod-ds's readers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

FIX = Path(__file__).parents[1] / "fixtures" / "format_v1"


@pytest.fixture(autouse=True)
def fresh_notes():
    """Notes are printed once per process; each test here looks for its own."""
    from frod_ds.runtime.errors import _noted

    _noted.clear()


def _raw_merged_weights() -> dict[str, torch.Tensor]:
    """``W'_i = U_i (diag σ_i + S_i) Vᵀ`` for every member, straight from the files."""
    manifest = json.loads((FIX / "store" / "manifest.json").read_text())
    adapter = load_file(str(FIX / "adapter" / "adapter.safetensors"))
    out = {}
    for category, spec in manifest["categories"].items():
        V = load_file(str(FIX / "store" / spec["files"][f"{category}.V"]))[f"{category}.V"].double()
        rows, cols = adapter[f"{category}.support"].long()
        for member in spec["members"]:
            U = load_file(str(FIX / "store" / spec["files"][f"{member}.U"]))[f"{member}.U"].double()
            M = torch.diag(adapter[f"{member}.frod_sigma"].double())
            M[rows, cols] += adapter[f"{member}.frod_s"].double()
            out[member + ".weight"] = (U @ M @ V.T).float()
    return out


def _plain_model(weights: dict[str, torch.Tensor]):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(FIX / "model", dtype=torch.float32)
    state = model.state_dict()
    assert set(weights) <= set(state)
    state.update(weights)
    model.load_state_dict(state)
    return model.eval()


def test_format1_store_reconstructs_the_model_weights(capsys):
    from frod_ds.model.store_reader import FactorStore

    store = FactorStore.open(FIX / "store")
    (note,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("note:")]
    assert "has no checksums (format 1" in note and "rebuild it with frod hjd --overwrite" in note
    base = {}
    for f in (FIX / "model").glob("*.safetensors"):
        base.update(load_file(str(f)))
    for category, members in store.categories.items():
        V = store.load_V(category, torch.float64)
        for member in members:
            W = base[member + ".weight"].double()
            rebuilt = (store.load_U(member, torch.float64) * store.load_sigma(member, torch.float64)) @ V.T
            assert (torch.linalg.norm(rebuilt - W) / torch.linalg.norm(W)).item() < 1e-5, member


def test_format1_store_verifies():
    from launch.hjd import main

    assert main(["--verify", str(FIX / "store"), "--model", str(FIX / "model"), "--samples", "2"]) == 0


def test_format1_adapter_builds_the_model_it_was_saved_from(capsys):
    from frod_ds.model.adapter import adapter_sources, load_adapter_into, supports_from_adapter
    from frod_ds.model.build import build_frod_model

    tensors, config, model_dir, store = adapter_sources(FIX / "adapter", str(FIX / "model"), str(FIX / "store"))
    notes = [x for x in capsys.readouterr().err.splitlines() if x.startswith("note:")]
    assert len(notes) == 3 and "is of adapter version 1, which records no checksum" in notes[0]
    assert "does not record the identity of its factor store (adapter version 1" in notes[2]
    model = build_frod_model(model_dir, store, supports_from_adapter(tensors, config), torch.float32)
    load_adapter_into(model, tensors)
    ids = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = model.eval()(ids).logits, _plain_model(_raw_merged_weights())(ids).logits
    assert (got - want).abs().max().item() < 1e-5


def test_format1_adapter_exports(tmp_path):
    from launch.export import main

    out = tmp_path / "merged"
    assert (
        main(
            [
                "--checkpoint",
                str(FIX / "adapter"),
                "--base-model",
                str(FIX / "model"),
                "--factor-store",
                str(FIX / "store"),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    exported = {}
    for f in out.glob("*.safetensors"):
        exported.update(load_file(str(f)))
    for name, W in _raw_merged_weights().items():
        assert torch.allclose(exported[name], W, atol=1e-6, rtol=1e-5), name
