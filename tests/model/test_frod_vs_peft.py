"""frod-ds' FRoD against stock PEFT's FRoD on a tiny Llama (issue #26, item 1; ``bench/frod_vs_peft.py``).

The same frozen factors (V, U_i), S support and σ⁰ injected into PEFT's ``FrodConfig`` model and into frod-ds'
``apply_frod`` model must give the same training run: logits at init, gradients of step 1, every AdamW update
(σ and S groups with their own LRs, weight decay, clipping, warmup + cosine) and every step's loss. Stock PEFT
is the independent computation; the second test shows the check notices a one-line change of the arithmetic.
"""

from __future__ import annotations

import pytest
import torch

from bench.frod_vs_peft import OptCfg, inject, lockstep, peft_frod_model

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"]
VOCAB, STEPS, TOL = 96, 8, 1e-5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from frod_ds.testing.toy import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("frod-vs-peft") / "llama", vocab_size=VOCAB)


def _pair(tiny, sparsity: float = 0.05):
    from transformers import AutoModelForCausalLM

    from frod_ds.model.apply import apply_frod

    load = lambda: AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32)  # noqa: E731
    frod = apply_frod(load(), TARGETS, sparsity=sparsity, seed=3)
    peft = peft_frod_model(load(), TARGETS, sparsity, 1e-3)
    inject(peft, frod)
    return frod, peft


def _batches() -> list[dict[str, torch.Tensor]]:
    """Two fixed batches, alternated (so the loss can fall); loss on the second half of each row."""
    g = torch.Generator().manual_seed(0)
    fixed = []
    for _ in range(2):
        ids = torch.randint(3, VOCAB, (4, 24), generator=g)  # (B, T)
        labels = ids.clone()
        labels[:, :12] = -100
        fixed.append({"input_ids": ids, "labels": labels})
    return [fixed[i % 2] for i in range(STEPS)]


CFG = OptCfg(lr_sigma=1e-2, lr_s=1e-3, weight_decay=0.01, eps=1e-8, max_grad_norm=1.0, warmup_ratio=0.25)


def test_injected_peft_frod_trains_like_frod_ds_step_by_step(tiny):
    frod, peft = _pair(tiny)
    run = lockstep(frod, peft, _batches(), CFG, log=lambda s: None)
    assert run["init"]["params"]["sigma"] == 0 and run["init"]["params"]["s"] == 0, "injection left σ or S apart"
    assert run["init"]["logits_max_abs_diff"] <= TOL * run["init"]["logits_max_abs"], run["init"]
    assert run["step1_grads"]["sigma"] <= TOL and run["step1_grads"]["s"] <= TOL, run["step1_grads"]
    for row in run["steps"]:
        assert row["loss_rel_diff"] <= TOL, row
        # AdamW's first steps divide each gradient entry by its own size, so an entry that is nearly zero (fp32
        # rounding of a cancelling sum) moves by a full LR step on both sides with a rounding-sized difference:
        # the updates agree to about 1e-3 while the gradients agree to 1e-6; a real slip is far above either.
        assert row["update_rel_diff"]["sigma"] <= 1e-2 and row["update_rel_diff"]["s"] <= 1e-2, row
    losses = [r["loss_frod"] for r in run["steps"]]
    assert losses[-1] < losses[0] - 0.05, f"training did not move the loss, so the check tested nothing: {losses}"


def test_the_check_notices_a_transposed_s(tiny):
    """The same run with PEFT's S read transposed in one category (a one-line arithmetic slip) disagrees."""
    frod, peft = _pair(tiny)
    base = peft.base_model
    base.frod_s_indices["self_attn_q_proj"]["default"] = base.frod_s_indices["self_attn_q_proj"]["default"].flip(0)
    run = lockstep(frod, peft, _batches()[:3], CFG, log=lambda s: None)
    assert run["init"]["logits_max_abs_diff"] <= TOL * run["init"]["logits_max_abs"]  # S = 0: same forward
    assert run["step1_grads"]["s"] > 1e-2, run["step1_grads"]
    assert max(r["loss_rel_diff"] for r in run["steps"][1:]) > TOL, run["steps"]


def test_committed_report_is_generated_from_its_results():
    """``bench/results/frod_vs_peft/report.md`` is what the generator gives for the committed ``results.json``, and
    the committed run met the tolerance over all its steps."""
    import json

    from bench.frod_vs_peft import DEFAULT_OUT
    from bench.frod_vs_peft import TOL as BENCH_TOL
    from bench.frod_vs_peft_report import render_report

    results = json.loads((DEFAULT_OUT / "results.json").read_text())
    assert (DEFAULT_OUT / "report.md").read_text() == render_report(results), (
        "run python -m bench.frod_vs_peft --report-only (do not edit the report by hand)"
    )
    steps = results["run"]["steps"]
    assert results["complete"] and len(steps) == results["setup"]["steps"] >= 50
    assert max(r["loss_rel_diff"] for r in steps) <= BENCH_TOL
