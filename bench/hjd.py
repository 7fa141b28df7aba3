"""Benchmark of the distributed HJD stage (launch/hjd.py) on synthetic LLaMA-shaped checkpoints.

    python -m bench.hjd --suite device --work /tmp/hjd-bench --out $OUT/hjd.json   # H100s: 7B on 1 and 2 GPUs, 70B on 2
    python -m bench.hjd --suite tiny --work /tmp/hjd-bench --out /tmp/hjd_tiny.json  # CPU: checks the harness

A checkpoint holds only the targeted weights (random bf16, std 0.02) written as HF safetensors shards with
``model.safetensors.index.json`` and a ``config.json``. Each run is ``torchrun --standalone`` over
``launch/hjd.py``; wall time is measured around the whole command (interpreter and NCCL start-up, reads,
HJD, writes with fsync) after dropping the page cache when the machine allows it. Peak GPU memory and
per-phase times come from the store's manifest. The 70B-shaped set is generated, decomposed and deleted
one category at a time (a full 70B set plus its store would not fit the disk). The JSON is rewritten
after every step, so a run cut short still reports what finished.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import struct
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

import torch

from frod_ds.core.names import DEFAULT_TARGETS

REPO = Path(__file__).resolve().parents[1]

PRESETS = {  # LLaMA shapes: hidden, intermediate, layers, attention heads, KV heads
    "tiny": dict(hidden=256, intermediate=688, layers=5, heads=4, kv_heads=2),
    "7b": dict(hidden=4096, intermediate=11008, layers=32, heads=32, kv_heads=32),
    "70b": dict(hidden=8192, intermediate=28672, layers=80, heads=64, kv_heads=8),
}
TARGETS = list(DEFAULT_TARGETS)
ENV = dict(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1", HF_HUB_OFFLINE="1")


def weight_shape(preset: str, category: str) -> tuple[int, int]:
    p = PRESETS[preset]
    h, kv = p["hidden"], p["hidden"] // p["heads"] * p["kv_heads"]
    return {
        "q_proj": (h, h),
        "k_proj": (kv, h),
        "v_proj": (kv, h),
        "o_proj": (h, h),
        "gate_proj": (p["intermediate"], h),
        "up_proj": (p["intermediate"], h),
    }[category]


def module_name(category: str, layer: int) -> str:
    block = "self_attn" if category in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    return f"model.layers.{layer}.{block}.{category}"


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Minimal safetensors writer (bf16 only): header, then the raw bytes; ``file.write`` drops the GIL."""
    header, offset = {}, 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": "BF16", "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for t in tensors.values():
            f.write(memoryview(t.contiguous().view(torch.uint8).numpy()))


def write_checkpoint(path: Path, preset: str, categories: list[str], shard_gb: float = 2.0, seed: int = 0) -> dict:
    """Random bf16 weights of ``categories`` for every layer, in shards of about ``shard_gb``."""
    t0 = time.perf_counter()
    path.mkdir(parents=True, exist_ok=True)
    p = PRESETS[preset]
    names = [
        (module_name(c, layer) + ".weight", weight_shape(preset, c)) for c in categories for layer in range(p["layers"])
    ]
    shards: list[list[tuple[str, tuple[int, int]]]] = [[]]
    size = 0
    for name, shape in names:
        nbytes = shape[0] * shape[1] * 2
        if shards[-1] and size + nbytes > shard_gb * 2**30:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=device).manual_seed(seed)
    weight_map, total = {}, 0
    with ThreadPoolExecutor(4) as pool:
        pending = []
        for s, shard in enumerate(shards):
            fname = f"model-{s + 1:05d}-of-{len(shards):05d}.safetensors"
            tensors = {}
            for name, shape in shard:
                w = torch.randn(*shape, generator=g, device=device, dtype=torch.float32).mul_(0.02)
                tensors[name] = w.to(torch.bfloat16).cpu()
                weight_map[name] = fname
                total += tensors[name].numel() * 2
            while len(pending) >= 4:  # bounded host memory
                pending.pop(0).result()
            pending.append(pool.submit(write_safetensors, path / fname, tensors))
        for f in pending:
            f.result()
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    (path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
                "hidden_size": p["hidden"],
                "intermediate_size": p["intermediate"],
                "num_hidden_layers": p["layers"],
                "num_attention_heads": p["heads"],
                "num_key_value_heads": p["kv_heads"],
                "torch_dtype": "bfloat16",
                "vocab_size": 32000,
            }
        )
    )
    os.sync()
    return {
        "preset": preset,
        "categories": categories,
        "gib": round(total / 2**30, 3),
        "shards": len(shards),
        "seconds": round(time.perf_counter() - t0, 2),
    }


