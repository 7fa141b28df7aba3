"""Model build from a checkpoint and a factor store (one process): equals plain transformers at init."""

from __future__ import annotations

import pytest
import torch

from frod_ds.build import build_frod_model, make_supports
from frod_ds.store import FactorStore
from tests.helpers_ckpt import run_hjd, write_tiny_llama

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"]


def _store_for(model_dir, out):
    proc = run_hjd(["--model", str(model_dir), "--out", str(out), "--dtype", "float64"], nproc=0)
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
