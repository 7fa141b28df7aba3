"""The failure policy (issue #22): a failed or killed command leaves nothing that blocks or corrupts the next one,
and a command that cannot give the right result says so in one line instead of exiting 0.

Each test reproduces one hole as it was seen (it fails on the code before the fix) and checks the behaviour
against an independent computation or the state on disk, not against a stored message.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from frod_ds.runtime.atomic import TMP
from tests.support import pace
from tests.support.leftovers import REPO, clean_env

SHM_OP = "deepspeed_shm_comm"
# What a training launch does first that builds a DeepSpeed op (launch/train.py: load_recipe, then this).
INIT_DEEPSPEED = "from frod_ds.runtime import distributed as D; D.init_deepspeed(); D.destroy(); print('started')"


def _start_deepspeed(ext: Path, timeout: float, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", INIT_DEEPSPEED],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=clean_env(TORCH_EXTENSIONS_DIR=str(ext), **env),
    )


def _die_holding_baton(baton: Path) -> None:
    """What ``kill -9`` of a launch mid-build leaves: torch's baton created by a process that then dies."""
    code = f"import os, signal; os.open({str(baton)!r}, os.O_CREAT | os.O_EXCL); os.kill(os.getpid(), signal.SIGKILL)"
    proc = subprocess.run([sys.executable, "-c", code], env=clean_env())
    assert proc.returncode == -signal.SIGKILL and baton.exists()


def test_a_launch_killed_mid_build_does_not_block_the_next(tmp_path):
    """A build killed mid-way leaves torch's baton; the next launch must start anyway (DeepSpeed's CPU op is no longer
    built at start-up, and any op that is waits only for a live builder: see the baton tests below)."""
    ext = tmp_path / "torch_extensions"
    (ext / SHM_OP).mkdir(parents=True)
    _die_holding_baton(ext / SHM_OP / "lock")
    proc = _start_deepspeed(ext, timeout=pace.scaled(300))
    assert proc.returncode == 0 and "started" in proc.stdout, proc.stderr[-2000:]
    assert not (ext / SHM_OP / f"{SHM_OP}.so").exists(), "nothing built at start-up"


def test_a_live_builders_lock_is_left_alone(tmp_path):
    from frod_ds.runtime.op_build import BATON, clear_stale_baton

    baton = tmp_path / BATON
    fd = os.open(baton, os.O_CREAT | os.O_EXCL)  # this process is the live builder
    try:
        assert not clear_stale_baton(tmp_path) and baton.exists()
    finally:
        os.close(fd)
    assert clear_stale_baton(tmp_path) and not baton.exists()  # now its owner has let go without deleting it


def test_a_builder_that_dies_while_others_wait_does_not_block_them(tmp_path):
    """The baton's owner is alive when the next launch looks, then is killed: the launch must not wait forever."""
    import time

    from frod_ds.runtime.op_build import BATON, wait_for_baton

    baton = tmp_path / BATON
    code = (
        f"import os, signal, time; os.open({str(baton)!r}, os.O_CREAT | os.O_EXCL); time.sleep(2); "
        "os.kill(os.getpid(), signal.SIGKILL)"
    )
    builder = subprocess.Popen([sys.executable, "-c", code], env=clean_env())
    try:
        while not baton.exists() and builder.poll() is None:
            time.sleep(0.05)
        start = time.monotonic()
        wait_for_baton(tmp_path, poll_s=0.1)
        assert not baton.exists() and builder.wait(timeout=pace.scaled(30)) == -signal.SIGKILL
        assert time.monotonic() - start < pace.scaled(60)
    finally:
        if builder.poll() is None:
            builder.kill()
            builder.wait()


def test_an_offload_run_builds_cpu_adam_under_the_build_lock(monkeypatch):
    """DeepSpeedCPUAdam (optimizer offload) JIT-builds the cpu_adam op at start-up: that build must go through
    op_build.load_op (a lock that dies with its holder, a dead builder's baton cleared), not torch's bare baton."""
    from frod_ds.config.recipe import load_recipe
    from frod_ds.runtime import op_build
    from frod_ds.train import trainer

    loaded = []

    class Stop(Exception):
        pass

    def record(builder):
        loaded.append(builder.name)
        raise Stop  # the real build is what the launch tests cover; here only the route

    monkeypatch.setattr(op_build, "load_op", record)
    model = torch.nn.Linear(2, 2)
    recipe = load_recipe(None, [*REQUIRED, "model.dtype=float32"])
    offload = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
    monkeypatch.setattr(trainer, "frod_param_groups", lambda m, *a: [{"params": list(m.parameters())}])
    with pytest.raises(Stop):
        trainer._optimizer(model, recipe, offload)
    assert loaded == ["cpu_adam"]
    assert isinstance(trainer._optimizer(model, recipe, {"zero_optimization": {"stage": 2}}), torch.optim.AdamW)
    assert loaded == ["cpu_adam"], "no op is built without offload"
    torch_on_cpu = {**offload, "zero_force_ds_cpu_optimizer": False}  # DeepSpeed's key: any optimizer on the CPU
    assert isinstance(trainer._optimizer(model, recipe, torch_on_cpu), torch.optim.AdamW)
    assert loaded == ["cpu_adam"], "torch's AdamW needs no build"
    # who steps an offloaded optimizer: DeepSpeed's key when given, else the device (no GPU: torch, no build)
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    table = {
        (None, "cpu"): "torch",
        (None, "cuda"): "deepspeed",
        (False, "cpu"): "torch",
        (False, "cuda"): "torch",
        (True, "cpu"): "deepspeed",
        (True, "cuda"): "deepspeed",
    }
    for (force, dev), want in table.items():
        cfg = offload if force is None else {**offload, "zero_force_ds_cpu_optimizer": force}
        assert trainer.cpu_optimizer(cfg, cpu if dev == "cpu" else gpu) == want, (force, dev)
    assert trainer.cpu_optimizer({"zero_optimization": {"stage": 3}}, cpu) is None


