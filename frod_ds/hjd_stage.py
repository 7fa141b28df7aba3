"""Distributed HJD stage (spec §1, "Distributed HJD"): checkpoint shards in, factor store out.

``run_stage`` plans the categories from the checkpoint's tensor names, fingerprints the targeted weights,
creates or resumes the store directory, then runs ``hjd_tsqr.run_category`` for each category not yet
complete (one at a time, so memory is one category's share) and records it in the manifest. Every rank
calls it; rank 0 alone writes the manifest. User errors reach every rank as ``CollectiveError``.
"""

from __future__ import annotations

import json
import math
import re
import resource
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from frod_ds import distributed as D
from frod_ds.apply import DEFAULT_TARGETS
from frod_ds.hf_checkpoint import HFCheckpoint, resolve_model_dir
from frod_ds.hjd import no_tf32
from frod_ds.hjd_tsqr import CategoryResult, run_category
from frod_ds.store import (
    FINGERPRINT_METHOD,
    FORMAT_VERSION,
    MANIFEST,
    atomic_write_json,
    dtype_name,
    fsync_dir,
    is_store_file,
    sigma_key,
    u_key,
    v_key,
    weights_fingerprint,
)

__all__ = ["StageConfig", "plan_categories", "run_stage"]

GiB = 2**30
U_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
CONFIG_KEYS = ("format_version", "fingerprint", "targets", "pi", "hjd_dtype")


@dataclass
class StageConfig:
    """What ``launch/hjd.py`` was asked to do; validated on construction."""

    model: str
    out: Path
    targets: tuple[str, ...] = DEFAULT_TARGETS
    pi: float = 1e-3
    dtype: torch.dtype = torch.float32
    block_gb: float = 4.0
    device_cache_gb: float = 16.0
    part_mb: float = 256.0
    device: str = "auto"
    overwrite: bool = False
    fsync: bool = True

    def __post_init__(self) -> None:
        problems = []
        self.out = Path(self.out)
        self.targets = tuple(self.targets)
        if not self.targets or len(set(self.targets)) != len(self.targets) or any(not t or "." in t for t in self.targets):
            problems.append(f"--targets must be distinct module names without dots, got {list(self.targets)}")
        if not (isinstance(self.pi, (int, float)) and math.isfinite(self.pi) and self.pi > 0):
            problems.append(f"--pi must be a finite number > 0, got {self.pi!r}")
        if self.dtype not in (torch.float32, torch.float64):
            problems.append(f"--dtype must be float32 or float64, got {self.dtype}")
        if not self.block_gb > 0:
            problems.append(f"--block-gb must be > 0, got {self.block_gb}")
        if not self.part_mb > 0:
            problems.append(f"--part-mb must be > 0, got {self.part_mb}")
        if not self.device_cache_gb >= 0:
            problems.append(f"--device-cache-gb must be >= 0, got {self.device_cache_gb}")
        if self.device not in ("auto", "cpu", "cuda"):
            problems.append(f"--device must be auto, cpu or cuda, got {self.device!r}")
        if problems:
            raise ValueError("; ".join(problems))


# -------------------------------------------------------------------------------------------- planning


def _natural_key(name: str) -> list[Any]:
    """``layers.10`` after ``layers.9``: digit runs compare as integers."""
    return [int(s) if s.isdigit() else s for s in re.split(r"(\d+)", name)]


def plan_categories(ckpt: HFCheckpoint, targets: Sequence[str]) -> dict[str, list[str]]:
    """``{target: [member, ...]}`` from the checkpoint's tensor names, members in layer order.

    A member is a module ``<path>.<target>`` with a 2-D floating ``<path>.<target>.weight``; all members
    of a category share the input width. Reads shard headers only (and so reports missing or truncated
    shards holding targeted weights).
    """
    found: dict[str, list[str]] = {t: [] for t in targets}
    for key in ckpt.keys():
        if key.endswith(".weight"):
            module = key[: -len(".weight")]
            leaf = module.rsplit(".", 1)[-1]
            if leaf in found:
                found[leaf].append(module)
    missing = [t for t, members in found.items() if not members]
    if missing:
        leaves = sorted({k[: -len(".weight")].rsplit(".", 1)[-1] for k in ckpt.keys() if k.endswith(".weight")})
        raise ValueError(
            f"no weight '<module>.{missing[0]}.weight' in {ckpt.dir} for --targets {missing}; the checkpoint's "
            f"weight names end in: {', '.join(leaves[:24])}"
        )
    for category, members in found.items():
        members.sort(key=_natural_key)
        widths = set()
        for m in members:
            info = ckpt.info(m + ".weight")
            if len(info.shape) != 2:
                raise ValueError(f"{m}.weight has shape {list(info.shape)}; HJD targets 2-D linear weights")
            if info.dtype not in U_DTYPES:
                raise ValueError(f"{m}.weight has dtype {info.dtype}; HJD needs bf16/fp16/fp32/fp64 weights (dequantize first)")
            widths.add(info.shape[1])
        if len(widths) > 1:
            raise ValueError(f"category {category!r} mixes input widths {sorted(widths)}; members must share n")
        dtypes = {ckpt.dtype(m + ".weight") for m in members}
        if len(dtypes) > 1:
            raise ValueError(f"category {category!r} mixes dtypes {sorted(map(str, dtypes))}; convert the checkpoint to one dtype")
    return found


