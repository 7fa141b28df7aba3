"""A tokenizer folder with one damaged file: the one line of ``load_tokenizer`` (every command that loads a
tokenizer: data build, train, eval) names the damaged file with its parse error, and config.json only when it is
the one that fails."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from frod_ds.prep.command import main
from frod_ds.prep.tokens import load_tokenizer
from frod_ds.runtime.errors import FrodError
from tests.support.eval_fixtures import llama_config, word_tokenizer

MIRROR = Path(__file__).parents[1] / "fixtures" / "data_prep" / "mirror"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A model folder's tokenizer side: tokenizer.json, tokenizer_config.json and a LLaMA config.json."""
    root = tmp_path_factory.mktemp("tok") / "m"
    word_tokenizer().save_pretrained(root)
    llama_config(40).save_pretrained(root)
    return root


def halve(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def set_key(path: Path, key: str, value: object) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), key: value}))


DAMAGES: dict[str, tuple[str, Callable[[Path], None], str]] = {
    "tokenizer.json cut in half": ("tokenizer.json", halve, "is not valid JSON (Expecting"),
    "tokenizer_config.json cut in half": ("tokenizer_config.json", halve, "is not valid JSON ("),
    "tokenizer.json replaced by {}": (
        "tokenizer.json",
        lambda p: p.write_text("{}\n"),
        "has no model and no added_tokens (every tokenizer.json has them)",
    ),
    "tokenizer.json a JSON list": ("tokenizer.json", lambda p: p.write_text("[]\n"), "holds a JSON list, not an"),
    "tokenizer_config.json a JSON list": (
        "tokenizer_config.json",
        lambda p: p.write_text("[]\n"),
        "holds a JSON list, not an object",
    ),
    "tokenizer.json empty": ("tokenizer.json", lambda p: p.write_text(""), "is empty"),
    "tokenizer.json of an unknown model type": (
        "tokenizer.json",
        lambda p: set_key(p, "model", {"type": "Nope"}),
        "is no tokenizer the tokenizers library can read (",
    ),
    "special_tokens_map.json cut short": (
        "special_tokens_map.json",
        lambda p: p.write_text('{"bos_token": '),
        "is not valid JSON (Expecting value: line 1 column 15",
    ),
    "added_tokens.json with an id that is a string": (
        "added_tokens.json",
        lambda p: p.write_text('{"<x>": "7"}\n'),
        "gives token '<x>' the id '7', not an integer",
    ),
    "special_tokens_map.json with an eos_token that is a number": (
        "special_tokens_map.json",
        lambda p: p.write_text('{"eos_token": 5}\n'),
        "gives eos_token 5, not a string or an object with a string content",
    ),
    "tokenizer_config.json with a pad_token whose content is a number": (
        "tokenizer_config.json",
        lambda p: set_key(p, "pad_token", {"__type": "AddedToken", "content": 5}),
        'gives pad_token {"__type": "AddedToken", "content": 5}, not a string or an object with a string content',
    ),
    "tokenizer_config.json with a pad_token object not marked AddedToken": (
        "tokenizer_config.json",
        lambda p: set_key(p, "pad_token", {"content": "<pad>"}),
        'gives pad_token {"content": "<pad>"}, an object without "__type": "AddedToken" (write the token as a string)',
    ),
    "tokenizer_config.json with an additional special token object not marked AddedToken": (
        "tokenizer_config.json",
        lambda p: set_key(p, "additional_special_tokens", [{"content": "<x1>"}]),
        'lists among additional_special_tokens {"content": "<x1>"}, an object without "__type": "AddedToken"',
    ),
    "special_tokens_map.json with an eos_token whose lstrip is a string": (
        "special_tokens_map.json",
        lambda p: p.write_text('{"eos_token": {"content": "</s>", "lstrip": "yes"}}\n'),
        'gives eos_token {"content": "</s>", "lstrip": "yes"}, whose lstrip is not true or false',
    ),
    "tokenizer_config.json with a tokenizer_class that is a number": (
        "tokenizer_config.json",
        lambda p: set_key(p, "tokenizer_class", 5),
        "gives tokenizer_class 5, not a class name",
    ),
    "tokenizer_config.json with padding_side middle": (
        "tokenizer_config.json",
        lambda p: set_key(p, "padding_side", "middle"),
        """gives padding_side "middle", not 'left' or 'right'""",
    ),
    "tokenizer_config.json with an empty unk_token": (
        "tokenizer_config.json",
        lambda p: set_key(p, "unk_token", ""),
        'gives unk_token "", an empty token',
    ),
    "tokenizer_config.json with added_tokens_decoder a list": (
        "tokenizer_config.json",
        lambda p: set_key(p, "added_tokens_decoder", []),
        "gives added_tokens_decoder [], not an object of id to token",
    ),
}