def test_an_nvme_run_builds_async_io_under_the_build_lock_first(monkeypatch):
    """NVMe offload makes DeepSpeed JIT-build async_io while it builds the model: the trainer builds it first
    through op_build.load_op (whose module DeepSpeed then reuses), and only under NVMe offload."""
    from frod_ds.runtime import op_build
    from frod_ds.train import trainer

    loaded = []
    monkeypatch.setattr(op_build, "load_op", lambda builder: loaded.append(builder.name))
    trainer.build_nvme_op({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}})
    assert loaded == []
    trainer.build_nvme_op({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}})
    trainer.build_nvme_op({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}})
    assert loaded == ["async_io", "async_io"]


def test_an_nvme_offload_deepspeed_would_not_do_is_refused_with_the_json(tmp_path):
    """NVMe under ZeRO-1/2 (DeepSpeed keeps that optimizer on the GPU without a word) or without an ``nvme_path``
    was answered about libaio; the JSON's own problem is named, and --nvme-path fills a missing path."""
    from frod_ds.config.ds_config import DSConfigError, resolve_ds_config

    z2 = _shipped()
    z2["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": str(tmp_path)}
    with pytest.raises(DSConfigError, match=r"offload_optimizer offloads to NVMe, which DeepSpeed does only under"):
        resolve_ds_config(z2, _recipe(), world_size=1)
    z3 = _shipped("zero3_cpu_fp32.json")
    z3["zero_optimization"]["offload_param"] = {"device": "nvme"}
    with pytest.raises(DSConfigError, match=r"offload_param offloads to NVMe but names no nvme_path; pass --nvme-path"):
        resolve_ds_config(dict(z3, zero_optimization=dict(z3["zero_optimization"])), _recipe(), world_size=1)
    resolved = resolve_ds_config(z3, _recipe(), world_size=1, nvme_path=str(tmp_path))
    assert resolved["zero_optimization"]["offload_param"]["nvme_path"] == str(tmp_path)


