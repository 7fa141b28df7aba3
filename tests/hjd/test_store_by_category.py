"""A factor store built one category per ``launch/hjd.py`` run (``--categories``), each run seeing only that
category's weights (the 70B chain on a machine that never holds the whole checkpoint): the result equals a store
built in one run from the full checkpoint, runs of another configuration or model are refused with one line, an
incomplete store is refused by training, and a checkpoint without the targeted weights is accepted exactly when
its other tensors are the base model's (in-process, one rank, CPU)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from frod_ds.io.hf_checkpoint import HFCheckpoint
from frod_ds.model.store_reader import FactorStore, check_store_matches
from frod_ds.runtime.errors import StoreError
from launch.hjd import main
from tests.support.helpers_ckpt import strip_checkpoint, write_tiny_llama

TARGETS = ["q_proj", "k_proj", "up_proj"]
T = ["--targets", ",".join(TARGETS), "--device", "cpu", "--no-fsync"]


def _error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
    return lines[0]


def _only(model, root, category: str):
    """The checkpoint as the chain has it while ``category`` is decomposed: untargeted tensors + its weights."""
    dst = root / f"only-{category}"
    return dst if dst.is_dir() else strip_checkpoint(model, dst, [t for t in TARGETS if t != category])


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A one-run store of the full checkpoint, and the same store built category by category."""
    root = tmp_path_factory.mktemp("bycat")
    model = write_tiny_llama(root / "model")
    assert main(["--model", str(model), "--out", str(root / "one"), *T]) == 0
    parts = root / "parts"
    states = []
    for c in TARGETS:
        assert main(["--model", str(_only(model, root, c)), "--out", str(parts), "--categories", c, *T]) == 0
        states.append(json.loads((parts / "manifest.json").read_text()))
    return root, model, parts, states


def _tensors(store_dir) -> dict[str, torch.Tensor]:
    out = {}
    for f in store_dir.glob("*.safetensors"):
        out.update(load_file(str(f)))
    return out


def test_store_built_category_by_category_equals_one_run(built):
    root, model, parts, states = built
    assert [s["completed_categories"] for s in states] == [TARGETS[:1], TARGETS[:2], TARGETS]
    assert [s["complete"] for s in states] == [False, False, True]
    one, by_cat = FactorStore.open(root / "one"), FactorStore.open(parts)
    assert by_cat.fingerprint == one.fingerprint, "same fingerprint as the full checkpoint's targeted weights"
    assert by_cat.manifest.base_fingerprint == one.manifest.base_fingerprint is not None
    assert by_cat.categories == one.categories and list(by_cat.categories) == TARGETS
    a, b = _tensors(root / "one"), _tensors(parts)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    check_store_matches(by_cat, HFCheckpoint(model))  # the full checkpoint
    check_store_matches(by_cat, HFCheckpoint(strip_checkpoint(model, root / "stripped", TARGETS)))


def test_incomplete_store_is_refused_with_the_categories_to_add(built, tmp_path, capsys):
    root, model, _, _ = built
    part = tmp_path / "part"
    assert (
        main(["--model", str(_only(model, tmp_path, "k_proj")), "--out", str(part), "--categories", "k_proj", *T]) == 0
    )
    out = capsys.readouterr().out
    assert "complete: False (missing q_proj, up_proj: add them with --categories q_proj,up_proj)" in out
    with pytest.raises(
        StoreError,
        match=r"incomplete \(done: \['k_proj'\], missing: \['q_proj', 'up_proj'\]\); "
        r"finish it with frod hjd --out .* --categories q_proj,up_proj",
    ):
        FactorStore.open(part)


