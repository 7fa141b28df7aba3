"""Interop with stock PEFT's FRoD tuner (peft 0.21.2): ``frod export --format peft`` after training (σ moved,
S ≠ 0) loads with ``PeftModel.from_pretrained`` and computes the FRoD model's logits; ``--from-peft`` turns a
stock-PEFT-trained adapter into a factor store + adapter that frod-ds loads (same logits as PEFT), evaluates (same
scores as PEFT's merged model) and trains on; bad input is one ``error:`` line and leaves nothing behind."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from frod_ds.interop.peft_common import PEFT_FILES
from frod_ds.runtime.errors import FrodError
from launch.export import main
from tests.support.train_env import CPU_ZERO3, build_env, run_train

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"]
# Export: PEFT recomputes its own basis and the sparse support is re-expressed in it, so the error is a fraction of
# the update (--peft-tol 1e-3 bounds each member's ‖ΔW‖ error): max |logit difference| ≤ EXPORT_TOL · max |logit
# change from training| (measured 3.6e-4: 1.3e-3 on a change of 3.6, fp32).
EXPORT_TOL = 1e-3
# Import is exact up to fp32 rounding (different op order): max |logit difference| ≤ IMPORT_TOL · max |logit change|
# (measured 1.7e-6: 5.2e-6 on a change of 3.0).
IMPORT_TOL = 2e-5


def _ids(vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (3, 13), generator=torch.Generator().manual_seed(seed))


def _base(model_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def _base_peft_frod_logits(model_dir, peft_dir, frod) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits on the same ids of the base model, of stock PEFT's ``PeftModel`` loading ``peft_dir`` onto it,
    and of ``frod``."""
    from peft import PeftModel

    ids = _ids(frod.config.vocab_size)
    with torch.no_grad():
        base = _base(model_dir)
        base_logits = base(ids).logits
        peft_logits = PeftModel.from_pretrained(base, str(peft_dir)).eval()(ids).logits
        return base_logits, peft_logits, frod(ids).logits