def test_an_nvme_run_on_a_machine_without_libaio_is_one_line_before_anything_starts(monkeypatch):
    """DeepSpeed's async_io builder refuses a machine without libaio only when the trainer loads it, mid-setup,
    with a traceback: the check runs first and names what is missing and what to use instead."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    from frod_ds.runtime.errors import FrodError
    from frod_ds.runtime.op_build import check_buildable

    monkeypatch.setattr(AsyncIOBuilder, "is_compatible", lambda self, verbose=False: False)
    with pytest.raises(FrodError) as e:
        check_buildable(AsyncIOBuilder())
    msg = str(e.value)
    assert "\n" not in msg and "async_io" in msg and "libaio-dev" in msg and "zero3_offload.json" in msg
    monkeypatch.setattr(AsyncIOBuilder, "is_compatible", lambda self, verbose=False: True)
    check_buildable(AsyncIOBuilder())


def _venv_ninja() -> Path | None:
    here = Path(sys.executable).parent / "ninja"
    other = shutil.which("ninja", path=os.environ.get("PATH", "").replace(str(here.parent), ""))
    return here if here.is_file() and other and Path(other).resolve() != here.resolve() else None


@pytest.mark.skipif(_venv_ninja() is None, reason="needs a ninja beside this Python and another on PATH")
def test_no_launch_builds_an_op_whichever_ninja_is_on_path(tmp_path):
    """Two ninjas (the venv's and the system's) used to rebuild the shm op in turn on every launch; now no launch
    builds it, whichever comes first on PATH."""
    ext = tmp_path / "torch_extensions"
    ext.mkdir()
    venv_bin = str(Path(sys.executable).parent)
    plain = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if p != venv_bin)
    for path in (os.pathsep.join([venv_bin, plain]), plain):
        proc = _start_deepspeed(ext, timeout=pace.scaled(300), PATH=path)
        assert proc.returncode == 0 and "started" in proc.stdout, proc.stderr[-2000:]
    assert not any(ext.rglob("*.so")), "an op was built at start-up"


# --- the DeepSpeed JSON and the recipe: one source of truth, mistakes named -------------------------------------

REQUIRED = ["model.base=m", "model.factor_store=f", "data.train=t.jsonl"]


def _shipped(name: str = "zero2_cpu_fp32.json") -> dict:
    import json

    return json.loads((REPO / "ds_configs" / name).read_text())


def _recipe(*overrides: str):
    from frod_ds.config.recipe import load_recipe

    return load_recipe(None, [*REQUIRED, "model.dtype=float32", *overrides])


@pytest.mark.parametrize("clip, norm", [(0.3, "1.0"), (1.0, "0.5"), (0, "1.0")])
def test_gradient_clipping_that_contradicts_max_grad_norm_is_refused(clip, norm):
    from frod_ds.config.ds_config import DSConfigError, resolve_ds_config

    cfg = {**_shipped(), "gradient_clipping": clip}
    with pytest.raises(DSConfigError) as e:
        resolve_ds_config(cfg, _recipe(f"train.max_grad_norm={norm}"), world_size=1)
    msg = str(e.value)
    assert f"gradient_clipping={clip!r}" in msg and f"max_grad_norm={float(norm)}" in msg and '"auto"' in msg


def test_gradient_clipping_that_agrees_or_is_auto_is_the_recipes():
    from frod_ds.config.ds_config import resolve_ds_config

    for clip in ("auto", 0.5):
        cfg = {**_shipped(), "gradient_clipping": clip}
        assert resolve_ds_config(cfg, _recipe("train.max_grad_norm=0.5"), 1)["gradient_clipping"] == 0.5
    cfg = {k: v for k, v in _shipped().items() if k != "gradient_clipping"}
    assert resolve_ds_config(cfg, _recipe("train.max_grad_norm=0.5"), 1)["gradient_clipping"] == 0.5


@pytest.mark.parametrize(
    "where, typo, meant",
    [
        ("", "gradient_cliping", "gradient_clipping"),
        ("", "steps_per_prnt", "steps_per_print"),
        ("zero_optimization", "overlap_com", "overlap_comm"),
        ("zero_optimization", "stage3_prefetch_bucket", "stage3_prefetch_bucket_size"),
    ],
)
def test_a_misspelled_deepspeed_key_is_named_with_the_closest_valid_one(where, typo, meant):
    from frod_ds.config.ds_config import DSConfigError, resolve_ds_config

    cfg = _shipped("zero3_cpu_fp32.json")
    (cfg[where] if where else cfg)[typo] = 1
    with pytest.raises(DSConfigError) as e:
        resolve_ds_config(cfg, _recipe(), world_size=1)
    dotted = f"{where}." if where else ""
    assert f'unknown key "{dotted}{typo}"' in str(e.value) and f'did you mean "{dotted}{meant}"' in str(e.value)


@pytest.mark.parametrize(
    "name",
    [
        "zero3.json",
        "zero3_offload.json",
        "zero3_nvme.json",
        "zero2.json",
        "zero0.json",
        "zero3_cpu_fp32.json",
        "zero2_cpu_fp32.json",
    ],
)
def test_every_shipped_deepspeed_key_is_known(name):
    from frod_ds.config.ds_checks import unknown_keys

    assert unknown_keys(_shipped(name)) == []


def _train_main(argv: list[str], capsys) -> tuple[int, str]:
    from frod_ds.cli.train import main

    code = main(argv)
    return code, capsys.readouterr().err


@pytest.mark.parametrize("text", ["model:\n  base: m\n   factor_store: f\n", "train: {lr_sigma: 1e-4\n", "a: [1, 2\n"])
def test_a_malformed_yaml_recipe_is_one_line(tmp_path, capsys, text):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(text)
    code, err = _train_main(
        ["--config", str(REPO / "ds_configs" / "zero2_cpu_fp32.json"), "--recipe", str(recipe)], capsys
    )
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and str(recipe) in lines[0], err
    assert "line " in lines[0] and "Traceback" not in err


@pytest.mark.parametrize("name", ["missing-tok", "a/b/c"])
def test_a_tokenizer_that_cannot_be_loaded_is_one_line_naming_it(tmp_path, name):
    """model.tokenizer / eval --tokenizer: a missing directory (or an id that cannot be resolved offline) is a
    user mistake named in one line, not transformers' OSError traceback."""
    from frod_ds.prep.tokens import load_tokenizer
    from frod_ds.runtime.errors import FrodError

    path = str(tmp_path / name)
    with pytest.raises(FrodError) as e:
        load_tokenizer(path)
    msg = str(e.value)
    assert "\n" not in msg and path in msg and "no such directory" in msg


def test_a_model_directory_without_tokenizer_files_says_so(tmp_path):
    """A model folder copied without its tokenizer: the line says the directory holds no tokenizer files and where
    to pass one, not transformers' "Couldn't instantiate the backend tokenizer"."""
    from frod_ds.prep.tokens import load_tokenizer
    from frod_ds.runtime.errors import FrodError
    from tests.support.eval_fixtures import random_llama, save_model, word_tokenizer

    tok = word_tokenizer()
    model = save_model(tmp_path / "m", random_llama(len(tok)), tok)
    assert len(load_tokenizer(str(model))) == len(tok)
    assert (model / "tokenizer_config.json").is_file() and (model / "tokenizer.json").is_file()
    (model / "tokenizer.json").rename(tmp_path / "tokenizer.json")  # the vocabulary lost, its config kept
    with pytest.raises(FrodError, match="holds tokenizer_config.json but no vocabulary .*copy the tokenizer files"):
        load_tokenizer(str(model))
    for f in model.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "spm")) or f.suffix == ".model":
            f.unlink()
    with pytest.raises(FrodError, match="the directory holds no tokenizer files .*; pass the directory that does"):
        load_tokenizer(str(model))


# --- export --format peft: --peft-tol is a promise --------------------------------------------------------------

PEFT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"]


@pytest.fixture(scope="module")
def peft_env(tmp_path_factory):
    from tests.support.train_env import build_env

    return build_env(tmp_path_factory.mktemp("policy-peft"))


