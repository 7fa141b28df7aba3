"""Rank 0's side of the factor store directory during the HJD stage: create or resume it, record each
finished category in the manifest (replaced from a background thread), and what each rank did.

The manifest is ``frod_ds.formats.factor_store.Manifest``; a store in ``--out`` is resumed, or gets more categories
(``--categories``), only when it was built with the same configuration (``CONFIG_FIELDS``: targets, π, dtypes,
quantization, model config, the fingerprint of the checkpoint's untargeted tensors) and every category it holds
complete whose weights this run sees has the same weight digests; else ``--overwrite`` is needed.
"""

from __future__ import annotations

import resource
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from frod_ds._moved import forward_names
from frod_ds.core.quant import NF4_BLOCKSIZE
from frod_ds.formats.checksum import has_crc32
from frod_ds.formats.factor_store import (
    MANIFEST,
    CategoryRecord,
    Manifest,
    QuantRecord,
    RankRecord,
    file_globs,
)
from frod_ds.formats.output_dir import MARKER
from frod_ds.formats.ownership import (
    check_not_an_input,
    check_replaceable,
    is_marked,
    marker_kind,
    record_files,
)
from frod_ds.formats.record_check import record_problem
from frod_ds.hjd.category import CategoryResult
from frod_ds.hjd.store_files import (
    KIND,
    aside_problem,
    refuse_edited,
    remove_store_files,
    set_aside,
    stamp_complete,
    unstamp,
)
from frod_ds.io.dtypes import dtype_name
from frod_ds.io.fingerprint import FINGERPRINT_METHOD, combine_digests, tensor_digests
from frod_ds.io.hf_checkpoint import HFCheckpoint
from frod_ds.runtime import distributed as D
from frod_ds.runtime.atomic import atomic_write_text, fsync_dir
from frod_ds.runtime.errors import HJDError, StoreError, note

__all__ = [
    "CONFIG_FIELDS",
    "new_manifest",
    "prepare_store",
    "ManifestWriter",
    "record_category",
    "rank_summary",
]

GiB = 2**30
# a store to resume or add categories to must match on these (the targeted weights: per category, weight_sha256)
CONFIG_FIELDS = (
    "format_version",
    "targets",
    "pi",
    "hjd_dtype",
    "u_dtype",
    "u_quant",
    "model_config",
    "base_fingerprint",
)


def _versions() -> dict[str, str]:
    import safetensors

    import frod_ds

    return {
        "frod_ds": frod_ds.__version__,
        "torch": torch.__version__,
        "safetensors": safetensors.__version__,
        "python": sys.version.split()[0],
    }


def _model_config(ckpt: HFCheckpoint) -> dict[str, Any] | None:
    """The config.json fields the store records (and a resumed run must match); None without a readable config.
    A config that contradicts the weights is refused here, before anything is written (``HFCheckpoint.config``)."""
    cfg = ckpt.config(required=False)
    if cfg is None:
        return None
    keys = (
        "model_type",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "torch_dtype",
        "dtype",
    )
    return {k: cfg[k] for k in keys if k in cfg}


def new_manifest(
    model: str,
    targets: list[str],
    pi: float,
    dtype: torch.dtype,
    u_dtype: torch.dtype | None,
    digests: dict[str, dict[str, str]],
    categories: dict[str, list[str]],
    ckpt: HFCheckpoint,
    quant: str = "none",
    base_fingerprint: str | None = None,
) -> Manifest:
    """The manifest of a store not yet started: this run's ``categories`` planned, none complete. ``u_dtype``: the
    dtype U is stored in (None: each category's checkpoint dtype); ``quant``: nf4 | int8 stores U quantized;
    ``digests``: ``{category: {member: weight digest}}``; ``base_fingerprint``: the checkpoint's other tensors."""
    u_quant = None if quant == "none" else QuantRecord(kind=quant, blocksize=NF4_BLOCKSIZE)
    records = {
        c: CategoryRecord(
            members=members,
            shapes={m: list(ckpt.shape(m + ".weight")) for m in members},
            width=ckpt.shape(members[0] + ".weight")[1],
            u_dtype=dtype_name(u_dtype or ckpt.dtype(members[0] + ".weight")),
            u_quant=u_quant,
            checksums={},
            weight_sha256=dict(digests[c]),
        )
        for c, members in categories.items()
    }
    return Manifest(
        base_model=model,
        fingerprint=_fingerprint(records),
        fingerprint_method=FINGERPRINT_METHOD,
        model_config=_model_config(ckpt),
        targets=list(targets),
        pi=pi,
        hjd_dtype=dtype_name(dtype),
        u_dtype=dtype_name(u_dtype) if u_dtype is not None else "auto",
        u_quant=u_quant,
        base_fingerprint=base_fingerprint,
        categories=records,
        world_size=D.get_world_size(),
        versions=_versions(),
    )


