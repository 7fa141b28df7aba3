"""A synthetic LLaMA checkpoint written a part at a time, for the chain kind (``bench/kinds/chain.py``).

Every tensor is drawn from a seed derived from its name, so any part can be written, deleted and written again bit
for bit on the same device type (LoRA's base regenerated into ``/dev/shm`` later, a lost file after a kill), and the
whole bf16 checkpoint never has to exist at once. Linears and embeddings are ``N(0, 0.02²)`` (LLaMA's
initializer_range) drawn in fp32 and rounded to bf16; RMSNorm weights are 1. Files hold consecutive tensors of a
part (``base`` or one targeted category) up to ``FILE_BYTES``, so their names and contents do not depend on the
number of ranks writing them; ``model.safetensors.index.json`` lists exactly the files present.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from pathlib import Path

import torch

from bench.kinds.shapes import Shape
from frod_ds.core.names import DEFAULT_TARGETS
from frod_ds.io.hf_checkpoint import INDEX_NAME
from frod_ds.io.safetensors_io import safetensors_header, tensor_bytes
from frod_ds.runtime.atomic import TMP, atomic_write_text

__all__ = ["FILE_BYTES", "TARGETS", "config_json", "part_tensors", "files_of", "write_part", "write_index", "delete"]

TARGETS = DEFAULT_TARGETS
STD = 0.02
DTYPE = torch.bfloat16
FILE_BYTES = 2**30  # 1 GiB files: a category spreads over the ranks that write it
Tensors = list[tuple[str, tuple[int, ...]]]


def config_json(shape: Shape) -> dict:
    """config.json of a bf16 LlamaForCausalLM of ``shape`` (untied, LLaMA-2's norm epsilon and special ids)."""
    sizes = dict(hidden_size=shape.hidden, intermediate_size=shape.inter, num_hidden_layers=shape.layers)
    heads = dict(num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, vocab_size=shape.vocab)
    ids = dict(bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, torch_dtype="bfloat16", use_cache=False)
    llama = dict(architectures=["LlamaForCausalLM"], model_type="llama", max_position_embeddings=4096)
    return {**llama, **sizes, **heads, **ids, "rms_norm_eps": 1e-5, "initializer_range": STD}


def _linear(shape: Shape, name: str) -> tuple[int, int]:
    """(out, in) of a decoder layer's linear ``name``."""
    h, f, kv = shape.hidden, shape.inter, shape.hidden // shape.heads * shape.kv_heads
    shapes = {"q_proj": (h, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, h)}
    return {**shapes, "gate_proj": (f, h), "up_proj": (f, h), "down_proj": (h, f)}[name]


def part_tensors(shape: Shape, part: str) -> Tensors:
    """``(name, shape)`` of a part in file order: ``base`` (embeddings, final norm, head, and per layer down_proj
    and the two norms: what training reads from the checkpoint) or one targeted category (its weight per layer)."""
    if part in TARGETS:
        block = "self_attn" if part in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        return [(f"model.layers.{i}.{block}.{part}.weight", _linear(shape, part)) for i in range(shape.layers)]
    assert part == "base", f"part {part!r} is neither 'base' nor one of {TARGETS}"
    out: Tensors = [
        ("model.embed_tokens.weight", (shape.vocab, shape.hidden)),
        ("model.norm.weight", (shape.hidden,)),
        ("lm_head.weight", (shape.vocab, shape.hidden)),
    ]
    for i in range(shape.layers):
        out += [
            (f"model.layers.{i}.mlp.down_proj.weight", _linear(shape, "down_proj")),
            (f"model.layers.{i}.input_layernorm.weight", (shape.hidden,)),
            (f"model.layers.{i}.post_attention_layernorm.weight", (shape.hidden,)),
        ]
    return out


def part_bytes(shape: Shape, part: str) -> int:
    return sum(math.prod(s) for _, s in part_tensors(shape, part)) * DTYPE.itemsize


def files_of(shape: Shape, part: str) -> dict[str, Tensors]:
    """``{file name: tensors}`` of a part: consecutive tensors up to ``FILE_BYTES`` a file (a larger one alone)."""
    groups: list[Tensors] = [[]]
    size = 0
    for name, shp in part_tensors(shape, part):
        nbytes = math.prod(shp) * DTYPE.itemsize
        if groups[-1] and size + nbytes > FILE_BYTES:
            groups.append([])
            size = 0
        groups[-1].append((name, shp))
        size += nbytes
    return {f"model-{part}-{j:04d}.safetensors": g for j, g in enumerate(groups)}


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


def _write_file(path: Path, tensors: Tensors, seed: int, device: torch.device) -> None:
    """Generate ``tensors`` one at a time and stream them into ``path`` (via ``path.tmp``, fsynced, renamed)."""
    head, _ = safetensors_header([(n, DTYPE, s) for n, s in tensors])
    tmp = path.with_name(path.name + TMP)
    with open(tmp, "wb") as f:
        f.write(head)
        for name, shp in tensors:
            f.write(memoryview(tensor_bytes(make_tensor(name, shp, seed, device).cpu()).numpy()))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_part(model_dir: Path, shape: Shape, part: str, seed: int, device: torch.device, rank: int, world: int) -> int:
    """This rank's files of ``part`` (every ``world``-th, from ``rank``), each skipped when present (written whole
    or not at all); returns the bytes this rank wrote."""
    written = 0
    for j, (fname, tensors) in enumerate(files_of(shape, part).items()):
        if j % world == rank and not (model_dir / fname).is_file():
            _write_file(model_dir / fname, tensors, seed, device)
            written += (model_dir / fname).stat().st_size
    return written


def _header_names(path: Path) -> list[str]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return [k for k in json.loads(f.read(n)) if k != "__metadata__"]


def write_index(model_dir: Path, drop: str | None = None) -> None:
    """The index of the files present in ``model_dir`` (those of part ``drop`` left out)."""
    files = sorted(p for p in model_dir.glob("model-*.safetensors") if drop is None or not _of(p.name, drop))
    weight_map = {name: p.name for p in files for name in _header_names(p)}
    index = {
        "metadata": {"total_size": sum(p.stat().st_size for p in files)},
        "weight_map": dict(sorted(weight_map.items())),
    }
    atomic_write_text(model_dir / INDEX_NAME, json.dumps(index, indent=1) + "\n")


def _of(fname: str, part: str) -> bool:
    return fname.startswith(f"model-{part}-")


def delete(model_dir: Path, part: str) -> int:
    """Remove ``part`` from the checkpoint: first from the index (no reader sees a listed file vanish), then its
    files; returns the bytes freed."""
    write_index(model_dir, drop=part)
    freed = 0
    for p in model_dir.iterdir():
        if _of(p.name, part):
            freed += p.stat().st_size
            p.unlink()
    return freed