def _trained_adapter(env, out: Path, quant: str = "none"):
    """A frod-ds adapter after 8 AdamW steps on a fixed batch (σ moved, S ≠ 0), U held ``quant`` in training."""
    import torch

    from frod_ds.formats.adapter_dir import AdapterConfig
    from frod_ds.model.adapter import save_adapter_from_model
    from frod_ds.model.apply import frod_param_groups
    from frod_ds.model.build import build_frod_model, make_supports
    from frod_ds.model.store_reader import FactorStore

    store = FactorStore.open(env.store)
    torch.manual_seed(0)
    model = build_frod_model(env.model, store, make_supports(store, PEFT_TARGETS, 0.1, 0), torch.float32, quant=quant)
    opt = torch.optim.AdamW(frod_param_groups(model, lr_sigma=1e-2, lr_s=1e-2))
    ids = torch.randint(0, model.config.vocab_size, (3, 13), generator=torch.Generator().manual_seed(1))
    for _ in range(8):
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    ckpt = save_adapter_from_model(
        model,
        out,
        AdapterConfig(
            base_model=str(env.model),
            factor_store=str(env.store),
            dtype="float32",
            sparsity=0.1,
            seed=0,
            frozen_quant=quant,
        ),
        store=store,
    )
    return ckpt, model.eval()


def _export(argv: list[str], capsys) -> tuple[int, str]:
    from frod_ds.cli.export import main

    capsys.readouterr()
    code = main(argv)
    return code, capsys.readouterr().err.strip()


def _peft_logits(env, peft_dir: Path, ids):
    import torch
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    with torch.no_grad():
        base = LlamaForCausalLM.from_pretrained(str(env.model), dtype=torch.float32).eval()
        base_logits = base(ids).logits
        return base_logits, PeftModel.from_pretrained(base, str(peft_dir)).eval()(ids).logits


def test_a_peft_export_that_misses_peft_tol_is_refused_and_the_tol_it_names_passes(peft_env, tmp_path, capsys):
    import re

    import torch

    ckpt, frod = _trained_adapter(peft_env, tmp_path / "adapter")
    out = tmp_path / "peft"
    code, err = _export(
        ["--checkpoint", str(ckpt), "--format", "peft", "--out", str(out), "--peft-tol", "1e-9"], capsys
    )
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("error: --peft-tol 1e-09 cannot be met"), err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["adapter"], "nothing partial"
    measured = float(re.search(r"differ from the trained ones by (\S+) ", err).group(1))
    accept = re.search(r"pass --peft-tol (\S+) to accept", err).group(1)
    assert float(accept) >= measured
    code, err = _export(
        ["--checkpoint", str(ckpt), "--format", "peft", "--out", str(out), "--peft-tol", accept], capsys
    )
    assert code == 0, err
    ids = torch.randint(0, frod.config.vocab_size, (3, 13), generator=torch.Generator().manual_seed(0))
    base_logits, peft_logits = _peft_logits(peft_env, out, ids)
    with torch.no_grad():
        want = frod(ids).logits
    # stock PEFT computes the trained model up to the accepted update error (a few times it, through the layers)
    assert (peft_logits - want).abs().max() <= 10 * float(accept) * (want - base_logits).abs().max() + 1e-5


def test_a_peft_export_of_an_nf4_trained_adapter_is_refused_with_its_error(peft_env, tmp_path, capsys):
    import torch

    ckpt, frod = _trained_adapter(peft_env, tmp_path / "adapter", quant="nf4")
    out = tmp_path / "peft"
    code, err = _export(["--checkpoint", str(ckpt), "--format", "peft", "--out", str(out)], capsys)
    assert code == 2 and len(err.splitlines()) == 1 and "--peft-tol 0.001 cannot be met" in err, err
    assert "nf4-quantized" in err and "--format hf" in err and not out.exists()
    # independent: what stock PEFT would have loaded (forced through) is not the trained model
    code, _ = _export(["--checkpoint", str(ckpt), "--format", "peft", "--out", str(out), "--peft-tol", "10"], capsys)
    assert code == 0
    ids = torch.randint(0, frod.config.vocab_size, (3, 13), generator=torch.Generator().manual_seed(0))
    base_logits, peft_logits = _peft_logits(peft_env, out, ids)
    with torch.no_grad():
        want = frod(ids).logits
    assert (peft_logits - want).abs().max() > 1e-2 * (want - base_logits).abs().max()


# --- HJD: one store, one model; an index that hides a tensor --------------------------------------------------


