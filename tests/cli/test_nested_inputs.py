"""Inputs nested deeper than Python's recursive JSON and YAML readers follow (a data row, an LLM-Adapters file, a
DeepSpeed JSON, a model's config.json, a recipe): one ``error:`` line naming the file and the nesting, exit 2,
nothing written; not a ``RecursionError`` traceback."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from frod_ds.cli.main import main as frod
from tests.support.leftovers import REPO

FIXTURES = REPO / "tests" / "fixtures" / "data_prep"
DEEP_JSON = "[" * 100_000 + "]" * 100_000
LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 128,
    "max_position_embeddings": 64,
    "torch_dtype": "float32",
}


def one_error(capsys, code: int) -> str:
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


def _with_deep_value(text: str) -> str:
    """A JSON object's text with one more key whose value is ``DEEP_JSON``."""
    return text.rstrip().rstrip("}") + ', "x": ' + DEEP_JSON + "}"


def test_data_build_names_the_row_nested_too_deep(tmp_path, capsys):
    mirror = tmp_path / "mirror"
    shutil.copytree(FIXTURES / "mirror", mirror)
    train = next((mirror / "boolq").glob("train*"))
    with open(train, "a") as f:
        f.write(DEEP_JSON + "\n")
    line = one_error(
        capsys, frod(["data", "build", "--source", str(mirror), "--tasks", "boolq", "--out", str(tmp_path / "d")])
    )
    assert str(train) in line and "nested 100000 deep" in line, line
    assert not (tmp_path / "d").exists()


def test_data_build_names_an_llm_adapters_file_nested_too_deep(tmp_path, capsys):
    (tmp_path / "c170.json").write_text(DEEP_JSON)
    out = tmp_path / "d"
    argv = [
        "data",
        "build",
        "--source",
        f"llm-adapters:{tmp_path / 'c170.json'}",
        "--tasks",
        "boolq",
        "--out",
        str(out),
    ]
    line = one_error(capsys, frod(argv))
    assert "c170.json" in line and "nested 100000 deep" in line, line
    assert not out.exists()


@pytest.fixture
def model(tmp_path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA))
    return folder


def test_plan_names_a_deepspeed_json_nested_too_deep(tmp_path, model, capsys):
    ds = tmp_path / "ds.json"
    ds.write_text(_with_deep_value((REPO / "ds_configs" / "zero2.json").read_text()))
    line = one_error(capsys, frod(["plan", "--model", str(model), "--gpus", "1", "--config", str(ds)]))
    assert "ds.json" in line and "nested 100001 deep" in line, line


def test_plan_names_a_config_json_nested_too_deep(model, capsys):
    (model / "config.json").write_text(_with_deep_value(json.dumps(LLAMA)))
    line = one_error(capsys, frod(["plan", "--model", str(model), "--gpus", "1"]))
    assert "config.json" in line and "nested 100001 deep" in line, line


def test_plan_names_a_recipe_nested_too_deep(tmp_path, model, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("train:\n  lr_sigma: " + "[" * 10_000 + "]" * 10_000 + "\n")
    line = one_error(capsys, frod(["plan", "--model", str(model), "--gpus", "1", "--recipe", str(recipe)]))
    assert "r.yaml" in line and "nests lists or mappings more than 100 deep" in line, line


def test_plan_names_a_deepspeed_json_nested_deeper_than_any_input_needs(tmp_path, model, capsys):
    """900 levels: Python's JSON reader follows them, the config's checks (recursive walks) would not."""
    ds = tmp_path / "ds.json"
    ds.write_text(
        (REPO / "ds_configs" / "zero2.json").read_text().rstrip().rstrip("}") + ', "x": ' + "[" * 900 + "]" * 900 + "}"
    )
    line = one_error(capsys, frod(["plan", "--model", str(model), "--gpus", "1", "--config", str(ds)]))
    assert "ds.json" in line and "nested 901 deep, more than the 100 levels" in line, line