def _fingerprint(records: dict[str, CategoryRecord]) -> str:
    """The store's fingerprint from its categories' member digests: ``weights_fingerprint`` of all their weights."""
    return combine_digests({m + ".weight": d for r in records.values() for m, d in (r.weight_sha256 or {}).items()})


def _config_diffs(manifest: Manifest, fresh: Manifest, ckpt: HFCheckpoint | None = None) -> list[str]:
    """Why ``manifest`` (in ``--out``) cannot take this run's categories: configuration fields that differ, and
    completed categories whose weights this run sees with other digests: this run's categories, and (with
    ``ckpt``) the store's other categories whose weights the checkpoint also holds, so that a ``--categories``
    run on another model's checkpoint cannot add its factors beside the first model's."""
    diffs = [k for k in CONFIG_FIELDS if getattr(manifest, k) != getattr(fresh, k)]
    for c, rec in fresh.categories.items():
        old = manifest.categories.get(c)
        if c in manifest.completed_categories and old is not None and old.weight_sha256 != rec.weight_sha256:
            diffs.append(f"weights:{c}")
    for c in manifest.completed_categories:
        old = manifest.categories.get(c)
        if ckpt is None or c in fresh.categories or old is None or not old.weight_sha256:
            continue
        seen = {m: m + ".weight" for m in old.weight_sha256 if m + ".weight" in ckpt}
        now = tensor_digests(ckpt, seen.values()) if seen else {}
        if any(now[name] != old.weight_sha256[m] for m, name in seen.items()):
            diffs.append(f"weights:{c}")
    return diffs


def _describe(manifest: Manifest, fresh: Manifest, diffs: list[str]) -> str:
    other_weights = [d.split(":", 1)[1] for d in diffs if d.startswith("weights:")]
    if "base_fingerprint" in diffs:
        other_weights.insert(0, "the untargeted tensors")
    shown = ", ".join(
        f"{k}: {getattr(manifest, k)!r} there, {getattr(fresh, k)!r} now"
        for k in diffs
        if k in CONFIG_FIELDS and k != "base_fingerprint"
    )
    if other_weights:
        shown = f"built from {manifest.base_model!r} (another model's weights: {', '.join(other_weights)} differ)" + (
            f"; {shown}" if shown else ""
        )
    return shown


def _existing_manifest(
    out: Path, fresh: Manifest, overwrite: bool, ckpt: HFCheckpoint | None = None
) -> Manifest | None:
    """The manifest in ``out`` with this run's categories merged in, if it is one to resume or extend; ``None``
    if it is to be replaced (``overwrite``); ``HJDError`` if it is of another configuration or model."""
    try:
        manifest = Manifest.read(out / MANIFEST)
        diffs = _config_diffs(manifest, fresh, ckpt)
    except StoreError:
        manifest, diffs = None, ["format_version"]
    if diffs and not overwrite:
        show = "an unreadable manifest" if manifest is None else _describe(manifest, fresh, diffs)
        raise HJDError(
            f"--out {out} holds a factor store with a different configuration ({show}); pass --overwrite to "
            "replace it or choose another --out"
        )
    if diffs or overwrite or manifest is None:
        return None
    for c, rec in fresh.categories.items():  # this run's categories: kept when complete, else planned afresh
        if c not in manifest.completed_categories:
            manifest.categories[c] = rec
    manifest.categories = {t: manifest.categories[t] for t in manifest.targets if t in manifest.categories}
    manifest.fingerprint = _fingerprint(manifest.categories)
    return manifest


