"""Which file of a tokenizer folder made ``AutoTokenizer.from_pretrained`` fail, so that its one line names it.

Asked only after a load failed (nothing transformers accepts is refused here): each file transformers reads to build
a tokenizer, that the folder holds, is parsed as it would be (strict JSON; ``tokenizer.json`` an object with the keys
every tokenizers file has, that the tokenizers library reads; ``tokenizer.model`` a SentencePiece model when there is
no ``tokenizer.json``), and the first that is damaged is named with its parse error. ``config.json`` is named only
when it is the one that fails: parsed, then built into a config as transformers does. Otherwise the line names the
folder and transformers' error.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from frod_ds.runtime.paths import file_problem
from frod_ds.runtime.strict_json import loads

__all__ = ["TOKENIZER_JSON_FILES", "damaged_file", "load_failure", "special_tokens_problem"]

# the JSON files transformers 5 reads for a tokenizer besides config.json, in the order they are checked
TOKENIZER_JSON_FILES = ("tokenizer_config.json", "tokenizer.json", "special_tokens_map.json", "added_tokens.json")
VOCAB_JSON = "vocab.json"  # a BPE vocabulary (GPT-2 style tokenizers without tokenizer.json)
TOKENIZERS_KEYS = {"model": dict, "added_tokens": list}  # what transformers and tokenizers read from tokenizer.json
AGAIN = "again from where the model came from"


def json_problem(path: Path, keys: dict[str, type] | None = None) -> str | None:
    """Why ``path`` (present) is no JSON object with ``keys`` (name -> JSON type), starting with the path; None
    when it is one. Parse errors keep their line and column: a file cut short fails at its last line."""
    problem = file_problem(path)
    if problem:
        return problem
    data = path.read_bytes()
    if not data.strip():
        return f"{path} is empty"
    try:
        doc = loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        return f"{path} is not UTF-8 text (byte {e.start})"
    except (json.JSONDecodeError, ValueError) as e:
        return f"{path} is not valid JSON ({e})"
    if not isinstance(doc, dict):
        return f"{path} holds a JSON {type(doc).__name__}, not an object"
    missing = [k for k, kind in (keys or {}).items() if not isinstance(doc.get(k), kind)]
    if missing:
        return f"{path} has no {' and no '.join(missing)} (every {path.name} has them)"
    return None


def tokenizers_problem(path: Path) -> str | None:
    """Why the tokenizers library cannot build a tokenizer from ``path`` (a JSON object with its keys), or None:
    a model of an unknown type or a vocabulary of the wrong shape parses as JSON but fails there."""
    from tokenizers import Tokenizer

    try:
        Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - tokenizers raises a plain Exception naming the line and column
        return f"{path} is no tokenizer the tokenizers library can read ({' '.join(str(e).split())[:200]})"
    return None


ADDED_TOKENS = "added_tokens.json"  # {token: id}: transformers sorts the ids


def added_tokens_problem(path: Path) -> str | None:
    """Why ``added_tokens.json`` (an object of token → integer id) is not one, or None (also when absent or damaged
    otherwise: ``json_problem`` says that)."""
    if not path.is_file():
        return None
    try:
        doc = loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    bad = [k for k, v in doc.items() if isinstance(v, bool) or not isinstance(v, int)] if isinstance(doc, dict) else []
    if bad:
        return f"{path} gives token {bad[0]!r} the id {doc[bad[0]]!r}, not an integer"
    return None


SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


TOKEN_FLAGS = ("lstrip", "rstrip", "normalized", "single_word", "special")  # an AddedToken's, each true or false
SIDES = {"padding_side": ("left", "right"), "truncation_side": ("left", "right")}


def _token_problem(value: object, typed: bool = False) -> str | None:
    """Why ``value`` is no special token as transformers takes one (a string, null, or an object whose "content" is
    a string and whose flags are true or false; with ``typed``, as tokenizer_config.json must, an object marked
    ``"__type": "AddedToken"``), or None."""
    if value == "" or (isinstance(value, dict) and value.get("content") == ""):  # transformers recurses on it
        return f"{json.dumps(value)[:80]}, an empty token"
    if value is None or isinstance(value, str):
        return None
    if typed and isinstance(value, dict) and value.get("__type") != "AddedToken":
        return f'{json.dumps(value)[:80]}, an object without "__type": "AddedToken" (write the token as a string)'
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        bad = [k for k in TOKEN_FLAGS if k in value and not isinstance(value[k], bool)]
        return f"{json.dumps(value)[:80]}, whose {bad[0]} is not true or false" if bad else None
    return f"{json.dumps(value)[:80]}, not a string or an object with a string content"


def special_tokens_problem(path: Path) -> str | None:
    """Why the values of ``tokenizer_config.json`` or ``special_tokens_map.json`` (present, a JSON object) that
    transformers checks are not what it takes, or None: each named token, each additional one, the tokenizer class,
    the padding and truncation sides, and each entry of ``added_tokens_decoder`` (an object of id → token)."""
    try:
        doc = loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict):
        return None
    typed = path.name == "tokenizer_config.json"  # transformers builds an AddedToken there only from a marked object
    for key in SPECIAL_TOKEN_KEYS:
        if key in doc and (why := _token_problem(doc[key], typed)):
            return f"{path} gives {key} {why}"
    extra = doc.get("additional_special_tokens")
    if extra is not None and not isinstance(extra, list):
        return f"{path} gives additional_special_tokens {json.dumps(extra)[:80]}, not a list"
    for value in extra or []:
        if why := _token_problem(value, typed):
            return f"{path} lists among additional_special_tokens {why}"
    if not isinstance(doc.get("tokenizer_class", ""), str | None):
        return f"{path} gives tokenizer_class {json.dumps(doc['tokenizer_class'])[:80]}, not a class name"
    for key, allowed in SIDES.items():
        if key in doc and doc[key] not in allowed:
            return f"{path} gives {key} {json.dumps(doc[key])[:80]}, not {' or '.join(map(repr, allowed))}"
    decoder = doc.get("added_tokens_decoder")
    if decoder is not None and not isinstance(decoder, dict):
        return f"{path} gives added_tokens_decoder {json.dumps(decoder)[:80]}, not an object of id to token"
    for k, value in (decoder or {}).items():
        if not k.lstrip("-").isdigit() or not isinstance(value, dict) or _token_problem(value):
            return f"{path} gives added_tokens_decoder entry {k!r}: {json.dumps(value)[:80]}, not an id to a token"
    return None


def sentencepiece_problem(path: Path) -> str | None:
    """Why ``path`` (present) is no SentencePiece model, or None; an empty file always, its contents only where
    the sentencepiece package is installed (transformers converts the model with it)."""
    problem = file_problem(path)
    if problem or path.stat().st_size == 0:
        return problem or f"{path} is empty"
    try:
        import sentencepiece
    except ImportError:
        return None
    try:
        sentencepiece.SentencePieceProcessor(model_file=str(path))
    except Exception as e:  # noqa: BLE001 - sentencepiece raises RuntimeError/OSError on a truncated proto
        return f"{path} is not a SentencePiece model ({' '.join(str(e).split())[:200]})"
    return None


def damaged_file(folder: Path) -> tuple[Path, str] | None:
    """``(file, why)`` of the first file transformers reads for a tokenizer in ``folder`` that is damaged (not what
    its kind parses as), config.json last; None when each file present parses."""
    fast = os.path.lexists(folder / "tokenizer.json")
    for name in [*TOKENIZER_JSON_FILES, *([] if fast else [VOCAB_JSON]), "config.json"]:
        path = folder / name
        keys = TOKENIZERS_KEYS if name == "tokenizer.json" else None
        problem = json_problem(path, keys) if os.path.lexists(path) else None
        if problem:
            return path, problem
    problem = tokenizers_problem(folder / "tokenizer.json") if fast else None
    if problem:
        return folder / "tokenizer.json", problem
    problem = added_tokens_problem(folder / ADDED_TOKENS)
    if problem:
        return folder / ADDED_TOKENS, problem
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        problem = special_tokens_problem(folder / name) if (folder / name).is_file() else None
        if problem:
            return folder / name, problem
    model = folder / "tokenizer.model"  # read only when there is no tokenizer.json to build the tokenizer from
    if os.path.lexists(model) and not fast:
        problem = sentencepiece_problem(model)
        if problem:
            return model, problem
    return None


def config_failure(folder: Path) -> str | None:
    """``Type: message`` of building ``folder``'s config.json into a config as ``AutoTokenizer`` does (a known
    model type, else a plain config), or None when it builds: a value of the wrong type fails only there."""
    if not (folder / "config.json").is_file():
        return None
    from transformers import AutoConfig, PreTrainedConfig

    try:
        try:
            AutoConfig.from_pretrained(str(folder))
        except (ValueError, OSError):
            PreTrainedConfig.from_pretrained(str(folder))
    except Exception as e:  # noqa: BLE001 - whatever transformers raised while reading the tokenizer
        return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
    return None


def load_failure(name: str, folder: Path | None, exc: BaseException) -> str:
    """The one line for a tokenizer ``name`` that transformers could not load with ``exc``: the damaged file of
    ``folder`` (a local directory, else None) when one is, config.json when transformers cannot build it, else
    transformers' error and what to do."""
    head = f"cannot load tokenizer {name!r}: "
    said = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
    if folder is None:  # a Hub id: offline, not cached, no such repo
        return head + said
    damaged = damaged_file(folder)
    if damaged and damaged[0].name == "config.json":
        return f"{head}{damaged[1]}; transformers reads it with the tokenizer: copy it {AGAIN}"
    if damaged:
        return f"{head}{damaged[1]}; the file is damaged: copy {damaged[0].name} {AGAIN}"
    config = config_failure(folder)
    if config:
        config_json = folder / "config.json"
        return f"{head}{config}; check {config_json} (transformers reads it with the tokenizer) or copy it {AGAIN}"
    return f"{head}{said}; copy the tokenizer files {AGAIN}"