@pytest.mark.parametrize("case", list(DAMAGES))
def test_the_damaged_tokenizer_file_is_named_not_config_json(model_dir, tmp_path, case):
    name, damage, said = DAMAGES[case]
    folder = tmp_path / "m"
    shutil.copytree(model_dir, folder)
    damage(folder / name)
    with pytest.raises(FrodError) as e:
        load_tokenizer(str(folder))
    line = str(e.value)
    assert line.startswith(f"cannot load tokenizer '{folder}': {folder / name} {said}"), line
    assert line.endswith(f"copy {name} again from where the model came from"), line
    assert "config.json" not in line.replace("tokenizer_config.json", ""), line
    assert "\n" not in line


def test_a_damaged_config_json_is_named(model_dir, tmp_path):
    """config.json cut in half (transformers reads it with the tokenizer): config.json is the file named."""
    folder = tmp_path / "m"
    shutil.copytree(model_dir, folder)
    halve(folder / "config.json")
    with pytest.raises(FrodError) as e:
        load_tokenizer(str(folder))
    line = str(e.value)
    assert line.startswith(f"cannot load tokenizer '{folder}': {folder / 'config.json'} is not valid JSON ("), line
    assert "transformers reads it with the tokenizer" in line and "tokenizer.json" not in line, line


def test_a_config_value_transformers_refuses_names_config_json(model_dir, tmp_path):
    """config.json that parses but that transformers cannot build (attention_bias the string "false")."""
    folder = tmp_path / "m"
    shutil.copytree(model_dir, folder)
    set_key(folder / "config.json", "attention_bias", "false")
    with pytest.raises(FrodError) as e:
        load_tokenizer(str(folder))
    line = str(e.value)
    assert "attention_bias" in line and f"check {folder / 'config.json'} (transformers reads it" in line, line


def test_a_truncated_sentencepiece_model_is_named(tmp_path):
    """No tokenizer.json, a tokenizer.model that is no SentencePiece model: tokenizer.model is named."""
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    (folder / "tokenizer.model").write_bytes(b"\x0a\x0b\x0a\x05hello")
    with pytest.raises(FrodError) as e:
        load_tokenizer(str(folder))
    line = str(e.value)
    said = f"cannot load tokenizer '{folder}': {folder / 'tokenizer.model'} is not a SentencePiece model ("
    assert line.startswith(said), line
    assert line.endswith("copy tokenizer.model again from where the model came from"), line


def test_data_build_names_the_cut_tokenizer_json(model_dir, tmp_path, capsys):
    """The command line: ``frod data build --tokenizer`` of a folder whose tokenizer.json is cut in half."""
    folder = tmp_path / "m"
    shutil.copytree(model_dir, folder)
    halve(folder / "tokenizer.json")
    argv = ["build", "--source", str(MIRROR), "--out", str(tmp_path / "cs"), "--tasks", "piqa"]
    assert main([*argv, "--tokenizer", str(folder), "--cutoff", "32"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: cannot load tokenizer"), err
    assert f"{folder / 'tokenizer.json'} is not valid JSON (" in err and "config.json" not in err, err
    assert not (tmp_path / "cs").exists()


@pytest.mark.parametrize("kind", ["folder", "broken link"])
def test_a_vocabulary_file_that_is_no_file_is_named(tmp_path, kind):
    """tokenizer.json a folder or a link to nothing: named as such, not "no vocabulary" beside it."""
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer_config.json").write_text("{}\n")
    if kind == "folder":
        (folder / "tokenizer.json").mkdir()
    else:
        (folder / "tokenizer.json").symlink_to(tmp_path / "gone.json")
    with pytest.raises(FrodError) as e:
        load_tokenizer(str(folder))
    said = "is a directory, not a file" if kind == "folder" else "is a broken symbolic link"
    assert f"{folder / 'tokenizer.json'} {said}" in str(e.value) and "no vocabulary" not in str(e.value), e.value


def test_a_tokenizer_under_home_is_read_from_the_folder_not_asked_of_the_hub(model_dir, tmp_path, monkeypatch):
    """``~/tk`` (quoted, so no shell expanded it) is the folder the shell would make of it."""
    monkeypatch.setenv("HOME", str(tmp_path))
    shutil.copytree(model_dir, tmp_path / "tk")
    assert load_tokenizer("~/tk").get_vocab() == load_tokenizer(str(tmp_path / "tk")).get_vocab()
