"""Reading weights ahead of use and writing factors behind it, for the HJD stage.

``MemberReader`` streams scheduled members' weights from the shards onto the compute device through page-locked
staging buffers (at most ``ahead_bytes`` ahead); ``FactorWriter`` copies factors off the device into a fixed pool
of page-locked buffers and writes them into pre-planned part files with their CRC-32, so disk reads and writes
overlap GPU work with bounded host memory (docs/hjd.md#the-routes-on-one-rank).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import zlib
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from torch import Tensor

from frod_ds.formats.checksum import combine_pieces
from frod_ds.formats.factor_store import part_file
from frod_ds.io.hf_checkpoint import HFCheckpoint
from frod_ds.io.safetensors_io import safetensors_header, save_tensors_atomic, tensor_bytes
from frod_ds.runtime.atomic import TMP, clear_tmp, open_tmp

__all__ = ["MemberReader", "FactorWriter", "plan_parts"]

MiB = 2**20


class MemberReader:
    """Reads ``<member>.weight`` tensors ahead of use; ``take`` returns them on ``device`` (checkpoint dtype)."""

    def __init__(
        self,
        ckpt: HFCheckpoint,
        device: torch.device,
        *,
        threads: int = 8,
        ahead_bytes: float = 4 * 2**30,
        chunk_bytes: int = 32 * MiB,
    ):
        self.ckpt, self.device, self.ahead, self.chunk = ckpt, device, ahead_bytes, int(chunk_bytes)
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="hjd-read")
        self._local = threading.local()  # per thread: staging buffer, copy stream
        self._plan: deque[str] = deque()  # scheduled, not yet submitted
        self._inflight: list[tuple[str, Future]] = []  # submitted, not yet taken (submission order)
        self._bytes = 0  # bytes submitted and not yet taken

    def _nbytes(self, member: str) -> int:
        return self.ckpt.info(member + ".weight").nbytes

    def _read(self, member: str) -> Tensor:
        name = member + ".weight"
        if self.device.type != "cuda":
            return self.ckpt.get(name)
        info = self.ckpt.info(name)
        loc = self._local
        if not hasattr(loc, "stream"):
            torch.cuda.set_device(self.device)
            loc.stream = torch.cuda.Stream(self.device)
            loc.stage = torch.empty(self.chunk, dtype=torch.uint8, pin_memory=True)
        with torch.cuda.stream(loc.stream):
            out = torch.empty(info.nbytes, dtype=torch.uint8, device=self.device)
            for start in range(0, info.nbytes, self.chunk):
                n = min(self.chunk, info.nbytes - start)
                self.ckpt.read_range(name, start, loc.stage[:n])
                out[start : start + n].copy_(loc.stage[:n], non_blocking=True)
                loc.stream.synchronize()  # the staging buffer is free again
        return out.view(info.dtype).reshape(info.shape)

    def _submit(self, member: str) -> None:
        self._inflight.append((member, self._pool.submit(self._read, member)))
        self._bytes += self._nbytes(member)

    def _pump(self) -> None:
        while self._plan and (not self._inflight or self._bytes + self._nbytes(self._plan[0]) <= self.ahead):
            self._submit(self._plan.popleft())

    def schedule(self, members: Sequence[str], first: bool = False) -> None:
        """Queue reads of ``members`` (in this order) behind those already scheduled, or before them."""
        if first:
            self._plan.extendleft(reversed(list(members)))
        else:
            self._plan.extend(members)
        self._pump()

    def take(self, member: str) -> Tensor:
        """``member``'s weight: the earliest scheduled read of it (read now if it was never scheduled)."""
        for j, (name, _) in enumerate(self._inflight):
            if name == member:
                break
        else:
            if member in self._plan:
                self._plan.remove(member)
            self._submit(member)
            j = len(self._inflight) - 1
        _, fut = self._inflight.pop(j)
        self._bytes -= self._nbytes(member)
        try:
            t = fut.result()
        finally:
            self._pump()
        if t.device.type == "cuda":
            t.record_stream(torch.cuda.current_stream(self.device))  # allocated on a reader's stream
        return t

    def close(self) -> None:
        self._plan.clear()
        for _, fut in self._inflight:
            fut.cancel()
        self._inflight.clear()
        self._pool.shutdown(wait=True)


def plan_parts(
    members: Sequence[tuple[str, Sequence[tuple[str, torch.dtype, Sequence[int]]]]], part_bytes: float
) -> list[list[str]]:
    """Group members (``(member, [(key, dtype, shape), ...])``, in order) into parts of about ``part_bytes``:
    a part is closed once it reaches the size; a member never spans two parts."""
    parts: list[list[str]] = [[]]
    size = 0
    for member, entries in members:
        if parts[-1] and size >= part_bytes:
            parts.append([])
            size = 0
        parts[-1].append(member)
        size += sum(torch.Size(shape).numel() * torch.empty(0, dtype=dt).element_size() for _, dt, shape in entries)
    return [p for p in parts if p]


class _Part:
    """One part file being written: its fd, the offset of every key, chunks outstanding (each gives its
    ``(offset, length, crc32)``)."""

    def __init__(self, path: Path, head: bytes, offsets: dict[str, int], keys: int):
        self.path, self.offsets = path, offsets
        self.tmp = path.with_name(path.name + TMP)
        clear_tmp(self.tmp, path)
        self.fd = open_tmp(self.tmp)
        try:
            os.pwrite(self.fd, head, 0)
        except OSError as e:
            self.discard()
            e.filename = e.filename or str(path)  # pwrite names no file; the error line should
            raise
        self.head = (0, len(head), zlib.crc32(head))
        self.keys_left = keys
        self.chunks: list[Future] = []

    def discard(self) -> None:
        """Close the temporary and remove it (a full disk or a failed plan: no half-written part stays)."""
        os.close(self.fd)
        with contextlib.suppress(OSError):
            os.unlink(self.tmp)


