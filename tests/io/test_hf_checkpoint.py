"""HFCheckpoint reads single tensors from safetensors shards and names the file when one is broken."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from frod_ds.io.hf_checkpoint import HFCheckpoint
from frod_ds.io.model_dir import resolve_model_dir
from tests.support.helpers_ckpt import shard_files, shard_of, write_tiny_llama

Q0 = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("ckpt") / "tiny", dtype=torch.bfloat16)


def test_checkpoint_reads_each_tensor_from_its_shard(ckpt_dir):
    from transformers import LlamaForCausalLM

    assert len(shard_files(ckpt_dir)) > 2, "the fixture must be sharded"
    ckpt = HFCheckpoint(ckpt_dir)
    model = LlamaForCausalLM.from_pretrained(ckpt_dir, dtype=torch.bfloat16)
    state = model.state_dict()
    assert set(ckpt.keys()) == set(state)
    for name in [Q0, "model.layers.2.mlp.up_proj.weight", "lm_head.weight"]:
        assert ckpt.shape(name) == tuple(state[name].shape)
        assert ckpt.dtype(name) == torch.bfloat16
        assert torch.equal(ckpt.get(name), state[name])
    assert ckpt.tensors_read == 3 and ckpt.bytes_read == sum(
        state[n].numel() * 2 for n in [Q0, "model.layers.2.mlp.up_proj.weight", "lm_head.weight"]
    )


def test_checkpoint_single_file_without_index(tmp_path):
    path = write_tiny_llama(tmp_path / "one", max_shard_size="100MB")
    assert not (path / "model.safetensors.index.json").exists()
    ckpt = HFCheckpoint(path)
    assert Q0 in ckpt.keys() and ckpt.get(Q0).shape == (32, 32)


def test_checkpoint_missing_shard_is_named(tmp_path):
    """A shard the index names and the folder lacks: refused when the folder is opened, naming it (before any
    weight is read); one deleted after the reader opened the folder: named when its tensor is read."""
    path = write_tiny_llama(tmp_path / "m")
    shard = shard_of(path, Q0)
    ckpt = HFCheckpoint(path)
    shard.unlink()
    with pytest.raises(ValueError, match=rf"shard {shard.name} is missing.*download"):
        ckpt.shape(Q0)
    with pytest.raises(ValueError, match=rf"names the shard {shard.name}, which .* does not hold"):
        HFCheckpoint(path)


@pytest.mark.parametrize("cut", [4, 100, -10])
def test_checkpoint_truncated_shard_is_named(tmp_path, cut):
    path = write_tiny_llama(tmp_path / "t")
    shard = shard_of(path, Q0)
    data = shard.read_bytes()
    shard.write_bytes(data[:cut])
    with pytest.raises(ValueError, match=rf"{shard.name} is truncated or corrupt"):
        HFCheckpoint(path).get(Q0)


def test_checkpoint_missing_tensor_and_missing_index(tmp_path):
    path = write_tiny_llama(tmp_path / "x")
    with pytest.raises(ValueError, match="'nope.weight' is not in the checkpoint"):
        HFCheckpoint(path).get("nope.weight")
    index = path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {Q0: "model-00001-of-00099.safetensors"}}))
    with pytest.raises(ValueError, match="names the shard model-00001-of-00099.safetensors, which"):
        HFCheckpoint(path)
    index.unlink()
    with pytest.raises(ValueError, match="holds safetensors shards .* but no model.safetensors.index.json"):
        HFCheckpoint(path)


def test_resolve_model_dir_local_and_offline_hub_id(tmp_path, monkeypatch):
    assert resolve_model_dir(str(tmp_path)) == tmp_path
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(ValueError, match="could not be resolved.*pass a local directory"):
        resolve_model_dir("someone/not-a-cached-model")
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model_dir(str(tmp_path / "no" / "such" / "dir"))


def test_config_is_checked_against_the_weights(tmp_path, capsys):
    """``HFCheckpoint.config``: the written model's own config passes; one naming another layer count or KV heads
    is refused naming the tensor; HJD's ``required=False`` reads a missing or torn config as none (noted)."""
    from frod_ds.runtime.errors import CheckpointError

    path = write_tiny_llama(tmp_path / "m")
    good = json.loads((path / "config.json").read_text())
    assert HFCheckpoint(path).config()["num_hidden_layers"] == 3
    for change, needle in (
        ({"num_hidden_layers": 2}, "the weights hold decoder layers 0-2, the config gives num_hidden_layers 2"),
        ({"num_hidden_layers": 4}, "the weights hold decoder layers 0-2, the config gives num_hidden_layers 4"),
        # answered at once, not by building a billion-entry set (it ran out of memory)
        ({"num_hidden_layers": 10**9}, "the config gives num_hidden_layers 1000000000"),
        ({"num_key_value_heads": 1}, "k_proj.weight has shape [16, 32], the config gives [8, 32]"),
        ({"vocab_size": 0}, "vocab_size must be a positive integer, got 0"),
        ({"model_type": "foo"}, "model_type 'foo' is no architecture transformers knows"),
        ({"model_type": "gpt2"}, "model_type 'gpt2' builds no LLaMA-family decoder"),  # a known model, not these
        ({"architectures": ["BertModel"]}, "architectures ['BertModel'] names no causal LM"),
        ({"torch_dtype": "float99"}, "torch_dtype 'float99' is no dtype"),
        ({"rms_norm_eps": float("nan")}, "rms_norm_eps must be a finite number > 0, got nan"),
        ({"rope_theta": -1}, "rope_theta must be a finite number > 0, got -1"),
        ({"rope_parameters": {"rope_theta": -5, "rope_type": "default"}}, "rope_theta must be a finite number > 0"),
        ({"hidden_act": "bogus"}, "hidden_act 'bogus' is no activation transformers knows"),
    ):
        (path / "config.json").write_text(json.dumps({**good, **change}))
        for required in (True, False):
            with pytest.raises(CheckpointError, match=re.escape(needle)):
                HFCheckpoint(path).config(required=required)
    (path / "config.json").write_text("{torn")  # damaged: refused by HJD too (training would refuse it later)
    for required in (True, False):
        with pytest.raises(CheckpointError, match="not valid JSON"):
            HFCheckpoint(path).config(required=required)
    (path / "config.json").unlink()
    assert HFCheckpoint(path).config(required=False) is None
    assert "records no model config" in capsys.readouterr().err
    # a config.json that is there but no readable file is refused by HJD too, naming what it is
    config = path / "config.json"
    for make, needle in (
        (config.mkdir, "config.json is a directory, not a file"),
        (lambda: os.mkfifo(config), "config.json is a named pipe (FIFO)"),
        (lambda: config.symlink_to(path / "gone.json"), "config.json is a broken symbolic link"),
        (lambda: config.symlink_to(config), "config.json is a symbolic-link loop"),
    ):
        make()
        for required in (True, False):
            with pytest.raises(CheckpointError, match=re.escape(needle)):
                HFCheckpoint(path).config(required=required)
        config.rmdir() if config.is_dir() and not config.is_symlink() else config.unlink()


