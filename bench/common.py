"""Shared helpers for benchmarks: timing with CUDA events, environment facts, JSON results."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch


def versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for mod in ("transformers", "deepspeed", "peft", "bitsandbytes"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - absent packages are simply not reported
            pass
    out["cuda"] = torch.version.cuda
    return out


def device_name() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    return f"cpu ({os.cpu_count()} cores)"


def time_fn(fn: Callable[[], None], warmup: int = 5, iters: int = 20) -> dict:
    """Median / min milliseconds of ``fn`` (CUDA events on GPU, perf_counter on CPU)."""
    import time

    for _ in range(warmup):
        fn()
    times = []
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": statistics.median(times), "min_ms": min(times), "iters": iters}


def write_result(name: str, payload: dict, out_dir: str | None = None) -> Path:
    """Write ``<out_dir>/<name>.json`` with command, device, date and versions."""
    out = Path(out_dir or os.environ.get("OUT") or Path(__file__).parent / "results")
    out.mkdir(parents=True, exist_ok=True)
    doc = {
        "benchmark": name,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "device": device_name(),
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "versions": versions(),
        **payload,
    }
    path = out / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(path)
    return path


def trainables_per_decoder_layer(result: dict) -> bool | None:
    """Whether a step-matrix result held σ and S per decoder layer (``FRoDTrainables``: two trainable
    tensors per layer), from its recorded tensor count; None for results from before that field."""
    if "trainable_tensors" not in result:
        return None
    return result["trainable_tensors"] == 2 * result["model"]["num_hidden_layers"]


def deepspeed_nvtx(result: dict) -> bool:
    """Whether a step-matrix run had DeepSpeed's NVTX ranges on: its recorded ``--nvtx``; results from
    before frod-ds turned them off record nothing, and ran with DeepSpeed's default, on."""
    return result.get("levers", {}).get("nvtx", True)


LLAMA_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
)


def llama_config(result: dict) -> dict:
    """The ``config.json`` of a step-matrix result's model (its recorded ``model`` widths), for the planner."""
    return {"model_type": "llama", **{k: result["model"][k] for k in LLAMA_KEYS}}
