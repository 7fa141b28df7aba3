"""Moved to ``frod_ds.prep.dataset`` and ``frod_ds.prep.row_checks``; this path goes in 0.3.0 (``frod_ds._moved``)."""

from frod_ds._moved import forward as _forward

__getattr__ = _forward(__name__)
