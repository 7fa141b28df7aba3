"""Host-to-GPU copy bandwidth of pinned host memory, one GPU alone and every GPU of the machine at once: what the
layer partition's host shards (``ds_configs/zero3_offload.json``) move each pass, and whether the GPUs of one host
share that rate (the step-time model's ``HOST_SHARD_BYTES_PER_S`` per GPU, ``HOST_BYTES_PER_S`` for the host).

    python -m bench.host_link --out $OUT            # on the GPU machine; writes host_link.json
    python -m bench.host_link --tiny --out /tmp/hl  # CPU rehearsal (copies between two host buffers)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.common import write_result


def copy_rate(devices: list[torch.device], nbytes: int, repeats: int) -> dict:
    """Bytes per second of ``repeats`` copies of a pinned ``nbytes`` buffer onto each of ``devices`` at once (each
    on its device's own stream, issued back to back, then synchronized): per device and in all."""
    cuda = devices[0].type == "cuda"
    src = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda) for _ in devices]
    dst = [torch.empty(nbytes, dtype=torch.uint8, device=d) for d in devices]
    streams = [torch.cuda.Stream(d) if cuda else None for d in devices]

    def once() -> float:
        t0 = time.perf_counter()
        for _ in range(repeats):
            for s, a, b in zip(streams, src, dst):
                if s is None:
                    b.copy_(a)
                else:
                    with torch.cuda.stream(s):
                        b.copy_(a, non_blocking=True)
        for s in streams:
            if s is not None:
                s.synchronize()
        return time.perf_counter() - t0

    once()  # warm-up
    times = [once() for _ in range(5)]
    per = nbytes * repeats / statistics.median(times)
    return {"devices": len(devices), "per_device_bytes_per_s": per, "all_bytes_per_s": per * len(devices), "s": times}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0, help="buffer per device")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--tiny", action="store_true", help="the CPU rehearsal (two host buffers)")
    ap.add_argument("--out", default=None, help="results dir (default $OUT or bench/results)")
    args = ap.parse_args()
    if args.tiny or not torch.cuda.is_available():
        devices = [torch.device("cpu")] * 2
        nbytes = 1 << 20
    else:
        devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
        nbytes = int(args.gib * 2**30)
    runs = [copy_rate(devices[:n], nbytes, args.repeats) for n in sorted({1, len(devices)})]
    for r in runs:
        print(
            f"{r['devices']} at once: {r['per_device_bytes_per_s'] / 1e9:.1f} GB/s each, "
            f"{r['all_bytes_per_s'] / 1e9:.1f} GB/s in all",
            flush=True,
        )
    print(write_result("host_link", {"bytes": nbytes, "repeats": args.repeats, "runs": runs}, args.out))


if __name__ == "__main__":
    main()
