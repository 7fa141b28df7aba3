"""CRC-32 checksums of files, also when the file is written in pieces out of order.

Factor-store files are written in chunks by a pool of threads; each chunk's CRC-32 is taken while the
chunk is in memory and the pieces are combined in file order (:func:`crc32_combine`, zlib's algorithm),
so the checksum costs no second pass over the data. A reader checks a file with :func:`file_crc32`. A
CRC-32 catches every change confined to 32 consecutive bits, any single changed byte included.
Imports nothing heavy (no torch).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from pathlib import Path

__all__ = ["crc32_combine", "combine_pieces", "file_crc32", "format_crc32", "has_crc32", "parse_crc32"]

_POLY = 0xEDB88320  # reflected CRC-32 polynomial


def _multmodp(a: int, b: int) -> int:
    """``a · b mod p(x)`` in zlib's reflected bit order."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                break
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return p


_X2N = [1 << 30]  # x^(2^k) mod p(x), k = 0..31
for _ in range(31):
    _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))


def _x8nmodp(n: int) -> int:
    """``x^(8n) mod p(x)``: the shift of a CRC over ``n`` zero bytes."""
    p, k = 1 << 31, 3
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of ``A + B`` from ``crc1 = crc32(A)``, ``crc2 = crc32(B)`` and ``len2 = len(B)``."""
    return _multmodp(_x8nmodp(len2), crc1) ^ crc2


def combine_pieces(pieces: Iterable[tuple[int, int, int]]) -> int:
    """CRC-32 of a file from ``(offset, length, crc)`` pieces that tile it from offset 0 (any order)."""
    crc, end = 0, 0
    for offset, length, piece in sorted(pieces):
        assert offset == end, f"pieces leave a gap or overlap at byte {end}"
        crc = crc32_combine(crc, piece, length)
        end += length
    return crc


def file_crc32(path: str | Path, block: int = 16 * 2**20) -> int:
    """CRC-32 of a file's bytes, read in blocks."""
    crc = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(block)
        view = memoryview(buf)
        while True:
            n = f.readinto(buf)
            if not n:
                return crc
            crc = zlib.crc32(view[:n], crc)


def format_crc32(crc: int) -> str:
    """The manifest's spelling of a checksum: ``"crc32:1a2b3c4d"``."""
    return f"crc32:{crc:08x}"


def parse_crc32(text: str) -> int | None:
    """Inverse of :func:`format_crc32`; ``None`` for anything else."""
    kind, _, value = text.partition(":")
    if kind != "crc32" or len(value) != 8:
        return None
    try:
        return int(value, 16)
    except ValueError:
        return None


def has_crc32(path: Path, checksums: dict[str, str] | None) -> bool:
    """Whether file ``path`` is readable and has the checksum ``checksums`` (file name -> ``crc32:…``, a factor
    store category's record) holds for it; ``None`` (a store format without checksums): nothing to check."""
    if checksums is None:
        return True
    want = checksums.get(path.name)
    try:
        return want is not None and format_crc32(file_crc32(path)) == want
    except OSError:
        return False
