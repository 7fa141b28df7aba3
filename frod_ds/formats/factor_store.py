"""The factor store's on-disk format: file and tensor names, and ``manifest.json`` as typed records.

The layout, every manifest field, the write order that makes ``complete`` true only of a whole store, building
a store one category per ``frod hjd`` run, and the format versions (1 and 2 still read, 3 written) are in
docs/formats.md#the-factor-store. Imports nothing heavy (no torch).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from frod_ds.formats.checksum import file_crc32, format_crc32
from frod_ds.formats.records import parse_json, record_from_dict, record_to_json
from frod_ds.runtime.atomic import TMP
from frod_ds.runtime.errors import StoreError
from frod_ds.runtime.paths import read_small_text

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "READABLE_VERSIONS",
    "MANIFEST",
    "v_key",
    "u_key",
    "sigma_key",
    "v_file",
    "part_file",
    "is_store_file",
    "file_globs",
    "category_of",
    "member_of_key",
    "QuantRecord",
    "CategoryRecord",
    "RankRecord",
    "RunRecord",
    "Manifest",
    "CategoryIdentity",
    "StoreIdentity",
]

FORMAT = "frod-factor-store"
FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
MANIFEST = "manifest.json"


def category_of(member: str) -> str:
    """The category of a module path: its last component (``model.layers.3.mlp.up_proj`` -> ``up_proj``)."""
    return member.rsplit(".", 1)[-1]


def v_key(category: str) -> str:
    return f"{category}.V"


def u_key(member: str) -> str:
    return f"{member}.U"


def sigma_key(member: str) -> str:
    return f"{member}.sigma"


def member_of_key(key: str) -> str:
    """``<member>.U`` / ``<member>.sigma`` -> ``<member>``."""
    return key.rsplit(".", 1)[0]


def v_file(category: str) -> str:
    return f"{category}.V.safetensors"


def part_file(category: str, rank: int, part: int) -> str:
    return f"{category}.rank{rank:05d}.part{part:04d}.safetensors"


_STORE_FILE = re.compile(rf"^[^.]+\.(V|rank\d{{5}}\.part\d{{4}})\.safetensors({re.escape(TMP)})?$")


def is_store_file(name: str, category: str | None = None) -> bool:
    """Whether ``name`` is a factor file (or its temporary) of this format, optionally of ``category``."""
    return bool(_STORE_FILE.match(name)) and (category is None or name.startswith(category + "."))


def file_globs(category: str) -> tuple[str, str]:
    """The names of ``category``'s factor files as globs, for the store's ownership record: written before the
    files are, when a rank's number of parts is not known yet."""
    return v_file(category), f"{category}.rank[0-9]*.part[0-9]*.safetensors"


@dataclass(frozen=True)
class QuantRecord:
    """How a store's ``U_i`` are quantized (``frod hjd --quant``): ``frod_ds.core.quant`` blobs of this kind."""

    kind: str  # "nf4" | "int8"
    blocksize: int  # NF4 block size (int8 is per row; recorded all the same)


@dataclass
class CategoryRecord:
    """One category: its members and shapes, and, once complete, its files, checksums, errors and route."""

    members: list[str]
    shapes: dict[str, list[int]]  # member -> [m, n]
    width: int  # n
    u_dtype: str  # the dtype U is stored in: the checkpoint's, or the manifest's u_dtype
    complete: bool = False
    u_quant: QuantRecord | None = None  # U stored quantized from u_dtype (absent: dense)
    files: dict[str, str] = field(default_factory=dict)  # key -> file
    checksums: dict[str, str] | None = None  # file -> "crc32:…"; None in format 1
    error: dict[str, float] = field(default_factory=dict)
    stored_error: dict[str, float] = field(default_factory=dict)
    max_error: float | None = None
    max_stored_error: float | None = None
    world_size: int | None = None
    seconds: float | None = None
    phase_seconds: dict[str, float] = field(default_factory=dict)
    method: str | None = None  # "gram" | "householder"
    cond_estimate: float | None = None  # Gram route's lower bound of cond(R)
    weight_sha256: dict[str, str] | None = (
        None  # member -> frod_ds.io.fingerprint.tensor_digests of its weight (format 3)
    )

    def expected_keys(self) -> set[str]:
        """Every tensor key a complete category has."""
        (category,) = {category_of(m) for m in self.members}
        return {v_key(category)} | {u_key(m) for m in self.members} | {sigma_key(m) for m in self.members}

    @property
    def u_storage(self) -> str:
        """How ``U_i`` is stored: its dtype, and the quantization over it."""
        return self.u_dtype + (f"+{self.u_quant.kind}" if self.u_quant is not None else "")


@dataclass(kw_only=True)
class RankRecord:
    """What one rank of the HJD stage did."""

    rank: int
    device: str
    seconds: float
    cpu_threads: int | None = None  # torch's intra-op threads (absent in stores of older versions)
    peak_host_rss_gib: float
    tensors_read: int
    bytes_read: int
    gpu: str | None = None
    peak_device_gib: float | None = None
    peak_device_reserved_gib: float | None = None


@dataclass
class RunRecord:
    """The last run of the HJD stage over this store."""

    seconds: float
    startup_s: float | None
    prologue_s: float
    world_size: int
    categories_done: list[str]
    categories_skipped: list[str]
    ranks: list[RankRecord]


