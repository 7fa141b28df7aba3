"""The chain's ``generate`` and ``hjd-<category>`` stages, in each rank of one launch (``bench/kinds/chain.py``).

    torchrun --standalone --nproc-per-node 4 -m bench.kinds.chain_prepare WORK/chain/CONFIG/runs/prepare.json

Rank 0 writes the inputs (config.json, data, tokenizer, recipe); every rank writes its share of the untargeted weights,
then per category of its weights; HJD runs over the launch's ranks as ``frod hjd --categories`` does; rank 0 deletes
the category and writes each stage's record. Written files and categories complete in the store are skipped.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from bench.kinds import synthetic
from bench.kinds.chain import TARGETS, Chain, GiB, launcher, shape_of
from bench.kinds.shapes import Shape
from bench.suite import load_suite

__all__ = ["prepare"]


def _store_has(store: Path, category: str) -> bool:
    from frod_ds.formats.factor_store import MANIFEST, Manifest

    return (store / MANIFEST).is_file() and category in Manifest.read(store / MANIFEST).completed_categories


def _inputs(ch: Chain, device_type: str) -> None:
    """Rank 0: the work dir's identity, config.json, data and tokenizer, recipe; refuses a disk too small."""
    from frod_ds.runtime.errors import FrodError

    s, shape, root = ch.cfg.settings, shape_of(ch.cfg.settings), ch.root
    (root / "model").mkdir(parents=True, exist_ok=True)
    ident = {"shape": shape.__dict__, "seed": s["seed"], "device_type": device_type}
    if (root / "chain.json").is_file() and json.loads((root / "chain.json").read_text()) != ident:
        raise FrodError(f"{root} was generated as {(root / 'chain.json').read_text().strip()}: use another --work")
    (root / "chain.json").write_text(json.dumps(ident) + "\n")  # a CPU generator draws other numbers than CUDA's
    (root / "model" / "config.json").write_text(json.dumps(synthetic.config_json(shape), indent=1) + "\n")
    if not (root / "data" / "train.jsonl").is_file():
        _write_data(root, shape, s)
    _write_recipe(ch)
    size = {c: synthetic.part_bytes(shape, c) for c in TARGETS}
    have = sum(p.stat().st_size for p in (root / "model").glob("model-base-*.safetensors"))
    need = synthetic.part_bytes(shape, "base") - have + max(size.values())
    need += sum(b for c, b in size.items() if not _store_has(root / "store", c))
    if shutil.disk_usage(root).free < need:
        free = shutil.disk_usage(root).free / GiB
        raise FrodError(f"{root}: the chain needs {need / GiB:.0f} GiB more disk, {free:.0f} GiB are free")


def _write_data(root: Path, shape: Shape, s: dict[str, Any]) -> None:
    """Rows of 2 x seq filler words (every example is cut to exactly ``seq`` tokens), a tokenizer trained on them."""
    import random

    from frod_ds.testing.toy import FILLER, train_sentencepiece_tokenizer

    rng = random.Random(s["seed"])
    n = max(256, 2 * s["gpus"] * s["mfu_batch_max"])
    rows = [
        {"prompt": " ".join(rng.choices(FILLER, k=2 * s["seq"])), "answer": rng.choice(["yes", "no"])} for _ in range(n)
    ]
    tok = train_sentencepiece_tokenizer(root / "tokenizer", [r["prompt"] for r in rows[:64]], min(400, shape.vocab))
    for f in tok.iterdir():
        shutil.copy2(f, root / "model" / f.name)
    (root / "data").mkdir(exist_ok=True)
    (root / "data" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _write_recipe(ch: Chain) -> None:
    """FRoD at the ``sparsity`` setting on the six targets, gradient checkpointing, the loss on every token,
    ``steps`` at ``batch``."""
    import yaml

    s, root = ch.cfg.settings, ch.root
    model = {"base": str(root / "model"), "factor_store": str(root / "store"), "sparsity": s["sparsity"]}
    data = {"train": str(root / "data" / "train.jsonl"), "cutoff_len": s["seq"], "train_on_inputs": True}
    train = {"max_steps": s["steps"], "micro_batch_size": s["batch"], "grad_accum": 1, "log_every": 1}
    train["phase_times"] = s["phase_times"]
    if s["profile_step"]:
        train["profile_step"] = s["profile_step"]
    recipe = {
        "model": {**model, "dtype": s["dtype"], "gradient_checkpointing": True},
        "data": data,
        "train": {**train, "save_every": s["save_at"], "rotation_every": 0, "keep_checkpoints": 2},
    }
    (root / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))


