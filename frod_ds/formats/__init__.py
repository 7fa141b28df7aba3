"""Torch-free typed on-disk records: JSON records, checksums, the factor store's and the adapter's formats, the
identity of a training run. Nothing here imports torch (tests/repo/test_layering.py checks it)."""

from frod_ds._moved import old_paths

__path__ = old_paths(__path__, __name__)  # old module paths, kept for one release