@pytest.fixture(scope="module")
def hjd_model(tmp_path_factory):
    """A tiny sharded LLaMA checkpoint (several safetensors shards and an index)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("policy-hjd")
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(cfg).save_pretrained(str(root / "model"), max_shard_size="40KB")
    assert (root / "model" / "model.safetensors.index.json").is_file()
    return root / "model"


def _hjd(*argv: str) -> subprocess.CompletedProcess:
    """``launch/hjd.py --device cpu ARGV`` in a process forked from this worker (its imports paid already)."""
    from tests.support.helpers_ckpt import run_hjd

    return run_hjd(["--device", "cpu", *argv], timeout=300)


def _other_targeted_weights(src: Path, dst: Path, category: str) -> None:
    """``src`` with every ``<category>`` weight changed and every other tensor identical (the same untargeted
    tensors: only the stored category's digests tell the two models apart)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    for shard in dst.glob("*.safetensors"):
        tensors = load_file(shard)
        for name in tensors:
            if f".{category}." in name:
                tensors[name] = tensors[name] + 0.05
        save_file(tensors, shard, metadata={"format": "pt"})


def test_hjd_categories_from_another_models_checkpoint_are_refused(hjd_model, tmp_path):
    import json

    store = tmp_path / "store"
    first = _hjd("--model", str(hjd_model), "--out", str(store), "--categories", "q_proj")
    assert first.returncode == 0, first.stderr[-2000:]
    before = {p.name: p.read_bytes() for p in store.iterdir()}
    other = tmp_path / "other"
    _other_targeted_weights(hjd_model, other, "q_proj")
    second = _hjd("--model", str(other), "--out", str(store), "--categories", "v_proj")
    lines = second.stderr.strip().splitlines()
    assert second.returncode == 2 and lines[-1].startswith("error: ") and "q_proj" in lines[-1], second.stderr[-2000:]
    assert "Traceback" not in second.stderr
    assert {p.name: p.read_bytes() for p in store.iterdir()} == before, "the store is left as it was"
    assert json.loads((store / "manifest.json").read_text())["complete"] is False
    # the same model's checkpoint still adds its categories
    third = _hjd("--model", str(hjd_model), "--out", str(store), "--categories", "v_proj")
    assert third.returncode == 0, third.stderr[-2000:]


def test_a_shard_index_missing_a_member_is_named(hjd_model, tmp_path):
    import json

    model = tmp_path / "model"
    shutil.copytree(hjd_model, model)
    index = model / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    dropped = "model.layers.1.self_attn.q_proj.weight"
    del data["weight_map"][dropped]
    index.write_text(json.dumps(data))
    res = _hjd("--model", str(model), "--out", str(tmp_path / "store"))
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and lines and lines[-1].startswith("error: "), res.stderr[-2000:]
    assert dropped in lines[-1] and str(index) in lines[-1], lines[-1]
    assert not (tmp_path / "store").exists() or not any((tmp_path / "store").iterdir())


# --- what the one error line tells the user to do -----------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["hf", "peft"])
def test_out_onto_a_foreign_directory_does_not_suggest_overwrite(tmp_path, capsys, fmt):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("not frod-ds output")
    argv = ["--checkpoint", str(tmp_path / "adapter"), "--format", fmt, "--out", str(foreign)]
    code, err = _export(argv, capsys)
    assert code == 2 and "--overwrite" not in err and "choose" in err, err
    code, err2 = _export([*argv, "--overwrite"], capsys)
    assert code == 2 and "--overwrite" not in err2, err2  # the flag the first message would have suggested
    assert (foreign / "notes.txt").read_text() == "not frod-ds output"


def test_data_prep_out_onto_a_foreign_directory_does_not_suggest_overwrite(tmp_path):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep")
    from tests.support import ranks

    args = ["data", "build", "--source", str(tmp_path / "raw"), "--tasks", "boolq", "--out", str(foreign)]
    res = ranks.run(0, [str(REPO / "tests" / "support" / "frod_main.py"), *args], clean_env(), REPO, timeout=120)
    assert res.returncode != 0 and "pass --overwrite" not in res.stderr, res.stderr[-1000:]
    assert (foreign / "notes.txt").read_text() == "keep"


def test_export_on_a_missing_gpu_is_one_line(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    out = tmp_path / "out"
    code, err = _export(["--checkpoint", str(tmp_path / "adapter"), "--out", str(out), "--device", "cuda"], capsys)
    assert code == 2 and len(err.splitlines()) == 1 and "no CUDA device" in err and "--device cpu" in err, err
    assert not out.exists()


# --- training: user mistakes are one line, a failed fresh run leaves no output_dir -----------------------------


@pytest.fixture(scope="module")
def train_env(tmp_path_factory):
    from tests.support.train_env import build_env

    return build_env(tmp_path_factory.mktemp("policy-train"))


def _train(env, out: Path, **extra):
    from tests.support.train_env import CPU_ZERO2, run_train

    return run_train(CPU_ZERO2, env.overrides(out, **extra), nproc=0, timeout=600)


def _one_error_line(res) -> str:
    lines = [line for line in res.stderr.replace("\r", "\n").splitlines() if line.startswith("error: ")]
    assert res.returncode == 2 and len(lines) == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert any(line.startswith("error: ") for line in res.stderr.splitlines()), "the error line starts a line"
    return lines[0]


def _variant(env, root: Path, name: str, edit) -> tuple[Path, Path]:
    """A copy of ``env``'s model changed by ``edit(model_dir)``, and its own factor store."""
    model = root / name
    shutil.copytree(env.model, model)
    edit(model)
    store = root / f"{name}-factors"
    res = _hjd("--model", str(model), "--out", str(store))
    assert res.returncode == 0, res.stderr[-2000:]
    return model, store


def test_data_train_may_name_a_data_prep_output_dir(train_env, tmp_path):
    import hashlib
    import json

    out = tmp_path / "run"
    res = _train(train_env, out, **{"data.train": train_env.data, "train.max_steps": 1})
    assert res.returncode == 0, res.stderr[-3000:]
    recorded = [json.loads(p.read_text())["data_sha256"]["train"] for p in out.rglob("run_identity.json")]
    assert recorded and set(recorded) == {hashlib.sha256((train_env.data / "train.jsonl").read_bytes()).hexdigest()}


def test_too_few_rows_names_the_limit_and_the_file_and_leaves_no_output_dir(train_env, tmp_path):
    out = tmp_path / "run"
    line = _one_error_line(_train(train_env, out, **{"data.limit": 3}))
    assert "data.limit=3" in line and str(train_env.data / "train.jsonl") in line, line
    assert not out.exists()


def test_a_tokenizer_larger_than_the_vocabulary_is_one_line(train_env, tmp_path):
    from frod_ds.testing.toy import write_tiny_llama

    def smaller_vocab(model: Path) -> None:  # same tokenizer (400 tokens), a model with 64 embedding rows
        cfg = __import__("json").loads((model / "config.json").read_text())
        for f in model.glob("*.safetensors*"):
            f.unlink()
        write_tiny_llama(
            model,
            vocab_size=64,
            max_shard_size="60KB",
            **{
                k: cfg[k]
                for k in (
                    "hidden_size",
                    "intermediate_size",
                    "num_attention_heads",
                    "num_key_value_heads",
                    "num_hidden_layers",
                )
            },
        )

    model, store = _variant(train_env, tmp_path, "small-vocab", smaller_vocab)
    out = tmp_path / "run"
    line = _one_error_line(
        _train(train_env, out, **{"model.base": model, "model.factor_store": store, "model.tokenizer": train_env.model})
    )
    assert "vocab_size 64" in line and "token id" in line, line
    assert not out.exists()


def test_examples_past_the_models_positions_are_one_line(train_env, tmp_path):
    """config.json's max_position_embeddings below the examples' length: training would run on positions the
    model never saw (the rotary embedding computes them all the same), so it is refused before any step. The
    weights are the same, so the store of the unchanged model is the one used."""
    import json

    model = tmp_path / "short"
    shutil.copytree(train_env.model, model)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 16}))
    out = tmp_path / "run"
    line = _one_error_line(_train(train_env, out, **{"model.base": model, "model.tokenizer": train_env.model}))
    assert "max_position_embeddings 16" in line and "data.cutoff_len" in line and "at most 16" in line, line
    assert not out.exists()