# ---------------------------------------------------------------------------------------------- helpers


def _versions() -> dict[str, str]:
    import safetensors

    import frod_ds

    return {
        "frod_ds": frod_ds.__version__,
        "torch": torch.__version__,
        "safetensors": safetensors.__version__,
        "python": sys.version.split()[0],
    }


def _model_config(model_dir: Path) -> dict[str, Any] | None:
    path = model_dir / "config.json"
    if not path.is_file():
        return None
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
    keys = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "torch_dtype", "dtype")
    return {k: cfg[k] for k in keys if k in cfg}


# ------------------------------------------------------------------------------------------------ store


def _new_manifest(cfg: StageConfig, fingerprint: str, categories: dict[str, list[str]], ckpt: HFCheckpoint) -> dict[str, Any]:
    cats = {}
    for c, members in categories.items():
        cats[c] = {
            "members": members,
            "shapes": {m: list(ckpt.shape(m + ".weight")) for m in members},
            "width": ckpt.shape(members[0] + ".weight")[1],
            "u_dtype": dtype_name(ckpt.dtype(members[0] + ".weight")),
            "complete": False,
        }
    return {
        "format": "frod-factor-store",
        "format_version": FORMAT_VERSION,
        "complete": False,
        "completed_categories": [],
        "base_model": cfg.model,
        "fingerprint": fingerprint,
        "fingerprint_method": FINGERPRINT_METHOD,
        "model_config": _model_config(ckpt.dir),
        "targets": list(cfg.targets),
        "pi": cfg.pi,
        "hjd_dtype": dtype_name(cfg.dtype),
        "categories": cats,
        "world_size": D.get_world_size(),
        "versions": _versions(),
    }


def _remove_store_files(out: Path, category: str | None = None) -> None:
    for p in out.iterdir():
        if is_store_file(p.name, category) or (category is None and p.name in (MANIFEST, MANIFEST + ".tmp")):
            p.unlink()


def _prepare_store(cfg: StageConfig, fresh: dict[str, Any]) -> dict[str, Any]:
    """Rank 0: create the store directory or resume the one there; returns the manifest to continue."""
    out = cfg.out
    mpath = out / MANIFEST
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; pass a directory")
    out.mkdir(parents=True, exist_ok=True)
    manifest = None
    if mpath.is_file():
        try:
            manifest = json.loads(mpath.read_text())
        except json.JSONDecodeError:
            manifest = {}
        diffs = [k for k in CONFIG_KEYS if manifest.get(k) != fresh[k]]
        if diffs and not cfg.overwrite:
            show = ", ".join(f"{k}: {manifest.get(k)!r} there, {fresh[k]!r} now" for k in diffs if k != "fingerprint")
            if "fingerprint" in diffs:
                show = f"built from {manifest.get('base_model')!r} (another model's weights)" + (f"; {show}" if show else "")
            raise ValueError(
                f"--out {out} holds a factor store with a different configuration ({show}); pass --overwrite to "
                "replace it or choose another --out"
            )
        if diffs or cfg.overwrite:
            _remove_store_files(out)
            manifest = None
    elif any(out.iterdir()):
        if not cfg.overwrite:
            raise ValueError(f"--out {out} exists, is not empty and holds no {MANIFEST}; choose a new or empty directory")
        _remove_store_files(out)
    if manifest is None:
        manifest = fresh
    # A completed category whose files went missing is redone.
    for c in list(manifest["completed_categories"]):
        spec = manifest["categories"][c]
        if not all((out / f).is_file() for f in set(spec.get("files", {}).values())):
            manifest["completed_categories"].remove(c)
            spec["complete"] = False
    manifest["complete"] = len(manifest["completed_categories"]) == len(manifest["categories"])
    manifest["world_size"] = D.get_world_size()
    manifest["versions"] = _versions()
    atomic_write_json(mpath, manifest)
    return manifest