def test_training_refuses_an_incomplete_store_in_one_line(built, tmp_path, capsys):
    root, model, _, _ = built
    from launch import train as train_cli
    from tests.support.train_env import CPU_ZERO2

    part = tmp_path / "part"
    assert (
        main(["--model", str(_only(model, tmp_path, "q_proj")), "--out", str(part), "--categories", "q_proj", *T]) == 0
    )
    data = tmp_path / "train.jsonl"
    data.write_text(
        json.dumps(
            {"task": "boolq", "id": "0", "prompt": "p", "answer": "true", "choices": ["true", "false"], "label": 0}
        )
        + "\n"
    )
    capsys.readouterr()
    code = train_cli.main(
        [
            "--config",
            str(CPU_ZERO2),
            f"model.base={model}",
            f"model.factor_store={part}",
            f"data.train={data}",
            f"output_dir={tmp_path / 'run'}",
            "model.dtype=float32",
            "model.targets=[q_proj,k_proj,up_proj]",
        ]
    )
    line = _error(capsys)
    assert code == 2 and "is incomplete" in line and "--categories k_proj,up_proj" in line
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_rerunning_a_done_category_changes_nothing(built, capsys):
    root, model, parts, _ = built
    before = {p.name: p.read_bytes() for p in parts.glob("*.safetensors")}
    assert main(["--model", str(_only(model, root, "k_proj")), "--out", str(parts), "--categories", "k_proj", *T]) == 0
    assert "already holds every category asked for, complete: nothing to do" in capsys.readouterr().out
    assert {p.name: p.read_bytes() for p in parts.glob("*.safetensors")} == before
    assert FactorStore.open(parts).complete


@pytest.mark.parametrize(
    "case", ["pi", "quant", "dtype", "u_dtype", "other_model", "other_weight", "not_a_target", "targets"]
)
def test_adding_to_a_store_of_another_configuration_or_model_is_refused(built, tmp_path, capsys, case):
    """After q_proj is in: adding k_proj with another π, quantization, HJD dtype, U dtype, from another model (its
    untargeted tensors differ) or re-adding q_proj with another q weight is one line, and the store is untouched."""
    root, model, _, _ = built
    store = tmp_path / "store"
    assert (
        main(["--model", str(_only(model, tmp_path, "q_proj")), "--out", str(store), "--categories", "q_proj", *T]) == 0
    )
    snapshot = {p.name: p.read_bytes() for p in store.iterdir()}
    k_only = _only(model, tmp_path, "k_proj")
    argv = ["--model", str(k_only), "--out", str(store), "--categories", "k_proj", *T]
    needle = {
        "pi": "pi: 0.001 there, 0.01 now",
        "quant": "u_quant: None there",
        "dtype": "hjd_dtype: 'float32' there",
        "u_dtype": "u_dtype: 'auto' there, 'bfloat16' now",
        "other_model": "another model's weights: the untargeted tensors differ",
        "other_weight": "another model's weights: q_proj differ",
        "not_a_target": "must be a non-empty subset of --targets",
        "targets": "targets: [",
    }[case]
    if case == "pi":
        argv += ["--pi", "0.01"]
    elif case == "quant":
        argv += ["--quant", "nf4"]
    elif case == "dtype":
        argv += ["--dtype", "float64"]
    elif case == "u_dtype":
        argv += ["--u-dtype", "bfloat16"]
    elif case == "other_model":
        argv[1] = str(_only(write_tiny_llama(tmp_path / "other", seed=3), tmp_path / "o", "k_proj"))
    elif case == "other_weight":
        q0 = "model.layers.0.self_attn.q_proj.weight"
        W = HFCheckpoint(model).get(q0)
        changed = strip_checkpoint(model, tmp_path / "changed", ["k_proj", "up_proj"], {q0: W.flip(0).contiguous()})
        argv = ["--model", str(changed), "--out", str(store), "--categories", "q_proj", *T]
    elif case == "not_a_target":
        argv[argv.index("--categories") + 1] = "gate_proj"
    elif case == "targets":
        argv[argv.index("--targets") + 1] = "q_proj,k_proj"
    capsys.readouterr()
    assert main(argv) == 2
    assert needle in _error(capsys)
    assert {p.name: p.read_bytes() for p in store.iterdir()} == snapshot, "the store is untouched"