def drop_caches() -> bool:
    """Empty the page cache so the stage reads from disk (root only); ``False`` when not allowed."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def run_stage(model: Path, out: Path, gpus: int, args: list[str], log: Path, cold: bool, torchrun: bool = True) -> dict:
    """``torchrun --nproc_per_node gpus launch/hjd.py`` (or, one GPU, plain ``python launch/hjd.py``) timed
    from outside; summary from the manifest."""
    shutil.rmtree(out, ignore_errors=True)
    env = dict(os.environ, **ENV, PYTHONPATH=str(REPO))
    if torch.cuda.is_available():
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(gpus))
    assert torchrun or gpus == 1, "several GPUs need a launcher"
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(gpus)] if torchrun else []
    cmd = [sys.executable, *launcher, str(REPO / "launch" / "hjd.py"), "--model", str(model), "--out", str(out), *args]
    dropped = drop_caches() if cold else False
    t0 = time.perf_counter()
    with open(log, "a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        rc = subprocess.run(cmd, env=env, cwd=REPO, stdout=f, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - t0
    result = {
        "gpus": gpus,
        "launcher": "torchrun" if torchrun else "python",
        "args": args,
        "rc": rc,
        "wall_s": round(wall, 2),
        "cold_cache": dropped,
    }
    mpath = out / "manifest.json"
    if mpath.is_file():
        from frod_ds.formats.factor_store import Manifest

        m = Manifest.read(mpath)
        ranks = m.run.ranks if m.run is not None else []
        result.update(
            complete=m.complete,
            stage_s=m.run and m.run.seconds,
            startup_s=m.run and m.run.startup_s,
            prologue_s=m.run and m.run.prologue_s,
            ranks=[dataclasses.asdict(r) for r in ranks],
            peak_gpu_gib=max((r.peak_device_gib or 0 for r in ranks), default=None),
            peak_gpu_reserved_gib=max((r.peak_device_reserved_gib or 0 for r in ranks), default=None),
            categories={
                c: {
                    "seconds": r.seconds,
                    "phase_seconds": r.phase_seconds,
                    "max_error": r.max_error,
                    "max_stored_error": r.max_stored_error,
                    "width": r.width,
                    "method": r.method,
                    "cond_estimate": r.cond_estimate,
                    "members": len(r.members),
                }
                for c, r in m.categories.items()
                if r.complete
            },
        )
    return result


def check_against_decompose(model: Path, out: Path) -> dict:
    """The GPU store (fp64) against single-process ``decompose`` on the CPU: V and reconstruction."""
    from frod_ds.hjd.math import decompose
    from frod_ds.io.hf_checkpoint import HFCheckpoint
    from frod_ds.model.store_reader import FactorStore

    store, ckpt = FactorStore.open(out), HFCheckpoint(model)
    worst = {"v_rel": 0.0, "recon_rel": 0.0}
    for category, members in store.categories.items():
        Ws = [ckpt.get(m + ".weight").double() for m in members]
        ref = decompose(Ws, pi=store.pi, dtype=torch.float64)
        V = store.load_V(category, torch.float64)
        worst["v_rel"] = max(worst["v_rel"], (torch.linalg.norm(V - ref.V) / torch.linalg.norm(ref.V)).item())
        for m, W in zip(members, Ws):
            U, s = store.load_U(m, torch.float64), store.load_sigma(m, torch.float64)
            # U is stored in bf16, so this is bf16-level; the stage's fp64 HJD error is max_hjd_error.
            worst["recon_rel"] = max(
                worst["recon_rel"], (torch.linalg.norm((U * s) @ V.T - W) / torch.linalg.norm(W)).item()
            )
        worst["max_hjd_error"] = max(worst.get("max_hjd_error", 0.0), store.record(category).max_error)
    return worst


def environment() -> dict:
    env = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "host_cpus": os.cpu_count(),
    }
    try:
        import safetensors

        env["safetensors"] = safetensors.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["gpu_count"] = torch.cuda.device_count()
        env["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--verify", "-q", "HEAD"], cwd=REPO, capture_output=True, text=True
        )
        if commit.returncode == 0:
            dirty = subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True, text=True
            ).stdout.strip()
            env["git_commit"] = commit.stdout.strip() + ("-dirty" if dirty else "")
    except OSError:
        pass
    return env


class Suite:
    """Steps with a deadline; results rewritten to ``out`` after each."""

    def __init__(self, work: Path, out: Path, budget_s: float):
        self.work, self.out, self.deadline = work, out, time.monotonic() + budget_s
        self.log = out.with_suffix(".log")
        argv = [Path(a).name if a == str(out) else a for a in sys.argv]  # no machine path in the results
        self.results: dict = {
            "command": "python3 " + " ".join(argv),
            "environment": environment(),
            "generated": [],
            "runs": [],
            "skipped": [],
            "notes": [],
        }
        work.mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def save(self) -> None:
        self.results["disk_free_gib"] = round(shutil.disk_usage(self.work).free / 2**30, 1)
        self.out.write_text(json.dumps(self.results, indent=1) + "\n")

    def step(self, name: str, need_s: float, fn, **info) -> dict | None:
        if self.left() < need_s:
            self.results["skipped"].append({"name": name, "reason": f"{self.left():.0f} s left, needs ~{need_s:.0f} s"})
            self.save()
            return None
        try:
            result = {"name": name, **info, **fn()}
        except Exception as e:  # keep going: later steps may still run
            result = {"name": name, **info, "exception": f"{type(e).__name__}: {e}"}
        (self.results["generated"] if name.startswith("gen") else self.results["runs"]).append(result)
        self.save()
        print(json.dumps({k: v for k, v in result.items() if k not in ("ranks", "categories")}), flush=True)
        return result


def suite(kind: str, work: Path, out: Path, budget_s: float) -> None:
    s = Suite(work, out, budget_s)
    gpus2 = 2 if (not torch.cuda.is_available() or torch.cuda.device_count() >= 2) else 1
    ckpt, store = work / "ckpt", work / "store"

    # 1. Correctness on this machine's backend: fp64 store vs CPU decompose.
    shutil.rmtree(ckpt, ignore_errors=True)
    s.step("gen-tiny", 30, lambda: write_checkpoint(ckpt, "tiny", TARGETS))
    s.step(
        "tiny-fp64-check",
        60,
        lambda: {
            **run_stage(ckpt, store, gpus2, ["--dtype", "float64"], s.log, False),
            "vs_decompose": check_against_decompose(ckpt, store),
        },
    )
    if kind == "tiny":
        s.step("tiny-fp32", 60, lambda: run_stage(ckpt, store, gpus2, [], s.log, False))
        shutil.rmtree(work, ignore_errors=True)
        return
    if kind == "7b-1gpu":  # where the 7B time goes on one GPU: launcher, disk reads, durable writes, route
        shutil.rmtree(ckpt, ignore_errors=True)
        if s.step("gen-7b", 90, lambda: write_checkpoint(ckpt, "7b", TARGETS)):
            s.step(
                "7b-1gpu-python-cold",
                60,
                lambda: run_stage(ckpt, store, 1, [], s.log, True, torchrun=False),
                preset="7b",
            )
            s.step(
                "7b-1gpu-python-cold-again",
                60,
                lambda: run_stage(ckpt, store, 1, [], s.log, True, torchrun=False),
                preset="7b",
            )
            s.step("7b-1gpu-torchrun-cold", 60, lambda: run_stage(ckpt, store, 1, [], s.log, True), preset="7b")
            s.step(
                "7b-1gpu-python-warm",
                60,
                lambda: run_stage(ckpt, store, 1, [], s.log, False, torchrun=False),
                preset="7b",
            )
            s.step(
                "7b-1gpu-python-warm-nofsync",
                60,
                lambda: run_stage(ckpt, store, 1, ["--no-fsync"], s.log, False, torchrun=False),
                preset="7b",
            )
            s.step(
                "7b-1gpu-python-cold-householder",
                80,
                lambda: run_stage(ckpt, store, 1, ["--method", "householder"], s.log, True, torchrun=False),
                preset="7b",
            )
        shutil.rmtree(work, ignore_errors=True)
        return

    # 2. LLaMA-2-7B shapes, six categories, on 2 GPUs (one GPU: --suite 7b-1gpu on a one-GPU machine).
    shutil.rmtree(ckpt, ignore_errors=True)
    if s.step("gen-7b", 60, lambda: write_checkpoint(ckpt, "7b", TARGETS)):
        s.step("7b-2gpu-cold", 40, lambda: run_stage(ckpt, store, gpus2, [], s.log, True), preset="7b")
        s.step("7b-2gpu-warm", 40, lambda: run_stage(ckpt, store, gpus2, [], s.log, False), preset="7b")
    shutil.rmtree(ckpt, ignore_errors=True)
    shutil.rmtree(store, ignore_errors=True)

    # 3. LLaMA-70B shapes on 2 GPUs, one category at a time (generate, decompose, delete).
    need = {"q_proj": 50, "k_proj": 25, "gate_proj": 120, "v_proj": 25, "o_proj": 50, "up_proj": 120}
    for category in ["q_proj", "k_proj", "gate_proj", "v_proj", "o_proj", "up_proj"]:
        if s.left() < need[category]:
            s.results["skipped"].append({"name": f"70b-{category}", "reason": f"{s.left():.0f} s left"})
            s.save()
            continue
        if s.step(f"gen-70b-{category}", need[category], lambda: write_checkpoint(ckpt, "70b", [category])):
            s.step(
                f"70b-2gpu-{category}",
                need[category] * 0.6,
                lambda: run_stage(ckpt, store, gpus2, ["--targets", category], s.log, True),
                preset="70b",
            )
        shutil.rmtree(ckpt, ignore_errors=True)
        shutil.rmtree(store, ignore_errors=True)
    runs = {r["name"]: r for r in s.results["runs"]}
    done = [c for c in TARGETS if runs.get(f"70b-2gpu-{c}", {}).get("rc") == 0]
    s.results["summary"] = {
        "7b_2gpu_cold_wall_s": runs.get("7b-2gpu-cold", {}).get("wall_s"),
        "7b_2gpu_warm_wall_s": runs.get("7b-2gpu-warm", {}).get("wall_s"),
        "70b_categories_done": done,
        "70b_wall_s_sum": round(sum(runs[f"70b-2gpu-{c}"]["wall_s"] for c in done), 1),
        "70b_stage_s_sum": round(sum(runs[f"70b-2gpu-{c}"].get("stage_s") or 0 for c in done), 1),
        "70b_peak_gpu_gib": max((runs[f"70b-2gpu-{c}"].get("peak_gpu_gib") or 0 for c in done), default=None),
    }
    s.save()
    shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--suite",
        choices=["tiny", "device", "7b-1gpu"],
        required=True,
        help="tiny: CPU harness check; device: GPUs (7B and 70B shapes); 7b-1gpu: 7B I/O breakdown",
    )
    p.add_argument("--work", type=Path, required=True, help="scratch directory for checkpoints and stores (deleted)")
    p.add_argument("--out", type=Path, required=True, help="results JSON (a .log with the stage output beside it)")
    p.add_argument("--budget-s", type=float, default=540, help="stop starting new steps after this many seconds")
    args = p.parse_args()
    suite(args.suite, args.work, args.out, args.budget_s)


if __name__ == "__main__":
    main()
