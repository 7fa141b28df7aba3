"""Cheap fingerprints of a checkpoint's tensors: which base model a factor store (or a training run) belongs to.

``weights_fingerprint`` of the targeted weights is a factor store's ``fingerprint``; it is combined from one digest
per tensor (``tensor_digests``, ``combine_digests``), so a store built one category per run, each run seeing only
that category's weights, records the same value as one built in a single run. ``base_fingerprint`` covers every
other tensor (embeddings, norms, untargeted linears): what training reads from the checkpoint, so it identifies
the base model when the targeted weights are no longer there.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from frod_ds.io.dtypes import dtype_name
from frod_ds.io.hf_checkpoint import HFCheckpoint

__all__ = [
    "FINGERPRINT_METHOD",
    "weights_fingerprint",
    "tensor_digests",
    "combine_digests",
    "base_names",
    "base_fingerprint",
    "sample_ranges",
]

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
    Any other model or fine-tune changes it; an edit confined to unsampled bytes does not (``frod hjd
    --verify`` re-checks reconstruction against the full weights of sampled members).
    """
    assert names, "weights_fingerprint needs at least one tensor name"
    return combine_digests(tensor_digests(ckpt, names))


def tensor_digests(ckpt: HFCheckpoint, names: Iterable[str]) -> dict[str, str]:
    """``{name: hex sha256}`` per tensor: its name, dtype, shape, byte size and sampled bytes (``sample_ranges``)."""
    digests: dict[str, str] = {}
    by_file: dict[Path, list[str]] = {}
    for name in sorted(set(names)):
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
                digests[name] = h.hexdigest()
    return digests


def combine_digests(digests: Mapping[str, str]) -> str:
    """The fingerprint of a set of tensors from their ``tensor_digests`` (in name order; any subsets' digests
    merged give the same value as the whole set read at once)."""
    total = hashlib.sha256(f"{FINGERPRINT_METHOD}\n".encode())
    for name in sorted(digests):
        total.update(bytes.fromhex(digests[name]))
    return total.hexdigest()


def base_names(keys: Iterable[str], targets: Iterable[str]) -> list[str]:
    """Every tensor but the targeted weights (``<path>.<target>.weight``, the rule of
    ``frod_ds.hjd.sharding.targeted_members``): what a FRoD model reads from the checkpoint, in name order."""
    wanted = set(targets)
    return sorted(k for k in keys if not (k.endswith(".weight") and k[: -len(".weight")].rsplit(".", 1)[-1] in wanted))


def base_fingerprint(ckpt: HFCheckpoint, targets: Iterable[str]) -> str | None:
    """``weights_fingerprint`` of ``base_names``: the base model's identity without its targeted weights (None when
    the checkpoint holds nothing else)."""
    names = base_names(ckpt.keys(), targets)
    return weights_fingerprint(ckpt, names) if names else None