class FactorWriter:
    """One rank's part files of one category at a time: ``begin`` with the plan, ``add`` each key's tensor
    (any device), then ``finish`` for the file map and the pending writes (each gives ``(file, crc32)``)."""

    def __init__(
        self,
        out: Path,
        *,
        fsync: bool,
        part_bytes: float,
        threads: int = 4,
        buffer_bytes: float = 2**30,
        chunk_bytes: int = 32 * MiB,
    ):
        self.out, self.fsync, self.part_bytes, self.chunk = out, fsync, part_bytes, int(chunk_bytes)
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="hjd-write")
        self._n_buffers = max(2, int(buffer_bytes // self.chunk))
        self._free: queue.Queue[Tensor] = queue.Queue()
        self._made = 0
        self._stream: torch.cuda.Stream | None = None

    # -- pinned buffers

    def _buffer(self) -> Tensor:
        try:
            return self._free.get_nowait()
        except queue.Empty:
            pass
        if self._made < self._n_buffers:
            self._made += 1
            return torch.empty(self.chunk, dtype=torch.uint8, pin_memory=True)
        return self._free.get()  # wait for the disk

    # -- plan and data

    def begin(
        self, category: str, rank: int, members: Sequence[tuple[str, Sequence[tuple[str, torch.dtype, Sequence[int]]]]]
    ) -> None:
        """Plan this rank's part files of ``category``: ``members`` as in :func:`plan_parts`."""
        self.category, self.rank = category, rank
        self.files: dict[str, str] = {}
        self._futures: list[Future] = []
        self._part_of: dict[str, _Part] = {}
        entries = dict(members)
        for j, names in enumerate(plan_parts(members, self.part_bytes)):
            fname = part_file(category, rank, j)
            keys = [e for m in names for e in entries[m]]
            head, offsets = safetensors_header(keys)
            try:
                part = _Part(self.out / fname, head, offsets, len(keys))
            except BaseException:
                for made in set(self._part_of.values()):  # the parts planned before this one
                    made.discard()
                raise
            for key, _, _ in keys:
                self._part_of[key] = part
                self.files[key] = fname

    def add(self, key: str, t: Tensor) -> None:
        """Write ``t`` at its planned place (asynchronously); the part is finished after its last key."""
        part = self._part_of.pop(key)
        data = tensor_bytes(t.detach())
        base = part.offsets[key]
        if data.device.type == "cuda":
            if self._stream is None:
                self._stream = torch.cuda.Stream(data.device)
            producer = torch.cuda.current_stream(data.device)
            self._stream.wait_stream(producer)  # t is ready on the compute stream
            data.record_stream(self._stream)
            for start in range(0, data.numel(), self.chunk):
                n = min(self.chunk, data.numel() - start)
                buf = self._buffer()
                with torch.cuda.stream(self._stream):
                    buf[:n].copy_(data[start : start + n], non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(self._stream)
                part.chunks.append(self._pool.submit(self._write_chunk, part, buf, n, base + start, event))
        elif data.numel():
            part.chunks.append(self._pool.submit(self._write_chunk, part, data, data.numel(), base, None))
        part.keys_left -= 1
        if part.keys_left == 0:
            self._futures.append(self._pool.submit(self._close_part, part))

    def _write_chunk(
        self, part: _Part, buf: Tensor, n: int, offset: int, event: torch.cuda.Event | None
    ) -> tuple[int, int, int]:
        try:
            if event is not None:
                event.synchronize()
            view = memoryview(buf.numpy())[:n]
            crc = zlib.crc32(view)
            done = 0
            while done < n:
                done += os.pwrite(part.fd, view[done:], offset + done)
        finally:
            if event is not None:
                self._free.put(buf)
        return offset, n, crc

    def _close_part(self, part: _Part) -> tuple[str, int]:
        try:
            # submitted earlier to the same pool; they finish first or raise here
            pieces = [part.head] + [f.result() for f in part.chunks]
            if self.fsync:
                os.fsync(part.fd)
        except BaseException as e:
            part.discard()  # a full disk: no half-written part stays in the store
            if isinstance(e, OSError) and e.filename is None:
                e.filename = str(part.path)  # pwrite names no file; the error line should
            raise
        os.close(part.fd)
        os.replace(part.tmp, part.path)
        return part.path.name, combine_pieces(pieces)

    def _write_whole(self, fname: str, tensors: dict[str, Tensor]) -> tuple[str, int]:
        return fname, save_tensors_atomic(self.out / fname, tensors, self.fsync)

    def write_file(self, fname: str, tensors: dict[str, Tensor]) -> None:
        """A file of its own (the category's ``V``), written in the pool."""
        cpu = {k: t.detach().cpu().contiguous() for k, t in tensors.items()}
        self.files.update(dict.fromkeys(cpu, fname))
        self._futures.append(self._pool.submit(self._write_whole, fname, cpu))

    def finish(self) -> tuple[dict[str, str], list[Future]]:
        """``{key: file}`` and the category's pending writes, each giving ``(file, crc32)`` (wait on them
        before recording the category)."""
        assert not self._part_of, f"keys never added: {sorted(self._part_of)[:3]}"
        return dict(self.files), list(self._futures)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