def _hjd_args(ch: Chain, category: str, device_type: str) -> list[str]:
    cpu = ["--device", "cpu"] if device_type == "cpu" else []
    return ["--model", str(ch.root / "model"), "--out", str(ch.root / "store"), "--categories", category, *cpu]


def _store_summary(ch: Chain, category: str) -> dict[str, Any]:
    from frod_ds.formats.factor_store import MANIFEST, Manifest
    from frod_ds.io.hf_checkpoint import HFCheckpoint

    m = Manifest.read(ch.root / "store" / MANIFEST)
    r = m.categories[category]
    left = [k for k in HFCheckpoint(ch.root / "model").keys() if f".{category}." in k]
    gib = lambda d: sum(p.stat().st_size for p in d.iterdir() if p.is_file()) / GiB  # noqa: E731
    peak = max((x.peak_device_gib or 0.0 for x in m.run.ranks), default=None) if m.run else None
    out = dict(members=len(r.members), route=r.method, max_error=r.max_error, hjd_peak_device_gib=peak)
    disk = dict(model_dir_gib=gib(ch.root / "model"), store_gib=gib(ch.root / "store"))
    disk["disk_free_gib"] = shutil.disk_usage(ch.root).free / GiB
    return {**out, **disk, "store_complete": m.complete, "category_tensors_in_checkpoint": len(left)}


def prepare(ch: Chain) -> None:
    """Every rank: its share of the untargeted weights, then per category generate → ``frod hjd --categories``
    over the launcher's ranks → delete. Files already written and categories already in the store are skipped."""
    from frod_ds.cli import hjd
    from frod_ds.runtime import distributed as D

    device, rank, world = D.local_device(), D.get_rank(), D.get_world_size()
    shape, seed, model = shape_of(ch.cfg.settings), ch.cfg.settings["seed"], ch.root / "model"
    D.on_main(lambda: _inputs(ch, device.type))
    t0 = time.perf_counter()
    wrote = sum(D.all_gather_object(synthetic.write_part(model, shape, "base", seed, device, rank, world)))
    if not ch.ok("generate") or wrote:
        D.on_main(lambda: synthetic.write_index(model))
        m = dict(untargeted_gib=synthetic.part_bytes(shape, "base") / GiB, written_gib=wrote / GiB, world_size=world)
        cmd = [*launcher(world), "-m", "bench.kinds.chain_prepare", str(ch.runs / "prepare.json")]
        D.on_main(lambda: ch.write("generate", "ok", m, time.perf_counter() - t0, cmd))
    for c in TARGETS:
        t0, wrote, timing = time.perf_counter(), 0, {}
        if not D.on_main(lambda: _store_has(ch.root / "store", c)):
            wrote = sum(D.all_gather_object(synthetic.write_part(model, shape, c, seed, device, rank, world)))
            D.on_main(lambda: synthetic.write_index(model))
            t1 = time.perf_counter()
            hjd.build(hjd.parse_args(_hjd_args(ch, c, device.type)))  # what `frod hjd` runs on each rank
            D.barrier()
            timing = {"generate_s": t1 - t0, "hjd_s": time.perf_counter() - t1}
        t1 = time.perf_counter()
        freed = D.on_main(lambda: synthetic.delete(model, c))  # also what a kill after HJD left behind
        if timing or freed or not ch.ok(f"hjd-{c}"):
            m = dict(timing, delete_s=time.perf_counter() - t1, generated_gib=wrote / GiB, freed_gib=freed / GiB)
            cmd = [*launcher(world), "-m", "frod_ds", "hjd", *_hjd_args(ch, c, device.type)]
            wall = time.perf_counter() - t0
            D.on_main(lambda: ch.write(f"hjd-{c}", "ok", {**m, **_store_summary(ch, c)}, wall, cmd))
        D.print0(f"hjd-{c}: done")


def main(path: str) -> int:
    """``path``: the JSON ``run_chain`` wrote (suite, config, results, work, device, call, series; the device facts
    the runner read, so that no rank touches a GPU other than its own)."""
    a = json.loads(Path(path).read_text())
    suite = load_suite(a["suite"])
    where = Path(a["results"]), Path(a["work"]), a["device"], a["call"], a["series"]
    ch = Chain(suite, suite.config(a["config"]), *where)
    from frod_ds.runtime import entry

    return entry.run(lambda: prepare(ch))


if __name__ == "__main__":
    code = main(sys.argv[1])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # files written, group left: skip the teardown where gloo's threads can abort a finished rank
