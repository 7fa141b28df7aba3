"""``frod eval --model`` of a folder that is not there (one line saying so, not the Hub's words about repo ids or
connections) and of an export whose tokenizer file is damaged (one line naming that file, not config.json)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from frod_ds.cli.main import main
from tests.support.eval_fixtures import make_rows, random_llama, save_model, word_tokenizer, write_eval_dir


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, Path]:
    """A tiny saved LLaMA export (weights, config, tokenizer) and a data dir with boolq and piqa."""
    root = tmp_path_factory.mktemp("eval-model-arg")
    tok = word_tokenizer()
    return {
        "export": save_model(root / "x", random_llama(len(tok), seed=1), tok),
        "data": write_eval_dir(root / "data", {"boolq": make_rows("boolq", 3), "piqa": make_rows("piqa", 3)}),
    }


def eval_error(model: str, assets: dict[str, Path], out: Path, capsys) -> str:
    """The last stderr line of ``frod eval --model model``, which must fail with exit status 2 and write nothing."""
    argv = ["eval", "--model", model, "--data", str(assets["data"]), "--tasks", "boolq,piqa", "--output", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("error: "), err
    assert not out.exists()
    return err[-1]


@pytest.mark.parametrize("form", ["absolute", "./relative", "a/b/c", "~nouser"])
def test_a_model_folder_that_does_not_exist_is_said_so(assets, tmp_path, capsys, monkeypatch, form):
    """A path that can only be a local folder: "no such folder", never "Repo id must be in the form ..."."""
    monkeypatch.chdir(tmp_path)
    model = {"absolute": str(tmp_path / "nowhere"), "./relative": "./nowhere", "a/b/c": "exports/run/nowhere"}.get(
        form,
        "~frod-no-such-user/model",  # ~user of no user: pathlib cannot expand it
    )
    line = eval_error(model, assets, tmp_path / "out", capsys)
    assert line.startswith(f"error: --model {model}: no such folder; pass a local model directory"), line
    assert "Repo id" not in line and "huggingface.co" not in line, line


def test_a_broken_link_as_model_is_named(assets, tmp_path, capsys):
    os.symlink(tmp_path / "gone", tmp_path / "link")
    line = eval_error(str(tmp_path / "link"), assets, tmp_path / "out", capsys)
    assert line.startswith(f"error: --model {tmp_path / 'link'} is a broken symbolic link"), line


@pytest.mark.parametrize("model", ["exports/nowhere", "nowhere"])
def test_what_could_be_a_hub_id_gives_both_readings(assets, tmp_path, capsys, monkeypatch, model):
    """``org/name`` or ``name`` with no such folder: still asked of the Hub (offline in the tests), and the line says
    that there is no local folder (relative to where it was looked for) and why the Hub repo could not be had."""
    monkeypatch.chdir(tmp_path)
    line = eval_error(model, assets, tmp_path / "out", capsys)
    want = f"error: --model {model}: no local folder {model} (relative to {tmp_path}), and the Hub repo {model!r} "
    assert line.startswith(want + "could not be loaded: "), line
    assert "cannot load --model" not in line, line


def test_an_export_whose_tokenizer_json_is_cut_names_tokenizer_json(assets, tmp_path, capsys):
    export = tmp_path / "x"
    shutil.copytree(assets["export"], export)
    data = (export / "tokenizer.json").read_bytes()
    (export / "tokenizer.json").write_bytes(data[: len(data) // 2])
    line = eval_error(str(export), assets, tmp_path / "out", capsys)
    said = f"error: cannot load tokenizer '{export}': {export / 'tokenizer.json'} is not valid JSON ("
    assert line.startswith(said), line
    assert line.endswith("copy tokenizer.json again from where the model came from") and "config.json" not in line


def test_an_export_whose_tokenizer_json_is_an_empty_object_names_it(assets, tmp_path, capsys):
    export = tmp_path / "x"
    shutil.copytree(assets["export"], export)
    (export / "tokenizer.json").write_text("{}\n")
    line = eval_error(str(export), assets, tmp_path / "out", capsys)
    assert f"{export / 'tokenizer.json'} has no model and no added_tokens" in line and "config.json" not in line, line


def test_a_console_pipe_closing_while_the_model_loads_is_not_the_models_fault(assets, monkeypatch):
    """transformers' progress bar hitting a closed console pipe raises BrokenPipeError, an OSError: it is the
    command's to stop with (141), never "cannot load --model ...: Broken pipe"."""
    import torch
    import transformers

    from frod_ds.eval.model_load import load_model
    from frod_ds.eval.run import EvalConfig

    def closed(*args, **kwargs):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", closed)
    config = EvalConfig(data=str(assets["data"]), output="unused", model=str(assets["export"]))
    with pytest.raises(BrokenPipeError):
        load_model(config, torch.device("cpu"), torch.float32)


def test_a_model_under_home_is_the_folder_the_shell_would_make_of_it(assets, tmp_path, capsys, monkeypatch):
    """``--model "~/x"`` (quoted: no shell expanded it) scores the export in $HOME/x, as the expanded path does;
    ``--model "~"`` of a home holding no model is one line naming what it lacks, not a repo-id complaint."""
    home = tmp_path / "home"
    shutil.copytree(assets["export"], home / "x")
    monkeypatch.setenv("HOME", str(home))
    argv = ["eval", "--data", str(assets["data"]), "--tasks", "boolq,piqa"]
    assert main([*argv, "--model", "~/x", "--output", str(tmp_path / "a")]) == 0
    assert main([*argv, "--model", str(home / "x"), "--output", str(tmp_path / "b")]) == 0
    scored = [(tmp_path / o / "results.json").read_text() for o in ("a", "b")]
    assert json.loads(scored[0])["tasks"] == json.loads(scored[1])["tasks"]
    capsys.readouterr()
    line = eval_error("~", assets, tmp_path / "c", capsys)
    assert "Repo id" not in line and str(home) in line and "config.json" in line, line
