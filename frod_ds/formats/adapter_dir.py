"""The adapter checkpoint's on-disk format: file names and ``adapter_config.json`` as a typed record.

``adapter-<step>/`` and ``adapter-final/`` hold ``adapter.safetensors`` (σ, S values and supports per module, the
same module paths the factor store uses), ``adapter_config.json`` (``AdapterConfig``) and ``recipe.yaml``.
Layout and versions (1 to 3 still read, 4 written): docs/formats.md#the-adapter-checkpoint. Torch-free.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from frod_ds.formats.factor_store import CategoryIdentity, StoreIdentity
from frod_ds.formats.records import parse_json, record_from_dict, record_to_json
from frod_ds.runtime.errors import AdapterError
from frod_ds.runtime.paths import read_small_text

__all__ = [
    "ADAPTER_FORMAT",
    "ADAPTER_VERSION",
    "WEIGHTS",
    "CONFIG",
    "AdapterCategory",
    "AdapterConfig",
    "sigma_name",
    "s_name",
    "support_name",
]

ADAPTER_FORMAT = "frod-ds-adapter"
ADAPTER_VERSION = 4
WEIGHTS = "adapter.safetensors"
CONFIG = "adapter_config.json"


def sigma_name(module: str) -> str:
    """Key of ``σ_i`` (n,) in ``adapter.safetensors`` (the module's own parameter name)."""
    return f"{module}.frod_sigma"


def s_name(module: str) -> str:
    """Key of the S values (nnz,) of a module."""
    return f"{module}.frod_s"


def support_name(category: str) -> str:
    """Key of a category's S support, (2, nnz) int64 rows and columns."""
    return f"{category}.support"


@dataclass
class AdapterCategory:
    """One category of the adapter: its members, ``n`` and the number of S entries; from version 2 also
    the identity of the factor store's category it was trained on."""

    members: list[str]
    n: int
    nnz: int
    v_sha256: str | None = None  # sha256 of the store's V (fp32 bytes, as stored)
    method: str | None = None  # the store's HJD route for the category
    u_storage: str | None = None  # how the store holds U_i ("bfloat16", "float32+nf4"; version 4)


@dataclass(kw_only=True)
class AdapterConfig:
    """``adapter_config.json``; :meth:`to_json` / :meth:`from_json` are its only writer and reader."""

    format: str = ADAPTER_FORMAT
    version: int = ADAPTER_VERSION
    base_model: str  # Hub id or directory (made absolute by training)
    factor_store: str  # directory of the factor store
    factor_store_fingerprint: str | None = None  # the store's base weights fingerprint
    tokenizer: str | None = None  # default: the base model's
    tokenizer_sha256: str | None = None  # prep.tokens.tokenizer_sha256 of the training tokenizer (absent before)
    targets: list[str] = field(default_factory=list)
    sparsity: float  # density of S
    seed: int  # seed of the S supports
    pi: float | None = None  # the store's π
    init_adapter: str | None = None  # the adapter training started from (model.init_adapter); absent in older configs
    dtype: str = "float32"  # parameter dtype of the trained model
    frozen_quant: str = "none"  # none | nf4 | int8: how the frozen U_i were held (absent in older adapters: none)
    quantize_base: bool = False  # the untargeted linears quantized too (of frozen_quant's kind)
    step: int | None = None
    categories: dict[str, AdapterCategory] = field(default_factory=dict)
    weights_crc32: str | None = None  # "crc32:…" of adapter.safetensors (version 3; absent before: not checked)
    hjd_dtype: str | None = None  # the precision the store's HJD computed in (version 4)
    config_sha256: str | None = None  # sha256 of the fields besides paths (version 4): an edit of them is seen

    def _digest(self) -> str:
        """sha256 of every field that changes what the adapter rebuilds; the paths (where the base, store and
        tokenizer are found: moved, they may be edited) and this digest itself left out."""
        paths = dict.fromkeys(("base_model", "factor_store", "tokenizer", "init_adapter"), "")
        body = record_to_json(dataclasses.replace(self, config_sha256=None, **paths), indent=None, sort_keys=True)
        return hashlib.sha256(body.encode()).hexdigest()

    def to_json(self) -> str:
        """The record with its own digest (``config_sha256``) as it is written."""
        return record_to_json(dataclasses.replace(self, config_sha256=self._digest()), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, where: str | Path) -> AdapterConfig:
        """Parse and check; ``AdapterError`` naming ``where`` when it is not an adapter config this code reads."""
        data = parse_json(text, where, AdapterError, "; the adapter is damaged")
        if not isinstance(data, dict) or data.get("format") != ADAPTER_FORMAT:
            got = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise AdapterError(f"{where}: format is {got!r}, expected {ADAPTER_FORMAT!r}")
        version = data.get("version", 0)
        if isinstance(version, int) and version > ADAPTER_VERSION:
            raise AdapterError(f"{where}: adapter version {version} is newer than this frod-ds; upgrade frod-ds")
        config = record_from_dict(cls, data, str(where), AdapterError)
        if config.version >= 4 and config.config_sha256 != config._digest():  # every writer of version 4 records it
            raise AdapterError(
                f"{where} was edited after frod-ds wrote it (its fields are not what config_sha256 records): they say "
                "how the adapter is rebuilt (sparsity, quantization, store), so an edit changes results (only its "
                "paths may be edited); use the adapter as frod-ds wrote it (e.g. an earlier adapter-<step>) or retrain"
            )
        if config.version >= 3 and config.weights_crc32 is None:  # every writer of version 3 records it
            raise AdapterError(
                f"{where}: an adapter of version {config.version} records the checksum of {WEIGHTS} "
                "(weights_crc32), this one has none: it was edited after it was written, so its weights cannot be "
                "checked; use the adapter as frod-ds wrote it (e.g. an earlier adapter-<step>) or retrain"
            )
        return config

    @classmethod
    def read(cls, path: Path) -> AdapterConfig:
        remedy = "the adapter is damaged: use an intact copy (e.g. an earlier adapter-<step>) or retrain"
        return cls.from_json(read_small_text(path, AdapterError, "adapter config", remedy), path)

    def store_identity(self) -> StoreIdentity:
        """The factor store this adapter was trained on, as far as the config records it."""
        return StoreIdentity(
            self.factor_store_fingerprint,
            self.pi,
            {c: CategoryIdentity(info.v_sha256, info.method, info.u_storage) for c, info in self.categories.items()},
            self.hjd_dtype,
        )

    @property
    def records_store_identity(self) -> bool:
        return all(info.v_sha256 is not None for info in self.categories.values())
