"""Reading a factor store (format: ``frod_ds.formats.factor_store``): ``FactorStore`` for training, eval, export and
verification, and the check that a store belongs to a base checkpoint.

Every factor file is checked against its CRC-32 in the manifest the first time anything is read from it,
so a single changed byte of any U, σ or V file is refused before it reaches a model. Stores written before
the checksums (format 1) load with a one-line note.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
from torch import Tensor

from frod_ds.core.quant import QuantSpec
from frod_ds.formats.checksum import file_crc32, format_crc32
from frod_ds.formats.factor_store import (
    MANIFEST,
    CategoryIdentity,
    CategoryRecord,
    Manifest,
    StoreIdentity,
    category_of,
    member_of_key,
    sigma_key,
    u_key,
    v_key,
)
from frod_ds.formats.folders import wrong_folder
from frod_ds.io.dtypes import FLOAT_DTYPES
from frod_ds.io.fingerprint import base_fingerprint, tensor_digests, weights_fingerprint
from frod_ds.io.hf_checkpoint import HFCheckpoint
from frod_ds.io.safetensors_io import tensor_bytes
from frod_ds.runtime.errors import StoreError, note
from frod_ds.runtime.paths import dir_problem

__all__ = ["FactorStore", "check_store_matches", "category_of"]


class FactorStore:
    """Read access to a factor store directory."""

    def __init__(self, path: Path, manifest: Manifest):
        self.path = Path(path)
        self.manifest = manifest
        self._category_of = {m: c for c, rec in manifest.categories.items() for m in rec.members}
        self._checked: set[str] = set()  # files whose checksum matched

    @classmethod
    def open(cls, path: str | os.PathLike, allow_incomplete: bool = False) -> FactorStore:
        """Open a store; ``StoreError`` when the directory or manifest is missing, of another format or
        version, or (unless ``allow_incomplete``) not complete."""
        path = Path(path)
        mpath = path / MANIFEST
        if not path.is_dir():
            if os.path.lexists(path):  # a file, a named pipe, a broken link or a link loop: say which
                raise StoreError(f"factor store {dir_problem(path)}; pass the directory frod hjd wrote")
            raise StoreError(f"factor store {path} does not exist; build it with frod hjd --model M --out {path}")
        wrong = wrong_folder(path, "factor store", ("factor-store",), "a factor store")
        if wrong:
            raise StoreError(wrong)
        if not mpath.is_file():
            raise StoreError(f"{path} is not a factor store (no {MANIFEST}); build it with frod hjd")
        store = cls(path, Manifest.read(mpath))
        if not allow_incomplete and not store.complete:
            done, missing = store.manifest.completed_categories, store.manifest.missing_categories
            if not missing:  # HJD stopped between its last category and the mark
                raise StoreError(
                    f"factor store {path} was not finished: every category is in, but the run that built it stopped "
                    f"before marking it complete; run that frod hjd again (frod hjd --model "
                    f"{store.manifest.base_model} --out {path}) to finish it"
                )
            raise StoreError(
                f"factor store {path} is incomplete (done: {done}, missing: {missing}); finish it with frod hjd "
                f"--out {path} --categories {','.join(missing)} (rerun with the same arguments after a killed run)"
            )
        if not store.manifest.has_checksums:
            note(
                f"factor store {path} has no checksums (format {store.manifest.format_version}, written by an older "
                "frod-ds): its files are not checked; rebuild it with frod hjd --overwrite to add them"
            )
        return store

    @property
    def complete(self) -> bool:
        return self.manifest.complete

    @property
    def categories(self) -> dict[str, list[str]]:
        """``{category: [member, ...]}``, members in layer order."""
        return {c: list(rec.members) for c, rec in self.manifest.categories.items()}

    @property
    def completed_categories(self) -> list[str]:
        return list(self.manifest.completed_categories)

    @property
    def targets(self) -> list[str]:
        return list(self.manifest.targets)

    @property
    def fingerprint(self) -> str:
        return self.manifest.fingerprint

    @property
    def base_model(self) -> str:
        return self.manifest.base_model

    @property
    def pi(self) -> float:
        return self.manifest.pi

    def category_of(self, member: str) -> str:
        """The category of ``member``; ``StoreError`` when it is not a member of this store."""
        if member not in self._category_of:
            raise StoreError(f"{member!r} is not a member of factor store {self.path} (targets {self.targets})")
        return self._category_of[member]

    def record(self, category: str) -> CategoryRecord:
        if category not in self.manifest.categories:
            raise StoreError(
                f"factor store {self.path} has no category {category!r} (has {list(self.manifest.categories)})"
            )
        return self.manifest.categories[category]

    def width(self, category: str) -> int:
        return self.record(category).width

    def member_shape(self, member: str) -> tuple[int, int]:
        m, n = self.record(self.category_of(member)).shapes[member]
        return int(m), int(n)

    def errors(self, category: str) -> dict[str, float]:
        """Per-member reconstruction error recorded by the HJD run (factors in ``hjd_dtype``)."""
        return dict(self.record(category).error)

    def file_of(self, key: str) -> Path:
        category = category_of(member_of_key(key)) if key.endswith(".V") else self.category_of(member_of_key(key))
        files = self.record(category).files
        if key not in files:
            raise StoreError(f"factor store {self.path} has no tensor {key!r} (category {category!r} incomplete?)")
        return self.path / files[key]

    def checksum_problem(self, file: Path) -> str | None:
        """Why ``file`` (a factor file of this store) does not have the CRC-32 the manifest records, or
        ``None``; a file that matched is not read again (format 1 stores record none: nothing to check)."""
        name = file.name
        if name in self._checked:
            return None
        record = next((r for r in self.manifest.categories.values() if name in set(r.files.values())), None)
        assert record is not None, f"{name} is not a file of factor store {self.path}"
        if record.checksums is not None:
            want = record.checksums.get(name)
            if want is None:
                return f"factor store {self.path} records no checksum for {name}; rebuild it with frod hjd --overwrite"
            try:
                got = format_crc32(file_crc32(file))
            except OSError as e:
                return f"could not read {file}: {e}; rebuild the store with frod hjd --overwrite"
            if got != want:
                return (
                    f"factor store file {file} is corrupt (its checksum is {got}, the manifest records {want}); "
                    "delete it and run frod hjd on the store again: it rebuilds that category"
                )
        self._checked.add(name)
        return None

    def check_file(self, file: Path) -> None:
        """``StoreError`` unless ``file`` has its recorded CRC-32 (:meth:`checksum_problem`)."""
        problem = self.checksum_problem(file)
        if problem is not None:
            raise StoreError(problem)

    def load_V(self, category: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> Tensor:
        """The category's shared basis ``V`` (n, n)."""
        self.record(category)
        return self._load(v_key(category), dtype, device)

    def load_U(self, member: str, dtype: torch.dtype | None = None, device: str | torch.device = "cpu") -> Tensor:
        """``U_i`` (m, n), in the stored (checkpoint) dtype unless ``dtype`` is given; a quantized ``U_i`` is
        dequantized (on ``device``) straight into that dtype (default: the category's ``u_dtype``)."""
        spec = self.u_spec(member)
        if spec is None:
            return self._load(u_key(member), dtype, device)
        u_dtype = FLOAT_DTYPES[self.record(self.category_of(member)).u_dtype]
        return spec.unpack(self.load_U_packed(member, device), dtype or u_dtype)

    def u_quant(self, category: str) -> str:
        """How the category's ``U_i`` are stored: ``none``, ``nf4`` or ``int8``."""
        q = self.record(category).u_quant
        return q.kind if q else "none"

    def u_spec(self, member: str) -> QuantSpec | None:
        """The ``QuantSpec`` of a quantized stored ``U_i`` (None when stored dense)."""
        q = self.record(self.category_of(member)).u_quant
        return QuantSpec(q.kind, self.member_shape(member), q.blocksize) if q else None  # U has W's shape

    def load_U_packed(self, member: str, device: str | torch.device = "cpu") -> Tensor:
        """A quantized store's ``U_i`` blob, (nbytes,) uint8, as stored."""
        assert self.u_spec(member) is not None, f"{member}: U is stored dense, not quantized"
        return self._load(u_key(member), None, device)

    def load_sigma(self, member: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> Tensor:
        """``σ_i`` (n,)."""
        return self._load(sigma_key(member), dtype, device)

    def identity(self, categories: list[str]) -> StoreIdentity:
        """What an adapter trained on ``categories`` of this store depends on: the base weights' fingerprint,
        π, HJD's precision, and per category a sha256 of ``V`` (as stored), the HJD route and how ``U`` is stored."""
        cats = {}
        for c in categories:
            V = self._load(v_key(c), None, "cpu")
            rec = self.record(c)
            cats[c] = CategoryIdentity(hashlib.sha256(tensor_bytes(V).numpy()).hexdigest(), rec.method, rec.u_storage)
        return StoreIdentity(self.fingerprint, self.pi, cats, self.manifest.hjd_dtype)

    def _load(self, key: str, dtype: torch.dtype | None, device: str | torch.device) -> Tensor:
        from safetensors import SafetensorError, safe_open

        file = self.file_of(key)
        self.check_file(file)
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                t = f.get_tensor(key)
        except (SafetensorError, OSError) as e:
            raise StoreError(f"could not read {key!r} from {file}: {e}; rebuild the store with frod hjd") from None
        return t.to(device=device, dtype=dtype or t.dtype)


def check_store_matches(store: FactorStore, ckpt: HFCheckpoint) -> None:
    """``StoreError`` (one line) unless ``ckpt`` is the base model the store was built from.

    With every targeted weight, they must have the store's ``fingerprint`` and the other tensors its
    ``base_fingerprint`` (format 3: a base with other norms or embeddings is another model). Lacking some
    (deleted once decomposed: training never reads them), the ones it holds must have their recorded digests and its
    other tensors the store's ``base_fingerprint`` (format 3; an older store needs the full checkpoint): such a
    checkpoint is never taken on trust, and the weights it lacks are the store's own (their digests, V and every
    factor file's checksum are in the manifest).
    """
    names = {m + ".weight": m for members in store.categories.values() for m in members}
    absent = [n for n in names if n not in ckpt]
    present = [n for n in names if n in ckpt]
    recorded_base = store.manifest.base_fingerprint
    if absent and recorded_base is None:
        raise StoreError(
            f"factor store {store.path} was built from {store.base_model} but {ckpt.dir} has no tensor "
            f"{absent[0]!r} ({len(absent)} missing), and the store (format {store.manifest.format_version}) records no "
            "fingerprint of the other weights to identify the model by; use the full checkpoint or rebuild the store "
            "with this version's frod hjd"
        )
    if not absent:
        fingerprint = weights_fingerprint(ckpt, list(names))
        if fingerprint != store.fingerprint:
            raise StoreError(
                f"factor store {store.path} was built from {store.base_model} (fingerprint {store.fingerprint[:16]}…) "
                f"but {ckpt.dir} has fingerprint {fingerprint[:16]}…; rebuild it with frod hjd"
            )
        if recorded_base is None:  # a store of format 1-2: its targeted weights are all it identifies
            return
    found = base_fingerprint(ckpt, store.targets)
    if found != recorded_base:
        raise StoreError(
            f"factor store {store.path} was built from {store.base_model} but {ckpt.dir}"
            f"{', which lacks the targeted weights,' if absent else ''} has other untargeted tensors (embeddings, "
            f"norms, untargeted linears: fingerprint "
            f"{recorded_base[:16]}… there, {(found or 'none')[:16]}… here); use that model's checkpoint or rebuild "
            "the store with frod hjd"
        )
    if not absent:
        return
    digests = tensor_digests(ckpt, present)
    for name in present:
        want = (store.record(store.category_of(names[name])).weight_sha256 or {}).get(names[name])
        if digests[name] != want:
            raise StoreError(
                f"factor store {store.path} was built from {store.base_model} but {name} in {ckpt.dir} is another "
                "weight than the one decomposed; use that model's checkpoint or rebuild the store with frod hjd"
            )