def test_core_in_peft_basis_is_exact_and_sparse_for_a_signed_permutation():
    """``M_p`` reproduces ``U_o M_o V_oᵀ`` with PEFT's ``U_p``, ``V_p`` (built as PEFT builds them: ``B = W V⁻ᵀ``,
    unit columns); for a signed permutation ``G`` it keeps S's nnz (permuted), for a rotation it is dense."""
    from frod_ds.interop.peft_export import core_in_peft_basis

    g = torch.Generator().manual_seed(0)
    m, n = 5, 6
    W = torch.randn(m, n, generator=g, dtype=torch.float64)
    V_p = torch.randn(n, n, generator=g, dtype=torch.float64)

    def factors(V):
        B = W @ torch.linalg.inv(V).T
        return B / B.norm(dim=0), B.norm(dim=0)

    U_p, lam0 = factors(V_p)
    perm = torch.tensor([2, 0, 1, 5, 3, 4])
    P = torch.zeros(n, n, dtype=torch.float64)
    P[perm, torch.arange(n)] = torch.tensor([1.0, -1, 1, 1, -1, 1], dtype=torch.float64)
    Q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    for G, sparse in ((P, True), (Q, False)):
        V_o = V_p @ G
        U_o, sigma0 = factors(V_o)
        M_o = torch.diag(sigma0 * (1 + 0.1 * torch.randn(n, generator=g, dtype=torch.float64)))
        M_o[0, 3], M_o[4, 1], M_o[2, 5] = 0.3, -0.2, 0.1  # S
        M_p = core_in_peft_basis(M_o, sigma0, lam0, G)
        assert torch.allclose(U_p @ M_p @ V_p.T, U_o @ M_o @ V_o.T, atol=1e-10)
        off = M_p - torch.diag(torch.diagonal(M_p))
        assert ((off.abs() > 1e-12).sum().item() == 3) == sparse
        assert torch.allclose(core_in_peft_basis(torch.diag(sigma0), sigma0, lam0, G), torch.diag(lam0), atol=1e-10)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Tiny model (2 layers, GQA k/v 16×32: PEFT's basis differs from frod-ds' by rotations there), tokenizer,
    data and factor store."""
    return build_env(tmp_path_factory.mktemp("peftenv"))


@pytest.fixture(scope="module")
def trained(env):
    """A frod-ds adapter after 8 AdamW steps on a fixed batch (σ moved, S ≠ 0), saved like training saves it."""
    from frod_ds.formats.adapter_dir import AdapterConfig
    from frod_ds.model.adapter import save_adapter_from_model
    from frod_ds.model.apply import frod_modules, frod_param_groups
    from frod_ds.model.build import build_frod_model, make_supports
    from frod_ds.model.store_reader import FactorStore

    store = FactorStore.open(env.store)
    model = build_frod_model(env.model, store, make_supports(store, TARGETS, 0.1, 0), torch.float32)
    sigma0 = {n: m.frod_sigma.detach().clone() for n, m in frod_modules(model)}
    opt = torch.optim.AdamW(frod_param_groups(model, lr_sigma=1e-2, lr_s=1e-2))
    ids = _ids(model.config.vocab_size, seed=1)
    losses = []
    for _ in range(8):
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses
    moved = max((m.frod_sigma - sigma0[n]).abs().max().item() for n, m in frod_modules(model))
    s_max = max(m.frod_s.abs().max().item() for _, m in frod_modules(model))
    assert moved > 0.02 and s_max > 0.02, (moved, s_max)
    ckpt = save_adapter_from_model(
        model,
        env.root / "frod-adapter",
        AdapterConfig(base_model=str(env.model), factor_store=str(env.store), dtype="float32", sparsity=0.1, seed=0),
        store=store,
    )
    return ckpt, model.eval()


@pytest.fixture(scope="module")
def exported(env, trained):
    out = env.root / "to-peft"
    assert main(["--checkpoint", str(trained[0]), "--out", str(out), "--format", "peft"]) == 0
    return out


def test_peft_export_after_training_loads_with_stock_peft_and_matches(env, trained, exported):
    from peft import FrodConfig, PeftConfig

    _, frod = trained
    report = json.loads((exported / "frod_export.json").read_text())
    cfg = PeftConfig.from_pretrained(str(exported))
    assert isinstance(cfg, FrodConfig) and cfg.sparse_rate == pytest.approx(report["sparse_rate"])
    assert sorted(cfg.target_modules) == sorted(TARGETS) and cfg.regularization_alpha == pytest.approx(1e-3)
    for cat, c in report["categories"].items():
        assert c["max_update_error"] <= 1e-3, (cat, c)  # the default --peft-tol
        assert c["nnz_peft"] >= c["nnz_mapped"] >= c["nnz_frod"] > 0, (cat, c)
    base_logits, peft_logits, want = _base_peft_frod_logits(env.model, exported, frod)
    diff = (peft_logits - want).abs().max().item()
    change = (want - base_logits).abs().max().item()
    assert diff < EXPORT_TOL * change, (diff, change)


def test_peft_export_sparse_rate_gives_each_category_its_nnz(exported):
    """Every category's saved support has the nnz PEFT derives from the one sparse_rate, no duplicates, off the
    diagonal, and one S value per entry (what PeftModel.from_pretrained needs to load without a size mismatch)."""
    from frod_ds.interop.peft_export import peft_nnz

    report = json.loads((exported / "frod_export.json").read_text())
    sd = load_file(str(exported / "adapter_model.safetensors"))
    for key, idx in sd.items():
        if ".frod_s_indices." not in key:
            continue
        n = int(sd[key.replace("frod_s_indices", "frod_s_size")][0])
        flat = idx[0] * n + idx[1]
        assert idx.shape[1] == peft_nnz(n, report["sparse_rate"]), key
        assert flat.unique().numel() == flat.numel() and not (idx[0] == idx[1]).any(), key
    values = [t for k, t in sd.items() if k.endswith("frod_lambda_s_values")]
    assert values and all(v.abs().max() > 0 for v in values)


@pytest.fixture(scope="module")
def stock_peft(env):
    """A FRoD adapter made and trained (6 AdamW steps) with stock PEFT only, on the same base model."""
    from peft import FrodConfig, get_peft_model

    model = get_peft_model(
        _base(env.model), FrodConfig(target_modules=TARGETS, sparse_rate=0.05, progressbar=False, projection_prng_key=3)
    )
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = _ids(model.config.vocab_size, seed=2)
    for _ in range(6):
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    out = env.root / "stock-peft"
    model.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def imported(env, stock_peft):
    out = env.root / "from-peft"
    assert main(["--from-peft", str(stock_peft), "--base-model", str(env.model), "--out", str(out)]) == 0
    return out


def test_peft_import_loads_in_frod_ds_with_stock_peft_logits(env, stock_peft, imported):
    from frod_ds.model.adapter import load_frod_model

    report = json.loads((imported / "frod_import.json").read_text())
    assert report["max_weight_error"] < 1e-6 and report["max_reconstruction_error"] < 1e-5, report
    frod, _ = load_frod_model(imported / "adapter")
    base_logits, want, got = _base_peft_frod_logits(env.model, stock_peft, frod)
    change = (want - base_logits).abs().max().item()
    assert change > 0.5, "the PEFT training moved the model"
    assert (got - want).abs().max().item() < IMPORT_TOL * change


def test_peft_import_evaluates_like_the_peft_model(env, stock_peft, imported, tmp_path):
    """launch/eval.py on the imported adapter scores every choice as on stock PEFT's merged model."""
    from peft import PeftModel
    from transformers import AutoTokenizer

    from launch.eval import main as eval_main

    merged = PeftModel.from_pretrained(_base(env.model), str(stock_peft)).merge_and_unload()
    merged.save_pretrained(str(tmp_path / "merged"))
    AutoTokenizer.from_pretrained(str(env.model)).save_pretrained(str(tmp_path / "merged"))
    common = ["--data", str(env.data), "--tasks", "boolq,piqa", "--limit", "6"]
    assert eval_main(["--checkpoint", str(imported / "adapter"), "--output", str(tmp_path / "a"), *common]) == 0
    assert eval_main(["--model", str(tmp_path / "merged"), "--output", str(tmp_path / "b"), *common]) == 0
    rows = [[json.loads(line) for line in (tmp_path / d / "predictions.jsonl").read_text().splitlines()] for d in "ab"]
    assert len(rows[0]) == len(rows[1]) == 12
    for a, b in zip(*rows):
        assert a["id"] == b["id"] and a["scores"] == pytest.approx(b["scores"], abs=1e-4)


