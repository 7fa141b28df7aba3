"""The distributed HJD stage (spec §1, "Distributed HJD"): checkpoint shards in, factor store out.

``run_stage`` plans this run's categories from the checkpoint's tensor names, fingerprints the weights, creates,
resumes or extends the store (``store_writer``), then factors each category not yet complete, one at a time
(``read_pass``, then a route): the next category's reads and the last one's writes overlap the compute, and a
category enters the manifest one behind it. Every rank calls it; rank 0 alone writes the manifest; user errors
reach every rank as ``CollectiveError``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from frod_ds.core.quant import QUANT_KINDS
from frod_ds.formats.factor_store import MANIFEST, Manifest, RunRecord
from frod_ds.formats.lease import holding
from frod_ds.hjd import store_files, store_writer
from frod_ds.hjd.category import CategoryResult, Phases, open_category
from frod_ds.hjd.math import no_tf32
from frod_ds.hjd.routes import RouteOptions, factor_category, read_pass
from frod_ds.hjd.sharding import DEFAULT_TARGETS, my_members, plan_categories
from frod_ds.hjd.streaming import FactorWriter, MemberReader
from frod_ds.io.dtypes import FLOAT_DTYPES, dtype_name
from frod_ds.io.fingerprint import base_fingerprint, tensor_digests
from frod_ds.io.hf_checkpoint import HFCheckpoint
from frod_ds.io.model_dir import resolve_model_dir
from frod_ds.runtime import distributed as D
from frod_ds.runtime.atomic import DISK_FULL_ERRNOS, atomic_write_text, disk_full_line
from frod_ds.runtime.errors import FrodError, HJDError
from frod_ds.runtime.shared_dir import check_shared_dir
from frod_ds.runtime.validate import device_problem, pi_problem, targets_problem

__all__ = ["StageConfig", "run_stage"]

GiB = 2**30


@dataclass
class StageConfig:
    """What ``frod hjd`` was asked to do; validated on construction."""

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
    quant: str = "none"  # none | nf4 | int8: U_i written quantized (frod_ds.core.quant blobs), from U in u_dtype
    categories: tuple[str, ...] | None = None  # the targets this run decomposes (None: all); the store holds targets

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        self.targets = tuple(self.targets)
        self.categories = self.targets if self.categories is None else tuple(self.categories)
        problems = [p for p in (targets_problem(self.targets, "--targets"), pi_problem(self.pi, "--pi")) if p]
        strangers = [c for c in self.categories if c not in self.targets]
        if strangers or not self.categories:
            problems.append(
                f"--categories {list(self.categories)} must be a non-empty subset of --targets "
                f"{list(self.targets)} (the store's categories)"
            )
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
        if self.u_dtype is not None and self.u_dtype not in FLOAT_DTYPES.values():
            problems.append(f"--u-dtype must be auto or one of {list(FLOAT_DTYPES)}, got {self.u_dtype}")
        if self.quant not in QUANT_KINDS:
            problems.append(f"--quant must be one of {', '.join(QUANT_KINDS)}, got {self.quant!r}")
        if not self.prefetch_gb > 0:
            problems.append(f"--prefetch-gb must be > 0, got {self.prefetch_gb}")
        if self.device not in ("auto", "cpu", "cuda"):
            problems.append(f"--device must be auto, cpu or cuda, got {self.device!r}")
        if problems:
            raise HJDError("; ".join(problems))

    @property
    def routes(self) -> RouteOptions:
        return RouteOptions(pi=self.pi, dtype=self.dtype, method=self.method, block_bytes=self.block_gb * GiB)


def _device(cfg: StageConfig) -> torch.device:
    if cfg.device == "cpu":
        return torch.device("cpu")
    problem = device_problem(cfg.device) if cfg.device == "cuda" else None
    if problem:
        raise HJDError(problem)
    return D.local_device()


def _open(cfg: StageConfig) -> tuple[torch.device, HFCheckpoint, dict[str, list[str]], Manifest | None]:
    """Every rank: the device, the checkpoint, the plan; rank 0 creates or resumes the store (None: it is complete
    and holds every category asked for). User errors on any rank stop all of them here, before any work."""
    device = D.on_all(lambda: _device(cfg))
    if device.type == "cuda":
        torch.cuda.set_device(device)  # a single process has no NCCL init that would create the context
        torch.zeros(1, device=device)  # creates the CUDA context before the memory-stats calls
        torch.cuda.reset_peak_memory_stats(device)
    model_dir = D.on_main(lambda: str(resolve_model_dir(cfg.model)))  # rank 0 downloads first, then the others
    ckpt = D.on_all(lambda: HFCheckpoint(model_dir if D.is_main() else resolve_model_dir(cfg.model)))
    D.on_all(lambda: ckpt.config(required=False))  # a config.json of other sizes than the weights: refused first
    categories = D.on_all(lambda: plan_categories(ckpt, cfg.categories))  # reads shard headers only

    def fresh() -> Manifest:
        by_name = tensor_digests(ckpt, [m + ".weight" for members in categories.values() for m in members])
        digests = {c: {m: by_name[m + ".weight"] for m in members} for c, members in categories.items()}
        return store_writer.new_manifest(
            cfg.model,
            list(cfg.targets),
            cfg.pi,
            cfg.dtype,
            cfg.u_dtype,
            digests,
            categories,
            ckpt,
            cfg.quant,
            base_fingerprint(ckpt, cfg.targets),
        )

    manifest = D.on_main(
        lambda: store_writer.prepare_store(cfg.out, fresh(), cfg.overwrite, {"--model": model_dir}, ckpt)
    )
    check_shared_dir(cfg.out, "--out")  # every rank writes its members' factors there
    return device, ckpt, categories, manifest


class _Recorder:
    """Enters categories into the manifest once their files are on disk, one category behind the compute."""

    def __init__(self, cfg: StageConfig, manifest: Manifest):
        self.cfg, self.manifest = cfg, manifest
        self.writer = store_writer.ManifestWriter(cfg.out) if D.is_main() else None
        self.pending: tuple[str, CategoryResult, float] | None = None

    def record_pending(self) -> None:
        """Collective: wait for the pending category's files on every rank, then rank 0 records it."""
        if self.pending is None:
            return
        category, out, seconds = self.pending
        self.pending = None
        error = None
        t_wait = time.perf_counter()
        try:
            out.wait()
            out.phase_seconds["write_wait"] = round(time.perf_counter() - t_wait, 3)
        except OSError as e:
            error = (
                disk_full_line(e)
                if e.errno in DISK_FULL_ERRNOS
                else f"writing the factor store in {self.cfg.out} failed ({e}); check free space and permissions"
            )
        D.agree_on_error(error)
        outs = D.all_gather_object(out)
        D.on_main(
            lambda: store_writer.record_category(self.cfg.out, self.manifest, category, outs, seconds, self.writer)
        )

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _factor_all(
    cfg: StageConfig,
    ckpt: HFCheckpoint,
    categories: dict[str, list[str]],
    todo: list[str],
    device: torch.device,
    reader: MemberReader,
    writer: FactorWriter,
    recorder: _Recorder,
) -> None:
    """The categories in ``todo``, one after the other, reads of the next overlapping the compute."""
    rank, world = D.get_rank(), D.get_world_size()
    if todo:
        reader.schedule(my_members(categories[todo[0]], rank, world))
    for j, category in enumerate(todo):
        t0 = time.perf_counter()
        D.on_main(lambda: store_files.remove_store_files(cfg.out, category))  # leftovers of a killed run
        source, sink = open_category(
            ckpt,
            category,
            categories[category],
            reader,
            writer,
            device,
            cfg.dtype,
            cfg.u_dtype,
            cfg.device_cache_gb * GiB,
            cfg.quant,
        )
        try:
            phases = Phases(device)
            G = read_pass(source, sink, phases)  # every read of this category (unless the cache overflows)
            if j + 1 < len(todo):
                reader.schedule(my_members(categories[todo[j + 1]], rank, world))  # read ahead
            out = factor_category(source, sink, G, phases, cfg.routes)  # returns with its writes in flight
        except D.CollectiveError:  # every rank stops here: keep the previous category first
            recorder.record_pending()
            raise
        finally:
            source.close()
            sink.close()
        del source, sink, G  # this category's device memory, before the next one's
        recorder.record_pending()  # its writes had this whole category's compute to finish
        recorder.pending = (category, out, time.perf_counter() - t0)
    recorder.record_pending()