def _is_legacy_store(out: Path) -> bool:
    """A factor store written before markers recorded kinds: unmarked, with a manifest that reads as a store's."""
    try:
        Manifest.read(out / MANIFEST)
    except (StoreError, OSError):
        return False
    return True


def _is_store(out: Path) -> bool:
    return marker_kind(out) == KIND if is_marked(out) else _is_legacy_store(out)


def prepare_store(
    out: Path, fresh: Manifest, overwrite: bool, inputs: dict[str, Any] | None = None, ckpt: HFCheckpoint | None = None
) -> Manifest | None:
    """Rank 0: create the store directory, or resume / extend the one there; returns the manifest to continue, or
    None where the store is complete (its file says so) and holds every category asked for: nothing to do, nothing
    written.
    Store files are replaced (``overwrite``, or a corrupt manifest) only where
    ``frod_ds.formats.ownership.check_replaceable`` allows it (a factor store holding nothing else, none of this
    run's ``inputs``), and only those its record lists; each category's files are recorded before they are made."""
    if out.exists() and not out.is_dir():
        raise HJDError(f"--out {out} is a file; pass a directory")
    check_not_an_input(out, inputs, error=HJDError)  # --out the model's own folder: named as such
    if out.is_dir() and any(out.iterdir()) and not overwrite and not _is_store(out):
        problem = record_problem(out)
        if problem is not None:  # the store may be whole: say what is wrong with its record
            raise HJDError(
                f"--out {out}: its ownership record {out / MARKER} is {problem}, not the small JSON file frod-ds "
                "writes; remove it and run the same command again"
            )
        raise HJDError(f"--out {out} exists, is not empty and holds no factor store; choose a new or empty directory")
    # before anything is written; what --overwrite deletes is only what the store's record lists
    check_replaceable(out, KIND, inputs, error=HJDError, legacy=_is_legacy_store, foreign=overwrite)
    out.mkdir(parents=True, exist_ok=True)
    damaged = not (out / MANIFEST).is_file() and any(p.name != MARKER for p in out.iterdir())
    if damaged and not overwrite and not is_marked(out):
        raise HJDError(f"--out {out} holds factor files but no {MANIFEST}; pass --overwrite to start it anew")
    resumable = (out / MANIFEST).is_file()
    manifest = _existing_manifest(out, fresh, overwrite, ckpt) if resumable else None  # reads only
    if resumable and manifest is None and aside_problem(out):  # before anything of out is touched
        raise HJDError(aside_problem(out))
    checked = manifest is None  # replaced, or started anew: the user's edits are looked for now, once
    if checked:
        refuse_edited(out, replacing=resumable)
    planned = [c for c in fresh.targets if c in fresh.categories]
    record_files(out, [MANIFEST, *(g for c in planned for g in file_globs(c))], KIND)  # before any is written
    if resumable and manifest is None:
        set_aside(out)  # until the new store is complete
    elif damaged:  # a store's leftovers without its manifest
        # Without the manifest no factor file can be trusted (which weights, which configuration): a store HJD
        # wrote is started anew (its files only); an unmarked one needs --overwrite (checked above)
        if not overwrite:
            note(f"--out {out} holds factor files but no {MANIFEST} (a damaged store): building it anew")
        remove_store_files(out)
    kept = manifest is not None and manifest.complete  # as its file says: a run killed before the mark is not
    if manifest is None:
        manifest = fresh
    # A completed category whose files went missing, or (resuming a store not marked complete) no longer match their
    # checksums, is redone (by a run that has its weights).
    for c in list(manifest.completed_categories):
        record = manifest.categories[c]
        files = sorted(set(record.files.values()))
        missing = [f for f in files if not (out / f).is_file()]
        changed = [] if missing or kept else [f for f in files if not has_crc32(out / f, record.checksums)]
        if missing or changed:
            if changed:
                note(f"factor store {out}: {', '.join(changed)} no longer match its checksum; redoing {c}")
            manifest.completed_categories.remove(c)
            record.complete = False
    manifest.complete = not manifest.missing_categories
    if kept and manifest.complete and set(fresh.categories) <= set(manifest.completed_categories):
        stamp_complete(out)  # one killed before its stamps (or built before them) is stamped now
        return None  # the store and its record of the run that built it stay as they are
    if not checked:
        refuse_edited(out, replacing=False)
    unstamp(out)
    manifest.world_size = D.get_world_size()
    manifest.versions = _versions()
    atomic_write_text(out / MANIFEST, manifest.to_json())
    return manifest