@pytest.mark.parametrize("key", ["pad_token", "unk_token"])
def test_a_special_token_the_vocabulary_lacks_is_named_with_its_file(train_env, tmp_path, key):
    """A special token in tokenizer_config.json the vocabulary lacks becomes an id past the embedding (transformers
    adds it): a pad token every padded batch would index, an unk token no row uses that eval of the trained
    adapter would refuse. Refused before training, as eval does, naming that value and file."""
    model = tmp_path / "model"
    shutil.copytree(train_env.model, model)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**cfg, key: "<nosuch>"}))
    out = tmp_path / "run"
    line = _one_error_line(_train(train_env, out, **{"model.base": model, "model.tokenizer": model}))
    assert f"{model / 'tokenizer_config.json'} gives {key} '<nosuch>', a token the vocabulary lacks" in line
    assert f"set {key} to a token of the vocabulary" in line, line
    assert not out.exists()


def test_check_context_measures_the_longest_example():
    from frod_ds.train.data import DataError, Example, check_context

    ex = [Example(input_ids=[1] * n, labels=[1] * n) for n in (5, 12, 9)]
    check_context(ex, 12, 64, "m")  # the longest fits exactly
    with pytest.raises(DataError, match="reach 12 tokens .*max_position_embeddings 11"):
        check_context(ex, 11, 64, "m")


def test_a_cutoff_past_the_positions_that_cuts_nothing_is_noted(capsys):
    """data.cutoff_len above max_position_embeddings trains what a cutoff at the positions would (no example is
    that long), and says so once; a cutoff within the positions says nothing."""
    from frod_ds.train.data import Example, check_context

    ex = [Example(input_ids=[1] * n, labels=[1] * n) for n in (5, 12, 9)]
    check_context(ex, 64, 64, "m")
    assert "note:" not in capsys.readouterr().err
    check_context(ex, 64, 100000, "m")
    check_context(ex, 64, 100000, "m")  # once per process
    err = capsys.readouterr().err
    assert err.count("note:") == 1
    assert "data.cutoff_len 100000 is past the model's max_position_embeddings 64" in err
    assert "the longest example is 12 tokens" in err


def test_nan_in_a_base_norm_is_named_where_it_enters(train_env, tmp_path):
    """A NaN in an untargeted base weight (which HJD does not read) stops training as the model is built, naming
    the tensor, before any step: not a non-finite loss three steps later with advice about learning rates."""
    from safetensors.torch import load_file, save_file

    def nan_norm(model: Path) -> None:
        for shard in model.glob("*.safetensors"):
            tensors = load_file(shard)
            name = "model.layers.0.input_layernorm.weight"
            if name in tensors:
                tensors[name][0] = float("nan")
                save_file(tensors, shard, metadata={"format": "pt"})

    model, store = _variant(train_env, tmp_path, "nan-norm", nan_norm)
    out = tmp_path / "run"
    res = _train(
        train_env,
        out,
        **{"model.base": model, "model.factor_store": store, "train.save_every": 1, "train.max_steps": 6},
    )
    line = _one_error_line(res)
    assert "model.layers.0.input_layernorm.weight holds 1 non-finite value(s) (NaN/inf) in the checkpoint" in line
    assert not out.exists(), "the failed fresh run removed the output_dir it created"


