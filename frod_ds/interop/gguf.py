"""A GGUF model file as a plain Hugging Face checkpoint, checked against the GGUF-loaded model (``frod convert-gguf``).

``convert_gguf`` writes ``model.safetensors`` (fp32 or bf16), ``config.json`` without the GGUF quantization entry,
``generation_config.json`` and the tokenizer files, after loading the written checkpoint back with plain
``from_pretrained`` and comparing logits on fixed prompts, token ids, decoding and the chat template. The directory
appears only when complete and checked; ``frod_convert.json`` in it records the source, its md5, the dtype and the
checks; the directory's ownership record (kind ``gguf-conversion``) lists what it wrote, and only an earlier
conversion holding nothing else is ever replaced (one from before records: recognised by ``frod_convert.json``).
The converter holds the lease on ``--out`` throughout. Nothing here downloads.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from frod_ds.formats.building import building_dir
from frod_ds.formats.lease import holding
from frod_ds.formats.ownership import check_out
from frod_ds.runtime.errors import FrodError
from frod_ds.runtime.paths import expand_home

__all__ = [
    "MARKER",
    "CHECK_TEXTS",
    "ConvertError",
    "ConversionMismatch",
    "ConvertResult",
    "convert_gguf",
    "md5_file",
]

MARKER = "frod_convert.json"
OUT_DTYPES = ("float32", "bfloat16")
CHECK_TEXTS = (
    "The capital of France is",
    "Question: Is the sky blue on a clear day?\nAnswer:",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "Ünïcödé, emoji 🙂, tabs\tand  double  spaces; numbers 3.14159 and 1,000,000.",
)
CHECK_CHAT = ({"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4."})
LOGIT_TOL = 1e-5  # fp32 forwards over identical weights; any real difference is orders above this


class ConvertError(FrodError):
    """Bad input to ``convert_gguf``; nothing was left behind."""


class ConversionMismatch(ConvertError):
    """The written checkpoint does not reproduce the GGUF model or tokenizer; nothing was left behind."""


def md5_file(path: Path) -> str:
    """The md5 of a file, hex (recorded in ``frod_convert.json``)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "md5").hexdigest()


@dataclass
class ConvertResult:
    """Where ``convert_gguf`` wrote the checkpoint, how long it took, and what its checks measured."""

    out: Path
    seconds: float
    checks: dict[str, Any]


KIND = "gguf-conversion"  # the ownership record's kind (frod_ds.formats.output_dir)


def _is_legacy_conversion(out: Path) -> bool:
    """A conversion written before outputs held records: ``frod_convert.json`` (this module's provenance file)."""
    return (out / MARKER).is_file()


def _check_utf8(out: Path) -> None:
    """``out`` must be UTF-8: a name with a byte that is not (a surrogate in ``str``) reaches the tokenizer library
    (Rust, UTF-8 paths only) as an error only after the weights are written; refused before anything is."""
    try:
        os.fsdecode(out).encode("utf-8")
    except UnicodeEncodeError:
        shown = os.fsencode(out).decode("utf-8", "backslashreplace")
        raise ConvertError(
            f"--out {shown} is not valid UTF-8: the tokenizer library cannot write there; choose a UTF-8 name"
        ) from None


def _check_out(out: Path, overwrite: bool, inputs: dict[str, Any]) -> None:
    if out.exists() and not out.is_dir():
        raise ConvertError(f"--out {out} is a file; pass a directory path that does not exist")
    check_out(out, KIND, inputs, overwrite, error=ConvertError, legacy=_is_legacy_conversion)


def _load_gguf(gguf: Path):
    """The GGUF model (fp32, dequantized) and tokenizer, through transformers' GGUF loader."""
    import torch
    from huggingface_hub.errors import StrictDataclassError  # transformers' config checks
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        import gguf as _  # noqa: F401 - transformers' GGUF loader needs it; say so plainly
    except ImportError:
        raise ConvertError(
            "the `gguf` package is not installed; pip install gguf==0.19.0 (frod-ds[test] has it)"
        ) from None
    _check_whole(gguf)
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model, loaded = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, output_loading_info=True
        )
    except BrokenPipeError:  # its progress bar's console reader went away: the command's to stop, not the file
        raise
    except (ValueError, OSError, KeyError, struct.error, StrictDataclassError) as e:  # struct: a header cut short
        raise ConvertError(
            f"transformers cannot load {gguf} as a GGUF model ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''})"
        ) from None
    missing = sorted(loaded["missing_keys"])  # left at their random initialisation: never a converted weight
    if missing:
        raise ConvertError(
            f"--gguf {gguf} holds no tensor for {len(missing)} of the model's weights (first: {missing[0]}); the file "
            "was edited or damaged, download or copy it again"
        )
    return model.eval(), tok


