"""A synthetic LLaMA checkpoint written piece by piece: every tensor generated from a seed derived from its name,
so any part can be written, deleted and written again bit for bit (on the same device type), and the whole bf16
checkpoint never has to exist at once (``bench/seventy_b.py``).

    shape = SHAPES["70b"]
    write_shard(dir / "model-q_proj-r0-0.safetensors", names, shape, device)   # one rank's share
    add_to_index(dir, {name: file, ...}) / remove_from_index(dir, files)        # what the checkpoint holds now

Values: linears and embeddings ``N(0, 0.02²)`` (LLaMA's initializer_range), drawn in fp32 with a generator seeded
by ``sha256(seed:name)`` on ``device`` and rounded to bf16; RMSNorm weights 1. The index
(``model.safetensors.index.json``) lists exactly the tensors present, so readers (``HFCheckpoint``, transformers)
see the checkpoint as it is at that moment.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from frod_ds.core.names import DEFAULT_TARGETS
from frod_ds.io.hf_checkpoint import INDEX_NAME
from frod_ds.io.safetensors_io import safetensors_header, tensor_bytes
from frod_ds.runtime.atomic import TMP, atomic_write_text

__all__ = [
    "Shape",
    "SHAPES",
    "TARGETS",
    "STD",
    "tensor_seed",
    "make_tensor",
    "category_names",
    "untargeted_names",
    "split_files",
    "write_shard",
    "add_to_index",
    "remove_from_index",
    "index_files",
]

TARGETS = DEFAULT_TARGETS
STD = 0.02
DTYPE = torch.bfloat16


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int

    def linear(self, name: str) -> tuple[int, int]:
        """(out, in) of a decoder layer's linear ``name``."""
        h, kv = self.hidden, self.hidden // self.heads * self.kv_heads
        return {
            "q_proj": (h, h),
            "k_proj": (kv, h),
            "v_proj": (kv, h),
            "o_proj": (h, h),
            "gate_proj": (self.intermediate, h),
            "up_proj": (self.intermediate, h),
            "down_proj": (h, self.intermediate),
        }[name]

    def config(self) -> dict:
        """config.json of a LlamaForCausalLM of this shape (bf16, untied, LLaMA-2's special ids and rope)."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "vocab_size": self.vocab,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "hidden_act": "silu",
            "initializer_range": STD,
            "tie_word_embeddings": False,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "attention_bias": False,
            "mlp_bias": False,
            "torch_dtype": "bfloat16",
            "use_cache": False,
        }

    def as_dict(self) -> dict:
        return asdict(self)


SHAPES = {
    "70b": Shape(hidden=8192, intermediate=28672, layers=80, heads=64, kv_heads=8, vocab=32000),  # LLaMA-2-70B
    "7b": Shape(hidden=4096, intermediate=11008, layers=32, heads=32, kv_heads=32, vocab=32000),  # LLaMA-2-7B
    "tiny": Shape(hidden=64, intermediate=160, layers=4, heads=4, kv_heads=2, vocab=2048),
}


def _module(category: str, layer: int) -> str:
    block = "mlp" if category in ("gate_proj", "up_proj", "down_proj") else "self_attn"
    return f"model.layers.{layer}.{block}.{category}"


def category_names(shape: Shape, category: str) -> list[tuple[str, tuple[int, ...]]]:
    """``(tensor name, shape)`` of one category's weights, layer order."""
    return [(_module(category, i) + ".weight", shape.linear(category)) for i in range(shape.layers)]


def untargeted_names(shape: Shape, layers: Iterable[int] | None = None, globals_: bool = True):
    """``(name, shape)`` of everything but the six targeted categories: per layer down_proj and the two norms
    (of ``layers``, default all), and (``globals_``) embeddings, final norm and lm_head."""
    out: list[tuple[str, tuple[int, ...]]] = []
    if globals_:
        out += [
            ("model.embed_tokens.weight", (shape.vocab, shape.hidden)),
            ("model.norm.weight", (shape.hidden,)),
            ("lm_head.weight", (shape.vocab, shape.hidden)),
        ]
    for i in range(shape.layers) if layers is None else layers:
        out += [
            (_module("down_proj", i) + ".weight", shape.linear("down_proj")),
            (f"model.layers.{i}.input_layernorm.weight", (shape.hidden,)),
            (f"model.layers.{i}.post_attention_layernorm.weight", (shape.hidden,)),
        ]
    return out


def tensor_seed(name: str, seed: int) -> int:
    """The generator seed of tensor ``name``: the first 63 bits of ``sha256("<seed>:<name>")``."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1


@torch.no_grad()
def make_tensor(name: str, shape: tuple[int, ...], seed: int, device: torch.device) -> torch.Tensor:
    """Tensor ``name`` in bf16 on ``device``: ones for a norm, else N(0, STD²) from ``tensor_seed``."""
    if len(shape) == 1:
        return torch.ones(shape, dtype=DTYPE, device=device)
    g = torch.Generator(device=device).manual_seed(tensor_seed(name, seed))
    return torch.randn(shape, generator=g, device=device, dtype=torch.float32).mul_(STD).to(DTYPE)


def split_files(names: list[tuple[str, tuple[int, ...]]], max_bytes: float) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Consecutive groups of at most ``max_bytes`` (bf16; a larger tensor alone)."""
    groups: list[list] = [[]]
    size = 0
    for name, shp in names:
        nbytes = math.prod(shp) * DTYPE.itemsize
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, shp))
        size += nbytes
    return [g for g in groups if g]


def write_shard(path: Path, names: list[tuple[str, tuple[int, ...]]], seed: int, device: torch.device) -> int:
    """Generate ``names`` one at a time on ``device`` and stream them into the safetensors file ``path`` (written
    as ``path.tmp``, fsynced, renamed). Returns the bytes of tensor data."""
    head, _ = safetensors_header([(n, DTYPE, shp) for n, shp in names])
    tmp = path.with_name(path.name + TMP)
    total = 0
    with open(tmp, "wb") as f:
        f.write(head)
        for name, shp in names:
            t = make_tensor(name, shp, seed, device).cpu()
            f.write(memoryview(tensor_bytes(t).numpy()))
            total += t.numel() * t.element_size()
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return total


def _read_index(model_dir: Path) -> dict:
    path = model_dir / INDEX_NAME
    return json.loads(path.read_text()) if path.is_file() else {"metadata": {"total_size": 0}, "weight_map": {}}


def _write_index(model_dir: Path, index: dict) -> None:
    sizes = {}
    for f in set(index["weight_map"].values()):
        sizes[f] = (model_dir / f).stat().st_size
    index["metadata"] = {"total_size": sum(sizes.values())}
    index["weight_map"] = dict(sorted(index["weight_map"].items()))
    atomic_write_text(model_dir / INDEX_NAME, json.dumps(index, indent=1) + "\n")


def add_to_index(model_dir: Path, weight_map: dict[str, str]) -> None:
    """List the tensors ``{name: file}`` (files already in ``model_dir``) in the index."""
    index = _read_index(model_dir)
    index["weight_map"].update(weight_map)
    _write_index(model_dir, index)


def remove_from_index(model_dir: Path, files: Iterable[str]) -> None:
    """Drop every tensor of ``files`` from the index (first), then delete the files."""
    files = set(files)
    index = _read_index(model_dir)
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v not in files}
    _write_index(model_dir, index)
    for f in files:
        for p in (model_dir / f, model_dir / (f + TMP)):
            p.unlink(missing_ok=True)


def index_files(model_dir: Path) -> set[str]:
    return set(_read_index(model_dir)["weight_map"].values())
