"""The factor store: HJD factors of a base model on disk, written by ``launch/hjd.py``, read by training,
export and the other tools.

Layout of a store directory::

    manifest.json                              written last, atomically replaced; the only index
    <category>.V.safetensors                   key "<category>.V": (n, n) fp32
    <category>.rank<PPPPP>.part<BBBB>.safetensors
                                               keys "<member>.U": (m, n) in the checkpoint's dtype,
                                                    "<member>.sigma": (n,) fp32
                                               (built with --quant nf4|int8: "<member>.U" is the (nbytes,)
                                               uint8 blob of frod_ds.quant, dequantized by load_U)

``<member>`` is the module's path in the HF model (``model.layers.3.self_attn.q_proj``; its weight is
``<member>.weight``), ``<category>`` the target name (``q_proj``); members are in layer order. The
manifest's ``categories[c]["files"]`` maps every key to its file, so readers never scan the directory.
Every file is written under ``<name>.tmp`` and renamed; a category enters ``completed_categories`` only
after all its files are renamed (and fsynced); ``"complete": true`` is written last. A store whose
manifest says complete is complete.

Manifest (``format_version`` 1)::

    format, format_version, complete, completed_categories
    base_model            what --model named (Hub id or directory)
    fingerprint           weights_fingerprint() of every member's weight, fingerprint_method
    model_config          a few config.json fields (model_type, hidden_size, ...), or null
    targets, pi, hjd_dtype ("float32" | "float64"), u_dtype ("auto": the checkpoint's, or --u-dtype)
    u_quant               null, or {kind: "nf4" | "int8", blocksize} when U is stored quantized
    categories: {c: {members, shapes {member: [m, n]}, width, u_dtype, u_quant, complete,
                     files {key: file}, error {member: e}, stored_error {member: e},
                     max_error, max_stored_error, world_size, seconds, phase_seconds,
                     method ("gram" | "householder"), cond_estimate (Gram route's bound of cond(R))}}
    world_size, versions {frod_ds, torch, safetensors, python},
    run {seconds, startup_s, prologue_s, world_size, categories_done, categories_skipped, ranks: [...]}

``error`` is ``‖W_i − U_i diag(σ_i) Vᵀ‖_F / ‖W_i‖_F`` with the factors in ``hjd_dtype``; ``stored_error``
the same with the stored tensors (U rounded to the category's ``u_dtype``, or quantized from it and
dequantized; σ and V in fp32).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from frod_ds.hf_checkpoint import HFCheckpoint, resolve_model_dir
from frod_ds.hjd import reconstruction_error
from frod_ds.quant import QuantSpec

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST",
    "FINGERPRINT_METHOD",
    "FactorStore",
    "weights_fingerprint",
    "check_store_matches",
    "verify_store",
    "dtype_name",
    "dtype_from_name",
    "v_key",
    "u_key",
    "sigma_key",
    "v_file",
    "part_file",
    "is_store_file",
    "atomic_write_json",
    "save_tensors_atomic",
    "fsync_dir",
]

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TMP = ".tmp"
FINGERPRINT_METHOD = "sha256-sampled-v1"
_SAMPLE_EDGE = 64 * 1024  # bytes hashed at each end of a tensor
_SAMPLE_BLOCK = 4 * 1024  # bytes hashed at each strided position
_SAMPLE_STRIDES = 4  # strided positions between the two ends

_DTYPES = {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def v_key(category: str) -> str:
    return f"{category}.V"


def u_key(member: str) -> str:
    return f"{member}.U"


def sigma_key(member: str) -> str:
    return f"{member}.sigma"


def v_file(category: str) -> str:
    return f"{category}.V.safetensors"


def part_file(category: str, rank: int, part: int) -> str:
    return f"{category}.rank{rank:05d}.part{part:04d}.safetensors"


_STORE_FILE = re.compile(r"^[^.]+\.(V|rank\d{5}\.part\d{4})\.safetensors(\.tmp)?$")


def is_store_file(name: str, category: str | None = None) -> bool:
    """Whether ``name`` is a factor file (or its temporary) of this format, optionally of ``category``."""
    return bool(_STORE_FILE.match(name)) and (category is None or name.startswith(category + "."))


# ---------------------------------------------------------------------------------------------- writing


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_json(path: Path, obj: Any) -> None:
    """Write ``path`` via ``path.tmp`` + fsync + rename: readers see the old or the new file, never half."""
    atomic_write_text(path, json.dumps(obj, indent=1, sort_keys=False) + "\n")


def atomic_write_text(path: Path, text: str) -> None:
    """:func:`atomic_write_json` for text already serialised."""
    tmp = path.with_name(path.name + TMP)
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.uint8: "U8"}


def safetensors_header(entries: Sequence[tuple[str, torch.dtype, Sequence[int]]]) -> tuple[bytes, dict[str, int]]:
    """The leading bytes of a safetensors file holding ``entries`` (name, dtype, shape) in this order:
    8-byte length + JSON header, padded so the data starts 8-byte aligned. Also returns each tensor's
    offset from the start of the file."""
    header: dict[str, Any] = {}
    offset = 0
    for name, dtype, shape in entries:
        assert dtype in _ST_DTYPES, f"{name}: float or uint8 dtype expected, got {dtype}"
        nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    start = 8 + len(raw)
    offsets = {name: start + header[name]["data_offsets"][0] for name, _, _ in entries}
    return len(raw).to_bytes(8, "little") + raw, offsets


def save_tensors_atomic(path: Path, tensors: dict[str, Tensor], fsync: bool = True) -> None:
    """Write a safetensors file under ``path.tmp`` and rename it (CPU tensors, float or uint8 dtypes).

    Written straight from the tensors' memory (no serialized copy; the writes release the GIL, so a
    background writer thread overlaps with GPU work). Readable by ``safetensors.safe_open``.
    """
    for name, t in tensors.items():
        assert t.device.type == "cpu", f"{name}: CPU tensor expected"
    head, _ = safetensors_header([(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()])
    tmp = path.with_name(path.name + TMP)
    with open(tmp, "wb") as f:
        f.write(head)
        for t in tensors.values():
            if t.numel():
                f.write(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------ fingerprint


def _sample_ranges(nbytes: int) -> list[tuple[int, int]]:
    """``(offset, length)`` pieces of a tensor's data that the fingerprint hashes."""
    if nbytes <= 2 * _SAMPLE_EDGE + _SAMPLE_STRIDES * _SAMPLE_BLOCK:
        return [(0, nbytes)]
    ranges = [(0, _SAMPLE_EDGE)]
    for j in range(1, _SAMPLE_STRIDES + 1):
        start = (nbytes * j // (_SAMPLE_STRIDES + 1)) // _SAMPLE_BLOCK * _SAMPLE_BLOCK
        ranges.append((start, _SAMPLE_BLOCK))
    ranges.append((nbytes - _SAMPLE_EDGE, _SAMPLE_EDGE))
    return ranges


def weights_fingerprint(ckpt: HFCheckpoint, names: Sequence[str]) -> str:
    """A cheap, deterministic fingerprint of the tensors ``names`` of a checkpoint (hex sha256).

    Covers, for every name (order does not matter): the name, dtype, shape and byte size, and the sha256
    of a fixed sample of its bytes — the first and last 64 KiB and four 4 KiB blocks at 1/5 … 4/5 of the
    data (the whole tensor when it is smaller than 144 KiB), read at the offsets of the safetensors
    header. About 144 KiB per tensor, so a 70B checkpoint's 480 targeted weights cost ~70 MB of reads.
    Any other model or fine-tune changes it; an edit confined to unsampled bytes does not (``launch/hjd.py
    --verify`` re-checks reconstruction against the full weights of sampled members).
    """
    names = sorted(set(names))
    if not names:
        raise ValueError("weights_fingerprint needs at least one tensor name")
    digests: dict[str, bytes] = {}
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(ckpt.info(name).file, []).append(name)
    for file, file_names in by_file.items():
        with open(file, "rb") as f:
            for name in file_names:
                info = ckpt.info(name)
                h = hashlib.sha256()
                h.update(f"{name}|{dtype_name(info.dtype)}|{list(info.shape)}|{info.nbytes}\n".encode())
                for offset, length in _sample_ranges(info.nbytes):
                    f.seek(info.start + offset)
                    h.update(f.read(length))
                digests[name] = h.digest()
    total = hashlib.sha256(f"{FINGERPRINT_METHOD}\n".encode())
    for name in names:
        total.update(digests[name])
    return total.hexdigest()


# ---------------------------------------------------------------------------------------------- reading


class FactorStore:
    """Read access to a factor store directory (see the module docstring for the format)."""

    def __init__(self, path: Path, manifest: dict[str, Any]):
        self.path = Path(path)
        self.manifest = manifest
        self._category_of = {m: c for c, spec in manifest["categories"].items() for m in spec["members"]}

    @classmethod
    def open(cls, path: str | os.PathLike, allow_incomplete: bool = False) -> FactorStore:
        """Open a store; ``ValueError`` when the directory or manifest is missing, of another format or
        version, or (unless ``allow_incomplete``) not complete."""
        path = Path(path)
        mpath = path / MANIFEST
        if not path.is_dir():
            raise ValueError(f"factor store {path} does not exist; build it with launch/hjd.py --model M --out {path}")
        if not mpath.is_file():
            raise ValueError(f"{path} is not a factor store (no {MANIFEST}); build it with launch/hjd.py")
        try:
            manifest = json.loads(mpath.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{mpath} is not valid JSON ({e}); rebuild the store with launch/hjd.py --overwrite") from None
        if manifest.get("format") != "frod-factor-store":
            raise ValueError(f"{mpath} is not a FRoD factor store manifest")
        if manifest.get("format_version") != FORMAT_VERSION:
            raise ValueError(
                f"factor store {path} has format version {manifest.get('format_version')}, this code reads "
                f"{FORMAT_VERSION}; rebuild it with this version's launch/hjd.py"
            )
        store = cls(path, manifest)
        if not allow_incomplete and not store.complete:
            done = manifest.get("completed_categories", [])
            missing = [c for c in manifest["categories"] if c not in done]
            raise ValueError(
                f"factor store {path} is incomplete (done: {done}, missing: {missing}); rerun launch/hjd.py "
                "with the same arguments to finish it"
            )
        return store

    @property
    def complete(self) -> bool:
        return bool(self.manifest.get("complete"))

    @property
    def categories(self) -> dict[str, list[str]]:
        """``{category: [member, ...]}``, members in layer order."""
        return {c: list(spec["members"]) for c, spec in self.manifest["categories"].items()}

    @property
    def targets(self) -> list[str]:
        return list(self.manifest["targets"])

    @property
    def fingerprint(self) -> str:
        return self.manifest["fingerprint"]

    @property
    def base_model(self) -> str:
        return self.manifest["base_model"]

    @property
    def pi(self) -> float:
        return float(self.manifest["pi"])

    def category_of(self, member: str) -> str:
        if member not in self._category_of:
            raise ValueError(f"{member!r} is not a member of factor store {self.path} (targets {self.targets})")
        return self._category_of[member]

    def width(self, category: str) -> int:
        return int(self._spec(category)["width"])

    def member_shape(self, member: str) -> tuple[int, int]:
        m, n = self._spec(self.category_of(member))["shapes"][member]
        return int(m), int(n)

    def errors(self, category: str) -> dict[str, float]:
        """Per-member reconstruction error recorded by the HJD run (factors in ``hjd_dtype``)."""
        return dict(self._spec(category).get("error", {}))

    def file_of(self, key: str) -> Path:
        category = key.rsplit(".", 1)[0] if key.endswith(".V") else self.category_of(key.rsplit(".", 1)[0])
        files = self._spec(category).get("files", {})
        if key not in files:
            raise ValueError(f"factor store {self.path} has no tensor {key!r} (category {category!r} incomplete?)")
        return self.path / files[key]

    def load_V(self, category: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> Tensor:
        """The category's shared basis ``V`` (n, n)."""
        self._spec(category)
        return self._load(v_key(category), dtype, device)

    def load_U(self, member: str, dtype: torch.dtype | None = None, device: str | torch.device = "cpu") -> Tensor:
        """``U_i`` (m, n), in the stored (checkpoint) dtype unless ``dtype`` is given; a quantized ``U_i`` is
        dequantized (on ``device``) straight into that dtype."""
        spec = self.u_spec(member)
        if spec is None:
            return self._load(u_key(member), dtype, device)
        u_dtype = dtype_from_name(self._spec(self.category_of(member))["u_dtype"])
        return spec.unpack(self.load_U_packed(member, device), dtype or u_dtype)

    def u_quant(self, category: str) -> str:
        """How the category's ``U_i`` are stored: ``none``, ``nf4`` or ``int8``."""
        q = self._spec(category).get("u_quant")
        return q["kind"] if q else "none"

    def u_spec(self, member: str) -> QuantSpec | None:
        """The ``QuantSpec`` of a quantized stored ``U_i`` (None when stored dense)."""
        q = self._spec(self.category_of(member)).get("u_quant")
        return QuantSpec(q["kind"], self.member_shape(member), int(q["blocksize"])) if q else None  # U has W's shape

    def load_U_packed(self, member: str, device: str | torch.device = "cpu") -> Tensor:
        """A quantized store's ``U_i`` blob, (nbytes,) uint8, as stored."""
        assert self.u_spec(member) is not None, f"{member}: U is stored dense, not quantized"
        return self._load(u_key(member), None, device)

    def load_sigma(self, member: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> Tensor:
        """``σ_i`` (n,)."""
        return self._load(sigma_key(member), dtype, device)

    def _spec(self, category: str) -> dict[str, Any]:
        if category not in self.manifest["categories"]:
            raise ValueError(f"factor store {self.path} has no category {category!r} (has {list(self.manifest['categories'])})")
        return self.manifest["categories"][category]

    def _load(self, key: str, dtype: torch.dtype | None, device: str | torch.device) -> Tensor:
        from safetensors import SafetensorError, safe_open

        file = self.file_of(key)
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                t = f.get_tensor(key)
        except (SafetensorError, OSError) as e:
            raise ValueError(f"could not read {key!r} from {file}: {e}; rebuild the store with launch/hjd.py") from None
        return t.to(device=device, dtype=dtype or t.dtype)


def check_store_matches(store: FactorStore, ckpt: HFCheckpoint) -> None:
    """``ValueError`` unless ``ckpt`` holds the weights the store was built from (same fingerprint)."""
    names = [m + ".weight" for members in store.categories.values() for m in members]
    missing = [n for n in names if n not in ckpt]
    if missing:
        raise ValueError(
            f"factor store {store.path} was built from {store.base_model} but {ckpt.dir} has no tensor "
            f"{missing[0]!r} ({len(missing)} missing); rebuild it with launch/hjd.py"
        )
    fingerprint = weights_fingerprint(ckpt, names)
    if fingerprint != store.fingerprint:
        raise ValueError(
            f"factor store {store.path} was built from {store.base_model} (fingerprint {store.fingerprint[:16]}…) "
            f"but {ckpt.dir} has fingerprint {fingerprint[:16]}…; rebuild it with launch/hjd.py"
        )


# ----------------------------------------------------------------------------------------------- verify

_VERIFY_TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4, torch.float64: 1e-8}
# Quantized U: NF4's relative error on a Gaussian-like matrix is about 0.09, int8's (row absmax) about 0.01.
_VERIFY_TOL_QUANT = {"nf4": 0.2, "int8": 3e-2}


def _check_files(store: FactorStore, category: str) -> list[str]:
    """Every file the manifest lists for ``category`` holds its keys with the manifest's shapes."""
    from safetensors import SafetensorError, safe_open

    spec = store.manifest["categories"][category]
    n, problems = int(spec["width"]), []
    for fname in sorted(set(spec["files"].values())):
        keys = [k for k, f in spec["files"].items() if f == fname]
        try:
            with safe_open(str(store.path / fname), framework="pt") as f:
                have = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
        except (SafetensorError, OSError) as e:
            problems.append(f"{category}: {fname} is missing or unreadable ({e})")
            continue
        for key in keys:
            member = key.rsplit(".", 1)[0]
            want = [n, n] if key == v_key(category) else [n] if key.endswith(".sigma") else spec["shapes"][member]
            if key.endswith(".U") and spec.get("u_quant"):
                want = [store.u_spec(member).nbytes]
            if have.get(key) != list(want):
                problems.append(f"{category}: {key} in {fname} has shape {have.get(key)}, manifest says {want}")
    return problems


def verify_store(store_dir: str | Path, model: str, samples: int = 2, seed: int = 0, tol: float | None = None,
                 device: str | torch.device = "cpu") -> list[str]:
    """Re-check a store against a checkpoint; returns the problems found (empty: verified).

    Checks that the store is complete, the weights fingerprint (``check_store_matches``), that every file
    holds its keys with the manifest's shapes, and for ``samples`` members per category (seeded) the
    relative reconstruction ``‖W_i − U_i diag(σ_i) Vᵀ‖_F / ‖W_i‖_F`` from the stored tensors against the
    full weights, within ``tol`` (default by U's dtype: bf16 2e-2, fp16 5e-3, fp32 1e-4, fp64 1e-8; quantized U:
    nf4 0.2, int8 3e-2).
    ``ValueError`` when the store or the model cannot be opened at all.
    """
    store = FactorStore.open(store_dir, allow_incomplete=True)
    ckpt = HFCheckpoint(resolve_model_dir(model))
    problems: list[str] = []
    if not store.complete:
        problems.append(f"factor store {store.path} is incomplete (done: {store.manifest.get('completed_categories')})")
    try:
        check_store_matches(store, ckpt)
    except ValueError as e:
        return problems + [str(e)]
    rng = random.Random(seed)
    for category, members in store.categories.items():
        if category not in store.manifest.get("completed_categories", []):
            continue
        file_problems = _check_files(store, category)
        problems += file_problems
        if file_problems:
            continue
        V = store.load_V(category, torch.float64, device)  # (n, n)
        for member in rng.sample(members, min(samples, len(members))):
            U = store.load_U(member, device=device)  # (m, n), stored dtype (a quantized U dequantized)
            quant = store.u_quant(category)
            limit = tol if tol is not None else _VERIFY_TOL_QUANT[quant] if quant != "none" else _VERIFY_TOL.get(U.dtype, 1e-8)
            W = ckpt.get(member + ".weight", device).double()
            e = reconstruction_error(W, U.double(), store.load_sigma(member, torch.float64, device), V)
            if not e <= limit:
                problems.append(f"{member}: reconstruction error {e:.3e} > tolerance {limit:.1e}")
    return problems