def test_checkpoint_without_targeted_weights_is_checked_by_its_other_tensors(built, tmp_path):
    root, model, parts, _ = built
    store = FactorStore.open(parts)
    check_store_matches(store, HFCheckpoint(strip_checkpoint(model, tmp_path / "none", TARGETS)))
    check_store_matches(store, HFCheckpoint(strip_checkpoint(model, tmp_path / "some", ["q_proj"])))
    other = write_tiny_llama(tmp_path / "other", seed=3)
    with pytest.raises(StoreError, match="lacks the targeted weights, has other untargeted tensors"):
        check_store_matches(store, HFCheckpoint(strip_checkpoint(other, tmp_path / "other-stripped", TARGETS)))
    up1 = "model.layers.1.mlp.up_proj.weight"
    changed = strip_checkpoint(model, tmp_path / "changed", ["q_proj"], {up1: torch.zeros(48, 32)})
    with pytest.raises(StoreError, match=f"{up1} in .* is another weight than the one decomposed"):
        check_store_matches(store, HFCheckpoint(changed))
    with pytest.raises(StoreError, match=r"\(fingerprint [0-9a-f]{16}…\) but .* has fingerprint"):
        check_store_matches(store, HFCheckpoint(other))  # every targeted weight there: the old check
    old = json.loads((parts / "manifest.json").read_text())
    old.pop("base_fingerprint")
    older = tmp_path / "older"
    older.mkdir()
    for f in parts.iterdir():
        (older / f.name).write_bytes(f.read_bytes())
    (older / "manifest.json").write_text(json.dumps(old))
    with pytest.raises(StoreError, match="records no fingerprint of the other weights"):
        check_store_matches(FactorStore.open(older), HFCheckpoint(tmp_path / "none"))


@pytest.mark.slow
def test_training_without_targeted_weights_equals_training_from_the_full_checkpoint(tmp_path):
    """2-rank ZeRO-3 on CPU: the checkpoint with every targeted weight deleted (U lives in the store) trains the same
    losses and adapter bit for bit as the full one; rerunning the full run's command on it is the same run (nothing
    redone); exporting the adapter over it gives the full checkpoint's merged model."""
    from frod_ds.interop.hf_export import export_transformers
    from tests.support.train_env import CPU_ZERO3, build_env, metrics, run_train

    six = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"]
    env = build_env(tmp_path / "env")
    stripped = strip_checkpoint(env.model, tmp_path / "stripped", six)
    assert not [k for k in HFCheckpoint(stripped).keys() if k.endswith(tuple(f"{c}.weight" for c in six))]
    steps = {"train.max_steps": 3, "train.save_every": 3, "train.schedule": "constant", "train.warmup_ratio": 0.0}
    runs = {}
    for name, base in (("full", env.model), ("stripped", stripped)):
        res = run_train(CPU_ZERO3, env.overrides(tmp_path / f"run-{name}", **steps, **{"model.base": base}))
        assert res.returncode == 0, res.stderr[-3000:]  # (output_dir beside, never inside, the checkpoint)
        runs[name] = metrics(tmp_path / f"run-{name}")
    assert [r["loss"] for r in runs["full"]] == [r["loss"] for r in runs["stripped"]]
    assert [r["grad_norm"] for r in runs["full"]] == [r["grad_norm"] for r in runs["stripped"]]
    a = load_file(str(tmp_path / "run-full" / "adapter-final" / "adapter.safetensors"))
    b = load_file(str(tmp_path / "run-stripped" / "adapter-final" / "adapter.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    before = (tmp_path / "run-full" / "metrics.jsonl").read_text()
    res = run_train(CPU_ZERO3, env.overrides(tmp_path / "run-full", **steps, **{"model.base": stripped}))
    assert res.returncode == 0 and "another run" not in res.stderr, res.stderr[-3000:]
    assert (tmp_path / "run-full" / "metrics.jsonl").read_text() == before, "a finished run: nothing redone"

    merged = {}
    for name, base in (("full", env.model), ("stripped", stripped)):
        out = export_transformers(
            tmp_path / "run-full" / "adapter-final", tmp_path / f"export-{name}", base_model=str(base)
        )
        merged[name] = {}
        for f in out.glob("*.safetensors"):
            merged[name].update(load_file(str(f)))
    assert merged["full"].keys() == merged["stripped"].keys()
    assert all(torch.equal(merged["full"][k], merged["stripped"][k]) for k in merged["full"])
    assert merged["full"]["model.layers.0.self_attn.q_proj.weight"].dtype == HFCheckpoint(env.model).dtype(
        "model.layers.0.self_attn.q_proj.weight"
    )
