"""The training benchmarks: FLOP formulas against torch's FLOP counter, and a CPU rehearsal of the whole matrix
(bench/train_matrix.py --tiny: every engine and method, the layer profile, the table)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from bench.flops import flops_per_token, frod_target_macs, lora_target_macs
from frod_ds import FRoDLinear, SparseSupport, decompose
from tests.support.helpers_ckpt import REPO
from tests.support.leftovers import clean_env


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


@pytest.mark.slow
def test_train_matrix_rehearsal_runs_every_engine_and_method(tmp_path):
    env = clean_env()
    out = tmp_path / "out"
    res = subprocess.run(
        [
            sys.executable,
            "bench/train_matrix.py",
            "--tiny",
            "--work",
            str(tmp_path / "w"),
            "--out",
            str(out),
            "--extras",
            "nf4",
            "--budget-s",
            "1e9",
            "--deadline-s",
            "1e9",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    doc = json.loads((out / "train_step_matrix_cpu.json").read_text())
    got = {(c["method"], c["engine"], c["frozen_quant"]) for c in doc["configs"]}
    assert got == {(m, e, "none") for m in ("frod", "lora") for e in ("plain", "zero2", "zero3")} | {
        ("frod", "zero2", "nf4"),
        ("lora", "zero2", "nf4"),
    }, doc["runs"]
    assert "FRoD zero2 (nf4 targets)" in doc["table_md"] and "LoRA r=16 zero2 (nf4 targets)" in doc["table_md"]
    dense = [c for c in doc["configs"] if c["frozen_quant"] == "none"]
    nf4 = [c for c in doc["configs"] if c["frozen_quant"] == "nf4"]
    first = [c["losses"][0] for c in dense]
    assert max(first) - min(first) < 1e-3 * abs(first[0]), "same model at init under every engine and method"
    for c in nf4:  # NF4 of U_i (FRoD) or of W (LoRA) moves the logits a little, not the loss much, at init
        assert c["losses"][0] != first[0] and abs(c["losses"][0] - first[0]) < 0.05 * abs(first[0]), c["losses"]
    for c in doc["configs"]:
        assert len(c["step_s_all"]) == 2 and all(len(w) == 2 for w in c["step_s_all"])
        assert c["flops_per_token"]["total"] > 0 and c["tokens_per_s_per_gpu"] > 0
    lora_best = min(
        (c for c in doc["configs"] if c["method"] == "lora" and c["frozen_quant"] == "none"),
        key=lambda c: c["step_s_median"],
    )
    group = doc["groups"][0]
    assert group["lora_best"]["engine"] == lora_best["engine"]
    assert (
        f"LoRA's best: **{lora_best['engine']}**" in doc["table_md"]
        and doc["table_md"].split("**Scaling**")[0].count("\n| ") == 9
    )
    assert doc["versions"]["deepspeed"] and doc["command"].startswith("python")

    # NF4 U_i under a bf16 ZeRO-3 zero.Init (sizes of the blobs must not follow zero.Init's dtype): the same model
    res = subprocess.run(
        [
            sys.executable,
            "bench/train_step.py",
            "run",
            "--method",
            "frod",
            "--frozen-quant",
            "nf4",
            "--config",
            "ds_configs/zero3.json",
            "--model",
            str(tmp_path / "w" / "model"),
            "--factors",
            str(tmp_path / "w" / "factors"),
            "--out",
            str(tmp_path / "z3"),
            "--batch",
            "2",
            "--seq",
            "32",
            "--warmup",
            "1",
            "--steps",
            "1",
            "--repeats",
            "1",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    (z3,) = [json.loads(p.read_text()) for p in (tmp_path / "z3").glob("*.json")]
    (z2,) = [c for c in nf4 if c["method"] == "frod"]
    assert z3["engine"] == "zero3" and z3["losses"][0] == pytest.approx(z2["losses"][0], rel=1e-3)

    prof = json.loads((out / "layer_profile.json").read_text())
    for shape in prof["shapes"]:
        saved = {k: v["saved_bytes"] for k, v in shape["variants"].items()}
        assert "dense M (n×n)" in saved["frod_autograd_tokens"], "plain autograd keeps M"
        for name in ("frod_fn_tokens_z_dense", "frod_fn_tokens_x_dense", "frod_fn_tokens_z_sampled"):
            assert "dense M (n×n)" not in saved[name], name
        assert "activations (z, h, Ax)" not in saved["frod_fn_tokens_x_dense"], "save x keeps no z"


def test_train_matrix_plan_keeps_the_given_order_and_refuses_unknown_engines():
    from bench.train_matrix import parse_plan

    plan = parse_plan("1:plain,zero2; 4:zero3 ;2:zero3-keep/frod")
    assert [(e, m, g) for e, m, _, g in plan] == [
        ("plain", "frod", 1),
        ("plain", "lora", 1),
        ("zero2", "frod", 1),
        ("zero2", "lora", 1),
        ("zero3", "frod", 4),
        ("zero3", "lora", 4),
        ("zero3-keep", "frod", 2),
    ]
    with pytest.raises(SystemExit, match="unknown engine 'zero4'"):
        parse_plan("1:zero4")
    with pytest.raises(SystemExit, match="plain PyTorch runs on one GPU"):
        parse_plan("2:plain")


def test_scaling_table_ratios_match_hand_computed_values():
    from bench.train_matrix import scaling_table

    def rec(method, engine, n, tps, config=None):
        return {
            "method": method,
            "engine": engine,
            "world_size": n,
            "gradient_checkpointing": False,
            "tokens_per_s_per_gpu": tps,
            "config": config or f"ds_configs/{engine}.json",
            "frod": {},
        }

    results = [
        rec("frod", "zero2", 1, 1000.0),
        rec("frod", "zero2", 2, 900.0),
        rec("frod", "zero3", 2, 450.0),
        rec("frod", "zero3", 2, 600.0, config="out/ds_variants/zero3-keep.json"),
    ]
    _, rows = scaling_table(results)
    got = {(r["config"], r["gpus"]): r for r in rows}
    assert got[("FRoD zero2", 2)]["scaling_vs_1gpu"] == pytest.approx(1.8)  # 2 x 900 / 1000
    assert got[("FRoD zero3", 2)]["over_zero2"] == pytest.approx(0.5)
    assert got[("FRoD zero3-keep", 2)]["over_zero2"] == pytest.approx(600 / 900)
    assert got[("FRoD zero3", 2)]["scaling_vs_1gpu"] is None  # no 1-GPU ZeRO-3 row


def test_link_benchmark_runs_on_two_gloo_ranks(tmp_path):
    env = clean_env()
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "bench/link.py",
            "--out",
            str(tmp_path),
            "--sizes-mib",
            "1",
            "--iters",
            "2",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    doc = json.loads((tmp_path / "link_2gpu.json").read_text())
    (row,) = doc["sizes"]
    assert doc["world_size"] == 2 and row["size_mib"] == pytest.approx(1.0)
    assert row["busbw_gbs"] == pytest.approx(row["algbw_gbs"] / 2)


def test_planner_check_plans_the_recorded_run_and_skips_what_the_planner_does_not_model():
    from bench.planner_check import check
    from frod_ds.plan.memory import plan_memory
    from frod_ds.plan.shapes import GiB, TrainShape, engine_from_ds_config, model_shape_from_config

    model = {
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 100,
    }
    ds = {"zero_optimization": {"stage": 3, "stage3_max_live_parameters": 10}}
    run = {
        "method": "frod",
        "ds_config": ds,
        "config": "x/zero3.json",
        "peak_allocated_gib": 1.0,
        "model": model,
        "frod": {"sparsity": 0.05, "impl": "autograd"},
        "micro_batch": 3,
        "seq_len": 16,
        "targets": ["q_proj", "v_proj"],
        "gradient_checkpointing": True,
        "world_size": 2,
        "device": "d",
        "_file": "f.json",
        "frozen_quant": "nf4",
    }
    got = check(run)
    want = plan_memory(
        model_shape_from_config({"model_type": "llama", **model}),
        TrainShape(3, 16, "bfloat16", ("q_proj", "v_proj"), 0.05, "nf4", False, True, "M"),
        engine_from_ds_config(ds),
        2,
        140 * GiB,
    )
    assert got["predicted_gib"] == pytest.approx(want.allocated / GiB)
    assert got["error"] == pytest.approx(want.allocated / GiB - 1.0)
    assert check({**run, "method": "lora"}) is None and check({**run, "ds_config": None}) is None


def test_step_harness_checkpoints_a_pretrained_lora_base_under_deepspeed(tmp_path):
    """``from_pretrained`` returns the base in eval mode, where transformers' layers skip checkpointing: the
    harness must put the engine in training mode, and it counts each layer's passes per step (2 = recomputed)
    instead of assuming ``--gc`` took effect."""
    env = clean_env()

    def run(*argv):
        res = subprocess.run(
            [sys.executable, "bench/train_step.py", *argv],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]

    run(
        "make-model",
        "--out",
        str(tmp_path / "m"),
        "--layers",
        "2",
        "--hidden",
        "64",
        "--inter",
        "128",
        "--heads",
        "4",
        "--vocab",
        "256",
    )
    for gc, passes in (("--gc", 2.0), (None, 1.0)):
        out = tmp_path / f"out{passes:g}"
        run(
            "run",
            "--method",
            "lora",
            "--config",
            "ds_configs/zero3.json",
            "--model",
            str(tmp_path / "m"),
            "--frozen-quant",
            "nf4",
            "--quantize-base",
            *([gc] if gc else []),
            "--batch",
            "2",
            "--seq",
            "32",
            "--warmup",
            "1",
            "--steps",
            "1",
            "--repeats",
            "1",
            "--out",
            str(out),
        )
        (doc,) = [json.loads(p.read_text()) for p in out.glob("*.json")]
        assert doc["gradient_checkpointing"] is bool(gc) and doc["layer_passes_per_step"] == passes
