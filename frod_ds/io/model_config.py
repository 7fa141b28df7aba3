"""A base checkpoint's ``config.json`` checked in one place: its sizes are positive integers, the key/value heads
divide the heads, and the weights have the shapes and layer count it names.

``config_problems`` checks the values (the planner, training, eval and export read them); ``weights_problems``
compares them with the checkpoint's tensor shapes (read from the safetensors headers), so that a config of another
model is refused before HJD writes a store or transformers fills missing layers with random weights. Only the keys
a config has are checked: a model family without LLaMA's names is compared on nothing it lacks. Torch-free.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "DTYPES",
    "LLAMA_FAMILY",
    "MAX_LAYERS",
    "MAX_SIZE",
    "REQUIRED_KEYS",
    "SIZE_KEYS",
    "SWITCH_KEYS",
    "config_problems",
    "expected_shapes",
    "missing_linear",
    "weights_problems",
]

# the sizes a LLaMA-family config.json gives, each a positive integer when present
SIZE_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
)
# the switches a LLaMA-family config.json gives, each true or false when present (a string "false" is truthy)
SWITCH_KEYS = ("attention_bias", "mlp_bias", "tie_word_embeddings", "use_cache")
# the largest size a config.json may give (the largest models' vocabularies and widths are a few hundred thousand):
# past it the sizes describe no checkpoint, and the planner's arithmetic on them leaves float's range
MAX_SIZE = 2**24
MAX_LAYERS = 2**31  # a typo of a billion layers is still planned (nothing fits), not refused
# the decoders frod-ds builds, plans and decomposes (model_type), and the dtypes a config.json may name
LLAMA_FAMILY = ("llama", "mistral", "qwen2")
DTYPES = ("float32", "float16", "bfloat16", "float64", "float", "half", "double", "auto", "float8_e4m3fn")
# the sizes a LLaMA-family config.json must give when its weights hold LLaMA-named decoder layers
REQUIRED_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
_LAYER = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$"
)


def _positive_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


def config_problems(cfg: Mapping[str, Any]) -> list[str]:
    """Every value of ``cfg`` no model can have: a size that is not a positive integer, key/value heads that do not
    divide the heads, a hidden size the heads do not divide (without ``head_dim``; a LLaMA's, with it too, as
    transformers' ``LlamaConfig`` checks). Empty when fine."""
    problems = [
        f"{k} must be a positive integer, got {cfg[k]!r}"
        for k in SIZE_KEYS
        if k in cfg and cfg[k] is not None and not _positive_int(cfg[k])
    ]
    for k in SIZE_KEYS:
        most = MAX_LAYERS if k == "num_hidden_layers" else MAX_SIZE
        if _positive_int(cfg.get(k)) and cfg[k] > most:
            size = cfg[k] if cfg[k] < 10**12 else f"of {len(str(cfg[k]))} digits"
            problems.append(f"{k} {size} is beyond any model (at most {most})")
    problems += [
        f"{k} must be true or false, got {cfg[k]!r}"
        for k in SWITCH_KEYS
        if cfg.get(k) is not None and not isinstance(cfg[k], bool)
    ]
    vocab = cfg.get("vocab_size")
    for k in ("pad_token_id", "bos_token_id", "eos_token_id"):
        ids = cfg.get(k)
        for i in ids if isinstance(ids, list) else [ids]:
            if i is None:
                continue
            if not isinstance(i, int) or isinstance(i, bool) or i < 0:
                problems.append(f"{k} must be a token id (an integer ≥ 0), got {i!r}")
            elif _positive_int(vocab) and i >= vocab:
                problems.append(f"{k} {i} is past the vocabulary (vocab_size {vocab})")
    heads, kv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    if _positive_int(heads) and _positive_int(kv) and heads % kv:
        problems.append(
            f"num_key_value_heads {kv} does not divide num_attention_heads {heads} (each key/value head serves a "
            "whole group of query heads)"
        )
    rope = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    for key, v in (
        ("rms_norm_eps", cfg.get("rms_norm_eps")),
        ("rope_theta", cfg.get("rope_theta", rope.get("rope_theta"))),
    ):
        if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf):
            problems.append(f"{key} must be a finite number > 0, got {v!r}")  # the forward divides by, powers of it
    for key in ("torch_dtype", "dtype"):
        if cfg.get(key) is not None and cfg[key] not in DTYPES:
            problems.append(f"{key} {cfg[key]!r} is no dtype (one of {', '.join(DTYPES)})")
    hidden = cfg.get("hidden_size")
    if _positive_int(hidden) and _positive_int(heads) and hidden % heads:
        split = f"num_attention_heads {heads} does not divide hidden_size {hidden}"
        if cfg.get("head_dim") is None:
            problems.append(f"{split} and there is no head_dim")
        elif cfg.get("model_type") == "llama":  # transformers' LlamaConfig refuses it whatever head_dim says
            problems.append(f"{split}, which a LLaMA needs")
    return problems


