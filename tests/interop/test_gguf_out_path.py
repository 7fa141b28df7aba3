"""``frod convert-gguf`` with an ``--out`` name that is not UTF-8 (a byte such as 0xff, which Python holds as a
surrogate): the tokenizer library (Rust) cannot write there, so the command refuses it in one line before anything
is written, instead of failing with a traceback after the weights are."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from frod_ds.interop.gguf import ConvertError, convert_gguf
from tests.support.leftovers import REPO, clean_env
from tests.support.realmodel import RealModelUnavailable, locate_gguf

BAD_NAME = b"out-\xff"


def _convert(gguf: Path, out: bytes) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "frod_ds", "convert-gguf", "convert", "--gguf", str(gguf), "--out", out]
    return subprocess.run(argv, cwd=REPO, capture_output=True, timeout=120, env=clean_env())


def _check_refused(result: subprocess.CompletedProcess, tmp_path: Path, gguf: Path) -> None:
    err = result.stderr.decode("utf-8", "backslashreplace")
    lines = [line for line in err.splitlines() if line.strip()]
    assert result.returncode == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("error: --out ") and "out-\\xff is not valid UTF-8" in lines[0], lines
    assert "choose a UTF-8 name" in lines[0]
    assert [p for p in os.listdir(os.fsencode(tmp_path)) if p != os.fsencode(gguf.name)] == [], "nothing written"


def test_a_non_utf8_out_is_refused_before_anything_is_written(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    _check_refused(_convert(gguf, os.fsencode(tmp_path) + b"/" + BAD_NAME), tmp_path, gguf)


def test_a_non_utf8_out_is_refused_by_the_library_call(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    out = tmp_path / os.fsdecode(BAD_NAME) / "model"
    with pytest.raises(ConvertError, match=r"is not valid UTF-8: the tokenizer library cannot write there"):
        convert_gguf(gguf, out)
    assert sorted(os.listdir(os.fsencode(tmp_path))) == [b"m.gguf"]


def test_a_non_utf8_out_with_the_real_model_is_one_line(tmp_path):
    """With the real SmolLM2 GGUF (where the conversion would otherwise write the weights, then fail)."""
    try:
        real = locate_gguf(download=False)
    except RealModelUnavailable as e:
        pytest.skip(str(e))
    gguf = tmp_path / real.name
    os.symlink(real, gguf)
    _check_refused(_convert(gguf, os.fsencode(tmp_path) + b"/" + BAD_NAME), tmp_path, gguf)
