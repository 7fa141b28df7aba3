"""Memory planner: the arithmetic against hand computations on tiny configs, the decision, the CLI and its errors."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys

import pytest

from frod_ds.config.ds_config import load_ds_config
from frod_ds.plan.memory import plan_memory
from frod_ds.plan.recommend import hint, recommend
from frod_ds.plan.shapes import Engine, GiB, TrainShape, model_shape_from_config, shipped_engines
from tests.support import pace
from tests.support.model_shapes import LLAMA2_7B, LLAMA2_70B, TINY
from tests.support.train_env import REPO, env_vars


def test_zero2_plan_equals_hand_computation():
    """L=3, h=64, f=128, 4 heads / 2 KV heads (d=16), vocab 100 untied; 2 × 8 tokens, bf16, density 0.25; 2 GPUs."""
    model = model_shape_from_config(TINY)
    train = TrainShape(micro_batch=2, seq_len=8, sparsity=0.25)
    plan = plan_memory(model, train, Engine("z2", 2, reduce_bucket=1000), gpus=2, gpu_bytes=1e9)
    e, L, T = 2, 3, 16
    U = (64 * 64 + 32 * 64 + 32 * 64 + 64 * 64 + 128 * 64 + 128 * 64) * L * e  # q k v o gate up, replicated
    V = 6 * 64 * 64 * e
    other = 64 * 128 * L * e + (2 * L + 1) * 64 * e + 2 * 100 * 64 * e  # down_proj, norms, embed + lm_head
    trainable = (64 + round(0.25 * 64 * 64)) * 6 * L  # σ (n) + S (s·n²) per member = 19584
    train_bytes = trainable * (e + (e + 12) / 2)  # bf16 params replicated; grads, fp32 master, Adam m/v halved
    per_token = 2 * 4 * 64 + e * 4 * 64 + 4 * 4 + e * 3 * 128 + e * 64 * 6  # norms fp32, SDPA q k v o + lse, SwiGLU, z
    act = per_token * T * L
    loss = T * 100 * (e + 12)
    want = {
        "frozen U_i": U,
        "frozen V": V,
        "frozen other": other,
        "trainable + optimizer": train_bytes,
        "activations": act,
        "M kept for backward": 0,
        "logits + loss": loss,
        "ZeRO-3 gathered": 0,
        "DeepSpeed buffers": 1000 * e,
    }
    assert plan.parts == pytest.approx(want)
    assert plan.allocated == pytest.approx(621136)
    assert plan.activations_other == pytest.approx(L * e * 64 * T + per_token * T)  # checkpointing: inputs + one layer


def test_zero3_nf4_plan_with_m_kept_equals_hand_computation():
    """The same model under ZeRO-3 on 2 GPUs, NF4 U_i, the plain-autograd layer (keeps M), persistence threshold 100,
    reuse distance 60000 (two of the three layers stay gathered at the turn of the backward)."""
    model = model_shape_from_config(TINY)
    train = TrainShape(micro_batch=2, seq_len=8, sparsity=0.25, quant="nf4", layer_saves="M")
    engine = Engine("z3", 3, reduce_bucket=1000, prefetch_bucket=500, persistence=100, max_reuse=60000)
    plan = plan_memory(model, train, engine, gpus=2, gpu_bytes=1e9)
    e, L, T = 2, 3, 16

    def nf4_bytes(m, n):  # codes (½ byte each) then fp32 absmax per 64, each 8-aligned
        codes = -(-(m * n // 2) // 8) * 8
        return -(-(codes + 4 * (m * n // 64)) // 8) * 8

    blobs = [
        nf4_bytes(64, 64),
        nf4_bytes(32, 64),
        nf4_bytes(32, 64),
        nf4_bytes(64, 64),
        nf4_bytes(128, 64),
        nf4_bytes(128, 64),
    ]
    assert blobs == [2304, 1152, 1152, 2304, 4608, 4608]
    U = sum(blobs) * L / 2  # every blob ≥ 100 elements: partitioned
    V = 6 * 64 * 64 * e / 2
    other = 64 * 128 * L * e / 2 + (2 * L + 1) * 64 * e + 2 * 100 * 64 * e / 2  # norms (64 < 100) persistent
    sigma = 64 * (e + (e + 12) / 2)  # persistent bf16 σ; gradient (bf16), fp32 master and Adam m, v halved
    s_vals = 1024 * (e / 2 + (e + 12) / 2)
    train_bytes = (sigma + s_vals) * 6 * L
    # per token: norms, SDPA, SwiGLU, z per member; memory_efficient_linear keeps down_proj's input (a quantized U
    # goes through its own Function: h is not kept)
    per_token = 2 * 4 * 64 + e * 4 * 64 + 4 * 4 + e * 3 * 128 + e * 64 * 6 + e * 128
    M = e * 64 * 64 * 6 * L
    loss = T * 100 * (e + 12) + T * e * 64  # + lm_head's input (memory_efficient_linear)
    P_layer = sum(blobs) / 2 + 64 * 128 + 1024 * 6  # gathered per layer: blobs, down_proj, S values (σ, norms persist)
    kept = 2  # 2k·P_layer + P_head < 60000 for k = 0, 1
    gathered = (kept * P_layer + 100 * 64 + 500) * e + 6 * 64 * 64 * e
    want = {
        "frozen U_i": U,
        "frozen V": V,
        "frozen other": other,
        "trainable + optimizer": train_bytes,
        "activations": per_token * T * L,
        "M kept for backward": M,
        "logits + loss": loss,
        "ZeRO-3 gathered": gathered,
        "DeepSpeed buffers": 1000 * e,
    }
    assert plan.parts == pytest.approx(want)
    assert plan.allocated == pytest.approx(707256)


def test_weight_order_keeps_x_per_shared_input_and_w_per_member():
    """At 1024 tokens every member of TINY takes the weight order (``frod_ds.core.layer.ordering``): x is kept once per
    input (attention, o_proj, MLP: 3 × n), W = U M Vᵀ once per member per call (Σ m·n)."""
    from frod_ds.plan.memory import layer_activation_bytes

    model = model_shape_from_config(TINY)
    per_token, per_call = layer_activation_bytes(model, TrainShape(micro_batch=4, seq_len=256, sparsity=0.25))
    e = 2
    assert per_token == 2 * 4 * 64 + e * 4 * 64 + 4 * 4 + e * 3 * 128 + e * 64 * 3
    assert per_call == e * (64 * 64 + 32 * 64 + 32 * 64 + 64 * 64 + 128 * 64 + 128 * 64)


def test_offload_leaves_only_persistent_frozen_and_no_optimizer_state_on_the_gpu():
    model = model_shape_from_config(TINY)
    train = TrainShape(micro_batch=2, seq_len=8, sparsity=0.25)
    engine = Engine("off", 3, offload_param=True, offload_optimizer=True, persistence=100)
    plan = plan_memory(model, train, engine, gpus=2, gpu_bytes=1e9)
    assert plan.parts["frozen U_i"] == 0 and plan.parts["frozen V"] == 0
    assert plan.parts["frozen other"] == (2 * 3 + 1) * 64 * 2  # the norms (persistent) stay
    assert plan.parts["trainable + optimizer"] == 6 * 3 * 64 * 2  # σ persistent; S, gradients, Adam on the CPU


def test_offloaded_parameters_are_gathered_as_full_copies_on_one_gpu_too():
    """With parameter offload the partitions are on the CPU, so one GPU holds gathered copies like N GPUs do (one
    layer's window, the shared Vs, lm_head; DeepSpeed copies each to the GPU); without offload one GPU holds its
    only partition and gathers nothing. By hand for TINY: per layer 7 frozen linears + σ + S (64-wide, S 0.25·64²
    per member; k/v are 32 x 64), head 100 x 64, Vs 6 x 64², prefetch bucket 0, reuse distance 1e9: all layers
    kept."""
    model = model_shape_from_config(TINY)
    train = TrainShape(micro_batch=2, seq_len=8, sparsity=0.25)
    off = Engine(
        "off",
        3,
        offload_param=True,
        offload_optimizer=True,
        persistence=0,
        prefetch_bucket=0,
        max_live=10**9,
        max_reuse=10**9,
    )
    on_gpu = Engine("z3", 3, persistence=0, prefetch_bucket=0, max_live=10**9, max_reuse=10**9)
    layer = (
        (2 * 64 * 64 + 2 * 32 * 64 + 2 * 128 * 64 + 64 * 128) + 2 * 64 + 6 * (64 + 1024)
    )  # q,o k,v gate,up down; norms
    by_hand = (3 * layer + 100 * 64) * 2 + 6 * 64 * 64 * 2
    for gpus in (1, 2):
        assert plan_memory(model, train, off, gpus, 1e9).parts["ZeRO-3 gathered"] == by_hand
    assert plan_memory(model, train, on_gpu, 1, 1e9).parts["ZeRO-3 gathered"] == 0
    assert plan_memory(model, train, on_gpu, 2, 1e9).parts["ZeRO-3 gathered"] == by_hand


def test_recommendation_is_the_fastest_fitting_set_up_at_the_recipes_precision():
    from frod_ds.plan.recommend import predicted_seconds

    model = model_shape_from_config(LLAMA2_70B)
    train = TrainShape(micro_batch=4, seq_len=256)
    engines = shipped_engines()
    rec = recommend(model, train, 2, 79.1 * 2**30, engines)
    assert rec is not None and rec.plan.fits and rec.quant == "none", "bf16 asked, bf16 given while anything fits"
    same = [p for p in rec.tried if (p.train.quant, p.train.quantize_base) == ("none", False)]
    assert len(same) == 2 * len(engines), "every engine, with and without checkpointing"
    assert rec.seconds == min(predicted_seconds(model, p) for p in same if p.fits)
    assert rec.engine.offload_param, "70B in bf16 fits 2 x 80 GB only with its weights in host memory"
    assert "frozen_quant=nf4" in rec.reason, "the much faster quantized set-up is named, not chosen"
    offload = recommend(model, train, 1, 16 * 2**30, engines)
    assert offload.engine.offload_param and offload.plan.host_bytes > 30 * 2**30  # 70B: weights in host memory
    assert recommend(model, train, 1, 0.5 * 2**30, engines) is None  # not even the CUDA context fits


def test_hint_names_the_faster_or_the_fitting_set_up():
    engines = {e.name: e for e in shipped_engines()}
    small = model_shape_from_config(LLAMA2_7B)
    train = TrainShape(micro_batch=4, seq_len=256, checkpointing=True)
    deepspeed_z3 = dataclasses.replace(engines["ds_configs/zero3.json"], layers=False)  # zero3_partition=deepspeed
    line = hint(small, train, deepspeed_z3, 1, 79.1 * 2**30)
    assert line.startswith("hint:") and "ds_configs/zero2.json fits" in line and "\n" not in line
    # zero3.json's layer partition on one GPU holds the model whole, as zero2.json does: nothing to gain
    assert hint(small, train, engines["ds_configs/zero3.json"], 1, 79.1 * 2**30) is None
    assert hint(small, train, engines["ds_configs/zero2.json"], 1, 79.1 * 2**30) is None
    big = model_shape_from_config(LLAMA2_70B)
    line = hint(big, train, engines["ds_configs/zero2.json"], 2, 79.1 * 2**30)
    assert "likely out of memory" in line and "zero3_offload.json, frozen bf16" in line, "the recipe's precision"
    assert "with frozen_quant=nf4" in line, "and the much faster quantized set-up, named"


def test_train_hint_reads_the_recipe_and_the_loaded_json(tmp_path):
    """``train_hint`` takes the DeepSpeed JSON as ``load_ds_config`` returned it and names it as it is told."""
    from frod_ds.config.ds_config import load_ds_config
    from frod_ds.config.recipe import load_recipe
    from frod_ds.plan.recommend import train_hint

    (tmp_path / "config.json").write_text(json.dumps(LLAMA2_7B))
    deepspeed = ["train.zero3_partition=deepspeed"]  # DeepSpeed's stage 3: zero2.json predicted faster on 2 GPUs
    recipe = load_recipe(REPO / "recipes" / "llama2_7b_cs170k.yaml", [f"model.base={tmp_path}", *deepspeed])
    zero3 = load_ds_config(REPO / "ds_configs" / "zero3.json")
    line = train_hint(recipe, zero3, 2, 79.1 * 2**30, name="my/zero3.json")
    assert line is not None and "zero2.json fits" in line and "faster than my/zero3.json" in line
    assert line.endswith("(frod plan)"), "the hint names the command in the one vocabulary"
    layers = load_recipe(REPO / "recipes" / "llama2_7b_cs170k.yaml", [f"model.base={tmp_path}"])
    assert train_hint(layers, zero3, 2, 79.1 * 2**30) is None, "the layer partition: within the hint's margin"
    assert train_hint(recipe, zero3, 2, None) is None  # no GPU: no line
    recipe = load_recipe(REPO / "recipes" / "llama2_7b_cs170k.yaml", [f"model.base={tmp_path / 'nothing'}"])
    assert train_hint(recipe, zero3, 2, 79.1 * 2**30) is None


def test_train_hint_never_reads_the_trainings_json_again(tmp_path, monkeypatch):
    """The DeepSpeed JSON is parsed once, by the trainer: ``train_hint`` gets the loaded dict and never opens the
    file (only the shipped JSONs it compares against are read)."""
    import frod_ds.plan.shapes as shapes
    from frod_ds.config.recipe import load_recipe
    from frod_ds.plan.recommend import train_hint

    (tmp_path / "config.json").write_text(json.dumps(LLAMA2_7B))
    recipe = load_recipe(REPO / "recipes" / "llama2_7b_cs170k.yaml", [f"model.base={tmp_path}"])
    mine = tmp_path / "mine.json"
    mine.write_text((REPO / "ds_configs" / "zero2.json").read_text())
    cfg = load_ds_config(mine)
    read = []
    monkeypatch.setattr(shapes, "load_ds_config", lambda path: read.append(str(path)) or load_ds_config(path))
    assert train_hint(recipe, cfg, 1, 1.0 * 2**30, name=str(mine)).startswith("hint: predicted")
    assert read and str(mine) not in read, read


# ---- the decision frod train's hint is built on -----------------------------------------------------------------


def _needed(model, train, name: str, gpus: int) -> float:
    """What ``name`` (a shipped config) needs per GPU, by the planner's own arithmetic (GPU size does not enter it)."""
    engine = {e.name: e for e in shipped_engines()}[name]
    return plan_memory(model, train, engine, gpus, 1.0).needed


@pytest.mark.parametrize("shape", [LLAMA2_7B, LLAMA2_70B])
@pytest.mark.parametrize("gpus", [1, 2, 8])
def test_recommendation_boundary_is_where_the_faster_set_up_stops_fitting(shape, gpus):
    """ZeRO-2 (exact, no checkpointing) is chosen exactly while it fits; one byte less and the planner moves on to
    a slower candidate; ZeRO-3 with the same recipe is chosen on a GPU where it fits and nothing before it does."""
    model, train = model_shape_from_config(shape), TrainShape(micro_batch=4, seq_len=256)
    z2 = _needed(model, train, "ds_configs/zero2.json", gpus)
    rec = recommend(model, train, gpus, z2)
    assert (rec.engine.name, rec.quant, rec.checkpointing) == ("ds_configs/zero2.json", "none", False)
    assert "the fastest set-up fits" in rec.reason
    smaller = recommend(model, train, gpus, z2 - 1)
    assert smaller is None or (smaller.engine.name, smaller.quant, smaller.checkpointing) != (
        "ds_configs/zero2.json",
        "none",
        False,
    )
    if smaller is not None:
        assert "more than" in smaller.reason and smaller.plan.needed <= z2 - 1


def test_shipped_configs_map_to_their_engine():
    """Every shipped JSON as the planner reads it: ZeRO stage (0-2 replicate the frozen model, like 2) and offload."""
    from frod_ds.plan.shapes import engine_from_ds_config

    cfgs = {p.stem: json.loads(p.read_text()) for p in (REPO / "ds_configs").glob("*.json")}
    got = {k: (engine_from_ds_config(c).stage, engine_from_ds_config(c).offload_param) for k, c in cfgs.items()}
    assert got == {
        "zero0": (2, False),
        "zero2": (2, False),
        "zero2_cpu_fp32": (2, False),
        "zero3": (3, False),
        "zero3_cpu_fp32": (3, False),
        "zero3_offload": (3, True),
        "zero3_nvme": (3, True),
    }
    assert [e.name for e in shipped_engines()] == [
        f"ds_configs/{f}" for f in ("zero2.json", "zero3.json", "zero3_offload.json", "zero3_nvme.json")
    ]
    assert all((REPO / e.name).is_file() for e in shipped_engines())


def test_train_hint_boundaries_follow_the_plan(tmp_path):
    """``frod train``'s hint (``train_hint``) at the planner's own boundaries: silent where the chosen config is
    the fastest that fits; names ZeRO-2 when ZeRO-3 was chosen and ZeRO-2 fits; says out of memory (one line) when
    ZeRO-2 was chosen and does not fit; silent again when the partitioned model fits more GPUs. "ZeRO-3" here is
    DeepSpeed's own (``train.zero3_partition=deepspeed``); the layer partition's hint: the test above."""
    from frod_ds.config.recipe import load_recipe
    from frod_ds.plan.recommend import train_hint
    from frod_ds.plan.shapes import train_shape_from_recipe

    (tmp_path / "config.json").write_text(json.dumps(LLAMA2_7B))
    recipe = load_recipe(REPO / "recipes" / "llama2_7b_cs170k.yaml", [f"model.base={tmp_path}"])
    model, train = model_shape_from_config(LLAMA2_7B), train_shape_from_recipe(recipe)
    z2_json, z3_json = (load_ds_config(REPO / "ds_configs" / f"{n}.json") for n in ("zero2", "zero3"))
    z2 = _needed(model, train, "ds_configs/zero2.json", 1)
    assert train_hint(recipe, z3_json, 1, None) is None, "no GPU: no hint"
    assert train_hint(recipe, z2_json, 1, z2) is None, "ZeRO-2 fits exactly: nothing to say"
    both = max(z2, _needed(model, train, "ds_configs/zero3.json", 1))  # ZeRO-3's buckets may need a little more
    deepspeed = load_recipe(
        REPO / "recipes" / "llama2_7b_cs170k.yaml", [f"model.base={tmp_path}", "train.zero3_partition=deepspeed"]
    )
    slow = train_hint(deepspeed, z3_json, 1, both)
    assert slow.startswith("hint: ds_configs/zero2.json fits") and "\n" not in slow
    oom = train_hint(recipe, z2_json, 1, z2 - 1)
    assert oom.startswith("hint: predicted") and "likely out of memory" in oom and "\n" not in oom
    z3_two = _needed(model, train, "ds_configs/zero3.json", 2)
    if z3_two < _needed(model, train, "ds_configs/zero2.json", 2):
        assert train_hint(recipe, z3_json, 2, z3_two) is None, "ZeRO-3 over 2 GPUs fits, ZeRO-2 does not"
    bad = {"zero_optimization": {"stage": 9}}
    assert train_hint(recipe, bad, 1, z2) is None, "training's own checks report it"


@pytest.mark.parametrize("rank", [0, 1])
def test_frod_train_prints_the_planners_hint_once_on_rank_0(tmp_path, monkeypatch, capsys, rank):
    """``frod train`` on a (pretended) GPU whose ZeRO-2 fits, asked for ZeRO-3: rank 0 prints the planner's line,
    exactly once and as one line; another rank prints nothing. Process group, setup and fit are stand-ins (setup
    hands the hint what it read: the parsed JSON, the stage-2 JSON the layer partition's engine runs, config.json)."""
    import types

    import torch

    import frod_ds.runtime.distributed as dist
    import frod_ds.train.trainer as trainer
    from frod_ds.cli.train import parse_args, train
    from frod_ds.config.ds_config import as_stage2
    from frod_ds.config.recipe import load_recipe
    from frod_ds.plan.recommend import train_hint
    from frod_ds.plan.shapes import train_shape_from_recipe

    (tmp_path / "config.json").write_text(json.dumps(LLAMA2_7B))
    overrides = [f"model.base={tmp_path}"]
    recipe = load_recipe(REPO / "recipes" / "llama2_7b_cs170k.yaml", overrides)
    gpu = _needed(model_shape_from_config(LLAMA2_7B), train_shape_from_recipe(recipe), "ds_configs/zero2.json", 1)
    monkeypatch.setattr(dist, "init_deepspeed", lambda: None)
    monkeypatch.setattr(dist, "get_rank", lambda: rank)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(total_memory=gpu))

    def setup(recipe, ds_config, nvme_path=None, *, on_inputs=None):
        base = types.SimpleNamespace(config=lambda: LLAMA2_7B)
        given = load_ds_config(ds_config)
        on_inputs(types.SimpleNamespace(ds_config=as_stage2(given), user_ds_config=given, base=base))
        return "run"

    monkeypatch.setattr(trainer, "setup", setup)
    monkeypatch.setattr(trainer, "fit", lambda run: 0)
    config = str(REPO / "ds_configs" / "zero3.json")
    assert (
        train(parse_args(["--config", config, "--recipe", str(REPO / "recipes" / "llama2_7b_cs170k.yaml"), *overrides]))
        == 0
    )
    printed = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    if rank == 0:
        assert printed == [train_hint(recipe, load_ds_config(config), 1, gpu, name=config)]
        assert printed[0].startswith("hint:")
    else:
        assert printed == []
    assert not (REPO / "frod_ds" / "engine_choice.py").exists(), "one implementation: the planner's"


