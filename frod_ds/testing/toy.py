"""Tiny, fully local stand-ins for a real setup: a small Llama checkpoint, a SentencePiece tokenizer
trained on the spot, and synthetic commonsense rows in the real HF schemas (BoolQ, PIQA).

Used by ``make demo`` and the tests; nothing here touches a hub. The synthetic task is built so a tiny
randomly initialised model can learn it with FRoD alone in minutes: the gold answer is fixed by which of
two cue-word families occurs in the text (the rest is filler), so a model that learns to look for the cue
beats chance and one that only learns the answer format does not.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

__all__ = ["write_tiny_llama", "train_sentencepiece_tokenizer", "write_synthetic_tasks", "TINY_LLAMA"]

TINY_LLAMA = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    # LLaMA's std 0.02 confines a 64-wide random model's logits to about ±1.3 (‖lm_head row‖·‖RMSNorm(h)‖),
    # so no adapter that leaves lm_head frozen can make an answer much likelier; 0.2 lifts that ceiling.
    initializer_range=0.2,
)

POSITIVE = ["sunny", "warm", "bright", "calm", "dry"]
NEGATIVE = ["rainy", "cold", "dark", "stormy", "wet"]
TOOLS_A = ["spoon", "cup", "bowl", "plate", "fork"]
TOOLS_B = ["hammer", "saw", "drill", "nail", "rope"]
FILLER = (
    "the a old small big red blue green town river road house garden morning evening people "
    "walk see find keep open close near far with from over under"
).split()


def _filler(rng: random.Random, k: int) -> str:
    return " ".join(rng.choice(FILLER) for _ in range(k))


def write_synthetic_tasks(root: str | Path, n_train: int = 400, n_eval: int = 100, seed: int = 0) -> Path:
    """``root/boolq/{train,validation}.jsonl`` and ``root/piqa/{train,validation}.jsonl`` in HF schemas."""
    rng = random.Random(seed)
    root = Path(root)

    def boolq(i: int) -> dict:
        positive = rng.random() < 0.5
        cue = rng.choice(POSITIVE if positive else NEGATIVE)
        passage = f"{_filler(rng, 4)} it was {cue} {_filler(rng, 3)}."
        return {"question": "was it a nice day", "answer": positive, "passage": passage}

    def piqa(i: int) -> dict:
        kitchen = rng.random() < 0.5
        tool = rng.choice(TOOLS_A if kitchen else TOOLS_B)
        return {
            "goal": f"use the {tool} {_filler(rng, 2)}",
            "sol1": f"in the kitchen {_filler(rng, 2)}",
            "sol2": f"in the shed {_filler(rng, 2)}",
            "label": 0 if kitchen else 1,
        }

    for task, make in (("boolq", boolq), ("piqa", piqa)):
        d = root / task
        d.mkdir(parents=True, exist_ok=True)
        for split, n in (("train", n_train), ("validation", n_eval)):
            with open(d / f"{split}.jsonl", "w") as f:
                for i in range(n):
                    f.write(json.dumps(make(i)) + "\n")
    return root


def train_sentencepiece_tokenizer(out_dir: str | Path, texts: list[str], vocab_size: int = 400) -> Path:
    """A BPE SentencePiece model trained on ``texts``, saved as a HF ``LlamaTokenizer`` (BOS, no EOS added)."""
    import sentencepiece as spm
    from transformers import LlamaTokenizer
    from transformers.convert_slow_tokenizer import SentencePieceExtractor

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    corpus = out_dir / "corpus.txt"
    corpus.write_text("\n".join(texts) + "\n")
    prefix = out_dir / "spm"
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(prefix),
        vocab_size=vocab_size,
        model_type="bpe",
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        byte_fallback=True,
        character_coverage=1.0,
        hard_vocab_limit=False,
        minloglevel=2,
        num_threads=1,
    )
    spec = SentencePieceExtractor(str(prefix) + ".model").extract(None)
    tok = LlamaTokenizer(vocab=spec["vocab"], merges=spec["merges"], add_bos_token=True, add_eos_token=False)
    tok.save_pretrained(str(out_dir))
    for p in (corpus, Path(str(prefix) + ".vocab")):
        p.unlink()
    return out_dir


def write_tiny_llama(
    out_dir: str | Path,
    vocab_size: int,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | None = None,
    **overrides,
) -> Path:
    """A randomly initialised ``LlamaForCausalLM`` saved as HF safetensors (sharded if ``max_shard_size``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, bos_token_id=1, eos_token_id=2, **{**TINY_LLAMA, **overrides})
    model = LlamaForCausalLM(cfg).to(dtype)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(out_dir), **kw)
    return Path(out_dir)
