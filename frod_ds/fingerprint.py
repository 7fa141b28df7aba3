"""A cheap fingerprint of a checkpoint's targeted weights: which base model a factor store belongs to."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

from frod_ds.dtypes import dtype_name
from frod_ds.hf_checkpoint import HFCheckpoint

__all__ = ["FINGERPRINT_METHOD", "weights_fingerprint", "sample_ranges"]

FINGERPRINT_METHOD = "sha256-sampled-v1"
_SAMPLE_EDGE = 64 * 1024  # bytes hashed at each end of a tensor
_SAMPLE_BLOCK = 4 * 1024  # bytes hashed at each strided position
_SAMPLE_STRIDES = 4  # strided positions between the two ends


def sample_ranges(nbytes: int) -> list[tuple[int, int]]:
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
    assert names, "weights_fingerprint needs at least one tensor name"
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
                for offset, length in sample_ranges(info.nbytes):
                    f.seek(info.start + offset)
                    h.update(f.read(length))
                digests[name] = h.digest()
    total = hashlib.sha256(f"{FINGERPRINT_METHOD}\n".encode())
    for name in names:
        total.update(digests[name])
    return total.hexdigest()