def test_a_failed_run_never_removes_an_output_dir_it_did_not_create(train_env, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    _one_error_line(_train(train_env, out, **{"data.limit": 3}))
    assert out.is_dir()


# --- data_prep: LLM-Adapters' evaluation folders ----------------------------------------------------------------


def test_a_task_folder_with_only_test_json_builds_its_test_split(tmp_path, capsys):
    import json

    from frod_ds.prep.dataset import BuildOptions, build
    from frod_ds.prep.rows import read_rows

    fixture = REPO / "tests" / "fixtures" / "data_prep" / "llm_adapters"
    root = tmp_path / "dataset"
    shutil.copytree(fixture / "boolq", root / "boolq")
    (root / "piqa").mkdir()
    shutil.copy(fixture / "piqa" / "test.json", root / "piqa" / "test.json")  # LLM-Adapters' dataset/piqa/test.json
    build(BuildOptions(source=f"llm-adapters:{root}", out=tmp_path / "out", tasks=("boolq", "piqa")))
    assert "note:" in capsys.readouterr().err
    piqa_test = json.loads((root / "piqa" / "test.json").read_text())
    assert len(read_rows(tmp_path / "out" / "eval" / "piqa.jsonl")) == len(piqa_test)
    train = read_rows(tmp_path / "out" / "train.jsonl")
    boolq_train = json.loads((root / "boolq" / "train.json").read_text())
    assert {r["task"] for r in train} == {"boolq"} and len(train) == len(boolq_train)


# --- a full disk: one line, nothing half-written, the same command resumes ----------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A 64 KiB tmpfs (needs the right to mount: root in CI containers); yields ``(path, grow)``, ``grow()``
    making it large enough for the rest of the test."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here")
    try:
        yield disk, lambda: subprocess.run(["mount", "-o", "remount,size=16m", str(disk)], check=True)
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_a_writer_that_reports_a_full_disk_as_something_else_is_a_full_disk(small_disk, tmp_path):
    """building_dir (every published output) asks the disk, before deleting the partial output, when its writer
    fails with something other than ENOSPC: safetensors' Rust writer raises SafetensorError("... No space left on
    device (os error 28)"), which reached the user of `export --format peft` as a traceback (failure corpus)."""
    from frod_ds.formats.building import building_dir
    from frod_ds.runtime.errors import FrodError

    disk, _ = small_disk
    out = disk / "export"

    class WriterError(Exception):  # what a non-Python writer raises instead of OSError
        pass

    with pytest.raises(FrodError, match=r"cannot write .*export: No space left on device; free space"):
        with building_dir(out, "hf-export") as tmp:
            try:
                (tmp / "weights").write_bytes(b"\0" * 200_000)
            except OSError:
                raise WriterError("I/O error: No space left on device (os error 28)") from None
    assert not out.exists() and list(disk.iterdir()) == [], "nothing left behind"
    with pytest.raises(ValueError, match="not a disk problem"):  # with space left, other errors stay themselves
        with building_dir(tmp_path / "roomy", "hf-export"):
            raise ValueError("not a disk problem")
    assert not (tmp_path / "roomy").exists()


def test_hjd_over_its_own_store_without_a_manifest_builds_it_anew(hjd_model, tmp_path):
    """Factor files without their manifest cannot be trusted (which weights, which configuration): a store the
    marker says HJD wrote is rebuilt by the same command (it asked for --overwrite); an unmarked one is not touched."""
    from frod_ds.formats.factor_store import MANIFEST
    from frod_ds.formats.ownership import MARKER

    store = tmp_path / "store"
    argv = ("--model", str(hjd_model), "--out", str(store), "--categories", "v_proj")
    assert _hjd(*argv).returncode == 0
    built = {p.name: p.read_bytes() for p in store.iterdir() if p.name != MANIFEST}
    (store / MANIFEST).unlink()
    res = _hjd(*argv)
    assert res.returncode == 0 and "no manifest.json (a damaged store): building it anew" in res.stderr, res.stderr
    assert {p.name: p.read_bytes() for p in store.iterdir() if p.name != MANIFEST} == built, "the same factors again"
    (store / MANIFEST).unlink()
    (store / MARKER).unlink()  # not known to be HJD's: the user's files stay
    res = _hjd(*argv)
    assert res.returncode == 2 and res.stderr.strip().splitlines()[-1].startswith(f"error: --out {store} "), res.stderr
    assert sorted(p.name for p in store.iterdir()) == sorted(n for n in built if n != MARKER)


def test_hjd_on_a_full_disk_is_one_line_and_the_same_command_resumes(hjd_model, small_disk):
    disk, grow = small_disk
    store = disk / "store"
    argv = ("--model", str(hjd_model), "--out", str(store))
    res = _hjd(*argv)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and lines[-1].startswith("error: cannot write ") and "No space left" in lines[-1], (
        res.stderr[-2000:]
    )
    assert "Traceback" not in res.stderr
    grow()
    assert _hjd(*argv).returncode == 0
    verify = _hjd("--verify", str(store), "--model", str(hjd_model))  # an independent check of every category
    assert verify.returncode == 0 and "OK" in verify.stdout, verify.stderr[-2000:]
    assert not [p.name for p in store.iterdir() if p.name.endswith(TMP)]