def _finish_category(cfg: StageConfig, manifest: dict[str, Any], category: str, outs: list[CategoryResult], seconds: float) -> None:
    """Rank 0: check every file is there, then record the category as complete (manifest replaced)."""
    spec = manifest["categories"][category]
    files: dict[str, str] = {}
    error: dict[str, float] = {}
    stored: dict[str, float] = {}
    for o in outs:
        files.update(o.files)
        error.update(o.error)
        stored.update(o.stored_error)
    expected = {v_key(category)} | {u_key(m) for m in spec["members"]} | {sigma_key(m) for m in spec["members"]}
    assert set(files) == expected, f"{category}: keys written differ from the plan"
    absent = sorted(f for f in set(files.values()) if not (cfg.out / f).is_file())
    if absent:
        raise ValueError(
            f"rank 0 cannot see {absent[0]} written by another rank in {cfg.out}; --out must be on a filesystem "
            "shared by all ranks"
        )
    fsync_dir(cfg.out)
    spec.update(
        files=files,
        error={m: error[m] for m in spec["members"]},
        stored_error={m: stored[m] for m in spec["members"]},
        max_error=max(error.values()),
        max_stored_error=max(stored.values()),
        world_size=D.get_world_size(),
        seconds=round(seconds, 3),
        phase_seconds={k: round(v, 3) for k, v in outs[0].phase_seconds.items()},
        complete=True,
    )
    manifest["completed_categories"].append(category)
    atomic_write_json(cfg.out / MANIFEST, manifest)


def _rank_summary(seconds: float, device: torch.device, ckpt: HFCheckpoint) -> dict[str, Any]:
    out = {
        "rank": D.get_rank(),
        "device": str(device),
        "seconds": round(seconds, 3),
        "peak_host_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB, 3),
        "tensors_read": ckpt.tensors_read,
        "bytes_read": ckpt.bytes_read,
    }
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
        out["peak_device_gib"] = round(torch.cuda.max_memory_allocated(device) / GiB, 3)
        out["peak_device_reserved_gib"] = round(torch.cuda.max_memory_reserved(device) / GiB, 3)
    return out


def _device(cfg: StageConfig) -> torch.device:
    if cfg.device == "cpu":
        return torch.device("cpu")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but no CUDA device is visible")
    return D.local_device()


def run_stage(cfg: StageConfig) -> dict[str, Any]:
    """Build (or finish) the factor store ``cfg.out``; every rank calls it. Returns rank 0's manifest
    (``{}`` on other ranks). User errors: ``CollectiveError`` on every rank."""
    t_start = time.perf_counter()
    device = D.on_all(lambda: _device(cfg))
    if device.type == "cuda":
        torch.cuda.set_device(device)  # a single process has no NCCL init that would create the context
        torch.zeros(1, device=device)  # creates the CUDA context before the memory-stats calls
        torch.cuda.reset_peak_memory_stats(device)
    model_dir = D.on_main(lambda: str(resolve_model_dir(cfg.model)))  # rank 0 downloads first, then the others
    ckpt = D.on_all(lambda: HFCheckpoint(model_dir if D.is_main() else resolve_model_dir(cfg.model)))
    categories = D.on_all(lambda: plan_categories(ckpt, cfg.targets))  # reads shard headers only
    names = [m + ".weight" for members in categories.values() for m in members]
    fingerprint = D.on_main(lambda: weights_fingerprint(ckpt, names))
    manifest = D.on_main(lambda: _prepare_store(cfg, _new_manifest(cfg, fingerprint, categories, ckpt)))
    todo = [c for c in categories if c not in manifest["completed_categories"]]
    skipped = [c for c in categories if c not in todo]
    D.print0(f"HJD {cfg.model}: {len(categories)} categories, world size {D.get_world_size()}, {dtype_name(cfg.dtype)} on "
             f"{device.type}" + (f"; resuming, done: {', '.join(skipped)}" if skipped else ""))
    writer = ThreadPoolExecutor(1, thread_name_prefix="hjd-write")
    loader = ThreadPoolExecutor(1, thread_name_prefix="hjd-read")
    try:
        with no_tf32(), torch.no_grad():
            for category in todo:
                t0 = time.perf_counter()
                D.on_main(lambda: _remove_store_files(cfg.out, category))  # leftovers of a killed run
                out = run_category(ckpt, category, categories[category], pi=cfg.pi, dtype=cfg.dtype, device=device,
                                   out=cfg.out, block_gb=cfg.block_gb, device_cache_gb=cfg.device_cache_gb, part_mb=cfg.part_mb,
                                   fsync=cfg.fsync, loader=loader, writer=writer)
                outs = D.all_gather_object(out)
                D.on_main(lambda: _finish_category(cfg, manifest, category, outs, time.perf_counter() - t0))
    finally:
        writer.shutdown(wait=True)
        loader.shutdown(wait=True)
    ranks = D.all_gather_object(_rank_summary(time.perf_counter() - t_start, device, ckpt))

    def finish() -> dict[str, Any]:
        manifest["run"] = {"seconds": round(time.perf_counter() - t_start, 3), "world_size": D.get_world_size(),
                           "categories_done": todo, "categories_skipped": skipped, "ranks": ranks}
        manifest["complete"] = len(manifest["completed_categories"]) == len(manifest["categories"])
        atomic_write_json(cfg.out / MANIFEST, manifest)
        return manifest

    manifest = D.on_main(finish)
    return manifest if D.is_main() else {}
