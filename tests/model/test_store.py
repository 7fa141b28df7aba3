"""Factor store format: keys, dtypes, manifest, fingerprint, and the reader API (single process)."""

from __future__ import annotations

import json

import pytest
import torch

from frod_ds.formats.factor_store import FORMAT_VERSION
from frod_ds.io.fingerprint import sample_ranges, weights_fingerprint
from frod_ds.io.hf_checkpoint import HFCheckpoint
from frod_ds.model.store_reader import FactorStore, check_store_matches
from frod_ds.runtime.atomic import TMP
from launch.hjd import main
from tests.support.helpers_ckpt import shard_of, weights, write_tiny_llama

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"]


@pytest.fixture(scope="module")
def bf16_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("bf16")
    model = write_tiny_llama(root / "model", dtype=torch.bfloat16)
    assert main(["--model", str(model), "--out", str(root / "store"), "--device", "cpu"]) == 0
    return model, root / "store"


def test_store_layout_keys_and_dtypes(bf16_store):
    model, path = bf16_store
    store = FactorStore.open(path)
    assert store.targets == TARGETS and store.base_model == str(model) and store.pi == 1e-3
    assert list(store.categories) == TARGETS
    assert store.categories["q_proj"] == [f"model.layers.{i}.self_attn.q_proj" for i in range(3)]
    assert store.categories["up_proj"] == [f"model.layers.{i}.mlp.up_proj" for i in range(3)]
    assert store.category_of("model.layers.1.mlp.gate_proj") == "gate_proj"
    assert store.width("gate_proj") == 32 and store.width("o_proj") == 32
    assert store.member_shape("model.layers.2.self_attn.k_proj") == (16, 32)
    assert store.member_shape("model.layers.0.mlp.up_proj") == (48, 32)
    member = "model.layers.2.self_attn.k_proj"
    U, sigma, V = store.load_U(member), store.load_sigma(member), store.load_V("k_proj")
    assert U.dtype == torch.bfloat16 and U.shape == (16, 32), "U in the checkpoint's dtype"
    assert sigma.dtype == torch.float32 and sigma.shape == (32,)
    assert V.dtype == torch.float32 and V.shape == (32, 32)
    assert store.load_U(member, dtype=torch.float64).dtype == torch.float64
    m = store.manifest
    assert m.format_version == FORMAT_VERSION and m.complete and m.completed_categories == TARGETS
    assert m.hjd_dtype == "float32" and m.world_size == 1 and m.versions["torch"] == torch.__version__
    assert m.model_config["num_hidden_layers"] == 3
    for spec in m.categories.values():
        assert spec.u_dtype == "bfloat16"
        assert set(spec.error) == set(spec.members) == set(spec.stored_error)
    assert not [p for p in path.iterdir() if p.name.endswith(TMP)]


def test_store_bf16_factors_reconstruct_at_bf16_level(bf16_store):
    model, path = bf16_store
    store = FactorStore.open(path)
    for category, members in store.categories.items():
        V = store.load_V(category, torch.float64)
        spec = store.manifest.categories[category]
        for member, W in zip(members, weights(model, members)):
            rebuilt = (store.load_U(member, torch.float64) * store.load_sigma(member, torch.float64)) @ V.T
            rel = (torch.linalg.norm(rebuilt - W.double()) / torch.linalg.norm(W.double())).item()
            assert spec.error[member] < 1e-5, "HJD itself (fp32, TF32 off) is exact"
            assert rel < 1e-2 and rel == pytest.approx(spec.stored_error[member], rel=1e-3, abs=1e-6)


def test_weights_fingerprint_deterministic_and_model_specific(tmp_path, bf16_store):
    model, _ = bf16_store
    names = [f"model.layers.{i}.self_attn.q_proj.weight" for i in range(3)]
    a = weights_fingerprint(HFCheckpoint(model), names)
    assert a == weights_fingerprint(HFCheckpoint(model), list(reversed(names))), "order does not matter"
    other = write_tiny_llama(tmp_path / "other", seed=1, dtype=torch.bfloat16)
    assert weights_fingerprint(HFCheckpoint(other), names) != a
    fp32 = write_tiny_llama(tmp_path / "fp32", seed=0, dtype=torch.float32)
    assert weights_fingerprint(HFCheckpoint(fp32), names) != a, "dtype is covered"
    assert weights_fingerprint(HFCheckpoint(model), names[:2]) != a, "the set of tensors is covered"
    # One flipped byte in a sampled position changes it.
    shard = shard_of(other, names[0])
    ckpt = HFCheckpoint(other)
    before = weights_fingerprint(ckpt, names)
    data = bytearray(shard.read_bytes())
    data[ckpt.info(names[0]).start] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert weights_fingerprint(HFCheckpoint(other), names) != before