@dataclass(kw_only=True)
class Manifest:
    """``manifest.json``; :meth:`to_json` / :meth:`from_json` are its only writer and reader."""

    format: str = FORMAT
    format_version: int = FORMAT_VERSION
    complete: bool = False
    completed_categories: list[str] = field(default_factory=list)
    base_model: str  # what --model named (Hub id or directory) in the run that created the store
    fingerprint: str  # frod_ds.io.fingerprint.weights_fingerprint of every member's weight (of the planned categories)
    fingerprint_method: str
    model_config: dict[str, Any] | None  # a few config.json fields (model_type, hidden_size, ...)
    targets: list[str]
    pi: float
    hjd_dtype: str  # "float32" | "float64"
    u_dtype: str = "auto"  # "auto": each category's checkpoint dtype; else --u-dtype (absent before it existed: auto)
    u_quant: QuantRecord | None = None  # --quant nf4|int8 (absent: U stored dense)
    base_fingerprint: str | None = None  # frod_ds.io.fingerprint.base_fingerprint: the other tensors (format 3)
    categories: dict[str, CategoryRecord]  # the targets planned so far (all of them once complete)
    world_size: int
    versions: dict[str, str]  # frod_ds, torch, safetensors, python
    run: RunRecord | None = None

    def to_json(self) -> str:
        return record_to_json(self)

    @classmethod
    def from_json(cls, text: str, where: str | Path) -> Manifest:
        """Parse and check a manifest; ``StoreError`` naming ``where`` when it is not one this code reads."""
        data = parse_json(text, where, StoreError, "; rebuild the store with frod hjd --overwrite")
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise StoreError(f"{where} is not a FRoD factor store manifest")
        version = data.get("format_version")
        if version not in READABLE_VERSIONS:
            raise StoreError(
                f"{where} has format version {version}, this code reads {', '.join(map(str, READABLE_VERSIONS))}; "
                "rebuild the store with this version's frod hjd"
                + (" or upgrade frod-ds" if isinstance(version, int) and version > FORMAT_VERSION else "")
            )
        manifest = record_from_dict(cls, data, str(where), StoreError)
        unknown = [c for c in manifest.completed_categories if c not in manifest.categories]
        if unknown:
            raise StoreError(f"{where}: completed category {unknown[0]!r} is not in 'categories'; rebuild the store")
        return manifest

    @classmethod
    def read(cls, path: Path) -> Manifest:
        remedy = "the store is damaged: build it again with frod hjd --overwrite"
        return cls.from_json(read_small_text(path, StoreError, "factor-store manifest", remedy), path)

    @property
    def has_checksums(self) -> bool:
        return self.format_version >= 2

    def edited_files(self, folder: Path) -> list[str]:
        """The files this manifest records a checksum for that are in ``folder`` with other bytes (a user's edit or
        a foreign file under a store's name): each is read whole for its CRC-32."""
        out = []
        for record in self.categories.values():
            for name, want in sorted((record.checksums or {}).items()):
                path = Path(folder) / name
                if path.is_symlink() or (path.exists() and not path.is_file()):
                    out.append(name)
                elif path.is_file() and format_crc32(file_crc32(path)) != want:
                    out.append(name)
        return out

    @property
    def missing_categories(self) -> list[str]:
        """Targets not yet complete, in target order."""
        return [t for t in self.targets if t not in self.completed_categories]


@dataclass(frozen=True)
class CategoryIdentity:
    """What makes a category's factors these factors: a sha256 of its ``V`` and the HJD route."""

    v_sha256: str | None  # None: not recorded (adapter format 1)
    method: str | None
    u_storage: str | None = None  # how U_i is stored ("bfloat16", "float32+nf4"); None: not recorded


@dataclass(frozen=True)
class StoreIdentity:
    """The identity of a factor store as an adapter or a training run depends on it: the base weights'
    fingerprint, π, and per category ``CategoryIdentity``. Fields that are ``None`` were not recorded."""

    fingerprint: str | None
    pi: float | None
    categories: dict[str, CategoryIdentity]
    hjd_dtype: str | None = None  # the precision HJD computed in: U_i and σ_i differ with it, V need not

    def differences(self, other: StoreIdentity) -> list[str]:
        """What differs between ``self`` (recorded) and ``other`` (found), comparing only recorded fields."""
        out = []
        if self.fingerprint is not None and other.fingerprint is not None and self.fingerprint != other.fingerprint:
            out.append(f"base weights fingerprint {self.fingerprint[:16]}… there, {other.fingerprint[:16]}… here")
        if self.pi is not None and other.pi is not None and self.pi != other.pi:
            out.append(f"pi {self.pi:g} there, {other.pi:g} here")
        if self.hjd_dtype is not None and other.hjd_dtype is not None and self.hjd_dtype != other.hjd_dtype:
            out.append(f"HJD in {self.hjd_dtype} there, {other.hjd_dtype} here")
        for c, mine in self.categories.items():
            if mine.v_sha256 is None and mine.method is None:
                continue  # nothing recorded for it
            theirs = other.categories.get(c)
            if theirs is None:
                out.append(f"no category {c!r} here")
                continue
            if mine.v_sha256 is not None and theirs.v_sha256 is not None and mine.v_sha256 != theirs.v_sha256:
                out.append(f"V of {c} differs")
            if mine.method is not None and theirs.method is not None and mine.method != theirs.method:
                out.append(f"{c} by the {mine.method} route there, {theirs.method} here")
            if mine.u_storage is not None and theirs.u_storage is not None and mine.u_storage != theirs.u_storage:
                out.append(f"U of {c} stored as {mine.u_storage} there, {theirs.u_storage} here")
        return out

    def to_json(self) -> str:
        return record_to_json(self)

    @classmethod
    def from_json(cls, text: str, where: str | Path) -> StoreIdentity:
        return record_from_dict(cls, parse_json(text, where, StoreError), str(where), StoreError)
