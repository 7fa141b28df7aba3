"""HJD, FRoD paper §3.1 / spec §1: the math and the distributed stage that writes the factor store.

    math.py          the decomposition as pure single-process functions (decompose() and its building blocks)
    sharding.py      targets, members per category, which rank owns which, kernel read-ahead (no torch)
    streaming.py     weights read ahead onto the device, factors written behind the compute with their CRC-32
    category.py      one category on one rank: its member source and factor sink
    routes.py        the Gram/Cholesky and Householder TSQR routes over a source and a sink
    store_writer.py  rank 0's side of the store directory: create/resume, manifest records
    stage.py         run_stage: the categories one after the other, reads and writes overlapping the compute

The math names (``decompose``, ``HJDResult``, ...) are importable from here; they load on first use, so
that ``frod_ds.hjd.sharding`` imports no torch.
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
    "no_tf32",
)

__all__ = list(_MATH)


def __getattr__(name: str) -> Any:
    if name in _MATH:
        return getattr(importlib.import_module("frod_ds.hjd.math"), name)
    raise AttributeError(f"module 'frod_ds.hjd' has no attribute {name!r}")
