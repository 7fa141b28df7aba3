"""Where a rank's step goes on the GPU: a few steps under ``torch.profiler`` (CUDA activity only, so the host is
slowed as little as a profiler allows), summed by kind of work.

Kernels are compute unless NCCL's; copies (``Memcpy``, the layer partition's peer copies among them) are counted
apart, since they run on the copy engines beside the kernels. The figure the 2-GPU profile found to matter is the
compute time spent beside a running NCCL kernel (which holds its SMs while it waits for its peer): ``summarize``
reports it with the time of each kind per step. Step times come from the unprofiled windows, never from these.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["collect", "summarize"]

Span = tuple[str, int, int]  # (kind: "compute" | "nccl" | "copy", start ns, end ns)


def _kind(name: str, is_copy: bool) -> str:
    if is_copy:
        return "copy"
    return "nccl" if "nccl" in name.lower() else "compute"


def _union(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _overlap(spans: Iterable[tuple[int, int]], cover: list[tuple[int, int]]) -> int:
    """Total length of ``spans`` inside the disjoint, sorted intervals ``cover``."""
    total = 0
    for a, b in spans:
        for c, d in cover:
            if c >= b:
                break
            total += max(0, min(b, d) - max(a, c))
    return total


def summarize(spans: list[Span], steps: int) -> dict[str, float]:
    """Milliseconds per step: each kind's summed time, compute beside NCCL, and the time the GPU ran anything."""
    by_kind: dict[str, list[tuple[int, int]]] = {"compute": [], "nccl": [], "copy": []}
    for kind, a, b in spans:
        by_kind[kind].append((a, b))
    nccl = _union(by_kind["nccl"])
    busy = _union([s for v in by_kind.values() for s in v])
    ms = 1e-6 / steps
    return {
        "compute_ms": sum(b - a for a, b in by_kind["compute"]) * ms,
        "nccl_ms": sum(b - a for a, b in nccl) * ms,
        "copy_ms": sum(b - a for a, b in _union(by_kind["copy"])) * ms,
        "compute_beside_nccl_ms": _overlap(by_kind["compute"], nccl) * ms,
        "gpu_busy_ms": sum(b - a for a, b in busy) * ms,
        "kernels_per_step": len(by_kind["compute"]) / steps,
    }


def collect(step: Callable[[], Any], steps: int, device: torch.device) -> dict[str, float]:
    """Run ``step`` ``steps`` times under the profiler (CUDA activity) and summarize its kernels and copies."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize(device)
    spans: list[Span] = []
    for e in prof.profiler.kineto_results.events():
        if e.device_type() != torch.autograd.DeviceType.CUDA:
            continue
        name = e.name()
        is_copy = name.lower().startswith("memcpy") or name.lower().startswith("memset")
        spans.append((_kind(name, is_copy), e.start_ns(), e.start_ns() + e.duration_ns()))
    return summarize(spans, steps)