def test_a_tied_config_over_a_checkpoint_with_its_own_head_is_refused(tmp_path):
    """``tie_word_embeddings: true`` where the checkpoint holds an ``lm_head.weight`` of other values: the tied
    model would drop the checkpoint's head, so the config is refused naming the key; a head equal to the
    embedding (a tied model saved with both) is fine, and so is the untied config."""
    from safetensors.torch import load_file, save_file

    from frod_ds.runtime.errors import CheckpointError

    path = write_tiny_llama(tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False and "lm_head.weight" in HFCheckpoint(path)
    (path / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    for required in (True, False):
        with pytest.raises(CheckpointError, match="holds an lm_head.weight of other values.*tie_word_embeddings to"):
            HFCheckpoint(path).config(required=required)
    embed, head = shard_of(path, "model.embed_tokens.weight"), shard_of(path, "lm_head.weight")
    tensors = load_file(head)
    tensors["lm_head.weight"] = load_file(embed)["model.embed_tokens.weight"].clone()
    save_file(tensors, head, metadata={"format": "pt"})
    assert HFCheckpoint(path).config()["tie_word_embeddings"] is True


def test_a_stray_single_file_beside_a_sharded_index_is_refused(tmp_path):
    """A folder holding a sharded checkpoint and a model.safetensors its index does not list (another model's):
    transformers would read the single file, frod-ds the shards, so the folder is refused, naming both; a single
    file the index itself lists is a shard like any other."""
    import shutil

    from frod_ds.runtime.errors import CheckpointError

    sharded = write_tiny_llama(tmp_path / "m")
    assert len(shard_files(sharded)) > 1
    one = write_tiny_llama(tmp_path / "one", max_shard_size="100MB", seed=3)
    shutil.copy(one / "model.safetensors", sharded / "model.safetensors")
    with pytest.raises(CheckpointError, match="holds both the sharded model.safetensors.index.json and a model"):
        HFCheckpoint(sharded)
    index = {"weight_map": {name: "model.safetensors" for name in HFCheckpoint(one).keys()}}
    (one / "model.safetensors.index.json").write_text(json.dumps(index))
    assert set(HFCheckpoint(one).keys()) == set(index["weight_map"])


def test_a_layer_without_a_linear_the_others_hold_is_refused(tmp_path):
    """One layer's q_proj missing from a checkpoint whose other layers hold it: HJD would decompose the category
    without it, so the checkpoint is refused as incomplete, with or without a config.json; a category absent from
    every layer (a checkpoint written without targeted weights) is whole."""
    from safetensors.torch import load_file, save_file

    from frod_ds.runtime.errors import CheckpointError

    path = write_tiny_llama(tmp_path / "m", max_shard_size="100MB")
    tensors = load_file(path / "model.safetensors")
    layers = sorted({int(k.split(".")[2]) for k in tensors if k.startswith("model.layers.")})
    assert len(layers) >= 2
    gone = f"model.layers.{layers[-1]}.self_attn.q_proj.weight"
    save_file({k: v for k, v in tensors.items() if k != gone}, path / "model.safetensors", metadata={"format": "pt"})
    holding = f"layers {layers[0]}-{layers[-2]} hold it" if len(layers) > 2 else f"layer {layers[0]} holds it"
    want = f"lacks {gone} ({holding}, layer {layers[-1]} not)"
    for required in (True, False):
        with pytest.raises(CheckpointError, match=re.escape(want)):
            HFCheckpoint(path).config(required=required)
    (path / "config.json").unlink()
    with pytest.raises(CheckpointError, match="the checkpoint is incomplete"):
        HFCheckpoint(path).config(required=False)
    kept = {k: v for k, v in tensors.items() if ".q_proj." not in k}
    save_file(kept, path / "model.safetensors", metadata={"format": "pt"})
    assert HFCheckpoint(path).config(required=False) is None  # no config.json: a note, no refusal


def test_shards_without_their_index_are_named_with_what_is_missing(tmp_path):
    from frod_ds.runtime.errors import CheckpointError
    from frod_ds.testing.toy import write_tiny_llama as write_toy

    model = write_toy(tmp_path / "model", vocab_size=64, max_shard_size="60KB")
    (model / "model.safetensors.index.json").unlink()
    shards = sorted(p.name for p in model.glob("*.safetensors"))
    assert len(shards) > 1
    with pytest.raises(CheckpointError, match=rf"holds safetensors shards \({re.escape(shards[0])}, .*but no "):
        HFCheckpoint(model)
    for p in model.glob("*.safetensors"):
        p.unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors.index.json or model.safetensors in"):
        HFCheckpoint(model)


@pytest.mark.parametrize(
    ("edit", "want"),
    [
        (lambda m: [list(m)], "has no weight_map object"),
        (lambda m: "model-00001.safetensors", "has no weight_map object"),
        (lambda m: {}, "maps no tensor (an empty weight_map)"),
        (lambda m: {**m, Q0: None}, f"maps '{Q0}' to null, not a shard file name"),
        (lambda m: {**m, Q0: 7}, f"maps '{Q0}' to 7, not a shard file name"),
        (lambda m: {**m, Q0: {"f": 1}}, f"maps '{Q0}' to "),
        (lambda m: {**m, Q0: ["a"]}, f"maps '{Q0}' to "),
        (lambda m: {**m, Q0: "../x.safetensors"}, 'to "../x.safetensors", not a shard file name in the folder'),
        (lambda m: {**m, Q0: "/abs/model-00001.safetensors"}, "not a shard file name in the folder"),
        (lambda m: {**m, Q0: "model-99999-of-99999.safetensors"}, "names the shard model-99999-of-99999"),
    ],
)
def test_a_damaged_index_is_refused_when_the_checkpoint_is_opened(tmp_path, edit, want):
    """A weight_map value that is not a plain shard file name of the folder (null, a number, an object, a path
    outside it), or a shard that is missing: one line naming the index and the entry when the reader every command
    opens a checkpoint with (hjd, train, export, eval) opens the folder, before transformers or a shard read fails."""
    import shutil

    from frod_ds.runtime.errors import CheckpointError

    path = tmp_path / "m"
    shutil.copytree(write_tiny_llama(tmp_path / "src"), path)
    index = path / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"] = edit(doc["weight_map"])
    index.write_text(json.dumps(doc))
    if want == "has no weight_map object":  # and a metadata that is no object, beside a sound map
        (path / "bad").mkdir()
        for f in path.iterdir():
            if f.is_file():
                (path / "bad" / f.name).write_bytes(f.read_bytes())
        good = json.loads((tmp_path / "src" / "model.safetensors.index.json").read_text())
        (path / "bad" / index.name).write_text(json.dumps({**good, "metadata": "x"}))
        with pytest.raises(CheckpointError, match="its metadata is a JSON str, not an object"):
            HFCheckpoint(path / "bad")
    with pytest.raises(CheckpointError, match=re.escape(want)) as e:
        HFCheckpoint(str(path))
    assert "\n" not in str(e.value) and "index.json" in str(e.value)


def test_a_rope_type_transformers_does_not_know_is_refused_naming_config_json(tmp_path):
    """rope_parameters.rope_type "bogus": transformers fails with KeyError('bogus') when it builds the model (eval,
    train, export's check); the config check that every model-building command makes names it, and a tokenizer
    load that fails on config.json (transformers reads it too) points there, not only at the tokenizer files."""
    from frod_ds.io.model_dir import check_config_file
    from frod_ds.prep.tokens import load_tokenizer
    from frod_ds.runtime.errors import FrodError

    path = write_tiny_llama(tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "rope_parameters": {"rope_type": "linear", "factor": 2.0}}))
    check_config_file(path)
    (path / "config.json").write_text(json.dumps({**cfg, "rope_parameters": {"rope_type": "bogus"}}))
    with pytest.raises(FrodError, match=re.escape("rope_parameters.rope_type 'bogus' is none transformers knows")):
        check_config_file(path)
    from tests.prep.test_data_prep_tokenizer import save_whitespace_tokenizer

    save_whitespace_tokenizer(path)
    (path / "config.json").write_text(json.dumps({**cfg, "attention_bias": "false"}))
    with pytest.raises(FrodError) as e:
        load_tokenizer(str(path))
    assert f"check {path / 'config.json'} (transformers reads it with the tokenizer)" in str(e.value)
    assert "attention_bias" in str(e.value) and "\n" not in str(e.value)
