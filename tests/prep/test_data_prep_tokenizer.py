"""`--tokenizer DIR --cutoff N` end to end with a real `transformers` tokenizer saved to disk (no Hub)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from frod_ds.prep.command import main

MIRROR = Path(__file__).parents[1] / "fixtures" / "data_prep" / "mirror"


def save_whitespace_tokenizer(path: Path) -> None:
    """A word-level tokenizer: one token per whitespace-separated word, BOS prepended, EOS id 2."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "<s>": 1, "</s>": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="<s>", eos_token="</s>").save_pretrained(
        path
    )


def test_tokenizer_dir_reports_rows_over_cutoff(capsys, tmp_path):
    save_whitespace_tokenizer(tmp_path / "tok")
    out = tmp_path / "cs"
    code = main(
        [
            "build",
            "--source",
            str(MIRROR),
            "--out",
            str(out),
            "--tasks",
            "piqa",
            "--tokenizer",
            str(tmp_path / "tok"),
            "--cutoff",
            "32",
        ]
    )
    stdout = capsys.readouterr().out
    assert code == 0
    # PIQA training texts are 32 and 33 words + BOS + EOS long (counted by hand in test_data_prep_build.py)
    assert "  piqa           train max    33  p95    33  over cutoff      1 of 2" in stdout
    assert "  piqa           eval  max    32  p95    32  over cutoff      0 of 1" in stdout
    report = json.loads((out / "manifest.json").read_text())["token_lengths"]
    assert report["per_task"]["piqa"]["train"]["over_cutoff"] == 1
    code = main(["stats", "--out", str(out), "--tokenizer", str(tmp_path / "tok"), "--cutoff", "32"])
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.split()[:3] == ["train.jsonl", "piqa", "2"] and line.split()[-1] == "1" for line in lines)


def test_unloadable_tokenizer_is_a_one_line_error(capsys, tmp_path):
    code = main(
        [
            "build",
            "--source",
            str(MIRROR),
            "--out",
            str(tmp_path / "cs"),
            "--tasks",
            "piqa",
            "--tokenizer",
            str(tmp_path / "no-such-tokenizer"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert str(tmp_path / "no-such-tokenizer") in err and "no such directory" in err, err
    assert not (tmp_path / "cs").exists()


def test_a_damaged_tokenizer_file_says_to_copy_the_files_again(tmp_path):
    """A tokenizer.json that is not JSON: the file named with its parse error, then what to do about it."""
    from frod_ds.prep.tokens import load_tokenizer
    from frod_ds.runtime.errors import FrodError

    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("this is not json\n")
    with pytest.raises(FrodError) as e:
        load_tokenizer(str(tmp_path / "tok"))
    assert str(e.value).startswith(f"cannot load tokenizer '{tmp_path / 'tok'}'")
    assert f"{tmp_path / 'tok' / 'tokenizer.json'} is not valid JSON (Expecting value: line 1 column 1" in str(e.value)
    assert str(e.value).endswith("copy tokenizer.json again from where the model came from")


@pytest.mark.parametrize("value", ["big", [512], True])
def test_a_model_max_length_that_is_no_number_is_one_line(tmp_path, value):
    """tokenizer_config.json's model_max_length given as a string, a list or a boolean: transformers loads it and
    truncation fails later with a TypeError; refused where the tokenizer is loaded, naming the key. A number loads."""
    from frod_ds.prep.tokens import load_tokenizer
    from frod_ds.runtime.errors import FrodError

    save_whitespace_tokenizer(tmp_path / "tok")
    assert isinstance(load_tokenizer(str(tmp_path / "tok")).model_max_length, int)
    cfg_path = tmp_path / "tok" / "tokenizer_config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "model_max_length": value}))
    with pytest.raises(FrodError, match=re.escape(f"gives model_max_length {value!r}, not a number")):
        load_tokenizer(str(tmp_path / "tok"))
