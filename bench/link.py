"""The link between the GPUs: topology and NCCL all-gather bandwidth, the numbers a ZeRO-3 step floor needs.

    torchrun --standalone --nproc_per_node 2 bench/link.py --out "$OUT"           # GPU machine
    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node 2 bench/link.py --out /tmp/l --sizes-mib 1 4  # CPU (gloo)

For each message size (MiB per rank after the gather, bf16) it times ``all_gather_into_tensor`` and reports
algorithm bandwidth (bytes gathered / time) and bus bandwidth (algbw × (N−1)/N, the bytes each GPU receives
per second: the figure to divide a ZeRO-3 step's gathered bytes by). ``nvidia-smi topo -m`` goes into the
JSON as text. Result: ``link_<N>gpu.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MIB = 2**20


def _topology() -> str | None:
    try:
        return subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(size_mib: float, iters: int, warmup: int) -> dict:
    """Median seconds of one all-gather whose output is ``size_mib`` MiB of bf16, and its bandwidths."""
    from frod_ds.runtime import distributed as dist

    world, device = dist.get_world_size(), dist.local_device()
    n_out = int(size_mib * MIB) // 2 // world * world
    out = torch.empty(n_out, dtype=torch.bfloat16, device=device)
    inp = torch.ones(n_out // world, dtype=torch.bfloat16, device=device)
    times = []
    for i in range(warmup + iters):
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        dist.all_gather_into(out, inp)
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    nbytes = n_out * 2
    return {
        "size_mib": nbytes / MIB,
        "median_s": t,
        "min_s": min(times),
        "algbw_gbs": nbytes / t / 1e9,
        "busbw_gbs": nbytes / t / 1e9 * (world - 1) / world,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="results dir (default $OUT or bench/results)")
    ap.add_argument("--sizes-mib", type=float, nargs="+", default=[16, 64, 256, 1024])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    from bench.common import write_result
    from frod_ds.runtime import distributed as dist

    dist.init_distributed()
    if dist.local_device().type == "cuda":
        torch.cuda.set_device(dist.local_device())
    rows = [measure(s, args.iters, args.warmup) for s in args.sizes_mib]
    world = dist.get_world_size()
    if dist.is_main():
        path = write_result(
            f"link_{world}gpu",
            {"world_size": world, "collective": "all_gather_into_tensor bf16", "sizes": rows, "topology": _topology()},
            args.out,
        )
        for r in rows:
            print(
                f"all-gather {r['size_mib']:.0f} MiB over {world}: {r['median_s'] * 1e3:.2f} ms, "
                f"algbw {r['algbw_gbs']:.1f} GB/s, busbw {r['busbw_gbs']:.1f} GB/s"
            )
        print(path)
    dist.destroy()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # result written, group destroyed: skip the teardown where a gloo rank can abort (see train_step.py)