def test_imported_adapter_continues_training(env, imported, tmp_path):
    """``model.init_adapter``: training starts from the imported σ/S on its support and moves them."""
    adapter = imported / "adapter"
    start = load_file(str(adapter / "adapter.safetensors"))
    out = tmp_path / "run"
    res = run_train(
        CPU_ZERO3,
        env.overrides(
            out,
            **{
                "model.factor_store": imported / "factor-store",
                "model.init_adapter": adapter,
                "train.max_steps": 2,
                "train.lr_sigma": 1e-3,
                "train.lr_s": 1e-4,
                "train.warmup_ratio": 0.0,
                "train.save_every": 0,
            },
        ),
        nproc=0,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    final = load_file(str(out / "adapter-final" / "adapter.safetensors"))
    assert final.keys() == start.keys()
    store_sigma = load_file(str(next((imported / "factor-store").glob("q_proj.rank*.safetensors"))))
    for key, t in start.items():
        if key.endswith(".support"):
            assert torch.equal(final[key], t), key
            continue
        step = (final[key] - t).abs().max().item()
        assert 0 < step <= 2 * (1e-3 if key.endswith("sigma") else 1e-4) * 1.01, (key, step)  # AdamW: ≤ lr per step
    q0 = "model.layers.0.self_attn.q_proj"
    assert (start[f"{q0}.frod_sigma"] - store_sigma[f"{q0}.sigma"]).abs().max() > 1e-2, "PEFT training moved σ"
    config = json.loads((out / "adapter-final" / "adapter_config.json").read_text())
    assert config["init_adapter"] == str(adapter.resolve()) and config["sparsity"] == pytest.approx(0.05)
    # the recipe's own sparsity (not the adapter's) is said not to apply
    assert "holds S supports of density 0.05" in res.stderr and "do not apply" in res.stderr, res.stderr[-2000:]


def test_peft_files_carry_their_sha256_from_export_to_import(env, exported, tmp_path, capsys):
    """The PEFT export records the sha256 of PEFT's files; ``--from-peft`` checks them: a byte changed since (a
    still loadable file) is one error line and nothing written, the untouched export imports and its report
    records what it imported."""
    import hashlib

    digests = {n: hashlib.sha256((exported / n).read_bytes()).hexdigest() for n in PEFT_FILES}
    assert json.loads((exported / "frod_export.json").read_text())["files"] == digests
    changed = tmp_path / "changed"
    shutil.copytree(exported, changed)
    data = bytearray((changed / "adapter_model.safetensors").read_bytes())
    data[-3] ^= 0x01  # the last tensor's values: safetensors still reads it
    (changed / "adapter_model.safetensors").write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["--from-peft", str(changed), "--base-model", str(env.model), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "adapter_model.safetensors was changed after frod export" in err[0], err
    assert not (tmp_path / "x").exists()
    assert main(["--from-peft", str(exported), "--base-model", str(env.model), "--out", str(tmp_path / "y")]) == 0
    assert json.loads((tmp_path / "y" / "frod_import.json").read_text())["peft_files"] == digests


def test_init_adapter_of_another_factor_store_is_refused(env, imported):
    from frod_ds.config.recipe import load_recipe
    from frod_ds.model.store_reader import FactorStore
    from frod_ds.train.preflight import init_adapter

    recipe = load_recipe(None, env.overrides(env.root / "unused", **{"model.init_adapter": imported / "adapter"}))
    with pytest.raises(FrodError, match="belongs to factor store"):
        init_adapter(recipe, FactorStore.open(env.store))


def test_peft_interop_bad_input_is_one_line_and_leaves_nothing(
    env, trained, stock_peft, exported, imported, tmp_path, capsys
):
    from peft import LoraConfig, get_peft_model

    from tests.support.helpers_ckpt import write_tiny_llama

    def err(argv):
        capsys.readouterr()
        assert main(argv) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), lines
        return lines[0]

    lora = tmp_path / "lora"
    get_peft_model(_base(env.model), LoraConfig(target_modules=["q_proj"], r=2)).save_pretrained(str(lora))
    corrupt = tmp_path / "corrupt"
    shutil.copytree(stock_peft, corrupt)
    (corrupt / "adapter_config.json").write_text("{not json")
    other = write_tiny_llama(
        tmp_path / "other",
        seed=7,
        vocab_size=_base(env.model).config.vocab_size,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("not ours")
    imp = ["--base-model", str(env.model)]
    assert "not a FRoD one" in err(["--from-peft", str(lora), *imp, "--out", str(tmp_path / "x1")])
    assert "not a PEFT adapter directory" in err(
        ["--from-peft", str(tmp_path / "nowhere"), *imp, "--out", str(tmp_path / "x2")]
    )
    assert "corrupt" in err(["--from-peft", str(corrupt), *imp, "--out", str(tmp_path / "x3")])
    assert "another base model" in err(
        ["--from-peft", str(stock_peft), "--base-model", str(other), "--out", str(tmp_path / "x4")]
    )
    assert "not written by frod-ds" in err(["--from-peft", str(stock_peft), *imp, "--out", str(foreign), "--overwrite"])
    assert "pass --overwrite" in err(["--from-peft", str(stock_peft), *imp, "--out", str(imported)])
    ck = ["--checkpoint", str(trained[0]), "--format", "peft"]
    assert "not written by frod-ds" in err([*ck, "--out", str(foreign), "--overwrite"])
    assert "pass --overwrite" in err([*ck, "--out", str(exported)])
    assert "--peft-tol" in err([*ck, "--out", str(tmp_path / "x5"), "--peft-tol", "0"])
    assert "--format hf only" in err([*ck, "--out", str(tmp_path / "x6"), "--dtype", "bfloat16"])
    assert "--checkpoint only" in err(
        ["--from-peft", str(stock_peft), "--format", "peft", "--out", str(tmp_path / "x7")]
    )
    assert (foreign / "keep.txt").read_text() == "not ours"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corrupt", "foreign", "lora", "other"], "nothing partial"
    assert sorted(p.name for p in imported.iterdir()) == [
        ".frod-ds-output",
        "adapter",
        "factor-store",
        "frod_import.json",
    ]
