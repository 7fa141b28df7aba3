"""Export to a plain transformers checkpoint: stock ``LlamaForCausalLM.from_pretrained`` computes what the
FRoD model computes; every untargeted tensor is the base checkpoint's, bit for bit."""

from __future__ import annotations

import json

import pytest
import torch

from frod_ds.model.adapter import merged_state_dict
from launch.export import main
from tests.support.helpers_ckpt import make_adapter, weights, write_tiny_llama


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    model_dir = write_tiny_llama(root / "model")
    ckpt, store, model = make_adapter(model_dir, root)
    return {"model_dir": model_dir, "checkpoint": ckpt, "store": store, "frod": model.eval(), "root": root}


def test_exported_checkpoint_loads_with_stock_transformers_and_matches(trained, tmp_path, capsys):
    from transformers import LlamaForCausalLM

    out = tmp_path / "merged"
    assert (
        main(["--checkpoint", str(trained["checkpoint"]), "--out", str(out), "--shard-gb", str(20 * 2**10 / 2**30)])
        == 0
    )
    assert "exported" in capsys.readouterr().out
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1, "small --shard-gb: several shards"
    plain = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(0, plain.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = plain(ids).logits, trained["frod"](ids).logits
    assert (got - want).abs().max().item() < 1e-4
    # Merged weights equal the model-side merge; everything else is the base checkpoint's tensor.
    state, merged = plain.state_dict(), merged_state_dict(trained["frod"])
    provenance = json.loads((out / "frod_export.json").read_text())
    targeted = {m + ".weight" for m in provenance["merged"]}
    assert len(targeted) == 6 * 3
    for name in targeted:
        assert torch.allclose(state[name], merged[name], atol=1e-6, rtol=1e-5), name
    others = [n for n in index["weight_map"] if n not in targeted]
    for name, base in zip(others, weights(trained["model_dir"], [n.removesuffix(".weight") for n in others])):
        assert torch.equal(state[name], base), name
    assert (
        provenance["factor_store_fingerprint"]
        == json.loads((trained["store"] / "manifest.json").read_text())["fingerprint"]
    )


def test_export_bf16_sets_the_config_dtype(trained, tmp_path):
    from transformers import AutoConfig

    out = tmp_path / "bf16"
    assert main(["--checkpoint", str(trained["checkpoint"]), "--out", str(out), "--dtype", "bfloat16"]) == 0
    from safetensors import safe_open

    index = json.loads((out / "model.safetensors.index.json").read_text())
    name = "model.layers.1.mlp.up_proj.weight"
    with safe_open(str(out / index["weight_map"][name]), framework="pt") as f:
        assert f.get_tensor(name).dtype == torch.bfloat16
    assert AutoConfig.from_pretrained(out).dtype == torch.bfloat16


def test_export_bad_input_leaves_nothing(trained, tmp_path, capsys):
    out = tmp_path / "taken"
    out.mkdir()
    assert main(["--checkpoint", str(trained["checkpoint"]), "--out", str(out)]) == 2
    assert "exists; pass --overwrite" in capsys.readouterr().err
    assert main(["--checkpoint", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x")]) == 2
    assert "not a frod-ds adapter checkpoint" in capsys.readouterr().err
    assert main(["--checkpoint", str(trained["checkpoint"]), "--out", str(tmp_path / "y"), "--dtype", "int8"]) == 2
    assert "--dtype" in capsys.readouterr().err
    other = write_tiny_llama(tmp_path / "other", seed=7)
    assert (
        main(["--checkpoint", str(trained["checkpoint"]), "--out", str(tmp_path / "z"), "--base-model", str(other)])
        == 2
    )
    assert "error:" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "taken"], "no partial export left behind"


def test_export_refuses_a_store_that_is_not_the_adapters(trained, tmp_path, capsys):
    """A store rebuilt from the same base model with another π: same fingerprint, other V; refused, nothing written."""
    from frod_ds.hjd.stage import StageConfig, run_stage

    other = tmp_path / "store-pi"
    run_stage(StageConfig(model=str(trained["model_dir"]), out=other, pi=1e-2, device="cpu", fsync=False))
    capsys.readouterr()
    out = tmp_path / "merged"
    assert main(["--checkpoint", str(trained["checkpoint"]), "--factor-store", str(other), "--out", str(out)]) == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert "was trained on another factor store" in line and "pi 0.001 there, 0.01 here" in line
    assert "V of q_proj differs" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store-pi"], "nothing exported"


def test_adapter_records_the_identity_of_its_factor_store(trained):
    """Per category: a sha256 of V as the store holds it (computed here from the file) and the HJD route."""
    import hashlib

    from safetensors.torch import load_file

    config = json.loads((trained["checkpoint"] / "adapter_config.json").read_text())
    manifest = json.loads((trained["store"] / "manifest.json").read_text())
    assert config["version"] == 4 and config["pi"] == manifest["pi"]
    for category, info in config["categories"].items():
        spec = manifest["categories"][category]
        V = load_file(str(trained["store"] / spec["files"][f"{category}.V"]))[f"{category}.V"]
        assert info["v_sha256"] == hashlib.sha256(V.contiguous().numpy().tobytes()).hexdigest()
        assert info["method"] == spec["method"]


def test_export_carries_every_non_weight_file_of_the_base_checkpoint(trained, tmp_path):
    """Tokenizer files whatever their names (chat template, BPE vocab and merges), licence and readme travel
    with the merged weights; weights, weight indexes, provenance and hidden files of the base do not."""
    import shutil

    base = tmp_path / "base"
    shutil.copytree(trained["model_dir"], base)
    carried = {
        "chat_template.jinja": "{{ messages }}",
        "tokenizer.json": "{}",
        "tokenizer_config.json": "{}",
        "special_tokens_map.json": "{}",
        "vocab.json": "{}",
        "merges.txt": "#v\n",
        "LICENSE": "Apache",
        "README.md": "# base",
        "generation_config.json": '{"do_sample": false}',
    }
    dropped = {
        "pytorch_model.bin": "w",
        "pytorch_model.bin.index.json": "{}",
        "model.gguf": "w",
        "frod_convert.json": "{}",
        ".gitattributes": "*",
    }
    for name, text in {**carried, **dropped}.items():
        (base / name).write_text(text)
    (base / "onnx").mkdir()
    (base / "onnx" / "model.onnx").write_text("w")
    out = tmp_path / "merged"
    assert main(["--checkpoint", str(trained["checkpoint"]), "--out", str(out), "--base-model", str(base)]) == 0
    for name, text in carried.items():
        assert (out / name).read_text() == text, name
    assert not any((out / name).exists() for name in [*dropped, "onnx"])
    assert json.loads((out / "config.json").read_text()) == json.loads((base / "config.json").read_text())
    names = {p.name for p in out.iterdir()}
    assert names == set(carried) | {
        "config.json",
        "model.safetensors.index.json",
        "frod_export.json",
        ".frod-ds-output",
    } | {n for n in names if n.startswith("model-") and n.endswith(".safetensors")}


def test_an_adapter_with_one_changed_byte_is_refused_not_used(trained, tmp_path, capsys):
    """adapter_config.json (format 3) records the CRC-32 of adapter.safetensors: a byte changed after writing
    (bit rot, a half-copied file, a hand edit) is one error line naming the file, and the export writes nothing;
    the untouched copy still exports. An adapter of format 2 (no checksum) is still read."""
    import shutil

    from frod_ds.formats.adapter_dir import AdapterConfig
    from frod_ds.model.adapter import read_adapter

    config = AdapterConfig.read(trained["checkpoint"] / "adapter_config.json")
    assert config.version == 4 and config.weights_crc32 and config.weights_crc32.startswith("crc32:")
    bad = tmp_path / "adapter-final"
    shutil.copytree(trained["checkpoint"], bad)
    weights_file = bad / "adapter.safetensors"
    data = bytearray(weights_file.read_bytes())
    data[-5] ^= 0x01  # one bit of the last tensor's values: still a valid safetensors file
    weights_file.write_bytes(bytes(data))
    assert main(["--checkpoint", str(bad), "--out", str(tmp_path / "merged")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not match the checksum" in err[0] and str(weights_file) in err[0], err
    assert not (tmp_path / "merged").exists()
    # the same bytes under a format-2 config (no checksum) are read as they are: the check is the record's
    old = json.loads((bad / "adapter_config.json").read_text())
    old.pop("weights_crc32")
    (bad / "adapter_config.json").write_text(json.dumps({**old, "version": 2}))
    tensors, cfg = read_adapter(bad)
    assert cfg.version == 2 and cfg.weights_crc32 is None and tensors


def test_an_adapter_config_with_its_checksum_removed_is_refused(trained, tmp_path, capsys):
    """Every writer of adapter format 3 records ``weights_crc32``: a version-3 config without it was edited, and its
    weights (here also changed, as an edit that hides one would) are refused, not used unchecked."""
    import shutil

    bad = tmp_path / "adapter-final"
    shutil.copytree(trained["checkpoint"], bad)
    config = json.loads((bad / "adapter_config.json").read_text())
    assert config["version"] == 4
    del config["weights_crc32"], config["config_sha256"], config["hjd_dtype"]  # as a version-3 writer left it
    config["version"] = 3
    (bad / "adapter_config.json").write_text(json.dumps(config))
    data = bytearray((bad / "adapter.safetensors").read_bytes())
    data[-5] ^= 0x01
    (bad / "adapter.safetensors").write_bytes(bytes(data))
    assert main(["--checkpoint", str(bad), "--out", str(tmp_path / "merged")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "weights_crc32" in err[0] and "adapter_config.json" in err[0], err
    assert not (tmp_path / "merged").exists()


def test_an_adapter_config_whose_targets_were_edited_is_refused(trained, tmp_path, capsys):
    """The targets an adapter config names are no part of its weights' checksum: a category removed from the config
    (a hand edit of its targets) disagrees with the supports the weights hold, and is one line naming both."""
    import shutil

    bad = tmp_path / "adapter-final"
    shutil.copytree(trained["checkpoint"], bad)
    config = json.loads((bad / "adapter_config.json").read_text())
    held = sorted(config["categories"])
    dropped = held[-1]
    config["categories"].pop(dropped)
    (bad / "adapter_config.json").write_text(json.dumps(config))
    assert main(["--checkpoint", str(bad), "--out", str(tmp_path / "merged")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "adapter_config.json was edited after frod-ds wrote it" in line, line  # version 4: its own digest
    for key in ("config_sha256", "hjd_dtype"):  # as a version-3 writer left it: the weights tell
        del config[key]
    for info in config["categories"].values():
        del info["u_storage"]
    (bad / "adapter_config.json").write_text(json.dumps({**config, "version": 3}))
    assert main(["--checkpoint", str(bad), "--out", str(tmp_path / "merged")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"names the categories {held[:-1]}, but adapter.safetensors holds supports of {held}" in line, line
    assert not (tmp_path / "merged").exists()


@pytest.mark.parametrize(
    ("key", "value"), [("sparsity", 0.5), ("frozen_quant", "nf4"), ("dtype", "bfloat16"), ("seed", 7)]
)
def test_an_adapter_config_whose_settings_were_edited_is_refused_and_its_paths_may_move(
    trained, tmp_path, capsys, key, value
):
    """Version 4 records a digest of every field but the paths: an edited sparsity or quantization would rebuild
    another model from the same weights. A factor store moved, with the path edited to match, still exports."""
    import shutil

    bad = tmp_path / "adapter-final"
    shutil.copytree(trained["checkpoint"], bad)
    config = json.loads((bad / "adapter_config.json").read_text())
    assert config[key] != value
    (bad / "adapter_config.json").write_text(json.dumps({**config, key: value}))
    assert main(["--checkpoint", str(bad), "--out", str(tmp_path / "merged")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "was edited after frod-ds wrote it" in line and "only its paths may be edited" in line, line
    assert not (tmp_path / "merged").exists()
    moved = tmp_path / "moved-store"
    shutil.copytree(config["factor_store"], moved)
    (bad / "adapter_config.json").write_text(json.dumps({**config, "factor_store": str(moved)}))
    assert main(["--checkpoint", str(bad), "--out", str(tmp_path / "merged")]) == 0


def test_an_adapter_whose_weights_file_is_a_pipe_is_named_as_such(trained, tmp_path, capsys):
    """adapter.safetensors replaced by a named pipe: one line saying so (not "not an adapter; it is a trained
    adapter"), without waiting on the pipe."""
    import os
    import shutil

    bad = tmp_path / "adapter-final"
    shutil.copytree(trained["checkpoint"], bad)
    (bad / "adapter.safetensors").unlink()
    os.mkfifo(bad / "adapter.safetensors")
    assert main(["--checkpoint", str(bad), "--out", str(tmp_path / "merged")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"{bad / 'adapter.safetensors'} is a named pipe (FIFO)" in line and "copy it again" in line, line


@pytest.mark.parametrize("damage", ["missing", "torn"])
def test_export_of_a_base_without_a_usable_config_is_refused(trained, tmp_path, capsys, damage):
    """The export copies the base's config.json into a transformers checkpoint: without a usable one it would
    write a checkpoint nothing can load (the failure corpus saw exit 0), so it is one line naming the file."""
    import shutil

    base = tmp_path / "base"
    shutil.copytree(trained["model_dir"], base)
    config = base / "config.json"
    if damage == "missing":
        config.unlink()
    else:
        config.write_text(config.read_text()[:20])
    code = main(["--checkpoint", str(trained["checkpoint"]), "--base-model", str(base), "--out", str(tmp_path / "m")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error:") and str(base) in err[0], err
    assert not (tmp_path / "m").exists()


def test_an_adapter_on_the_store_rebuilt_in_another_precision_is_refused(trained, tmp_path, capsys):
    """The store rebuilt from the same model in float64 (same V, other U_i and σ_i: checked here) would merge other
    weights: the adapter records HJD's precision, so export (and eval, by the same check) refuse it."""
    from frod_ds.model.store_reader import FactorStore
    from tests.support.helpers_ckpt import hjd_in_process

    f64 = tmp_path / "f64"
    res = hjd_in_process(["--model", str(trained["model_dir"]), "--out", str(f64), "--dtype", "float64"])
    assert res.returncode == 0, res.stderr[-2000:]
    a, b = FactorStore.open(trained["store"]), FactorStore.open(f64)
    member = a.categories["q_proj"][0]
    assert not torch.equal(a.load_U(member), b.load_U(member).to(a.load_U(member).dtype))
    capsys.readouterr()
    argv = ["--checkpoint", str(trained["checkpoint"]), "--out", str(tmp_path / "merged")]
    assert main([*argv, "--factor-store", str(f64)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "trained on another factor store" in line and "HJD in float32 there, float64 here" in line, line
    assert not (tmp_path / "merged").exists()


def test_an_adapter_whose_base_model_moved_names_the_file_and_the_flag(trained, tmp_path, capsys):
    import shutil

    moved = tmp_path / "adapter-final"
    shutil.copytree(trained["checkpoint"], moved)
    config = json.loads((moved / "adapter_config.json").read_text())
    (moved / "adapter_config.json").write_text(json.dumps({**config, "base_model": str(tmp_path / "gone")}))
    assert main(["--checkpoint", str(moved), "--out", str(tmp_path / "merged")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"{moved / 'adapter_config.json'} names does not exist" in line and "--base-model" in line, line
    argv = ["--checkpoint", str(moved), "--out", str(tmp_path / "merged"), "--base-model", str(trained["model_dir"])]
    assert main(argv) == 0


def test_a_base_tensor_past_float16s_range_is_named_as_such_not_as_damage(trained, tmp_path, capsys):
    """--dtype float16 of a base whose untargeted tensor holds finite values past 65504: the cast makes infs, and
    the line says float16 is too narrow (and what to use), not that the file is damaged; bfloat16 exports it."""
    from safetensors.torch import load_file, save_file

    from tests.support.helpers_ckpt import shard_of

    base = write_tiny_llama(tmp_path / "base", seed=5)
    name = "model.embed_tokens.weight"
    shard = shard_of(base, name)
    tensors = load_file(shard)
    tensors[name] = tensors[name] * 1e7
    assert torch.isfinite(tensors[name]).all() and tensors[name].abs().max() > 65504
    save_file(tensors, shard, metadata={"format": "pt"})
    ckpt, _, _ = make_adapter(base, tmp_path / "adapter")
    argv = ["--checkpoint", str(ckpt)]
    capsys.readouterr()
    assert main([*argv, "--out", str(tmp_path / "f16"), "--dtype", "float16"]) == 2
    err = capsys.readouterr().err
    assert f"{name} does not fit float16" in err and "export with --dtype bfloat16" in err, err
    assert "damaged" not in err and not (tmp_path / "f16").exists()
    assert main([*argv, "--out", str(tmp_path / "bf16"), "--dtype", "bfloat16"]) == 0