# ---- the CLI ---------------------------------------------------------------------------------------------------------


def _plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "frod_ds", "plan", *args],
        env=env_vars(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=pace.scaled(120),
    )


def _plan_here(*args: str) -> subprocess.CompletedProcess:
    """``frod plan ARGS`` by its ``main`` in this process (what it printed, its exit code), without a subprocess's
    imports: for checks of what the command decides, once the command line itself is checked (``_plan``)."""
    import contextlib
    import io

    from frod_ds.cli.plan import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(["frod", "plan", *args], code, out.getvalue(), err.getvalue())


def test_cli_prints_every_part_and_the_verdict(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA2_7B))
    res = _plan(
        "--model",
        str(tmp_path),
        "--gpus",
        "2",
        "--config",
        "ds_configs/zero3.json",
        "--seq-len",
        "512",
        "train.micro_batch_size=4",
    )
    assert res.returncode == 0, res.stderr
    for part in (
        "frozen U_i",
        "frozen V",
        "frozen other",
        "trainable + optimizer",
        "activations",
        "M kept for backward",
        "logits + loss",
        "ZeRO-3 gathered",
        "DeepSpeed buffers",
        "total allocated",
    ):
        assert part in res.stdout, part
    assert "fits" in res.stdout and "fastest set-up that fits: ds_configs/zero2.json" in res.stdout
    assert "activations with gradient checkpointing" in res.stdout
    assert "CPU optimizer term runs on the host" not in res.stdout
    res = _plan_here("--model", str(tmp_path), "--gpus", "1", "--gpu-mem", "4", "--config", "ds_configs/zero2.json")
    assert res.returncode == 1 and "does NOT fit" in res.stdout
    res = _plan_here("--model", str(tmp_path), "--gpus", "2", "--config", "ds_configs/zero3_offload.json")
    assert res.returncode == 0 and "CPU optimizer term runs on the host" in res.stdout, res.stdout
    assert "with torchrun's OpenMP threads, one per rank" in res.stdout, res.stdout


