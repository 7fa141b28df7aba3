"""The synthetic-70B chain (bench/seventy_b.py) and its weight generator (bench/synthetic_llama.py): generated
tensors are reproducible per name, files and index are what safetensors and transformers read, steps out of
order are one line, and the whole chain rehearsed at ``--tiny`` on 2 CPU ranks: untargeted tensors, the six
categories generated → decomposed into one NF4 store → deleted, training killed after its checkpoint and resumed
with the same losses, FRoD (2 ranks under zero3.json; one with the NF4 base under zero2.json) and QLoRA (2 ranks,
zero2.json) timed, the report."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from bench.synthetic_llama import (
    SHAPES,
    add_to_index,
    category_names,
    index_files,
    make_tensor,
    remove_from_index,
    split_files,
    tensor_seed,
    untargeted_names,
    write_shard,
)
from tests.support.train_env import RANKS, REPO, env_vars

TINY = SHAPES["tiny"]
CPU = torch.device("cpu")


def test_generated_tensors_are_reproducible_per_name_and_distinct_across_names():
    name, shape = category_names(TINY, "q_proj")[1]
    a, b = make_tensor(name, shape, 0, CPU), make_tensor(name, shape, 0, CPU)
    assert a.dtype == torch.bfloat16 and tuple(a.shape) == shape and torch.equal(a, b)
    other = category_names(TINY, "q_proj")[2]
    assert not torch.equal(a, make_tensor(other[0], other[1], 0, CPU)), "another layer: other values"
    assert not torch.equal(a, make_tensor(name, shape, 1, CPU)), "another seed: other values"
    assert tensor_seed(name, 0) == tensor_seed(name, 0) != tensor_seed(other[0], 0)
    assert abs(a.float().std().item() - 0.02) < 0.003 and abs(a.float().mean().item()) < 0.003
    norm = make_tensor("model.norm.weight", (TINY.hidden,), 0, CPU)
    assert torch.equal(norm, torch.ones(TINY.hidden, dtype=torch.bfloat16))


def test_names_cover_a_llama_checkpoint_exactly():
    """Untargeted + the six categories = the state dict of transformers' LlamaForCausalLM of that config."""
    from transformers import LlamaConfig, LlamaForCausalLM

    names = dict(untargeted_names(TINY))
    for c in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"):
        names.update(dict(category_names(TINY, c)))
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in TINY.config().items() if k != "architectures"}))
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == names
    split = untargeted_names(TINY, [0, 1], globals_=True) + untargeted_names(TINY, [2, 3], globals_=False)
    assert sorted(split) == sorted(untargeted_names(TINY))


def test_shards_and_index_read_back(tmp_path):
    names = category_names(TINY, "gate_proj")
    groups = split_files(names, 2 * 160 * 64 * 2)  # two weights per file
    assert [len(g) for g in groups] == [2, 2] and sum(groups, []) == names
    weight_map = {}
    for j, g in enumerate(groups):
        write_shard(tmp_path / f"f{j}.safetensors", g, 0, CPU)
        weight_map.update({n: f"f{j}.safetensors" for n, _ in g})
    add_to_index(tmp_path, weight_map)
    for n, shape in names:
        with safe_open(str(tmp_path / weight_map[n]), framework="pt") as f:
            assert torch.equal(f.get_tensor(n), make_tensor(n, shape, 0, CPU)), n
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(
        (tmp_path / f).stat().st_size for f in ("f0.safetensors", "f1.safetensors")
    )
    remove_from_index(tmp_path, {"f0.safetensors"})
    assert index_files(tmp_path) == {"f1.safetensors"} and not (tmp_path / "f0.safetensors").exists()


def test_steps_out_of_order_are_one_line(tmp_path, capsys):
    from bench.seventy_b import main

    work = ["--work", str(tmp_path / "w"), "--tiny"]
    assert main(["category", "q_proj", *work]) == 2
    assert "run gen-untargeted on --work" in capsys.readouterr().err
    assert main(["train", *work]) == 2
    assert "does not exist; build it with frod hjd" in capsys.readouterr().err
    assert main(["train-resume", *work]) == 2
    assert "run train first" in capsys.readouterr().err
    assert main(["gen-untargeted", *work, "--data", str(tmp_path / "nodata")]) == 2
    assert "is not a directory: pass LLM-Adapters' dataset folder" in capsys.readouterr().err
    (tmp_path / "w").mkdir(exist_ok=True)
    (tmp_path / "w" / "chain.json").write_text(json.dumps({"shape": SHAPES["70b"].as_dict(), "seed": 0}))
    assert main(["category", "q_proj", *work]) == 2
    assert "was generated with shape" in capsys.readouterr().err