class ManifestWriter:
    """Rank 0: replaces the manifest from a background thread, in order (the fsyncs of a directory whose
    files are being written can take a second; the GPU need not wait for them)."""

    def __init__(self, out: Path):
        self.path = out / MANIFEST
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="hjd-manifest")
        self._pending: list[Future] = []

    def write(self, manifest: Manifest) -> None:
        text = manifest.to_json()  # a snapshot: the caller goes on changing the record

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


def record_category(
    out: Path, manifest: Manifest, category: str, outs: list[CategoryResult], seconds: float, writer: ManifestWriter
) -> None:
    """Rank 0: check every rank's files are there, then record the category as complete (manifest replaced)."""
    record = manifest.categories[category]
    files: dict[str, str] = {}
    checksums: dict[str, str] = {}
    error: dict[str, float] = {}
    stored: dict[str, float] = {}
    for o in outs:
        files.update(o.files)
        checksums.update(o.checksums)
        error.update(o.error)
        stored.update(o.stored_error)
    assert set(files) == record.expected_keys(), f"{category}: keys written differ from the plan"
    assert set(checksums) == set(files.values()), f"{category}: a file without checksum"
    absent = sorted(f for f in set(files.values()) if not (out / f).is_file())
    if absent:
        raise HJDError(
            f"rank 0 cannot see {absent[0]} written by another rank in {out}; --out must be on a filesystem "
            "shared by all ranks"
        )
    record.files = files
    record.checksums = checksums
    record.error = {m: error[m] for m in record.members}
    record.stored_error = {m: stored[m] for m in record.members}
    record.max_error = max(error.values())
    record.max_stored_error = max(stored.values())
    record.world_size = D.get_world_size()
    record.seconds = round(seconds, 3)
    record.phase_seconds = {k: round(v, 3) for k, v in outs[0].phase_seconds.items()}
    record.method = outs[0].method
    record.cond_estimate = outs[0].cond_estimate
    record.complete = True
    manifest.completed_categories.append(category)
    writer.write(manifest)


def rank_summary(seconds: float, device: torch.device, ckpt: HFCheckpoint) -> RankRecord:
    """What this rank did: time, peak memory, what it read."""
    out = RankRecord(
        rank=D.get_rank(),
        device=str(device),
        seconds=round(seconds, 3),
        cpu_threads=torch.get_num_threads(),
        peak_host_rss_gib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB, 3),
        tensors_read=ckpt.tensors_read,
        bytes_read=ckpt.bytes_read,
    )
    if device.type == "cuda":
        out.gpu = torch.cuda.get_device_name(device)
        out.peak_device_gib = round(torch.cuda.max_memory_allocated(device) / GiB, 3)
        out.peak_device_reserved_gib = round(torch.cuda.max_memory_reserved(device) / GiB, 3)
    return out


# Names that moved to frod_ds.hjd.store_files in 0.2.0: importing them from here warns (frod_ds._moved).
__getattr__ = forward_names(
    __name__,
    dict.fromkeys(
        ("remove_store_files", "discard_unfinished", "restore_aside", "drop_aside", "set_aside", "aside_problem"),
        "frod_ds.hjd.store_files",
    ),
)