def test_hjd_overwrite_that_fills_the_disk_gives_the_old_store_back(hjd_model, tmp_path):
    """A disk with room for one store: --overwrite with another model's weights runs out of space part-way, and
    the store it was replacing is back whole (it was left half new, half gone), checked by --verify."""
    other = tmp_path / "other"
    _other_targeted_weights(hjd_model, other, "q_proj")
    built = tmp_path / "built"
    assert _hjd("--model", str(other), "--out", str(built)).returncode == 0
    size = sum(-(-p.stat().st_size // 4096) * 4096 for p in built.rglob("*") if p.is_file())  # tmpfs pages
    disk = tmp_path / "disk"
    disk.mkdir()
    opts = f"size={size + size // 2 + 64 * 1024}"  # the store, and half of another
    if subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here")
    try:
        store = disk / "store"
        shutil.copytree(built, store)
        before = {str(p.relative_to(store)): p.read_bytes() for p in store.rglob("*") if p.is_file()}
        res = _hjd("--model", str(hjd_model), "--out", str(store), "--overwrite")
        lines = [x for x in res.stderr.splitlines() if x.startswith("error:")]
        assert res.returncode == 2 and len(lines) == 1 and "No space left" in lines[0], res.stderr[-3000:]
        assert "the store it was to replace is back" in res.stderr
        assert {str(p.relative_to(store)): p.read_bytes() for p in store.rglob("*") if p.is_file()} == before
        assert sorted(p.name for p in disk.iterdir()) == ["store"], "no aside folder or lease left"
        verify = _hjd("--verify", str(store), "--model", str(other))
        assert verify.returncode == 0 and "OK" in verify.stdout, verify.stderr[-2000:]
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_training_on_a_full_disk_is_one_line_and_leaves_no_output_dir(train_env, small_disk):
    disk, grow = small_disk
    out = disk / "run"
    extra = {"train.save_every": 2, "train.max_steps": 4}
    line = _one_error_line(_train(train_env, out, **extra))
    assert line.startswith("error: cannot write ") and "No space left" in line, line
    assert not out.exists(), "the failed fresh run removed the output_dir it created"
    grow()
    res = _train(train_env, out, **extra)
    assert res.returncode == 0 and (out / "adapter-final").is_dir(), res.stderr[-3000:]


@contextlib.contextmanager
def _file_size_limit(nbytes: int):
    """This process's (and its forks') soft ``RLIMIT_FSIZE`` (``ulimit -f``) for the block, restored after. Python
    ignores SIGXFSZ, so a write past it fails with EFBIG instead of killing the process."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_a_write_past_the_file_size_limit_is_named_as_such(tmp_path):
    """torch.save reports EFBIG as a RuntimeError ("unexpected pos"): with a file-size limit set, it is that limit,
    with the advice to raise it (not to free space on a disk that has plenty)."""
    import errno

    import torch

    from frod_ds.runtime.atomic import disk_full_error, disk_full_line

    path = tmp_path / "big.pt"
    with _file_size_limit(64 * 1024):
        with pytest.raises(RuntimeError) as info:
            torch.save(torch.zeros(100_000), path)
        err = disk_full_error(path, info.value)
        line = disk_full_line(err)
    assert err is not None and err.errno == errno.EFBIG
    assert "File too large" in line and "file-size limit of 65,536 bytes (ulimit -f)" in line
    assert "free space" not in line
    assert disk_full_error(path, RuntimeError("unrelated")) is None  # no limit, space left: not a disk problem


def test_a_data_build_past_the_file_size_limit_is_one_line_and_leaves_nothing(tmp_path, capsys):
    from frod_ds.prep.command import main
    from frod_ds.testing.toy import write_synthetic_tasks

    write_synthetic_tasks(tmp_path / "raw", n_train=80, n_eval=20)
    out = tmp_path / "data"
    with _file_size_limit(20 * 1024):
        code = main(["build", "--source", str(tmp_path / "raw"), "--tasks", "boolq,piqa", "--out", str(out)])
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert code == 2 and len(lines) == 1 and "File too large" in lines[0] and "ulimit -f" in lines[0], err
    assert "Traceback" not in err and sorted(p.name for p in tmp_path.iterdir()) == ["raw"]
    assert main(["build", "--source", str(tmp_path / "raw"), "--tasks", "boolq,piqa", "--out", str(out)]) == 0


def test_a_checkpoint_past_the_file_size_limit_is_one_line_and_the_run_goes_on_after(train_env, tmp_path):
    """The checkpoint's files are torch.save's (RuntimeError), DeepSpeed's and safetensors' (SafetensorError):
    whichever fails first, one line naming the limit; raised, the same command trains the run to the end."""
    out = tmp_path / "run"
    extra = {"train.save_every": 2, "train.max_steps": 4}
    with _file_size_limit(24 * 1024):
        res = _train(train_env, out, **extra)
    line = _one_error_line(res)
    assert "File too large" in line and "ulimit -f" in line, line
    res = _train(train_env, out, **extra)
    assert res.returncode == 0 and (out / "adapter-final").is_dir(), res.stderr[-3000:]


# --- a checkpoint whose config.json is missing or torn --------------------------------------------------------------


@pytest.mark.parametrize("damage", ["missing", "torn"])
def test_training_on_a_checkpoint_without_a_usable_config_is_one_line(peft_env, tmp_path, damage):
    """HJD decomposes the weights alone, so a checkpoint without a usable config.json gets a store; training on it
    names the file before building anything (it was transformers' OSError / JSONDecodeError traceback)."""
    from tests.support.train_env import CPU_ZERO2, train_in_process

    model = tmp_path / "model"
    shutil.copytree(peft_env.model, model)
    config = model / "config.json"
    if damage == "missing":
        config.unlink()
    else:
        config.write_text(config.read_text()[: len(config.read_text()) // 2])
    out = tmp_path / "run"
    res = train_in_process(CPU_ZERO2, peft_env.overrides(out, **{"model.base": model, "train.max_steps": 1}))
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:"), res.stderr
    assert str(config) in lines[0] or str(model) in lines[0], lines[0]
    assert ("no config.json" if damage == "missing" else "not valid JSON") in lines[0]
    assert not out.exists()