def expected_shapes(cfg: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    """``{linear: (out, in)}`` of one decoder layer's LLaMA linears as ``cfg`` sizes them (those it can size)."""
    h, f = cfg.get("hidden_size"), cfg.get("intermediate_size")
    heads = cfg.get("num_attention_heads")
    kv = cfg.get("num_key_value_heads") or heads
    hd = cfg.get("head_dim") or (h // heads if _positive_int(h) and _positive_int(heads) else None)
    out: dict[str, tuple[int, int]] = {}
    if _positive_int(h) and _positive_int(heads) and _positive_int(hd):
        out.update(q_proj=(heads * hd, h), o_proj=(h, heads * hd))
        if _positive_int(kv):
            out.update(k_proj=(kv * hd, h), v_proj=(kv * hd, h))
    if _positive_int(h) and _positive_int(f):
        out.update(gate_proj=(f, h), up_proj=(f, h), down_proj=(h, f))
    return out


def weights_problems(cfg: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> list[str]:
    """Where the tensors (``{name: shape}``) contradict ``cfg``: a decoder linear of another shape, another number of
    decoder layers, an embedding of another vocabulary or width. Empty when they agree (or share nothing to compare)."""
    want = expected_shapes(cfg)
    problems: list[str] = []
    layers: set[int] = set()
    for name, shape in sorted(shapes.items()):
        hit = _LAYER.search(name)
        if hit is None:
            continue
        layers.add(int(hit.group(1)))
        expected = want.get(hit.group(2))
        if expected is not None and tuple(shape) != expected and not problems:
            problems.append(f"{name} has shape {list(shape)}, the config gives {list(expected)}")
    kind, arch = cfg.get("model_type"), cfg.get("architectures")
    if layers and kind not in LLAMA_FAMILY and "text_config" not in cfg:
        problems.append(f"model_type {kind!r} builds no LLaMA-family decoder ({', '.join(LLAMA_FAMILY)}) for them")
    if layers and isinstance(arch, list) and arch and not any(str(a).endswith("ForCausalLM") for a in arch):
        problems.append(f"architectures {arch} names no causal LM (e.g. LlamaForCausalLM) for them")
    absent = [k for k in REQUIRED_KEYS if cfg.get(k) is None]
    if layers and absent and "text_config" not in cfg:  # transformers would build its own defaults' sizes
        names = ", ".join(absent)
        problems.append(f"it names no {names}, which transformers would fill with its defaults, not these weights'")
    n = cfg.get("num_hidden_layers")
    # layers == {0, …, n-1}, without building that set (a config may say a billion)
    if layers and _positive_int(n) and (len(layers) != n or min(layers) != 0 or max(layers) != n - 1):
        problems.append(f"the weights hold decoder layers {_ranges(layers)}, the config gives num_hidden_layers {n}")
    vocab, hidden = cfg.get("vocab_size"), cfg.get("hidden_size")
    for name, shape in sorted(shapes.items()):
        if name.endswith("embed_tokens.weight") or name == "lm_head.weight":
            expected = (vocab, hidden)
            if _positive_int(vocab) and _positive_int(hidden) and tuple(shape) != expected:
                problems.append(
                    f"{name} has shape {list(shape)}, the config gives [vocab_size, hidden_size] {list(expected)}"
                )
                break
    return problems


def missing_linear(names: Iterable[str]) -> str | None:
    """A decoder linear some layers hold and others do not, as ``"<name> (layers … hold it, layer … not)"``; None
    when each linear is held by every layer or by none (a checkpoint without a targeted category is whole)."""
    layers: set[int] = set()
    held: dict[str, set[int]] = {}  # per decoder linear, the layers holding it
    for name in names:
        hit = _LAYER.search(name)
        if hit is not None:
            layers.add(int(hit.group(1)))
            held.setdefault(name[: hit.start(1)] + "{}" + name[hit.end(1) :], set()).add(int(hit.group(1)))
    for pattern, where in sorted(held.items()):
        if where != layers:
            missing = sorted(layers - where)
            holding = f"layers {_ranges(where)} hold it" if len(where) > 1 else f"layer {_ranges(where)} holds it"
            lacking = f"layer{'s' * (len(missing) > 1)} {_ranges(set(missing))}"
            return f"{pattern.format(missing[0])} ({holding}, {lacking} not)"
    return None


def _ranges(indices: set[int]) -> str:
    """``0-1`` for {0, 1}; ``0-3, 5`` for a gap."""
    runs: list[list[int]] = []
    for i in sorted(indices):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in runs)