def test_a_density_that_leaves_s_empty_is_refused_as_training_refuses_it(tmp_path):
    """``frod plan`` refuses a ``model.sparsity`` whose S has no entry in a targeted category (round(s·n²) = 0 for
    its width n), as ``frod train`` does before it starts, and plans one entry more."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA2_7B))
    n = LLAMA2_7B["hidden_size"]  # q_proj's width; down_proj's is 11008
    targets = "model.targets=[down_proj,q_proj]"
    for s, named in ((0.4 / n**2, "q_proj (width 4096"), (0.6 / n**2, None), (1e-9, "down_proj (width 11008")):
        res = _plan_here("--model", str(tmp_path), "--gpus", "1", targets, f"model.sparsity={s!r}")
        if named:
            assert res.returncode == 2 and f"gives S no entries for {named}" in res.stderr, (s, res.stderr)
        else:
            assert res.returncode == 0 and "fastest set-up that fits" in res.stdout, (s, res.stderr)


def test_the_users_gradient_checkpointing_is_kept_by_the_recommendation(tmp_path):
    """``model.gradient_checkpointing`` given (an override or the recipe file) is planned as given, the engine and
    precision still recommended; unset, the recommendation picks it. The activations printed are ``plan_memory``'s
    for that choice (computed here)."""
    from frod_ds.cli.plan import H100_GIB, _gib
    from frod_ds.config.recipe import load_recipe
    from frod_ds.plan.shapes import engine_from_ds_config, train_shape_from_recipe

    (tmp_path / "config.json").write_text(json.dumps(LLAMA2_7B))
    (tmp_path / "r.yaml").write_text("model:\n  gradient_checkpointing: true\n")
    model = model_shape_from_config(LLAMA2_7B)
    train = train_shape_from_recipe(load_recipe(None, ["model.gradient_checkpointing=true"], paths=False))
    free = _plan_here("--model", str(tmp_path), "--gpus", "1")
    assert free.returncode == 0 and "fastest set-up that fits: ds_configs/zero2.json" in free.stdout
    assert "gradient checkpointing off" in free.stdout  # fits without: faster
    for given in (["model.gradient_checkpointing=true"], ["--recipe", str(tmp_path / "r.yaml")]):
        res = _plan_here("--model", str(tmp_path), "--gpus", "1", *given)
        assert res.returncode == 0 and "gradient checkpointing on" in res.stdout, given
        assert "gradient checkpointing off" not in res.stdout, given
        name = re.search(r"fastest set-up that fits: (\S+),", res.stdout).group(1)
        cfg = json.loads((REPO / name).read_text())
        want = plan_memory(model, train, engine_from_ds_config(cfg, name), 1, H100_GIB * GiB)
        for part, b in want.parts.items():  # every part of the plan printed is this one's
            assert f"  {part:<24}{_gib(b)} GiB\n" in res.stdout, (given, part, res.stdout)
    off = _plan_here("--model", str(tmp_path), "--gpus", "1", "--gpu-mem", "20", "model.gradient_checkpointing=false")
    assert "gradient checkpointing on" not in off.stdout  # kept off, even where on would fit more


def test_a_float32_recipe_is_labelled_fp32_and_advised_with_the_dtype_change_its_json_needs(tmp_path):
    """The shipped JSONs train in bf16 (``bf16.enabled`` true: ``frod train`` refuses a float32 recipe with them).
    A float32 recipe's own JSON is planned and labelled in fp32; the advice names the dtype change the shipped JSON
    needs, planned in that dtype; ``frod train``'s hint does not offer a JSON the run would be refused with."""
    from frod_ds.cli.plan import H100_GIB
    from frod_ds.config.recipe import load_recipe
    from frod_ds.plan.shapes import engine_from_ds_config, train_shape_from_recipe

    (tmp_path / "config.json").write_text(json.dumps(LLAMA2_7B))
    res = _plan_here(
        "--model", str(tmp_path), "--gpus", "1", "--config", "ds_configs/zero2_cpu_fp32.json", "model.dtype=float32"
    )
    assert res.returncode == 0, res.stderr
    assert "ds_configs/zero2_cpu_fp32.json on 1 GPU(s), frozen fp32, gradient checkpointing off:" in res.stdout
    advice = "fastest set-up that fits: ds_configs/zero2.json with model.dtype=bfloat16, frozen bf16,"
    assert advice in res.stdout
    model = model_shape_from_config(LLAMA2_7B)
    fp32 = train_shape_from_recipe(load_recipe(None, ["model.dtype=float32"], paths=False))
    rec = recommend(model, fp32, 1, H100_GIB * GiB)
    zero2 = engine_from_ds_config(json.loads((REPO / "ds_configs/zero2.json").read_text()), "ds_configs/zero2.json")
    bf16 = dataclasses.replace(fp32, dtype="bfloat16")
    assert rec.plan.train.dtype == "bfloat16" and rec.engine.dtype == "bfloat16"
    assert rec.plan.needed == plan_memory(model, bf16, zero2, 1, H100_GIB * GiB).needed
    z3 = json.loads((REPO / "ds_configs/zero3_cpu_fp32.json").read_text())
    ours = engine_from_ds_config(z3, "fp32.json", "deepspeed")  # slower than zero2.json, which is bf16 only
    assert ours.dtype == "float32" and hint(model, fp32, ours, 1, H100_GIB * GiB) is None
    assert "ds_configs/zero2.json fits" in hint(model, bf16, dataclasses.replace(ours, dtype=None), 1, H100_GIB * GiB)
    assert recommend(model, bf16, 1, H100_GIB * GiB).describe().startswith("ds_configs/zero2.json, frozen bf16,")


