"""Torch-free typed on-disk records: JSON records, checksums, the factor store's and the adapter's formats, the
identity of a training run. Nothing here imports torch (tests/repo/test_layering.py checks it)."""
