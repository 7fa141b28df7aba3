"""The model shapes suites name, and the random checkpoint and factor store each configuration of a shape reads.

Weights are random bf16 (step time does not depend on their values); the factor store is the project's own
``frod hjd`` of that checkpoint, so FRoD's build reads what a user's run reads.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["SHAPES", "Shape", "make_model", "prepare", "prepared"]


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    inter: int
    heads: int
    kv_heads: int
    vocab: int = 32000


SHAPES = {
    "7b": Shape(32, 4096, 11008, 32, 32),  # LLaMA-2-7B
    "70b": Shape(80, 8192, 28672, 64, 8),  # LLaMA-2-70B (the chain kind generates it a part at a time)
    "70bw40": Shape(40, 8192, 28672, 64, 8),  # LLaMA-2-70B's widths, 40 of its 80 layers
    "tiny": Shape(2, 64, 128, 4, 4),  # CPU rehearsals
}


def make_model(shape: Shape, out: Path) -> None:
    """A random bf16 LLaMA checkpoint of ``shape`` in ``out`` (seed 0; on the GPU when there is one)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        hidden_size=shape.hidden,
        intermediate_size=shape.inter,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        vocab_size=shape.vocab,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(out, max_shard_size="2GB")


def prepared(name: str, work: Path) -> tuple[Path, Path]:
    """``(checkpoint, factor store)`` of shape ``name`` that :func:`prepare` made; an error when it has not."""
    base = Path(work) / name
    if not (base / "READY").exists():
        raise SystemExit(
            f"error: {base} holds no complete {name} checkpoint and store (python -m bench run makes them)"
        )
    return base / "model", base / "factors"


def prepare(name: str, work: Path, log=print) -> tuple[Path, Path]:
    """``(checkpoint, factor store)`` of shape ``name`` under ``work/<name>/``, made once and reused when complete."""
    base = Path(work) / name
    model, factors, done = base / "model", base / "factors", base / "READY"
    if not done.exists():
        base.mkdir(parents=True, exist_ok=True)
        if not (model / "config.json").exists():
            log(f"making a random {name} checkpoint in {model}")
            make_model(SHAPES[name], model)
        log(f"frod hjd --model {model} --out {factors}")
        subprocess.run(
            [sys.executable, "-m", "frod_ds", "hjd", "--model", str(model), "--out", str(factors)], check=True
        )
        done.touch()
    return model, factors
