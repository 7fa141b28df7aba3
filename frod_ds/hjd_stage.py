"""Distributed HJD stage (spec §1, "Distributed HJD"): checkpoint shards in, factor store out.

``run_stage`` plans the categories from the checkpoint's tensor names, fingerprints the targeted weights,
creates or resumes the store directory, then runs a ``hjd_tsqr.CategoryJob`` for each category not yet
complete (one at a time, so memory is one category's share) and records it in the manifest. The work
overlaps: while a category is computed the next one's weights are read (``MemberReader``), and a
category's files finish writing (``FactorWriter``) while the next one is computed; it enters the manifest
once every rank's files are on disk, one category behind the compute (a killed run redoes at most the
last two). Every rank calls it; rank 0 alone writes the manifest.
User errors reach every rank as ``CollectiveError``.
"""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from frod_ds import distributed as D
from frod_ds.hf_checkpoint import HFCheckpoint, resolve_model_dir
from frod_ds.hjd import no_tf32
from frod_ds.hjd_io import FactorWriter, MemberReader
from frod_ds.hjd_plan import DEFAULT_TARGETS, my_members, targeted_members
from frod_ds.hjd_tsqr import CategoryJob, CategoryResult
from frod_ds.quant import NF4_BLOCKSIZE, QUANT_KINDS
from frod_ds.store import (
    FINGERPRINT_METHOD,
    FORMAT_VERSION,
    MANIFEST,
    atomic_write_json,
    atomic_write_text,
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
CONFIG_KEYS = ("format_version", "fingerprint", "targets", "pi", "hjd_dtype", "u_dtype", "u_quant")
CONFIG_DEFAULTS = {"u_dtype": "auto", "u_quant": None}  # what a manifest written before the key existed meant


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
    method: str = "auto"
    io_threads: int = 8
    prefetch_gb: float = 4.0
    u_dtype: torch.dtype | None = None  # None: each category's checkpoint dtype
    quant: str = "none"  # none | nf4 | int8: U_i written quantized (frod_ds.quant blobs), from U in u_dtype

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
        if self.method not in ("auto", "householder"):
            problems.append(f"--method must be auto or householder, got {self.method!r}")
        if not (isinstance(self.io_threads, int) and self.io_threads >= 1):
            problems.append(f"--io-threads must be an integer >= 1, got {self.io_threads!r}")
        if self.u_dtype is not None and self.u_dtype not in U_DTYPES:
            problems.append(f"--u-dtype must be auto or one of {[dtype_name(d) for d in U_DTYPES]}, got {self.u_dtype}")
        if not self.prefetch_gb > 0:
            problems.append(f"--prefetch-gb must be > 0, got {self.prefetch_gb}")
        if self.quant not in QUANT_KINDS:
            problems.append(f"--quant must be one of {', '.join(QUANT_KINDS)}, got {self.quant!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            problems.append(f"--device must be auto, cpu or cuda, got {self.device!r}")
        if problems:
            raise ValueError("; ".join(problems))


# -------------------------------------------------------------------------------------------- planning


def plan_categories(ckpt: HFCheckpoint, targets: Sequence[str]) -> dict[str, list[str]]:
    """``{target: [member, ...]}`` from the checkpoint's tensor names, members in layer order.

    A member is a module ``<path>.<target>`` with a 2-D floating ``<path>.<target>.weight``; all members
    of a category share the input width. Reads shard headers only (and so reports missing or truncated
    shards holding targeted weights).
    """
    found = targeted_members(ckpt.keys(), targets)
    missing = [t for t, members in found.items() if not members]
    if missing:
        leaves = sorted({k[: -len(".weight")].rsplit(".", 1)[-1] for k in ckpt.keys() if k.endswith(".weight")})
        raise ValueError(
            f"no weight '<module>.{missing[0]}.weight' in {ckpt.dir} for --targets {missing}; the checkpoint's "
            f"weight names end in: {', '.join(leaves[:24])}"
        )
    for category, members in found.items():
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


def _u_quant(cfg: StageConfig) -> dict[str, Any] | None:
    return None if cfg.quant == "none" else {"kind": cfg.quant, "blocksize": NF4_BLOCKSIZE}


def _new_manifest(cfg: StageConfig, fingerprint: str, categories: dict[str, list[str]], ckpt: HFCheckpoint) -> dict[str, Any]:
    cats = {}
    for c, members in categories.items():
        cats[c] = {
            "members": members,
            "shapes": {m: list(ckpt.shape(m + ".weight")) for m in members},
            "width": ckpt.shape(members[0] + ".weight")[1],
            "u_dtype": dtype_name(cfg.u_dtype or ckpt.dtype(members[0] + ".weight")),
            "u_quant": _u_quant(cfg),
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
        "u_dtype": dtype_name(cfg.u_dtype) if cfg.u_dtype is not None else "auto",
        "u_quant": _u_quant(cfg),
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
        diffs = [k for k in CONFIG_KEYS if manifest.get(k, CONFIG_DEFAULTS.get(k)) != fresh[k]]
        if diffs and not cfg.overwrite:
            show = ", ".join(f"{k}: {manifest.get(k, CONFIG_DEFAULTS.get(k))!r} there, {fresh[k]!r} now"
                             for k in diffs if k != "fingerprint")
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


class _ManifestWriter:
    """Rank 0: replaces the manifest from a background thread, in order (the fsyncs of a directory whose
    files are being written can take a second; the GPU need not wait for them)."""

    def __init__(self, out: Path):
        self.path = out / MANIFEST
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="hjd-manifest")
        self._pending: list[Future] = []

    def write(self, manifest: dict[str, Any]) -> None:
        text = json.dumps(manifest, indent=1) + "\n"  # a snapshot: the caller goes on changing the dict

        def run() -> None:
            fsync_dir(self.path.parent)  # the renamed factor files first
            atomic_write_text(self.path, text)

        self._pending.append(self._pool.submit(run))
        done = [f for f in self._pending if f.done()]
        for f in done:
            self._pending.remove(f)
            f.result()  # raise an error of an earlier write here

    def flush(self) -> None:
        for f in self._pending:
            f.result()
        self._pending = []

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self._pool.shutdown(wait=True)


def _finish_category(cfg: StageConfig, manifest: dict[str, Any], category: str, outs: list[CategoryResult], seconds: float,
                     writer: _ManifestWriter) -> None:
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
    spec.update(
        files=files,
        error={m: error[m] for m in spec["members"]},
        stored_error={m: stored[m] for m in spec["members"]},
        max_error=max(error.values()),
        max_stored_error=max(stored.values()),
        world_size=D.get_world_size(),
        seconds=round(seconds, 3),
        phase_seconds={k: round(v, 3) for k, v in outs[0].phase_seconds.items()},
        method=outs[0].method,
        cond_estimate=outs[0].cond_estimate,
        complete=True,
    )
    manifest["completed_categories"].append(category)
    writer.write(manifest)


def _rank_summary(seconds: float, device: torch.device, ckpt: HFCheckpoint) -> dict[str, Any]:
    out = {
        "rank": D.get_rank(),
        "device": str(device),
        "seconds": round(seconds, 3),
        "cpu_threads": torch.get_num_threads(),
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


def run_stage(cfg: StageConfig, process_start: float | None = None) -> dict[str, Any]:
    """Build (or finish) the factor store ``cfg.out``; every rank calls it. Returns rank 0's manifest
    (``{}`` on other ranks). User errors: ``CollectiveError`` on every rank. ``process_start``: the
    process's ``time.time()`` at launch, to report start-up time."""
    t_start = time.perf_counter()
    startup = round(time.time() - process_start, 3) if process_start is not None else None
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
    reader = MemberReader(ckpt, device, threads=cfg.io_threads, ahead_bytes=cfg.prefetch_gb * GiB)
    writer = FactorWriter(cfg.out, fsync=cfg.fsync, part_bytes=cfg.part_mb * 2**20, threads=max(1, cfg.io_threads // 2),
                          buffer_bytes=min(cfg.prefetch_gb, 1.0) * GiB)
    rank, world = D.get_rank(), D.get_world_size()
    pending: tuple[str, CategoryResult, float] | None = None
    manifest_writer = _ManifestWriter(cfg.out) if D.is_main() else None

    def record(category: str, out: CategoryResult, seconds: float) -> None:
        """Once this rank's files of ``category`` are on disk (all ranks): into the manifest."""
        error = None
        t_wait = time.perf_counter()
        try:
            out.wait()
            out.phase_seconds["write_wait"] = round(time.perf_counter() - t_wait, 3)
        except OSError as e:
            error = f"writing the factor store in {cfg.out} failed ({e}); check free space and permissions"
        D.agree_on_error(error)
        outs = D.all_gather_object(out)
        D.on_main(lambda: _finish_category(cfg, manifest, category, outs, seconds, manifest_writer))

    prologue = round(time.perf_counter() - t_start, 3)
    try:
        with no_tf32(), torch.no_grad():
            if todo:
                reader.schedule(my_members(categories[todo[0]], rank, world))
            for j, category in enumerate(todo):
                t0 = time.perf_counter()
                D.on_main(lambda: _remove_store_files(cfg.out, category))  # leftovers of a killed run
                job = CategoryJob(ckpt, category, categories[category], reader=reader, writer=writer, pi=cfg.pi,
                                  dtype=cfg.dtype, device=device, block_gb=cfg.block_gb,
                                  device_cache_gb=cfg.device_cache_gb, method=cfg.method, u_dtype=cfg.u_dtype,
                                  quant=cfg.quant)
                try:
                    job.gram_pass()  # every read of this category (unless the cache overflows)
                    if j + 1 < len(todo):
                        reader.schedule(my_members(categories[todo[j + 1]], rank, world))  # read ahead
                    out = job.finish()  # returns with this category's writes in flight
                except D.CollectiveError:  # every rank stops here: keep the previous category first
                    if pending is not None:
                        record(*pending)
                    raise
                finally:
                    job.close()
                if pending is not None:  # its writes had this whole category's compute to finish
                    record(*pending)
                pending = (category, out, time.perf_counter() - t0)
                del job
            if pending is not None:
                record(*pending)
    finally:
        reader.close()
        writer.close()
        if manifest_writer is not None:
            manifest_writer.close()
    ranks = D.all_gather_object(_rank_summary(time.perf_counter() - t_start, device, ckpt))

    def finish() -> dict[str, Any]:
        manifest["run"] = {"seconds": round(time.perf_counter() - t_start, 3), "startup_s": startup,
                           "prologue_s": prologue, "world_size": D.get_world_size(),
                           "categories_done": todo, "categories_skipped": skipped, "ranks": ranks}
        manifest["complete"] = len(manifest["completed_categories"]) == len(manifest["categories"])
        atomic_write_json(cfg.out / MANIFEST, manifest)
        return manifest

    manifest = D.on_main(finish)
    return manifest if D.is_main() else {}