def test_layers_override_keeps_the_widths_and_is_part_of_the_work_dirs_identity(tmp_path, capsys):
    """``--layers 24 --shape 70b``: LLaMA-2-70B's widths with 24 layers (70B's layer shapes on one GPU); a work dir
    made with another layer count is refused with one line."""
    from bench.seventy_b import _shape, main, parse_args

    w = ["--work", str(tmp_path / "w")]
    shape = _shape(parse_args(["report", *w, "--layers", "24"]))
    assert shape.as_dict() == {**SHAPES["70b"].as_dict(), "layers": 24}
    assert _shape(parse_args(["report", *w])) == SHAPES["70b"]
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "chain.json").write_text(json.dumps({"shape": shape.as_dict(), "seed": 0}))
    assert main(["category", "q_proj", *w, "--layers", "20"]) == 2
    assert "was generated with shape" in capsys.readouterr().err


@pytest.mark.slow
def test_tiny_chain_rehearsal(tmp_path):
    w, out = tmp_path / "w", tmp_path / "out"
    common = ["--tiny", "--work", str(w), "--out", str(out)]
    launch = [sys.executable, str(RANKS), "2", "bench/seventy_b.py"]  # the chain's own steps run torchrun

    def run(cmd):
        res = subprocess.run(cmd, cwd=REPO, env=env_vars(), capture_output=True, text=True, timeout=900)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        return res.stdout

    run(launch + ["gen-untargeted", *common, "--data", str(REPO / "tests" / "fixtures" / "data_prep" / "llm_adapters")])
    untargeted = set(json.loads((w / "model" / "model.safetensors.index.json").read_text())["weight_map"])
    assert untargeted == {n for n, _ in untargeted_names(TINY)}
    stdout = run(launch + ["category", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", *common])
    assert "complete: True" in stdout
    assert set(json.loads((w / "model" / "model.safetensors.index.json").read_text())["weight_map"]) == untargeted
    assert sorted(p.name for p in (w / "model").glob("*.safetensors")) == [
        "model-base-r0-000.safetensors",
        "model-base-r1-000.safetensors",
    ]
    manifest = json.loads((w / "store" / "manifest.json").read_text())
    assert manifest["complete"] and manifest["u_quant"]["kind"] == "nf4"

    run([sys.executable, "bench/seventy_b.py", "train", *common])
    run([sys.executable, "bench/seventy_b.py", "train-resume", *common])
    res = json.loads((out / "seventy_b_train_resume.json").read_text())
    assert res["compared_steps"] == [5, 6] and res["max_rel_loss_diff"] <= 1e-3 and res["steps"] == 8
    assert res["planner"]["parts_gib"]["frozen U_i"] > 0

    run([sys.executable, "bench/seventy_b.py", "step", *common])
    run(
        [
            sys.executable,
            "bench/seventy_b.py",
            "step",
            *common,
            "--gpus",
            "1",
            "--quantize-base",
            "--config",
            "ds_configs/zero2.json",
        ]
    )
    frod = json.loads((out / "seventy_b_step_frod.json").read_text())
    one = json.loads((out / "seventy_b_step_frod_1gpu_zero2_base.json").read_text())
    assert (frod["world_size"], frod["engine"], frod["quantize_base"]) == (2, "zero3", False)
    assert (one["world_size"], one["engine"], one["quantize_base"], one["frozen_quant"]) == (1, "zero2", True, "nf4")

    # QLoRA as the 2-GPU chains run it (2 ranks, zero2.json); its ZeRO-3 path has tests/bench/test_qlora_zero3.py
    run([sys.executable, "bench/seventy_b.py", "qlora", *common, "--config", "ds_configs/zero2.json"])
    lora = json.loads((out / "seventy_b_step_lora_zero2.json").read_text())
    assert (lora["method"], lora["world_size"], lora["engine"]) == ("lora", 2, "zero2")
    assert lora["frozen_quant"] == "nf4" and lora["quantize_base"]
    assert not (w / "qlora-shm").exists() and not (w / "qlora-model").exists(), "regenerated weights deleted"
    assert "holds the weights the factor store was built from" in (out / "logs" / "qlora_gen.log").read_text()
    stdout = run([sys.executable, "bench/seventy_b.py", "report", *common])
    assert "QLoRA r=16, NF4 base" in stdout and "FRoD training (launch/train.py" in stdout
    assert (out / "seventy_b_resume_losses.png").stat().st_size > 0
    assert (
        "FRoD s=0.02, NF4 U_i and base (zero2, gc, 1 GPU(s)" in stdout
        and "FRoD s=0.02, NF4 U_i (zero3, gc, 2" in stdout
    )
    assert "QLoRA r=16, NF4 base (zero2, gc, 2 GPU(s)" in stdout
    summary = json.loads((out / "seventy_b_report.json").read_text())["summary"]
    assert summary["qlora_best"]["engine"] == "zero2" and summary["baseline"].endswith("zero2, 2 GPU(s)")