def run_stage(cfg: StageConfig, process_start: float | None = None) -> Manifest | None:
    """Build (or finish) the factor store ``cfg.out``; every rank calls it. Returns rank 0's manifest
    (``None`` on other ranks, and on every rank when the store already held every category asked for: nothing is
    run or written then). User errors: ``CollectiveError`` on every rank. ``process_start``: the
    process's ``time.time()`` at launch, to report start-up time. Rank 0 holds the lease on ``--out`` throughout:
    a second HJD run into the same store is refused at once."""
    with D.held_on_main(lambda: holding(cfg.out, store_files.KIND, "--out", HJDError)):
        try:
            return _build(cfg, process_start)
        except OSError:  # a full disk mid-replacement: the store --overwrite was replacing comes back whole
            if D.is_main():
                store_files.restore_aside(cfg.out)
            raise


def _build(cfg: StageConfig, process_start: float | None) -> Manifest | None:
    t_start = time.perf_counter()
    startup = round(time.time() - process_start, 3) if process_start is not None else None
    existed = cfg.out.exists() if D.is_main() else True  # a store this run creates is removed if it is refused
    device, ckpt, categories, manifest = _open(cfg)
    if manifest is None:  # its manifest keeps the record of the run that built it
        D.print0(f"{cfg.out} already holds every category asked for, complete: nothing to do, the store left as it was")
        return None
    todo = [c for c in categories if c not in manifest.completed_categories]
    skipped = [c for c in categories if c not in todo]
    D.print0(
        f"HJD {cfg.model}: {len(categories)} categories, world size {D.get_world_size()}, {dtype_name(cfg.dtype)} on "
        f"{device.type}" + (f"; resuming, done: {', '.join(skipped)}" if skipped else "")
    )
    reader = MemberReader(ckpt, device, threads=cfg.io_threads, ahead_bytes=cfg.prefetch_gb * GiB)
    writer = FactorWriter(
        cfg.out,
        fsync=cfg.fsync,
        part_bytes=cfg.part_mb * 2**20,
        threads=max(1, cfg.io_threads // 2),
        buffer_bytes=min(cfg.prefetch_gb, 1.0) * GiB,
    )
    recorder = _Recorder(cfg, manifest)
    prologue = round(time.perf_counter() - t_start, 3)
    refused = False
    try:
        with no_tf32(), torch.no_grad():
            _factor_all(cfg, ckpt, categories, todo, device, reader, writer, recorder)
    except FrodError:  # bad weights (NaN, a failed probe): nothing unfinished is left; a killed run stays resumable
        refused = True
        raise
    finally:
        reader.close()
        writer.close()
        recorder.close()
        if refused and D.is_main():
            store_files.discard_unfinished(cfg.out, manifest, existed)
            store_files.restore_aside(cfg.out)  # a store --overwrite was replacing
    ranks = D.all_gather_object(store_writer.rank_summary(time.perf_counter() - t_start, device, ckpt))

    def finish() -> Manifest:
        manifest.run = RunRecord(
            seconds=round(time.perf_counter() - t_start, 3),
            startup_s=startup,
            prologue_s=prologue,
            world_size=D.get_world_size(),
            categories_done=todo,
            categories_skipped=skipped,
            ranks=ranks,
        )
        manifest.complete = not manifest.missing_categories
        atomic_write_text(cfg.out / MANIFEST, manifest.to_json())
        if manifest.complete:
            store_files.stamp_complete(cfg.out)
        store_files.drop_aside(cfg.out)  # the store --overwrite replaced
        return manifest

    manifest = D.on_main(finish)
    return manifest if D.is_main() else None
