"""The model shapes suites name, and the random checkpoint and factor store each configuration of a shape reads.

Weights are random bf16 (step time does not depend on their values); the factor store is the project's own
``frod hjd`` of that checkpoint, so FRoD's build reads what a user's run reads. A shape of ``GENERATED`` (70B does
not fit one GPU whole) is written a part at a time by ``bench/kinds/synthetic.py``, each rank of a launch writing its
share of the files on its GPU, then decomposed by ``frod hjd`` over the same ranks:

    torchrun --standalone --nproc-per-node 4 -m bench.kinds.shapes 70b WORK/70b
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["GENERATED", "SHAPES", "Shape", "launcher", "make_model", "prepare", "prepared"]

REPO = Path(__file__).resolve().parents[2]
SEED = 0  # of a generated checkpoint (bench/kinds/synthetic.py draws every tensor from it and its name)


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
    "70b": Shape(80, 8192, 28672, 64, 8),  # LLaMA-2-70B
    "70bw40": Shape(40, 8192, 28672, 64, 8),  # LLaMA-2-70B's widths, 40 of its 80 layers
    "tiny": Shape(2, 64, 128, 4, 4),  # CPU rehearsals
    "tiny-gqa": Shape(2, 64, 96, 4, 2, vocab=1001),  # CPU rehearsals of a generated shape (1001: an uneven split)
}
GENERATED = ("70b", "70bw40", "tiny-gqa")  # made a part at a time over the ranks (the chain kind does its own)


def launcher(n: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n)]


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


def prepare(name: str, work: Path, log=print, ranks: int = 1) -> tuple[Path, Path]:
    """``(checkpoint, factor store)`` of shape ``name`` under ``work/<name>/``, made once and reused when complete; a
    ``GENERATED`` shape on ``ranks`` ranks (a cut-off launch goes on from the files it left)."""
    base = Path(work) / name
    model, factors, done = base / "model", base / "factors", base / "READY"
    if not done.exists():
        base.mkdir(parents=True, exist_ok=True)
        if name in GENERATED:
            _check_room(name, base)
            log(f"generating {name} on {ranks} ranks, then frod hjd over them, in {base}")
            subprocess.run([*launcher(ranks), "-m", "bench.kinds.shapes", name, str(base)], check=True, cwd=REPO)
        else:
            if not (model / "config.json").exists():
                log(f"making a random {name} checkpoint in {model}")
                make_model(SHAPES[name], model)
            log(f"frod hjd --model {model} --out {factors}")
            hjd = [sys.executable, "-m", "frod_ds", "hjd", "--model", str(model), "--out", str(factors)]
            subprocess.run(hjd, check=True)
        done.touch()
    return model, factors


def _check_room(name: str, base: Path) -> None:
    """Refuse a file system with less room than the files left to write and the store (about the targeted weights'
    size): a 70B checkpoint and store take 222 GiB."""
    from bench.kinds import synthetic

    shape, gib = SHAPES[name], 2**30
    have = sum(p.stat().st_size for p in (base / "model").glob("model-*.safetensors"))
    targeted = sum(synthetic.part_bytes(shape, c) for c in synthetic.TARGETS)
    need = synthetic.part_bytes(shape, "base") + 2 * targeted - have
    free = shutil.disk_usage(base).free
    if free < need:
        raise SystemExit(
            f"error: {base}: the {name} checkpoint and its factor store need {need / gib:.0f} GiB more, "
            f"{free / gib:.0f} GiB are free (give --work a larger file system, e.g. /dev/shm)"
        )


def _generate(name: str, base: Path) -> None:
    """On each rank: its share of every part's files, then ``frod hjd`` over the ranks (written files and
    categories complete in the store are skipped)."""
    from bench.kinds import synthetic
    from frod_ds.cli import hjd
    from frod_ds.runtime import distributed as D

    shape, model = SHAPES[name], base / "model"
    device, rank, world = D.local_device(), D.get_rank(), D.get_world_size()
    model.mkdir(parents=True, exist_ok=True)
    D.on_main(lambda: (model / "config.json").write_text(json.dumps(synthetic.config_json(shape), indent=1) + "\n"))
    for part in ("base", *synthetic.TARGETS):
        synthetic.write_part(model, shape, part, SEED, device, rank, world)
    D.barrier()
    D.on_main(lambda: synthetic.write_index(model))
    cpu = ["--device", "cpu"] if device.type == "cpu" else []
    hjd.build(hjd.parse_args(["--model", str(model), "--out", str(base / "factors"), *cpu]))


if __name__ == "__main__":
    from bench.kinds import shapes  # the module synthetic.py imports, not a second copy of this one
    from frod_ds.runtime import entry

    code = entry.run(lambda: shapes._generate(sys.argv[1], Path(sys.argv[2])))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # files written, group left: skip the teardown where gloo's threads can abort a finished rank