@pytest.mark.parametrize(
    "change,needle",
    [
        (
            {"zero_optimization": {"stage": 2, "reduce_bucket_sise": 5e7}},
            'did you mean "zero_optimization.reduce_bucket_size"',
        ),
        ({"gradient_cliping": 1.0}, 'did you mean "gradient_clipping"'),
        ({"zero_optimization": {"stage": 9}}, "zero_optimization.stage must be 0, 1, 2 or 3, got 9"),
    ],
)
def test_cli_plan_refuses_a_deepspeed_json_training_would_refuse(tmp_path, change, needle):
    """A misspelled key plans against DeepSpeed's default silently unless refused, as training refuses it."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA2_7B))
    cfg = {**json.loads((REPO / "ds_configs" / "zero2.json").read_text()), **change}
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    res = _plan_here("--model", str(tmp_path), "--gpus", "1", "--config", str(tmp_path / "ds.json"))
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], res.stderr


@pytest.mark.parametrize("gather,refused", [("peer", True), ("collective", False), ("auto", False)])
def test_cli_plan_refuses_peer_copies_of_host_shards_as_training_does(tmp_path, gather, refused):
    """``zero3_gather=peer`` with CPU parameter offload: training refuses it (peer copies cannot read host
    memory), so the planner does too, in the same line, instead of planning NCCL gathers with exit 0."""
    from frod_ds.config.ds_config import DSConfigError, load_ds_config
    from frod_ds.config.zero3_layout import check_gather

    (tmp_path / "config.json").write_text(json.dumps(LLAMA2_7B))
    args = ["--model", str(tmp_path), "--gpus", "2", "--config", "ds_configs/zero3_offload.json"]
    res = _plan_here(*args, f"train.zero3_gather={gather}")
    lines = [line for line in res.stderr.splitlines() if line.strip() and not line.startswith("note:")]
    if refused:
        assert res.returncode == 2 and len(lines) == 1 and "peer copies cannot read" in lines[0], res.stderr
        with pytest.raises(DSConfigError, match="peer copies cannot read"):
            check_gather(load_ds_config(REPO / "ds_configs" / "zero3_offload.json"), "layers", "peer")
    else:
        assert res.returncode == 0 and "shards in host memory" in res.stdout, res.stderr
    check_gather(load_ds_config(REPO / "ds_configs" / "zero3_offload.json"), "deepspeed", "peer")  # no host shards


@pytest.mark.parametrize(
    "config,needle",
    [
        (None, "has no config.json"),
        ({"model_type": "gpt2", "n_embd": 768}, "model_type 'gpt2' is not one the planner models"),
        ({"model_type": "llama", "hidden_size": 64}, "missing or non-integer intermediate_size"),
        # a key given twice: transformers builds from the last value, the weights may have the first
        (json.dumps(LLAMA2_7B)[:-1] + ', "hidden_size": 8192}', 'key "hidden_size" is given twice in the top level'),
    ],
)
def test_cli_bad_model_is_one_line(tmp_path, config, needle):
    if isinstance(config, str):
        (tmp_path / "config.json").write_text(config)
    elif config is not None:
        (tmp_path / "config.json").write_text(json.dumps(config))
    res = _plan("--model", str(tmp_path), "--gpus", "1")
    assert res.returncode == 2, res.stdout + res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], res.stderr


LLAMA_SIZES = {**LLAMA2_7B, "num_key_value_heads": 32}


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"hidden_size": 0}, "hidden_size must be a positive integer, got 0"),
        ({"num_hidden_layers": -2}, "num_hidden_layers must be a positive integer, got -2"),
        ({"num_hidden_layers": 0}, "num_hidden_layers must be a positive integer, got 0"),  # divided by it
        ({"vocab_size": 0}, "vocab_size must be a positive integer, got 0"),
        ({"num_key_value_heads": 5}, "num_key_value_heads 5 does not divide num_attention_heads 32"),
        ({"num_attention_heads": 7}, "num_attention_heads 7 does not divide hidden_size 4096"),
        ({"num_attention_heads": 5, "num_key_value_heads": 5, "head_dim": 128}, "which a LLaMA needs"),
        ({"intermediate_size": 11008.0}, "intermediate_size must be a positive integer, got 11008.0"),
        ({"num_attention_heads": True}, "num_attention_heads must be a positive integer, got True"),
        ({"max_position_embeddings": "256"}, "max_position_embeddings must be a positive integer, got '256'"),
        ({"attention_bias": "false"}, "attention_bias must be true or false, got 'false'"),  # a truthy string
        ({"tie_word_embeddings": "no"}, "tie_word_embeddings must be true or false, got 'no'"),
        ({"mlp_bias": 0}, "mlp_bias must be true or false, got 0"),
        ({"pad_token_id": 99999}, "pad_token_id 99999 is past the vocabulary (vocab_size 32000)"),
        ({"eos_token_id": [2, "x"]}, "eos_token_id must be a token id (an integer ≥ 0), got 'x'"),
    ],
)
def test_config_sizes_no_model_has_are_refused(tmp_path, change, needle):
    """Each size is checked by the one reader of config.json (frod_ds.io.model_config) before any arithmetic: the
    planner's own reading and the file's (``load_model_shape``) give the same line; a sound config plans."""
    from frod_ds.plan.shapes import PlanError, load_model_shape
    from frod_ds.runtime.errors import FrodError

    assert model_shape_from_config(LLAMA_SIZES).parameters > 6e9
    with pytest.raises(PlanError, match=re.escape(needle)):
        model_shape_from_config({**LLAMA_SIZES, **change})
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA_SIZES, **change}))
    with pytest.raises(FrodError, match=re.escape(needle)):
        load_model_shape(str(tmp_path))
    if "head_dim" in change:  # transformers' own LlamaConfig refuses it; a Mistral with its own head_dim is sound
        from transformers import LlamaConfig

        with pytest.raises(Exception, match="not a multiple of the number of attention heads"):  # noqa: B017, PT011
            LlamaConfig(**{**LLAMA_SIZES, **change})
        assert model_shape_from_config({**LLAMA_SIZES, **change, "model_type": "mistral"}).heads == 5


def test_cli_plan_of_a_zero_layer_config_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA2_7B, "num_hidden_layers": 0}))
    res = _plan("--model", str(tmp_path), "--gpus", "1")
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    assert "num_hidden_layers must be a positive integer, got 0" in lines[0] and "Traceback" not in res.stderr


def test_a_billion_layer_config_is_planned_at_once(tmp_path):
    """Nothing in the plan walks the layers one by one: a config claiming 10⁹ of them (a typo) gets its verdict in
    well under a second of work, the same one the plan of 10⁶ and 10⁷ layers reaches (nothing fits)."""
    import time

    verdicts = []
    for layers in (10**6, 10**7, 10**9):
        (tmp_path / "config.json").write_text(json.dumps({**LLAMA2_7B, "num_hidden_layers": layers}))
        t0 = time.process_time()
        res = _plan_here("--model", str(tmp_path), "--gpus", "2", "--config", "ds_configs/zero3.json")
        assert time.process_time() - t0 < 5, layers
        verdicts.append((res.returncode, "nothing fits" in res.stdout + res.stderr))
    assert verdicts == [verdicts[0]] * 3 and verdicts[0][1], verdicts


def test_ds_layers_kept_for_reuse_count_as_the_layer_walk_did():
    """The closed form of the layers ZeRO-3 keeps gathered against the walk it replaced, over random sizes."""
    import random

    from frod_ds.plan.memory import _layers_kept

    rng = random.Random(0)
    for _ in range(5000):
        layers, p_head = rng.randint(0, 60), rng.uniform(0, 50)
        p_layer = rng.choice([0, rng.uniform(0, 10), rng.randint(1, 10)])
        reuse = rng.choice([rng.uniform(0, 200), float(rng.randint(0, 200))])
        walk = sum(1 for k in range(layers) if 2 * k * p_layer + p_head < reuse)
        assert _layers_kept(layers, p_layer, p_head, reuse) == walk


def test_plan_refuses_a_ds_config_with_its_own_optimizer_as_training_does(tmp_path):
    """An ``optimizer`` or ``scheduler`` block, which training refuses, is refused by ``frod plan --config`` too,
    with the same words (one check for both)."""
    from frod_ds.config.ds_config import DSConfigError, check_ds_config, own_blocks

    (tmp_path / "config.json").write_text(json.dumps(LLAMA2_7B))
    for block in ("optimizer", "scheduler"):
        cfg = {**load_ds_config(REPO / "ds_configs" / "zero2.json"), block: {"type": "Adam"}}
        path = tmp_path / f"{block}.json"
        path.write_text(json.dumps(cfg))
        res = _plan_here("--model", str(tmp_path), "--gpus", "1", "--config", str(path))
        assert res.returncode == 2 and f'remove the "{block}" block' in res.stderr, res.stderr
        with pytest.raises(DSConfigError, match=f'remove the "{block}" block'):
            check_ds_config(cfg, path)
        assert own_blocks(cfg) and not own_blocks(load_ds_config(REPO / "ds_configs" / "zero2.json"))


@pytest.mark.parametrize(
    "edit, gpus, says",
    [
        ({"train_batch_size": 7}, "1", "train_batch_size=7 in the DeepSpeed config but the recipe gives 4"),
        ({"train_batch_size": 4}, "2", "train_batch_size=4 in the DeepSpeed config but the recipe gives 8"),
        ({"bf16": {"enabled": False}}, "1", "bf16.enabled=False in the DeepSpeed config but model.dtype=bfloat16"),
        ({"gradient_clipping": 5.0}, "1", "gradient_clipping=5.0 in the DeepSpeed config but the recipe gives"),
    ],
)
def test_plan_refuses_a_ds_config_that_contradicts_the_recipe_as_training_does(tmp_path, edit, gpus, says):
    """A batch size (for the GPUs asked: micro 4 x accum 1 x GPUs), bf16 switch or clipping that training refuses
    against the recipe is refused by ``frod plan --config`` too, naming the file; the values the recipe gives pass."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA2_7B))
    path = tmp_path / "ds.json"
    base = load_ds_config(REPO / "ds_configs" / "zero2.json")
    recipe = ["model.dtype=bfloat16", "train.micro_batch_size=4", "train.grad_accum=1", "train.max_grad_norm=1.0"]
    path.write_text(json.dumps({**base, **edit}))
    res = _plan_here("--model", str(tmp_path), "--gpus", gpus, "--config", str(path), *recipe)
    assert res.returncode == 2 and f"DeepSpeed config {path}: {says}" in res.stderr, res.stderr
    agreeing = {"train_batch_size": 4 * int(gpus), "bf16": {"enabled": True}, "gradient_clipping": 1.0}
    path.write_text(json.dumps({**base, **{k: agreeing[k] for k in edit}}))
    res = _plan_here("--model", str(tmp_path), "--gpus", gpus, "--config", str(path), *recipe)
    assert res.returncode in (0, 1) and "error" not in res.stderr, res.stderr  # planned (fits or not)