def test_weights_fingerprint_reads_a_fixed_small_sample():
    small = sample_ranges(1000)
    assert small == [(0, 1000)]
    big = sample_ranges(28672 * 8192 * 2)  # a 70B gate_proj in bf16
    assert sum(length for _, length in big) == 144 * 1024
    assert big[0][0] == 0 and big[-1][0] + big[-1][1] == 28672 * 8192 * 2


def test_check_store_matches_refuses_another_model(tmp_path, bf16_store):
    model, path = bf16_store
    store = FactorStore.open(path)
    check_store_matches(store, HFCheckpoint(model))
    other = write_tiny_llama(tmp_path / "other", seed=7, dtype=torch.bfloat16)
    with pytest.raises(
        ValueError,
        match=r"was built from .* \(fingerprint [0-9a-f]{16}…\) but .* has fingerprint "
        r"[0-9a-f]{16}…; rebuild it with frod hjd",
    ):
        check_store_matches(store, HFCheckpoint(other))


@pytest.mark.parametrize("name", ["model.layers.1.post_attention_layernorm.weight", "model.embed_tokens.weight"])
def test_check_store_matches_refuses_a_base_with_other_untargeted_weights(tmp_path, bf16_store, name):
    """The full checkpoint with the store's targeted weights but another norm or embedding is another model: the
    store's base_fingerprint refuses it (eval and export scored and merged onto it without a word)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from tests.support.helpers_ckpt import shard_of

    model, path = bf16_store
    other = tmp_path / "other"
    shutil.copytree(model, other)
    tensors = load_file(shard_of(other, name))
    tensors[name] = tensors[name] * 0
    save_file(tensors, shard_of(other, name), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"but .*other has other untargeted tensors \(embeddings, norms"):
        check_store_matches(FactorStore.open(path), HFCheckpoint(other))


def test_factor_store_open_errors(tmp_path, bf16_store):
    with pytest.raises(ValueError, match="does not exist"):
        FactorStore.open(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="not a factor store"):
        FactorStore.open(tmp_path)
    _, path = bf16_store
    incomplete = tmp_path / "incomplete"
    incomplete.mkdir()
    manifest = json.loads((path / "manifest.json").read_text())
    manifest.update(complete=False, completed_categories=["q_proj"])
    (incomplete / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"incomplete \(done: \['q_proj'\].*--categories k_proj,v_proj"):
        FactorStore.open(incomplete)
    assert FactorStore.open(incomplete, allow_incomplete=True).complete is False
    store = FactorStore.open(path)
    with pytest.raises(ValueError, match="not a member"):
        store.load_U("model.layers.0.mlp.down_proj")
    with pytest.raises(ValueError, match="no category"):
        store.load_V("down_proj")


def test_store_files_carry_their_crc32(bf16_store):
    """Each file's checksum in the manifest is the CRC-32 of its bytes on disk (computed here independently),
    although the part files were written in chunks by several threads."""
    import zlib

    _, path = bf16_store
    store = FactorStore.open(path)
    for record in store.manifest.categories.values():
        assert set(record.checksums) == set(record.files.values())
        for fname, checksum in record.checksums.items():
            assert checksum == f"crc32:{zlib.crc32((path / fname).read_bytes()):08x}", fname


def test_a_changed_byte_in_any_factor_file_is_refused_at_load(tmp_path, bf16_store):
    """Any single changed byte of a U, σ or V file (header or data) stops the first read of that file."""
    import shutil

    from frod_ds.runtime.errors import StoreError

    _, path = bf16_store
    files = sorted(p.name for p in path.iterdir() if p.name.endswith(".safetensors"))
    for k, fname in enumerate(files):
        copy = tmp_path / f"store{k}"
        shutil.copytree(path, copy)
        data = bytearray((copy / fname).read_bytes())
        at = len(data) - 1 - k if k % 2 else 8 + k  # a data byte, or a header byte
        data[at] ^= 0x01
        (copy / fname).write_bytes(bytes(data))
        store = FactorStore.open(copy)
        with pytest.raises(
            StoreError,
            match=rf"{fname} is corrupt \(its checksum is crc32:[0-9a-f]{{8}}, the manifest "
            r"records crc32:[0-9a-f]{8}\); delete it and run frod hjd on the store again",
        ):
            for category, members in store.categories.items():
                store.load_V(category)
                for m in members:
                    store.load_U(m)
                    store.load_sigma(m)
