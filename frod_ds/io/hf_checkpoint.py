"""Read single tensors of a Hugging Face safetensors checkpoint without loading the model.

``HFCheckpoint`` reads ``model.safetensors.index.json`` (or a single ``model.safetensors``), parses each
shard's header itself (8-byte little-endian length + JSON) to know shapes, dtypes and byte offsets, and
reads a requested tensor's byte range from the shard that holds it. Shard headers are checked against the
file size on first use, so a missing or truncated shard is reported before any rank starts computing.

Importing this module does not import torch (``frod hjd`` uses it to start reading ahead while torch
loads); tensors are made on demand.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from frod_ds._moved import forward_names
from frod_ds.io import model_dir as _model_dir
from frod_ds.io.model_config import missing_linear, weights_problems
from frod_ds.io.model_dir import check_config_file, check_model_folder
from frod_ds.runtime.errors import CheckpointError, note
from frod_ds.runtime.paths import dir_problem
from frod_ds.runtime.strict_json import loads

if TYPE_CHECKING:
    import torch
    from torch import Tensor

__all__ = [
    "INDEX_NAME",
    "SINGLE_NAME",
    "safetensors_dtype",
    "HFCheckpoint",
    "TensorInfo",
]

INDEX_NAME = _model_dir.INDEX_NAME
SINGLE_NAME = "model.safetensors"

_ITEMSIZE = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}


def safetensors_dtype(code: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype code (``"BF16"`` -> ``torch.bfloat16``)."""
    import torch

    return {
        "F64": torch.float64,
        "F32": torch.float32,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "I64": torch.int64,
        "I32": torch.int32,
        "I16": torch.int16,
        "I8": torch.int8,
        "U8": torch.uint8,
        "BOOL": torch.bool,
        "F8_E4M3": torch.float8_e4m3fn,
        "F8_E5M2": torch.float8_e5m2,
    }[code]