def test_planner_errors_are_user_errors(tmp_path):
    """In-process: the planner's and the config lookup's errors are ``FrodError``s (the entry prints them)."""
    from frod_ds.plan.shapes import PlanError, load_model_shape
    from frod_ds.runtime.errors import CheckpointError

    with pytest.raises(CheckpointError, match="has no config.json"):
        load_model_shape(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(PlanError, match="model_type 'gpt2'"):
        load_model_shape(str(tmp_path))


def _fits_anywhere(model, train, gpus, gpu, engines):
    from frod_ds.plan.memory import plan_memory
    from frod_ds.plan.recommend import candidates

    return any(
        plan_memory(model, dataclasses.replace(train, quant=q, quantize_base=qb, checkpointing=gc), e, gpus, gpu).fits
        for e, q, qb, gc in candidates(engines, train)
    )


def test_more_gpus_are_advised_only_where_they_help():
    """70B on 40 GiB GPUs with ZeRO-3 (no offload) alone: the advice names the fewest GPU count that fits, checked
    by trying every count below it; 7B with 64 x 256 tokens per 8 GiB GPU: activations and logits alone exceed the
    GPU on 1, 64 or 4096 GPUs, and the advice says more GPUs do not help and what does."""
    from frod_ds.plan.recommend import fewest_gpus, no_fit_advice

    big, gpu = model_shape_from_config(LLAMA2_70B), 40 * GiB
    zero3 = [e for e in shipped_engines() if e.name == "ds_configs/zero3.json"]
    train = TrainShape(micro_batch=1, seq_len=256)
    need = fewest_gpus(big, train, 1, gpu, zero3)
    assert need is not None and need > 1
    assert [n for n in range(1, need + 1) if _fits_anywhere(big, train, n, gpu, zero3)] == [need]
    assert f"from {need} GPUs one does" in no_fit_advice(big, train, 1, gpu, zero3)

    small, gpu = model_shape_from_config(LLAMA2_7B), 8 * GiB
    train = TrainShape(micro_batch=64, seq_len=256)
    engines = shipped_engines()
    assert not any(_fits_anywhere(small, train, n, gpu, engines) for n in (1, 64, 4096))
    assert fewest_gpus(small, train, 1, gpu, engines) is None
    advice = no_fit_advice(small, train, 1, gpu, engines)
    assert "on any number of GPUs" in advice and "more GPUs do not shrink" in advice and "micro_batch_size" in advice
    assert "use more GPUs" not in advice


def test_cli_plan_says_how_the_layer_partition_gathers_and_times_it_so(tmp_path):
    """Under zero3.json on 2 GPUs ``frod plan`` names the gather the recipe's ``train.zero3_gather`` makes and its
    step carries that gather's exposed link time: the peer copies' less than NCCL's (step_time's two constants)."""
    import re

    from frod_ds.plan.step_time import LAYERS_LINK_EXPOSED, PEER_LINK_EXPOSED

    (tmp_path / "config.json").write_text(json.dumps(LLAMA2_7B))
    base = ("--model", str(tmp_path), "--gpus", "2", "--config", "ds_configs/zero3.json")
    links = {}
    for gather, words in (("auto", "copies out of the other GPUs' memory"), ("collective", "NCCL all-gathers")):
        res = _plan_here(*base, f"train.zero3_gather={gather}")
        assert res.returncode == 0 and f"gathered by {words}" in res.stdout, res.stdout
        links[gather] = float(re.search(r"link (\d+)", res.stdout).group(1))
    assert links["auto"] == pytest.approx(links["collective"] * PEER_LINK_EXPOSED / LAYERS_LINK_EXPOSED, abs=1)


def test_the_layer_partition_with_offload_keeps_only_gathered_units_on_the_gpu():
    """``offload_param`` to the CPU under ``train.zero3_partition=layers``: the units' shards are in host memory,
    so the GPU holds V and the final norm whole, a layer plus the larger of a layer and the head gathered (on one
    GPU too); the step's side stream copies each rank's shard in for both passes, then gathers the rest by NCCL (never
    peer copies), behind the compute up to the compute's length."""
    from frod_ds.plan.memory import frozen_tensors
    from frod_ds.plan.shapes import engine_from_ds_config
    from frod_ds.plan.step_time import HOST_SHARD_BYTES_PER_S, NVLINK_BUSBW, step_time

    model = model_shape_from_config(TINY)
    train = TrainShape(micro_batch=2, seq_len=8, sparsity=0.25)
    cfg = load_ds_config(REPO / "ds_configs" / "zero3_offload.json")
    off = engine_from_ds_config(cfg, "off", "layers", "auto")
    on = engine_from_ds_config(load_ds_config(REPO / "ds_configs" / "zero3.json"), "z3", "layers", "auto")
    assert (off.layers, off.offload_param, off.peer) == (True, True, False) and on.peer
    assert engine_from_ds_config(cfg, "off", "auto", "auto").layers is True  # auto: the layer partition
    assert engine_from_ds_config(cfg, "off", "deepspeed", "auto").layers is False
    for gpus in (1, 2):
        p_off, p_on = plan_memory(model, train, off, gpus, 1e9), plan_memory(model, train, on, gpus, 1e9)
        assert p_off.parts["frozen U_i"] == 0 and p_off.parts["frozen V"] == p_on.parts["frozen V"] > 0
        layer = sum(b * c / model.layers for v in frozen_tensors(model, train).values() for b, c, inl in v if inl)
        head = model.vocab * model.hidden * train.e
        assert p_off.parts["ZeRO-3 gathered"] == pytest.approx(layer + max(layer, head))
    frozen = sum(b * c for v in frozen_tensors(model, train).values() for b, c, _ in v)
    shared = sum(b * c for b, c, _ in frozen_tensors(model, train)["frozen V"]) + model.hidden * train.e
    for gpus in (1, 2):
        t, t_on = step_time(model, train, off, gpus), step_time(model, train, on, gpus)
        moved = 2 * (frozen - shared)
        side = moved / gpus / HOST_SHARD_BYTES_PER_S + moved * (gpus - 1) / gpus / NVLINK_BUSBW
        busy = t.parts["compute"] + t.parts["recompute"] + t.parts["host beyond device"]  # the longer of the two
        assert t.parts["offload"] == pytest.approx(max(0.0, side - busy)) and "link" not in t.parts
        assert t.parts["compute"] == t_on.parts["compute"]
    # copies outlasting the compute make the step the side stream's length (not the sum); a long compute hides them
    # (a host issuing its work in no time: here the host's work would be the longer one, hiding the copies itself)
    from frod_ds.plan.step_time import Link

    t = step_time(model, train, off, 1, Link(host=0.0))
    assert t.parts["offload"] > 0
    assert t.parts["compute"] + t.parts["offload"] == pytest.approx(2 * (frozen - shared) / HOST_SHARD_BYTES_PER_S)
    long = step_time(model, TrainShape(micro_batch=64, seq_len=4096, sparsity=0.25), off, 1)
    assert long.parts["offload"] == 0 and long.parts["compute"] > 2 * (frozen - shared) / HOST_SHARD_BYTES_PER_S
