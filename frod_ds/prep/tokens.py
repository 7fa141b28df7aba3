"""Token-length checks of rendered rows against a training cutoff.

A row's length is the length of its training text ``prompt + separator + answer`` (`frod_ds.prep.rows.training_text`)
encoded with the tokenizer's special tokens (BOS for LLaMA), plus one for the EOS the training collator
appends (not added twice if the tokenizer already ends the sequence with EOS).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm


def load_tokenizer(name: str) -> Any:
    """`transformers.AutoTokenizer.from_pretrained(name)` (a Hub id or a local directory); what cannot be loaded is
    one line naming it (``FrodError``): every command that loads a tokenizer (data build, training, eval, the
    adapter loader) comes here."""
    from frod_ds.runtime.errors import FrodError
    from frod_ds.runtime.paths import expand_home, file_problem

    path = expand_home(name)
    if not path.is_dir() and (path.exists() or name.startswith((".", "/", "~")) or name.count("/") > 1):
        what = "is a file, not a directory" if path.exists() else "no such directory"
        raise FrodError(
            f"tokenizer {name}: {what}; pass the directory holding the tokenizer files (by default "
            "the model's) or a Hugging Face Hub id"
        )
    vocab = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "vocab.txt")
    odd = [file_problem(path / f) for f in vocab if os.path.lexists(path / f) and not (path / f).is_file()]
    if path.is_dir() and odd:  # a folder, a broken link, a pipe where a vocabulary belongs
        raise FrodError(f"tokenizer {name}: {odd[0]}; copy the tokenizer files again from where the model came from")
    if path.is_dir() and not any((path / f).is_file() for f in vocab):  # transformers says only what it could not build
        if (path / "tokenizer_config.json").is_file():  # transformers would build some tokenizer without a vocabulary
            raise FrodError(
                f"tokenizer {name}: the directory holds tokenizer_config.json but no vocabulary ({', '.join(vocab[:3])}"
                "); copy the tokenizer files again from where the model came from"
            )
        raise FrodError(
            f"tokenizer {name}: the directory holds no tokenizer files (tokenizer.json, tokenizer.model, "
            "tokenizer_config.json); pass the directory that does (model.tokenizer in a recipe, --tokenizer for eval)"
        )
    from frod_ds.prep.tokenizer_files import AGAIN, special_tokens_problem

    for config in ("tokenizer_config.json", "special_tokens_map.json") if path.is_dir() else ():
        problem = special_tokens_problem(path / config) if (path / config).is_file() else None
        if problem:  # some of these load and fail later, deep in transformers (an empty token recurses)
            raise FrodError(f"cannot load tokenizer {name!r}: {problem}; the file is damaged: copy {config} {AGAIN}")
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path) if path.is_dir() else name)  # ~ is a folder, not a Hub id
    except Exception as exc:  # offline, missing files, unknown id, a damaged file: one line naming the file
        from frod_ds.prep.tokenizer_files import load_failure

        raise FrodError(load_failure(name, path if path.is_dir() else None, exc)) from None
    longest = getattr(tokenizer, "model_max_length", None)  # truncation compares lengths with it
    if longest is not None and (isinstance(longest, bool) or not isinstance(longest, (int, float))):
        raise FrodError(
            f"tokenizer {name}: tokenizer_config.json gives model_max_length {longest!r}, not a number; set it to the "
            "model's context length (an integer) or remove it"
        )
    return tokenizer


def token_past(tokenizer: Any, rows: int) -> str | None:
    """Which special or added token of ``tokenizer`` has an id past an embedding of ``rows`` rows, said with the file
    that names it: a special token the vocabulary lacks is added by transformers as a new id, so a value in
    tokenizer_config.json, not the tokenizer as a whole, is what to mend. None when every such id has a row."""
    specials = getattr(tokenizer, "special_tokens_map", {}) or {}
    named = [(k, t) for k, v in specials.items() for t in (v if isinstance(v, list) else [v]) if isinstance(t, str)]
    added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
    named += [("added token", t) for t in added]
    folder = Path(str(getattr(tokenizer, "name_or_path", "") or "."))
    for key, token in named:
        tid = tokenizer.convert_tokens_to_ids(token)
        if isinstance(tid, int) and tid >= rows:
            where = _naming_file(folder, key, token)
            mend = f"set {key} to a token of the vocabulary" if key != "added token" else "remove it"
            return (
                f"{where} gives {key} {token!r}, a token the vocabulary lacks: transformers adds it as id {tid}, past "
                f"the model's {rows} embedding rows; {mend}"
            )
    return None


def _naming_file(folder: Path, key: str, token: str) -> str:
    """The tokenizer file of ``folder`` that names ``token`` (as ``key``, or among the added tokens)."""
    import json

    files = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "tokenizer.json")
    for name in files:
        try:
            doc = json.loads((folder / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        values = [doc.get(key)] if isinstance(doc, dict) and key != "added token" else []
        if isinstance(doc, dict) and name == "added_tokens.json":
            values = list(doc)
        elif isinstance(doc, dict) and name == "tokenizer.json":
            values = [t.get("content") for t in doc.get("added_tokens") or () if isinstance(t, dict)]
        elif isinstance(doc, dict) and isinstance(doc.get("added_tokens_decoder"), dict):
            values += [t.get("content") for t in doc["added_tokens_decoder"].values() if isinstance(t, dict)]
        values = [v.get("content") if isinstance(v, dict) else v for v in values]
        if token in values or any(isinstance(v, list) and token in v for v in values):
            return str(folder / name)
    return f"the tokenizer {folder}"


def tokenizer_sha256(tokenizer: Any) -> str:
    """sha256 of what decides the ids a tokenizer gives: its vocabulary (added tokens included) and its BOS, EOS and
    unknown tokens (not the pad token, which training sets where none is). Another tokenizer of the same size gives
    another digest; the same files loaded anywhere, the same."""
    import hashlib
    import json

    doc = {
        "vocab": sorted(tokenizer.get_vocab().items()),
        "special": [getattr(tokenizer, f"{k}_token_id", None) for k in ("bos", "eos", "unk")],
    }
    return hashlib.sha256(json.dumps(doc, ensure_ascii=False).encode()).hexdigest()


def token_lengths(tokenizer: Any, texts: Sequence[str], desc: str = "tokenizing", batch_size: int = 1024) -> list[int]:
    """Length in tokens of each text, special tokens and the appended EOS included."""
    eos = getattr(tokenizer, "eos_token_id", None)
    lengths: list[int] = []
    with tqdm(total=len(texts), desc=desc, unit="row", disable=None, leave=False) as bar:
        for start in range(0, len(texts), batch_size):
            batch = list(texts[start : start + batch_size])
            for ids in tokenizer(batch, add_special_tokens=True)["input_ids"]:
                lengths.append(len(ids) + (0 if ids and eos is not None and ids[-1] == eos else 1))
            bar.update(len(batch))
    return lengths


def summarize(lengths: Sequence[int], cutoff: int | None) -> dict[str, Any]:
    """Count, max, mean, 95th percentile (nearest rank) and rows over `cutoff` of token lengths."""
    if not lengths:
        return {"rows": 0, "max": 0, "mean": 0.0, "p95": 0, "over_cutoff": 0}
    ordered = sorted(lengths)
    p95 = ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]
    summary = {"rows": len(ordered), "max": ordered[-1], "mean": round(sum(ordered) / len(ordered), 1), "p95": p95}
    summary["over_cutoff"] = sum(1 for n in ordered if cutoff is not None and n > cutoff)
    return summary