class TensorInfo:
    """Where one tensor lives: shard file, dtype, shape, absolute byte range in the file."""

    __slots__ = ("file", "code", "shape", "start", "end")

    def __init__(self, file: Path, code: str, shape: tuple[int, ...], start: int, end: int):
        self.file, self.code, self.shape, self.start, self.end = file, code, shape, start, end

    @property
    def dtype(self) -> torch.dtype:
        return safetensors_dtype(self.code)

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def _read_header(file: Path) -> dict[str, TensorInfo]:
    """Parse and check a safetensors header; ``CheckpointError`` naming the file when it is missing or broken."""
    if not file.is_file():
        raise CheckpointError(
            f"shard {file.name} is missing from {file.parent} (it is listed in {INDEX_NAME}); the download is "
            "incomplete: download the checkpoint again"
        )
    size = file.stat().st_size
    broken = (
        f"safetensors file {file} is truncated or corrupt ({size} bytes on disk); delete it and download the "
        "checkpoint again"
    )
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(broken)
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > 100 * 2**20:
            raise CheckpointError(broken)
        try:
            header = loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise CheckpointError(broken) from None
    base = 8 + n
    out: dict[str, TensorInfo] = {}
    data_end = 0
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(x) for x in meta["data_offsets"])
            code = str(meta["dtype"])
            itemsize = _ITEMSIZE[code]
            shape = tuple(int(s) for s in meta["shape"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{broken} (bad header entry for {name!r})") from None
        numel = 1
        for d in shape:
            numel *= d
        if end - begin != numel * itemsize:
            raise CheckpointError(f"{broken} (the byte range of {name!r} does not match its shape and dtype)")
        data_end = max(data_end, end)
        out[name] = TensorInfo(file, code, shape, base + begin, base + end)
    if base + data_end != size:
        raise CheckpointError(f"{broken}; its header says {base + data_end} bytes")
    return out


class HFCheckpoint:
    """Tensor-level access to a safetensors checkpoint directory; nothing is read until asked for.

    Counts what it reads (``tensors_read``, ``bytes_read``) so a distributed stage can report that each
    rank read only its own members.
    """

    def __init__(self, model_dir: str | os.PathLike):
        self.dir = Path(model_dir)
        problem = dir_problem(self.dir)
        if problem:
            raise CheckpointError(f"checkpoint directory {problem}")
        check_model_folder(self.dir, "model directory")
        index = self.dir / INDEX_NAME
        single = self.dir / SINGLE_NAME
        if index.is_file():
            weight_map = _model_dir.index_weight_map(self.dir) or {}
            self._file_of = {name: self.dir / fname for name, fname in weight_map.items()}
            if single.is_file() and single not in set(self._file_of.values()):
                raise CheckpointError(
                    f"{self.dir} holds both the sharded {INDEX_NAME} and a {SINGLE_NAME} it does not list: "
                    f"transformers would read {SINGLE_NAME}, frod-ds the shards; move the one that is not this "
                    "model's out of the folder"
                )
        elif single.is_file():
            self._file_of = {name: single for name in _read_header(single)}
        else:
            shards = sorted(p.name for p in self.dir.glob("*.safetensors"))
            if shards:  # the shards without the index that says which tensor each holds
                shown = ", ".join(shards[:3]) + (f" and {len(shards) - 3} more" if len(shards) > 3 else "")
                raise CheckpointError(
                    f"{self.dir} holds safetensors shards ({shown}) but no {INDEX_NAME}, which maps each tensor to "
                    "its shard; copy it from the original checkpoint"
                )
            hint = (
                " (found PyTorch .bin files: convert them to safetensors first)" if any(self.dir.glob("*.bin")) else ""
            )
            raise CheckpointError(
                f"no {INDEX_NAME} or {SINGLE_NAME} in {self.dir}; HJD reads safetensors checkpoints{hint}"
            )
        self._indexed = index.is_file()
        self._headers: dict[Path, dict[str, TensorInfo]] = {}
        self._config: dict | None = None
        self.tensors_read = 0
        self.bytes_read = 0
        self._lock = threading.Lock()  # reader threads count what they read

    def config(self, required: bool = True) -> dict | None:
        """The checkpoint's ``config.json``, read and checked on first use only: its values (``check_config_file``)
        and the weights' shapes and layer count against it (``model_config.weights_problems``). ``required=False``
        (HJD, which needs only the weights): None, with a note, when there is none; a damaged config (not JSON) or
        one that contradicts the weights is refused either way: training would refuse it after the HJD."""
        if self._config is None:
            path = self.dir / "config.json"
            gap = missing_linear(self.keys())
            if gap is not None:  # HJD would decompose the category without that member, training fail to build
                where = self.dir / INDEX_NAME if self._indexed else self.dir
                raise CheckpointError(
                    f"{where} lacks {gap}: the checkpoint is incomplete; copy it again from its source"
                )
            if not required and not os.path.lexists(path):
                note(f"{self.dir} has no config.json: the factor store records no model config")
                return None
            config = check_config_file(self.dir)
            kind = config.get("model_type")
            if isinstance(kind, str):  # the planner reads config.json without transformers (and torch): not there
                from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

                if kind not in CONFIG_MAPPING_NAMES:
                    raise CheckpointError(
                        f"{path}: model_type {kind!r} is no architecture transformers knows; copy config.json from "
                        "the original checkpoint (a model newer than this transformers needs a newer one)"
                    )
            act = config.get("hidden_act")
            if act is not None:  # transformers looks it up only when it builds the MLPs, with a KeyError
                from transformers.activations import ACT2FN

                if not isinstance(act, str) or act not in ACT2FN:
                    raise CheckpointError(f"{path}: hidden_act {act!r} is no activation transformers knows (e.g. silu)")
            shapes = {name: self.shape(name) for name in self.keys() if name.endswith(".weight")}
            problems = weights_problems(config, shapes)
            if problems:
                raise CheckpointError(
                    f"{path} does not describe the weights in {self.dir} ({'; '.join(problems)}); the config is of "
                    "another model: copy the config.json that came with these weights"
                )
            if self._untied_head(config):
                raise CheckpointError(
                    f"{path} ties lm_head to the embedding (tie_word_embeddings: true), but {self.dir} holds an "
                    "lm_head.weight of other values, which the tied model would drop: set tie_word_embeddings to "
                    "false to keep the checkpoint's own head, as transformers does"
                )
            self._config = config
        return self._config

    def _untied_head(self, config: dict) -> bool:
        """The config ties ``lm_head`` to ``embed_tokens`` while the checkpoint holds an ``lm_head.weight`` of
        other values (a copy of the embedding is fine)."""
        embed = next((k for k in self.keys() if k.endswith("embed_tokens.weight")), None)
        if config.get("tie_word_embeddings") is not True or "lm_head.weight" not in self or embed is None:
            return False
        same = self.shape("lm_head.weight") == self.shape(embed)
        return not (same and self.get("lm_head.weight").equal(self.get(embed)))

    def keys(self) -> list[str]:
        """All tensor names of the checkpoint (from the index; no shard is opened)."""
        return list(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def info(self, name: str) -> TensorInfo:
        """Shard, dtype, shape and byte range of ``name`` (reads and checks that shard's header once)."""
        if name not in self._file_of:
            raise CheckpointError(f"tensor {name!r} is not in the checkpoint {self.dir}; check the model and --targets")
        file = self._file_of[name]
        if file not in self._headers:
            self._headers[file] = self._checked_header(file)
        header = self._headers[file]
        if name not in header:
            raise CheckpointError(
                f"{INDEX_NAME} in {self.dir} maps {name!r} to {file.name}, which does not contain it; the index and "
                "shards are from different downloads: download the checkpoint again"
            )
        return header[name]

    def _checked_header(self, file: Path) -> dict[str, TensorInfo]:
        """``file``'s header; with an index, every tensor the shard holds must be listed there: a tensor the
        index leaves out is invisible to every reader (no factors, no adapter for that module), not an error."""
        header = _read_header(file)
        if self._indexed:
            unlisted = sorted(n for n in header if n not in self._file_of)
            if unlisted:
                raise CheckpointError(
                    f"{self.dir / INDEX_NAME} does not list tensor {unlisted[0]!r} (held by {file.name}"
                    f"{f', and {len(unlisted) - 1} more' if len(unlisted) > 1 else ''}); the index is incomplete: "
                    "download the checkpoint again or add the tensor to its weight_map"
                )
        return header

    def check(self, names: Iterable[str]) -> None:
        """Check the shards holding ``names`` (present, header readable, size consistent) up front."""
        for name in names:
            self.info(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.info(name).shape

    def dtype(self, name: str) -> torch.dtype:
        return self.info(name).dtype

    def files(self, names: Iterable[str]) -> list[Path]:
        """The distinct shard files holding ``names``."""
        return sorted({self.info(n).file for n in names})

    def get(self, name: str, device: str | torch.device = "cpu") -> Tensor:
        """Read one tensor: its byte range straight from its shard into a new tensor (``os.preadv``, which
        releases the GIL, so reader threads run in parallel)."""
        import torch

        info = self.info(name)
        buf = torch.empty(info.nbytes, dtype=torch.uint8)
        self.read_range(name, 0, buf)
        t = buf.view(info.dtype).reshape(info.shape)
        return t if str(device) == "cpu" else t.to(device)

    def read_range(self, name: str, start: int, out: Tensor) -> None:
        """Bytes ``[start, start + out.numel())`` of ``name``'s data into the CPU ``uint8`` tensor ``out``."""
        info = self.info(name)
        length = out.numel()
        assert out.element_size() == 1 and out.is_contiguous() and 0 <= start and start + length <= info.nbytes
        if length:
            view = memoryview(out.numpy())
            try:
                fd = os.open(info.file, os.O_RDONLY)
                try:
                    done = 0
                    while done < length:
                        k = os.preadv(fd, [view[done:]], info.start + start + done)
                        if k <= 0:
                            raise OSError(f"read ended {length - done} bytes early")
                        done += k
                finally:
                    os.close(fd)
            except OSError as e:
                raise CheckpointError(
                    f"could not read {name!r} from {info.file}: {e}; the file is corrupt: download the checkpoint again"
                ) from None
        with self._lock:
            self.bytes_read += length
            if start + length == info.nbytes:
                self.tensors_read += 1

    def readahead(self, names: Iterable[str], budget_bytes: float) -> threading.Thread:
        """Ask the kernel to start reading ``names`` (in this order, up to ``budget_bytes``) into the page
        cache (``posix_fadvise(WILLNEED)``), from a daemon thread; returns it. Only a hint: errors end it
        quietly, and later reads are correct either way."""

        def run() -> None:
            left = budget_bytes
            try:
                for name in names:
                    info = self.info(name)
                    if left < info.nbytes:
                        return
                    fd = os.open(info.file, os.O_RDONLY)
                    try:
                        os.posix_fadvise(fd, info.start, info.nbytes, os.POSIX_FADV_WILLNEED)
                    finally:
                        os.close(fd)
                    left -= info.nbytes
            except (OSError, ValueError, AttributeError):
                return

        names = list(names)
        thread = threading.Thread(target=run, name="hjd-readahead", daemon=True)
        thread.start()
        return thread

    def read_bytes(self, name: str, offset: int, length: int) -> bytes:
        """Raw bytes ``[offset, offset + length)`` of ``name``'s data (used by the weights fingerprint)."""
        info = self.info(name)
        assert 0 <= offset and offset + length <= info.nbytes, "byte range outside the tensor"
        with open(info.file, "rb") as f:
            f.seek(info.start + offset)
            return f.read(length)


# where a model's folder and config.json are found moved to frod_ds.io.model_dir; its names forward there from here
_MOVED_NAMES = dict.fromkeys(_model_dir.__all__, _model_dir.__name__)
__getattr__ = forward_names(__name__, _MOVED_NAMES)
