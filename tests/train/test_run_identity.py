"""The run identity covers every input that changes the numbers and nothing elastic resume may change: a resume
with another tokenizer of the same size, another base config.json or another ``model.init_adapter`` is refused
with one line naming it; the same inputs under other paths, and another split of the same global batch over
ranks, resume. Each "other" input is checked to be other by an independent computation first."""

from __future__ import annotations

import collections
import json
import shutil
from pathlib import Path

import pytest

from tests.support.train_env import CPU_ZERO2, build_env, run_train, train_in_process

pytestmark = pytest.mark.slow
COMMON = {"train.max_steps": 2, "train.save_every": 1}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return build_env(tmp_path_factory.mktemp("identity"))


@pytest.fixture(scope="module")
def trained(env):
    """A finished one-process ZeRO-2 run with sealed checkpoints at steps 1 and 2."""
    out = env.root / "run"
    res = run_train(CPU_ZERO2, env.overrides(out, **COMMON), nproc=0)
    assert res.returncode == 0, res.stderr[-3000:]
    return out


def _tree(root: Path) -> list[tuple[str, int, int]]:
    return sorted((str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*"))


def _refused(env, out: Path, *needles: str, **extra) -> None:
    before = _tree(out)
    res = train_in_process(CPU_ZERO2, env.overrides(out, **COMMON, **extra))
    errors = [x for x in res.stderr.splitlines() if x.startswith("error:")]
    assert res.returncode == 2 and len(errors) == 1, res.stderr[-3000:]
    assert "holds another run" in errors[0], errors[0]
    for needle in needles:
        assert needle in errors[0], errors[0]
    assert _tree(out) == before, "a refused resume changes nothing"


def _swapped_tokenizer(env, dest: Path) -> Path:
    """The run's tokenizer with the ids of the two tokens the training text uses most swapped: same files, same
    vocabulary size, other ids."""
    from transformers import AutoTokenizer

    shutil.copytree(env.model, dest, ignore=shutil.ignore_patterns("*.safetensors*", "config.json"))
    tok = AutoTokenizer.from_pretrained(str(env.model))
    text = [json.loads(x)["prompt"] for x in (env.data / "train.jsonl").read_text().splitlines()]
    counts = collections.Counter(i for ids in tok(text)["input_ids"] for i in ids if i not in tok.all_special_ids)
    (a, _), (b, _) = counts.most_common(2)
    spec = json.loads((dest / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    ta, tb = tok.convert_ids_to_tokens([a, b])
    vocab[ta], vocab[tb] = b, a
    (dest / "tokenizer.json").write_text(json.dumps(spec))
    other = AutoTokenizer.from_pretrained(str(dest))
    assert len(other) == len(tok) and other(text[0])["input_ids"] != tok(text[0])["input_ids"]
    return dest


def test_resume_with_another_tokenizer_of_the_same_size_is_refused(env, trained, tmp_path):
    tok = _swapped_tokenizer(env, tmp_path / "tok")
    _refused(env, trained, "token ids of data.train", **{"model.tokenizer": tok})


def test_resume_with_another_base_config_is_refused(env, trained, tmp_path):
    base = tmp_path / "base"
    shutil.copytree(env.model, base)
    cfg = json.loads((base / "config.json").read_text())
    cfg["rope_theta"] = 2 * cfg.get("rope_theta", 10000.0)  # same weights, other positions: other numbers
    (base / "config.json").write_text(json.dumps(cfg))
    _refused(env, trained, "config.json", **{"model.base": base})


def test_the_same_inputs_elsewhere_resume(env, trained, tmp_path):
    """The tokenizer and the base model copied to other paths: the same run (a finished one changes nothing)."""
    base = tmp_path / "base"
    shutil.copytree(env.model, base)
    cfg = json.loads((base / "config.json").read_text())
    cfg["transformers_version"], cfg["_name_or_path"] = "0.0.1", "somewhere/else"  # bookkeeping only
    (base / "config.json").write_text(json.dumps(cfg))
    before = (trained / "adapter-final" / "adapter.safetensors").read_bytes()
    res = run_train(CPU_ZERO2, env.overrides(trained, **COMMON, **{"model.base": base, "model.tokenizer": base}), 0)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed from step00000002" in res.stdout + res.stderr
    assert (trained / "adapter-final" / "adapter.safetensors").read_bytes() == before


def _identity(env, trained, world: int = 1, **extra):
    """``run_identity`` of the recipe with ``extra``, on ``world`` ranks, read the way preflight reads it."""
    from frod_ds.config.recipe import load_recipe
    from frod_ds.io.hf_checkpoint import HFCheckpoint
    from frod_ds.prep.tokens import load_tokenizer
    from frod_ds.train.data import encode_examples, read_training_rows
    from frod_ds.train.identity import run_identity

    recipe = load_recipe(None, env.overrides(trained, **COMMON, **extra))
    tok = load_tokenizer(str(recipe.model.tokenizer or recipe.model.base))
    rows = read_training_rows(recipe.data.train)
    examples = encode_examples(tok, rows, recipe.data.cutoff_len, recipe.data.train_on_inputs)
    return run_identity(recipe, HFCheckpoint(Path(recipe.model.base)), world, examples, [])


def test_init_adapter_counts_by_content_not_path(env, trained, tmp_path):
    from safetensors.torch import load_file

    from frod_ds.formats.adapter_dir import AdapterConfig
    from frod_ds.model.adapter import write_adapter

    shutil.copytree(trained / "adapter-final", tmp_path / "copy")
    tensors = load_file(str(trained / "adapter-final" / "adapter.safetensors"))
    sigma = next(k for k in tensors if k.endswith(".frod_sigma"))
    tensors[sigma] = tensors[sigma] * 1.01
    write_adapter(tmp_path / "moved", tensors, AdapterConfig.read(trained / "adapter-final" / "adapter_config.json"))
    here = _identity(env, trained, **{"model.init_adapter": trained / "adapter-final"})
    assert here.differences(_identity(env, trained, **{"model.init_adapter": tmp_path / "copy"})) == []
    assert here.differences(_identity(env, trained, **{"model.init_adapter": tmp_path / "moved"})) == [
        "model.init_adapter content"
    ]


def test_world_size_and_its_split_of_the_global_batch_are_not_the_identity(env, trained):
    two = _identity(env, trained, world=2, **{"train.micro_batch_size": 4, "train.grad_accum": 2})
    one = _identity(env, trained, world=1, **{"train.micro_batch_size": 4, "train.grad_accum": 4})
    assert two.differences(one) == []
    half = _identity(env, trained, world=1, **{"train.micro_batch_size": 4, "train.grad_accum": 2})
    assert two.differences(half) == ["global_batch: 16 there, 8 now"]


def test_a_record_of_an_older_frod_ds_compares_without_the_new_digests(env, trained):
    """A record written before the digests (no ``inputs_sha256``, ``model.init_adapter`` among the
    hyperparameters) is the same run as today's; a new field it lacks is not a difference."""
    from frod_ds.formats.run_identity import RunIdentity

    now = _identity(env, trained)
    old = json.loads(now.to_json())
    del old["inputs_sha256"]
    old["hyperparameters"]["model.init_adapter"] = None
    assert RunIdentity.from_json(json.dumps(old), "old.json").differences(now) == []


def test_resume_on_a_store_rebuilt_in_another_precision_is_refused(env, trained, tmp_path):
    """The same model decomposed in float64: the same V (HJD forms it in float64 either way), other U_i and σ_i
    (checked here), so the resumed steps would be other numbers; the store's identity names the precision."""
    import torch

    from frod_ds.model.store_reader import FactorStore
    from tests.support.helpers_ckpt import hjd_in_process

    f64 = tmp_path / "f64"
    res = hjd_in_process(["--model", str(env.model), "--out", str(f64), "--dtype", "float64", "--device", "cpu"])
    assert res.returncode == 0, res.stderr[-2000:]
    a, b = FactorStore.open(env.store), FactorStore.open(f64)
    member = a.categories["q_proj"][0]
    assert torch.equal(a.load_V("q_proj"), b.load_V("q_proj").to(a.load_V("q_proj").dtype))
    assert not torch.equal(a.load_U(member), b.load_U(member).to(a.load_U(member).dtype))
    before = _tree(trained)
    res = train_in_process(CPU_ZERO2, env.overrides(trained, **COMMON, **{"model.factor_store": f64}))
    errors = [x for x in res.stderr.splitlines() if x.startswith("error:")]
    assert res.returncode == 2 and len(errors) == 1, res.stderr[-3000:]
    assert "another factor store (HJD in float32 there, float64 here)" in errors[0], errors[0]
    assert _tree(trained) == before
