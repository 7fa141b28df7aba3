"""Tiny Hugging Face checkpoints on disk for the HJD stage tests (no hub access), and a runner for
``launch/hjd.py`` as a subprocess (single process or ``torchrun --standalone``)."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import torch

from tests.support import pace
from tests.support.leftovers import REPO, clean_env

LAUNCH = REPO / "launch" / "hjd.py"


def write_tiny_llama(
    path: Path, seed: int = 0, dtype: torch.dtype = torch.float32, max_shard_size: str = "12KB", **overrides
) -> Path:
    """``frod_ds.testing.toy.write_tiny_llama`` at HJD-test size, in several shards (``model.safetensors.index.json``).
    Defaults: hidden 32, 3 layers, 4 heads, 2 KV heads (k/v 16×32), LLaMA's init std 0.02."""
    from frod_ds.testing.toy import write_tiny_llama as write

    kw = dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.02,
    )
    kw.update(overrides)
    return write(path, vocab_size=kw.pop("vocab_size", 64), seed=seed, dtype=dtype, max_shard_size=max_shard_size, **kw)


def shard_files(path: Path) -> list[Path]:
    index = json.loads((path / "model.safetensors.index.json").read_text())
    return sorted({path / f for f in index["weight_map"].values()})


def shard_of(path: Path, tensor: str) -> Path:
    index = json.loads((path / "model.safetensors.index.json").read_text())
    return path / index["weight_map"][tensor]


def weights(path: Path, members: list[str]) -> list[torch.Tensor]:
    """The members' weights read straight from the shards (an independent path from ``HFCheckpoint``)."""
    from safetensors import safe_open

    out = []
    for m in members:
        with safe_open(str(shard_of(path, m + ".weight")), framework="pt") as f:
            out.append(f.get_tensor(m + ".weight"))
    return out


def strip_checkpoint(src: Path, dst: Path, categories, replace: dict[str, torch.Tensor] | None = None) -> Path:
    """A copy of checkpoint ``src`` without the weights ``<path>.<category>.weight`` of ``categories`` (as left once
    HJD has decomposed them), in one ``model.safetensors``, with every non-weight file (config, tokenizer) copied;
    ``replace``: tensors to swap in. Reads the shards with safetensors itself (independent of ``HFCheckpoint``)."""
    import shutil

    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    drop = set(categories)
    kept = {
        k: v
        for k, v in tensors.items()
        if not (k.endswith(".weight") and k[: -len(".weight")].rsplit(".", 1)[-1] in drop)
    }
    kept.update(replace or {})
    save_file(kept, str(dst / "model.safetensors"), metadata={"format": "pt"})
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy2(f, dst / f.name)
    return dst


def run_hjd(
    args: list[str], nproc: int = 0, script: Path = LAUNCH, timeout: float = 180, launcher: str = "ranks"
) -> subprocess.CompletedProcess:
    """``launch/hjd.py ARGS`` as a subprocess: one plain process when ``nproc == 0``, else NPROC CPU ranks (gloo)
    started by ``tests/support/ranks.py`` (torchrun's environment, the imports paid once) or ``launcher="torchrun"``
    (``torchrun --standalone``). The DeepSpeed launcher's line is tests/cli/test_cli.py's."""
    env = clean_env()
    if launcher == "ranks":  # forked from this test process (tests.support.ranks.run): the imports paid already
        from tests.support import ranks

        return ranks.run(nproc, [str(script), *args], env, REPO, timeout)
    cmd = [sys.executable]
    if nproc and launcher == "torchrun":
        cmd += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    cmd += [str(script), *args]
    return subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=pace.scaled(timeout))


def hjd_in_process(args: list[str]) -> subprocess.CompletedProcess:
    """``launch/hjd.py ARGS`` as one process without a launcher, run by its ``main`` in this process: the exit
    code and what it printed, as :func:`run_hjd` returns them, without a subprocess's torch start-up. For runs
    whose launcher or process boundary is not what the test checks."""
    from launch.hjd import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(args)
    return subprocess.CompletedProcess(["launch/hjd.py", *args], code, out.getvalue(), err.getvalue())


def make_adapter(model_dir: Path, root: Path, sparsity: float = 0.05, seed: int = 0):
    """A trained-looking FRoD adapter over ``model_dir``: factor store by the HJD stage (one process), σ
    scaled and S filled with random values. Returns ``(adapter_dir, store_dir, frod_model)``."""
    from frod_ds.formats.adapter_dir import AdapterConfig
    from frod_ds.hjd.stage import StageConfig, run_stage
    from frod_ds.model.adapter import save_adapter_from_model
    from frod_ds.model.apply import frod_modules
    from frod_ds.model.build import build_frod_model, make_supports
    from frod_ds.model.store_reader import FactorStore

    run_stage(StageConfig(model=str(model_dir), out=root / "store", device="cpu", fsync=False))
    store = FactorStore.open(root / "store")
    model = build_frod_model(
        model_dir, store, make_supports(store, list(store.categories), sparsity, seed), torch.float32
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, m in frod_modules(model):
            m.frod_sigma.mul_(1 + 0.3 * torch.randn(m.frod_sigma.shape, generator=g))
            m.frod_s.add_(0.1 * torch.randn(m.frod_s.shape, generator=g))
    ckpt = save_adapter_from_model(
        model,
        root / "adapter-final",
        AdapterConfig(
            base_model=str(model_dir),
            factor_store=str(root / "store"),
            dtype="float32",
            sparsity=sparsity,
            seed=seed,
            targets=list(store.categories),
        ),
        store=store,
    )
    return ckpt, root / "store", model