def _check_whole(path: Path) -> None:
    """A file that is no GGUF, or a GGUF cut short (a torn download or copy: its header and tensor table describe
    more bytes than it holds), is named as such; transformers' loader would fail on it with a numpy or struct
    error about a buffer."""
    from gguf import GGUFReader

    size = path.stat().st_size
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ConvertError(f"--gguf {path} is not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    reader = None
    try:
        reader = GGUFReader(path)
        end = max((t.data_offset + int(t.n_bytes) for t in reader.tensors), default=0)
    except (ValueError, IndexError, OverflowError, struct.error) as e:  # what reading past the end gives
        end, why = None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if end is None or end > size:
        said = f"its tensors end at byte {end}" if end is not None else f"its header and tensors do not fit ({why})"
        raise ConvertError(
            f"--gguf {path} is truncated or damaged: {size} bytes, and {said}; download or copy it again"
        )
    problem = _header_problem(reader)
    if problem:
        raise ConvertError(f"--gguf {path}: {problem}; the file was edited or damaged, download or copy it again")


def _header_problem(reader) -> str | None:
    """Where the GGUF's model header disagrees with its own tensors (a loader would build the header's model, a
    300-layer one from a 30-layer file, or fail deep in a config check), or None."""

    def meta(key: str, kind: type = int):
        field = reader.fields.get(f"{arch}.{key}")
        return kind(field.parts[field.data[0]][0]) if field is not None and field.data else None

    field = reader.fields.get("general.architecture")
    if field is None or not field.data:
        return "its header names no general.architecture"
    arch = bytes(field.parts[field.data[0]]).decode("utf-8", "replace")
    tensors = {t.name: [int(d) for d in t.shape] for t in reader.tensors}
    blocks = sorted({int(m.group(1)) for name in tensors if (m := re.match(r"blk\.(\d+)\.", name))})
    n, emb = meta("block_count"), meta("embedding_length")
    heads, kv = meta("attention.head_count"), meta("attention.head_count_kv")
    if n is not None and blocks != list(range(n)):
        return f"its header says {arch}.block_count {n}, its tensors hold {len(blocks)} layer{'s' * (len(blocks) != 1)}"
    odd = _layer_unlike_the_first(tensors, blocks)
    if odd:
        return odd
    embd = tensors.get("token_embd.weight")
    if emb is not None and embd is not None and embd[0] != emb:
        return f"its header says {arch}.embedding_length {emb}, its token_embd.weight is {embd[0]} wide"
    if heads is not None and (heads < 1 or (emb is not None and emb % heads)):
        return f"its header's {arch}.attention.head_count {heads} does not divide embedding_length {emb}"
    if kv is not None and heads is not None and (kv < 1 or heads % kv):
        return f"its header's {arch}.attention.head_count_kv {kv} does not divide head_count {heads}"
    ffn, vocab, down = meta("feed_forward_length"), meta("vocab_size"), tensors.get("blk.0.ffn_down.weight")
    if ffn is not None and down is not None and down[0] != ffn:
        return f"its header says {arch}.feed_forward_length {ffn}, its blk.0.ffn_down.weight takes {down[0]}"
    if vocab is not None and embd is not None and embd[-1] != vocab:
        return f"its header says {arch}.vocab_size {vocab}, its token_embd.weight has {embd[-1]} rows"
    for key in ("rope.freq_base", "attention.layer_norm_rms_epsilon"):
        value = meta(key, float)
        if value is not None and not (math.isfinite(value) and value > 0):
            return f"its header's {arch}.{key} is {value}, where a model needs a finite number > 0"
    return None


def _plain_model(model, dtype):
    """The same architecture without GGUF quantization state, holding ``model``'s weights (cast to ``dtype``)."""
    from frod_ds.model.skeleton import no_init_weights  # weight init skipped: every tensor is overwritten

    cfg = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        cfg.pop(key, None)
    cfg["dtype"] = str(dtype).removeprefix("torch.")
    config = type(model.config).from_dict(cfg)
    with no_init_weights():
        plain = type(model)(config)
    if getattr(config, "tie_word_embeddings", False):
        plain.tie_weights()
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    assert not unexpected and set(missing) <= tied, f"state dict mismatch: missing {missing}, unexpected {unexpected}"
    plain.generation_config = model.generation_config
    return plain.to(dtype).eval()


def _logits(model, tok, texts) -> list:
    """The logits of each text, one forward per text (fp32 on the CPU)."""
    import torch

    with torch.no_grad():
        return [model(input_ids=torch.tensor([tok(t, add_special_tokens=True)["input_ids"]])).logits[0] for t in texts]


def _check_tokenizer(ref, tok) -> dict[str, Any]:
    """The saved tokenizer against the GGUF one: ids, decoding, chat template, special tokens."""
    problems = []
    for t in CHECK_TEXTS:
        a, b = ref(t)["input_ids"], tok(t)["input_ids"]
        if a != b:
            problems.append(f"ids of {t[:30]!r} differ")
        if tok.decode(b) != ref.decode(a):
            problems.append(f"decoding of {t[:30]!r} differs")
    chat = [dict(m) for m in CHECK_CHAT]
    if (ref.chat_template is None) != (tok.chat_template is None):
        problems.append("chat template lost")
    elif ref.chat_template is not None:
        if ref.apply_chat_template(chat, tokenize=False) != tok.apply_chat_template(chat, tokenize=False):
            problems.append("chat template renders differently")
    specials = ("bos_token", "eos_token", "pad_token", "unk_token")
    for s in specials:
        if getattr(ref, s) != getattr(tok, s):
            problems.append(f"{s} {getattr(tok, s)!r}, GGUF tokenizer {getattr(ref, s)!r}")
    if len(ref) != len(tok):
        problems.append(f"vocabulary {len(tok)}, GGUF tokenizer {len(ref)}")
    return {
        "texts": len(CHECK_TEXTS),
        "chat_template": tok.chat_template is not None,
        "problems": problems,
        **{s: getattr(tok, s) for s in specials},
    }


def _check_model(gguf_model, saved_dir: Path, dtype, tok) -> dict[str, Any]:
    """Logits of the saved checkpoint (plain ``from_pretrained``, fp32 compute) against the GGUF model
    whose weights are rounded to ``dtype`` the same way (fp32: unchanged)."""
    import torch
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(str(saved_dir), dtype=torch.float32).eval()
    ref_full = _logits(gguf_model, tok, CHECK_TEXTS)
    if dtype != torch.float32:
        with torch.no_grad():
            for p in gguf_model.parameters():
                p.copy_(p.to(dtype).float())
    ref = _logits(gguf_model, tok, CHECK_TEXTS) if dtype != torch.float32 else ref_full
    got = _logits(saved, tok, CHECK_TEXTS)
    diff = max(float((a - b).abs().max()) for a, b in zip(got, ref))
    diff_full = max(float((a - b).abs().max()) for a, b in zip(got, ref_full))
    return {
        "prompts": len(CHECK_TEXTS),
        "max_abs_logit_diff": diff,
        "tol": LOGIT_TOL,
        "max_abs_logit_diff_vs_unrounded_fp32": diff_full,
    }


def _layer_unlike_the_first(tensors: dict[str, list[int]], blocks: list[int]) -> str | None:
    """A layer whose tensor names differ from layer 0's (one renamed or dropped), said before the minute-long load
    that would leave the missing weight at its random initialisation; None when every layer holds the same names."""
    held: dict[int, set[str]] = {}
    for name in tensors:
        if m := re.match(r"blk\.(\d+)\.(.+)", name):
            held.setdefault(int(m.group(1)), set()).add(m.group(2))
    first = held.get(0, set())
    for b in blocks[1:]:
        lacks, extra = sorted(first - held[b]), sorted(held[b] - first)
        if lacks or extra:
            said = [f"lacks blk.{b}.{lacks[0]}"] if lacks else []
            said += [f"holds blk.{b}.{extra[0]}"] if extra else []
            return f"its layer {b} {' and '.join(said)}, unlike layer 0"
    return None


def convert_gguf(gguf: str | Path, out: str | Path, dtype: str = "float32", overwrite: bool = False) -> ConvertResult:
    """Write a plain HF checkpoint of GGUF file ``gguf`` to ``out`` (the module docstring says what is checked).

    ``dtype``: ``float32`` or ``bfloat16`` for every weight. ``ConvertError`` on bad input,
    ``ConversionMismatch`` when a check fails; either way nothing is left under ``out``.
    """
    import torch
    import transformers

    gguf, out = expand_home(gguf), Path(out)  # an output's literal ~ is refused where it is leased, as every output's
    if dtype not in OUT_DTYPES:
        raise ConvertError(f"--dtype must be one of {', '.join(OUT_DTYPES)}, got {dtype!r}")
    _check_utf8(out)
    if not gguf.is_file():
        raise ConvertError(f"--gguf {gguf} is not a file; pass the path of a .gguf model file")
    inputs = {"--gguf": gguf}
    with holding(out, KIND, "--out", ConvertError):  # a second writer of out is refused at once
        _check_out(out, overwrite, inputs)
        t0 = time.perf_counter()
        tdtype = getattr(torch, dtype)
        gguf_model, ref_tok = _load_gguf(gguf)
        with building_dir(out, KIND, inputs, ConvertError) as tmp:
            _plain_model(gguf_model, tdtype).save_pretrained(str(tmp))
            ref_tok.save_pretrained(str(tmp))
            _tidy_tokenizer_config(tmp / "tokenizer_config.json", gguf_model.config)
            tok = transformers.AutoTokenizer.from_pretrained(str(tmp))
            checks = {
                "tokenizer": _check_tokenizer(ref_tok, tok),
                "logits": _check_model(gguf_model, tmp, tdtype, tok),
            }
            problems = list(checks["tokenizer"]["problems"])
            if not checks["logits"]["max_abs_logit_diff"] <= LOGIT_TOL:
                diff = checks["logits"]["max_abs_logit_diff"]
                problems.append(f"logits differ from the GGUF model's by {diff:.3g}")
            if problems:
                raise ConversionMismatch(f"the converted checkpoint does not match {gguf.name}: {'; '.join(problems)}")
            record = _provenance(gguf, dtype, tmp, checks, time.perf_counter() - t0)
            (tmp / MARKER).write_text(json.dumps(record, indent=1) + "\n")
    return ConvertResult(out, record["seconds"], checks)


def _provenance(gguf: Path, dtype: str, tmp: Path, checks: dict[str, Any], seconds: float) -> dict[str, Any]:
    """``frod_convert.json``: the source, its md5, the dtype, the files written and what the checks measured."""
    import torch
    import transformers

    try:
        import gguf as gguf_pkg

        gguf_version = getattr(gguf_pkg, "__version__", None) or _dist_version("gguf")
    except ImportError:
        gguf_version = None
    return {
        "format": "frod-ds-gguf-conversion",
        "source": str(gguf),
        "source_name": gguf.name,
        "source_bytes": gguf.stat().st_size,
        "source_md5": md5_file(gguf),
        "dtype": dtype,
        "files": sorted(p.name for p in tmp.iterdir()) + [MARKER],
        "checks": checks,
        "seconds": round(seconds, 2),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "gguf": gguf_version},
    }


def _tidy_tokenizer_config(path: Path, config) -> None:
    """Drop what describes the local load rather than the tokenizer (``is_local``, ``local_files_only``),
    name the class by its portable alias (transformers 4.x has no ``TokenizersBackend``) and bound
    ``model_max_length`` by the model's context instead of the "unset" 1e30."""
    cfg = json.loads(path.read_text())
    for key in ("is_local", "local_files_only"):
        cfg.pop(key, None)
    if cfg.get("tokenizer_class") == "TokenizersBackend":
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    ctx = getattr(config, "max_position_embeddings", None)
    if ctx and not cfg.get("model_max_length", 0) <= ctx:
        cfg["model_max_length"] = int(ctx)
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def _dist_version(name: str) -> str | None:
    """The installed version of distribution ``name``, None when unknown."""
    with contextlib.suppress(Exception):
        from importlib.metadata import version

        return version(name)
    return None
