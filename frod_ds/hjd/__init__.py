"""HJD, FRoD paper §3.1 / spec §1: the math and the distributed stage that writes the factor store.

``math`` is the decomposition as pure single-process functions; ``sharding`` says which rank owns which weights
(no torch); ``streaming`` reads weights ahead and writes factors behind; ``category`` and ``routes`` run one
category on one rank; ``store_writer`` is rank 0's side of the store, ``store_files`` its files on disk;
``stage`` runs the categories in turn.
The math names (``decompose``, ``HJDResult``, ...) load from here on first use, so ``sharding`` stays torch-free.
"""

from __future__ import annotations

import importlib
from typing import Any

from frod_ds._moved import old_paths

__path__ = old_paths(__path__, __name__)  # old module paths, kept for one release

_MATH = (
    "HJDResult",
    "decompose",
    "validate_members",
    "thin_qr",
    "tsqr_combine",
    "t_pi_term",
    "shared_basis",
    "member_factors",
    "gram",
    "gram_factor",
    "gram_t_pi_term",
    "gram_t_pi",
    "gram_basis",
    "weight_factors",
    "reconstruction_error",
    "reconstruction_error_t",
    "RECONSTRUCTION_TOL",
    "reconstruction_tol",
    "probe_vectors",
    "probe_error",
    "no_tf32",
)

__all__ = list(_MATH)


def __getattr__(name: str) -> Any:
    if name in _MATH:
        return getattr(importlib.import_module("frod_ds.hjd.math"), name)
    raise AttributeError(f"module 'frod_ds.hjd' has no attribute {name!r}")
