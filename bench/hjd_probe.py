"""Throughput of the pieces the HJD stage is made of, on this machine: what bounds a 7B run.

    python bench/hjd_probe.py --work /tmp/probe --out probe.json

Measures (each a best-of-a-few wall time): interpreter + torch + CUDA start-up; fp32 (TF32 off) GEMM,
Householder QR, eigh and batched Cholesky at LLaMA-7B shapes; host<->device copies (pageable and pinned);
disk writes (buffered, fsync) and reads (page cache and, as root, after dropping it) with 1 and several
threads. The numbers set the plan of ``frod_ds/hjd/routes.py``; none is asserted anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.hjd import drop_caches  # noqa: E402

GiB = 2**30


def timed(fn, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def startup() -> dict:
    out = {}
    for name, code in [
        ("python", "pass"),
        ("import_torch", "import torch"),
        ("torch_cuda_init", "import torch; torch.zeros(1, device='cuda'); torch.cuda.synchronize()"),
    ]:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True)
        out[name] = round(time.perf_counter() - t0, 3)
    script = (
        "import torch, torch.distributed as d; d.init_process_group('nccl', device_id=torch.device('cuda', 0)); "
        "d.barrier(); d.destroy_process_group()"
    )
    Path("/tmp/probe_ddp.py").write_text(script)
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", "/tmp/probe_ddp.py"],
        check=True,
        env=dict(os.environ, NCCL_NVLS_ENABLE="0"),
    )
    out["torchrun_1proc_nccl"] = round(time.perf_counter() - t0, 3)
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", "import sys; sys.argv=['x','--help']; sys.path.insert(0,'.'); import launch.hjd"],
        check=True,
    )
    out["import_launch_hjd"] = round(time.perf_counter() - t0, 3)
    return out


def gpu() -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    dev = torch.device("cuda")
    out = {}
    n = 4096
    for m in (4096, 11008):
        A = torch.randn(m, n, device=dev)
        B = torch.randn(n, n, device=dev)
        t = timed(lambda: A @ B, 5)
        out[f"sgemm_{m}x{n}x{n}_tflops"] = round(2 * m * n * n / t / 1e12, 1)
        t = timed(lambda: A.T @ A, 5)
        out[f"gram_{m}x{n}_tflops"] = round(2 * m * n * n / t / 1e12, 1)
        Ab = A.to(torch.bfloat16)
        t = timed(lambda: Ab.float(), 5)
        out[f"bf16_to_fp32_{m}_ms"] = round(t * 1e3, 3)
    Ad = torch.randn(11008, n, device=dev, dtype=torch.float64)
    Bd = torch.randn(n, n, device=dev, dtype=torch.float64)
    t = timed(lambda A=Ad, B=Bd: A @ B, 5)
    out["dgemm_11008x4096x4096_tflops"] = round(2 * 11008 * n * n / t / 1e12, 1)
    del Ad, Bd
    for M in (131072, 352256):
        W = torch.randn(M, n, device=dev)
        t = timed(lambda: torch.linalg.qr(W, mode="reduced"), 2)
        out[f"qr_{M}x{n}_s"] = round(t, 3)
        t = timed(lambda: torch.geqrf(W), 2)
        out[f"geqrf_{M}x{n}_s"] = round(t, 3)
        del W
        torch.cuda.empty_cache()
    for M in (16384, 32768):
        W = torch.randn(M, n, device=dev)
        t = timed(lambda: torch.linalg.qr(W, mode="reduced"), 2)
        out[f"qr_{M}x{n}_s"] = round(t, 3)
    S = torch.randn(n, n, device=dev)
    S = S @ S.T / n + torch.eye(n, device=dev)
    out["eigh_4096_fp32_s"] = round(timed(lambda: torch.linalg.eigh(S), 2), 3)
    out["eigh_4096_fp64_s"] = round(timed(lambda: torch.linalg.eigh(S.double()), 2), 3)
    out["chol_inv_4096_fp32_s"] = round(timed(lambda: torch.cholesky_inverse(torch.linalg.cholesky(S)), 3), 4)
    Sb = S.expand(16, n, n).contiguous()
    out["chol_inv_batch16_4096_fp32_s"] = round(
        timed(lambda Sb=Sb: torch.cholesky_inverse(torch.linalg.cholesky(Sb)), 2), 4
    )
    del Sb
    out["inv_4096_fp32_s"] = round(timed(lambda: torch.linalg.inv(S), 3), 4)
    # host <-> device
    for pinned in (False, True):
        h = torch.empty(GiB // 2, dtype=torch.uint8, pin_memory=pinned)
        d = torch.empty(GiB // 2, dtype=torch.uint8, device=dev)
        tag = "pinned" if pinned else "pageable"
        out[f"h2d_{tag}_gbs"] = round(0.5 * GiB / timed(lambda: d.copy_(h, non_blocking=pinned), 3) / 1e9, 1)
        out[f"d2h_{tag}_gbs"] = round(0.5 * GiB / timed(lambda: h.copy_(d, non_blocking=pinned), 3) / 1e9, 1)
    t0 = time.perf_counter()
    torch.empty(2 * GiB, dtype=torch.uint8, pin_memory=True)
    out["pin_alloc_2gib_s"] = round(time.perf_counter() - t0, 3)
    return out


def disk(work: Path) -> dict:
    out = {}
    work.mkdir(parents=True, exist_ok=True)
    buf = os.urandom(64 * 2**20)
    files = [work / f"f{i}.bin" for i in range(8)]
    per = GiB // 2  # 8 files x 0.5 GiB = 4 GiB

    def write(p: Path, fsync: bool) -> None:
        with open(p, "wb") as f:
            for _ in range(per // len(buf)):
                f.write(buf)
            if fsync:
                f.flush()
                os.fsync(f.fileno())

    def read(p: Path) -> int:
        fd = os.open(p, os.O_RDONLY)
        try:
            mv = bytearray(32 * 2**20)
            n = 0
            while True:
                k = os.readv(fd, [mv])
                if k <= 0:
                    return n
                n += k
        finally:
            os.close(fd)

    for threads in (1, 4):
        for fsync in (False, True):
            for p in files:
                p.unlink(missing_ok=True)
            os.sync()
            t0 = time.perf_counter()
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(lambda p: write(p, fsync), files))
            out[f"write_{threads}t_{'fsync' if fsync else 'buffered'}_gbs"] = round(
                4 * GiB / (time.perf_counter() - t0) / 1e9, 2
            )
    t0 = time.perf_counter()
    os.sync()
    out["sync_after_s"] = round(time.perf_counter() - t0, 2)
    for threads in (1, 4, 8):
        for cold in (True, False):
            if cold and not drop_caches():
                continue
            t0 = time.perf_counter()
            with ThreadPoolExecutor(threads) as pool:
                n = sum(pool.map(read, files))
            out[f"read_{threads}t_{'cold' if cold else 'cached'}_gbs"] = round(n / (time.perf_counter() - t0) / 1e9, 2)
    for p in files:
        p.unlink(missing_ok=True)
    st = os.statvfs(work)
    out["disk_free_gib"] = round(st.f_bavail * st.f_frsize / GiB, 1)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    res: dict = {"torch": torch.__version__, "cpus": os.cpu_count()}
    if torch.cuda.is_available():
        res["gpu_name"] = torch.cuda.get_device_name(0)
    for name, fn in [("startup", startup), ("gpu", gpu), ("disk", lambda: disk(args.work))]:
        try:
            res[name] = fn()
        except Exception as e:  # report what ran
            res[name] = {"exception": f"{type(e).__name__}: {e}"}
        args.out.write_text(json.dumps(res, indent=1) + "\n")
        print(name, json.dumps(res[name]), flush=True)


if __name__ == "__main__":
    main()
