"""The FLOP counts of ``frod_ds.plan.flops`` (MFU in the benchmarks, the step-time model) against torch's FLOP
counter: FRoD's and LoRA's extra multiply-adds per targeted layer and token, and the frozen model's forward."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from frod_ds import FRoDLinear, SparseSupport, decompose
from frod_ds.plan.flops import flops_per_token, frod_target_macs, lora_target_macs


def _counted_flops(fn) -> int:
    with FlopCounterMode(display=False) as fc:
        fn()
    return fc.get_total_flops()


def _fwd_bwd(layer, x):
    def fn():
        xx = x.detach().clone().requires_grad_(True)
        layer(xx).sum().backward()

    return fn


@pytest.mark.parametrize("tokens, save", [(8, "z"), (8, "x"), (256, "z")])  # token order (z, x), weight order
def test_frod_extra_flops_per_token_match_the_flop_counter(tokens, save):
    m, n, s = 48, 32, 0.25
    res = decompose([torch.randn(m, n, dtype=torch.float64)])
    frod = FRoDLinear(res.U[0], nn.Parameter(res.V, requires_grad=False), res.sigma[0], SparseSupport.random(n, s, 0))
    frod.save = save
    frozen = nn.Linear(n, m, bias=False, dtype=torch.float64).requires_grad_(False)
    x = torch.randn(tokens, n, dtype=torch.float64)
    extra = _counted_flops(_fwd_bwd(frod, x)) - _counted_flops(_fwd_bwd(frozen, x))
    assert extra == pytest.approx(2 * tokens * frod_target_macs(m, n, frod.support.nnz, tokens, save, "dense"))


def test_lora_extra_flops_per_token_match_the_flop_counter():
    from peft import LoraConfig, get_peft_model

    m, n, r, tokens = 48, 32, 4, 10
    base = nn.Sequential()
    base.add_module("proj", nn.Linear(n, m, bias=False))
    lora = get_peft_model(base, LoraConfig(r=r, target_modules=["proj"], lora_dropout=0.0))
    nn.init.normal_(lora.base_model.model.proj.lora_B["default"].weight)
    frozen = nn.Linear(n, m, bias=False).requires_grad_(False)
    x = torch.randn(tokens, n)
    extra = _counted_flops(_fwd_bwd(lora, x)) - _counted_flops(_fwd_bwd(frozen, x))
    assert extra == 2 * tokens * lora_target_macs(m, n, r) == 2 * tokens * 3 * r * (m + n)


def test_base_forward_flops_match_the_flop_counter(llama_factory):
    """Linear layers and lm_head as counted; attention counted causal (half of eager's full square)."""
    model = llama_factory(attn_implementation="eager")
    cfg = model.config.to_dict()
    B, seq = 2, 16
    ids = torch.randint(0, cfg["vocab_size"], (B, seq))
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        model(input_ids=ids)
    counts = fc.get_flop_counts()["Global"]
    linear = sum(v for k, v in counts.items() if k.__name__.split(".")[0] in ("mm", "addmm"))
    attention = sum(v for k, v in counts.items() if k.__name__.split(".")[0] == "bmm")
    f = flops_per_token(cfg, seq, "lora", B * seq, lora_r=4)
    attn_causal = 2 * cfg["num_hidden_layers"] * seq * cfg["hidden_size"]
    assert linear + attention / 2 == pytest.approx(B * seq * f["base_forward"])
    assert attention / 2 == pytest.approx(B * seq * attn_causal)
