"""Where a multi-GPU training step's time goes, per rank: host (Python thread) time, GPU busy time, NCCL time and
how much of it is one rank waiting for the other, for FRoD under DeepSpeed (``ds``) and PEFT LoRA r=16 under plain
PyTorch / DistributedDataParallel (``ddp``). Full-depth LLaMA-2-7B shape with random bf16 weights, 4x512 tokens per
GPU, no checkpointing (``bench/train_step.py``'s models, builds and steppers).

    python bench/profile_two_gpu.py drive --work /tmp/p --out "$OUT" --parts A,B      # GPU machine, 2 GPUs, ~8 min
    DS_ACCELERATOR=cpu python bench/profile_two_gpu.py drive --tiny --work /tmp/p --out /tmp/p/out   # CPU rehearsal
    python bench/profile_two_gpu.py summarize --dir RESULTS                           # summary.json/.md again

Part A (``ds``, one process per configuration): FRoD s=0.02 under ``ds_configs/zero2.json`` and ``zero3.json`` on
2 GPUs, ``zero3.json`` on 1 GPU, and ``zero3.json`` with ``stage3_param_persistence_threshold`` 1e11 (every
parameter resident: nothing all-gathered) on 2 GPUs. Part B (``ddp``, one torchrun process, several variants in a
row on the same model): LoRA r=16 plain on rank 0 alone (rank 1 idle), plain on both ranks without any
synchronisation (``indep``: two processes sharing the machine), and DDP (static graph, 25 MB buckets) with
harness-side changes (threads, ``gradient_as_bucket_view``, ``broadcast_buffers``, bucket size, each rank's threads
pinned to its own half of the CPUs: ``*_pin``).

Per rank and configuration: ``warmup`` untimed steps; ``repeats`` x ``steps`` timed steps, each between device
synchronisations, with the host's issue time (until ``step()`` returns) and the Python thread's CPU time
(``time.thread_time``) over it, and every thread's CPU time over the timed steps by thread name (``/proc``: the
main thread runs the forward and the optimizer step, ``pt_autograd_<dev>`` the backward); ``phase_steps`` steps
synchronised between forward, backward and optimizer step; then ``prof_steps`` steps under ``torch.profiler`` (CUDA
activity only by default; ``--cpu-ops`` adds CPU ops and the top-20 op tables, at 2-3x the host time per step: on
these launch-bound steps even CUDA-only profiling slows the host, so the profiled steps' idle and wait times are
upper bounds; the timed steps are never profiled). From the profiler's trace: the union of compute
kernels (and copies) per step, NCCL kernel time, NCCL time while no compute runs (exposed), time with nothing on the
GPU (idle: waiting for the host), the gaps' sizes, host time blocked in synchronising CUDA calls, kernel launches,
collectives by name and size (``record_param_comms``) and DeepSpeed's collective calls counted at
``deepspeed.comm``'s backend. ``summarize`` matches the two ranks' NCCL kernels in order: for each one, the shorter
of the two durations is the transfer and the excess on the other rank is waiting for its peer. GPU clocks and power
come from an ``nvidia-smi`` log over the whole call, cut to each configuration's timed window.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import gzip
import json
import os
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

BLOCKING = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",
    "cuStreamSynchronize",
    "cuCtxSynchronize",
    "cuEventSynchronize",
)
DS_COMM = (
    "all_gather_into_tensor",
    "all_gather_base",
    "all_gather_coalesced",
    "all_gather",
    "reduce_scatter_tensor",
    "reduce_scatter",
    "all_reduce",
    "all_reduce_coalesced",
    "reduce",
    "broadcast",
)


# -- intervals -------------------------------------------------------------------------------------------------


def _union(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(iv):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _length(u) -> float:
    return sum(e - s for s, e in u)


def _intersect(a, b) -> list[tuple[float, float]]:
    i = j = 0
    out = []
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _gaps(u, lo: float, hi: float) -> list[float]:
    gaps, t = [], lo
    for s, e in u:
        if s > t:
            gaps.append(s - t)
        t = max(t, e)
    if hi > t:
        gaps.append(hi - t)
    return gaps


# -- trace analysis --------------------------------------------------------------------------------------------


def analyze_trace(path: Path, steps: int) -> dict:
    """Per-step numbers from a ``torch.profiler`` chrome trace whose steps are ``record_function("probe_step_<i>")``
    ranges (microseconds in the trace; milliseconds per step out)."""
    ev = json.loads(Path(path).read_text())["traceEvents"]
    xs = [e for e in ev if e.get("ph") == "X"]
    marks = sorted(
        (e for e in xs if str(e.get("name", "")).startswith("probe_step_") and e.get("cat") != "gpu_user_annotation"),
        key=lambda e: e["ts"],
    )
    if marks:
        lo = float(marks[0]["ts"])
    else:  # CUDA activity only (no CPU ops recorded): the window opens at the first CUDA call or kernel
        first = [
            float(e["ts"])
            for e in xs
            if e.get("cat") in ("cuda_runtime", "cuda_driver", "kernel", "gpu_memcpy", "gpu_memset")
        ]
        if not first:
            return {"error": "no probe_step ranges and no CUDA events in the trace"}
        lo = min(first)
    kern = [e for e in xs if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and float(e["ts"]) >= lo - 1]
    hi_cpu = max([float(m["ts"]) + float(m["dur"]) for m in marks] or [lo])
    hi = max([hi_cpu] + [float(k["ts"]) + float(k["dur"]) for k in kern])
    window = hi - lo
    per = 1e3 * steps  # us totals -> ms per step

    def cls(k) -> str:
        if "nccl" in k["name"].lower():
            return "nccl"
        return "compute" if k.get("cat") == "kernel" else "copy"

    iv = {"compute": [], "copy": [], "nccl": []}
    for k in kern:
        iv[cls(k)].append((float(k["ts"]), float(k["ts"]) + float(k["dur"])))
    u = {c: _union(v) for c, v in iv.items()}
    work = _union(iv["compute"] + iv["copy"])
    allk = _union(iv["compute"] + iv["copy"] + iv["nccl"])
    nccl_overlap = _length(_intersect(u["nccl"], work))
    idle_gaps = _gaps(allk, lo, hi)
    work_gaps = _gaps(work, lo, hi)

    def hist(gs):
        return {
            "n_per_step": len(gs) / steps,
            "over_20us_per_step": sum(g > 20 for g in gs) / steps,
            "over_100us_per_step": sum(g > 100 for g in gs) / steps,
            "over_1ms_per_step": sum(g > 1000 for g in gs) / steps,
            "ms_in_gaps_over_100us_per_step": sum(g for g in gs if g > 100) / per,
            "largest_ms": [round(g / 1e3, 3) for g in sorted(gs, reverse=True)[:8]],
        }

    by_name: dict[str, list[float]] = {}
    for k in kern:
        r = by_name.setdefault(k["name"], [0, 0.0])
        r[0] += 1
        r[1] += float(k["dur"])
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])
    top_kernels = [{"kernel": n[:110], "calls_per_step": c / steps, "ms_per_step": d / per} for n, (c, d) in top[:20]]
    nccl_kernels = [
        {"kernel": n[:110], "calls_per_step": c / steps, "ms_per_step": d / per}
        for n, (c, d) in top
        if "nccl" in n.lower()
    ]
    nccl_seq = [
        [k["name"][:60], round(float(k["dur"]), 2), round(float(k["ts"]) - lo, 1)]
        for k in sorted(kern, key=lambda k: float(k["ts"]))
        if cls(k) == "nccl"
    ]
    names = sorted(by_name)
    ids = {n: i for i, n in enumerate(names)}
    timeline = {
        "names": [n[:110] for n in names],
        "cols": ["start_us", "dur_us", "name_id", "stream"],
        "rows": [
            [
                round(float(k["ts"]) - lo, 1),
                round(float(k["dur"]), 2),
                ids[k["name"]],
                (k.get("args") or {}).get("stream"),
            ]
            for k in sorted(kern, key=lambda k: float(k["ts"]))
        ],
        "steps_cpu_us": [[round(float(m["ts"]) - lo, 1), round(float(m["dur"]), 1)] for m in marks],
    }

    rt = [
        e
        for e in xs
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and float(e["ts"]) >= lo - 1 and float(e["ts"]) <= hi
    ]
    rt_by: dict[str, list[float]] = {}
    for e in rt:
        r = rt_by.setdefault(e["name"], [0, 0.0])
        r[0] += 1
        r[1] += float(e["dur"])
    blocking = sum(d for n, (c, d) in rt_by.items() if n in BLOCKING)
    # cudaMemcpyAsync device->host waits for the stream too; count only the long ones as waits
    memcpy_wait = sum(float(e["dur"]) for e in rt if e["name"] == "cudaMemcpyAsync" and float(e["dur"]) > 50)
    launches = sum(c for n, (c, d) in rt_by.items() if "Launch" in n)
    top_rt = [
        {"call": n, "calls_per_step": c / steps, "ms_per_step": d / per}
        for n, (c, d) in sorted(rt_by.items(), key=lambda kv: -kv[1][1])[:12]
    ]

    colls: dict[str, dict] = {}
    for e in xs:
        a = e.get("args") or {}
        if "Collective name" not in a or float(e["ts"]) < lo - 1:
            continue
        dtype = str(a.get("dtype", ""))
        size = {"BFloat16": 2, "Float": 4, "Half": 2, "Long": 8, "Int": 4, "Byte": 1, "Char": 1}.get(dtype, 0)
        key = f"{a['Collective name']}"
        c = colls.setdefault(key, {"calls": 0, "out_bytes": 0, "sizes_mib": {}})
        c["calls"] += 1
        nel = a.get("Out msg nelems") or 0
        try:
            nel = int(nel)
        except (TypeError, ValueError):
            nel = 0
        c["out_bytes"] += nel * size
        sz = f"{nel * size / 2**20:.2f}"
        c["sizes_mib"][sz] = c["sizes_mib"].get(sz, 0) + 1
    for c in colls.values():
        c["calls_per_step"] = c.pop("calls") / steps
        c["out_mib_per_step"] = c.pop("out_bytes") / 2**20 / steps
        c["sizes_mib"] = dict(sorted(((k, v / steps) for k, v in c["sizes_mib"].items()), key=lambda kv: -kv[1])[:12])

    step_cpu = [float(m["dur"]) / 1e3 for m in marks]
    return {
        "steps": steps,
        "window_ms_per_step": window / per,
        "step_issue_ms_profiled": step_cpu,
        "compute_kernel_sum_ms": _length(iv["compute"]) / per,
        "compute_busy_ms": _length(u["compute"]) / per,
        "copy_busy_ms": _length(u["copy"]) / per,
        "work_busy_ms": _length(work) / per,
        "nccl_kernel_sum_ms": _length(iv["nccl"]) / per,
        "nccl_busy_ms": _length(u["nccl"]) / per,
        "nccl_overlapped_with_work_ms": nccl_overlap / per,
        "nccl_exposed_ms": (_length(u["nccl"]) - nccl_overlap) / per,
        "gpu_busy_any_ms": _length(allk) / per,
        "gpu_idle_ms": (window - _length(allk)) / per,
        "idle_gaps": hist(idle_gaps),
        "work_gaps": hist(work_gaps),
        "kernels_per_step": len(kern) / steps,
        "nccl_kernels_per_step": len(iv["nccl"]) / steps,
        "launches_per_step": launches / steps,
        "host_blocked_sync_ms": blocking / per,
        "host_blocked_memcpy_ms": memcpy_wait / per,
        "top_kernels": top_kernels,
        "nccl_by_kernel": nccl_kernels,
        "top_cuda_runtime": top_rt,
        "collectives_record_param_comms": colls,
        "nccl_sequence": nccl_seq,
        "timeline": timeline,
    }


# -- measuring one stepper ----------------------------------------------------------------------------------


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class CommCounter:
    """Counts DeepSpeed's collective calls (and their output bytes) at ``deepspeed.comm``'s backend object."""

    def __init__(self):
        self.on = False
        self.counts: dict[str, list] = {}
        try:
            import deepspeed.comm.comm as dcomm
        except Exception:  # noqa: BLE001 - no deepspeed: nothing to count
            return
        cdb = getattr(dcomm, "cdb", None)
        if cdb is None:
            return
        for name in DS_COMM:
            fn = getattr(cdb, name, None)
            if callable(fn):
                setattr(cdb, name, self._wrap(name, fn))

    def _wrap(self, name, fn):
        def wrapped(*a, **kw):
            if self.on:
                out = kw.get("output_tensor", kw.get("tensor", a[0] if a else None))
                nbytes = 0
                if isinstance(out, torch.Tensor):
                    nbytes = out.numel() * out.element_size()
                elif isinstance(out, (list, tuple)):
                    nbytes = sum(t.numel() * t.element_size() for t in out if isinstance(t, torch.Tensor))
                c = self.counts.setdefault(name, [0, 0, {}])
                c[0] += 1
                c[1] += nbytes
                key = f"{nbytes / 2**20:.2f}"
                c[2][key] = c[2].get(key, 0) + 1
            return fn(*a, **kw)

        return wrapped

    def report(self, steps: int) -> dict:
        return {
            n: {
                "calls_per_step": c / steps,
                "mib_per_step": b / 2**20 / steps,
                "sizes_mib": dict(sorted(((k, v / steps) for k, v in s.items()), key=lambda kv: -kv[1])[:12]),
            }
            for n, (c, b, s) in self.counts.items()
        }


def _steal_s() -> float | None:
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def _thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of this process's threads so far, summed per thread name (``/proc``)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            comm = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            out[comm] = out.get(comm, 0.0) + (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            continue
    return out


def _pin(cpus) -> None:
    """Every thread of this process onto ``cpus``."""
    for task in Path("/proc/self/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cpus)
        except OSError:
            pass


def _pct(v: list[float], q: float) -> float:
    s = sorted(v)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


def measure(step, phases_fn, batches, device, args, name: str, rank: int, comm: CommCounter | None, out: Path) -> dict:
    """Warm-up, timed windows, phase steps, profiled steps: this rank's record."""
    from torch.profiler import ProfilerActivity, profile, record_function

    for _ in range(args.warmup):
        step(next(batches))
    _sync(device)
    gc.collect()
    rows = []
    t_start = time.time()
    cpu0, steal0 = time.process_time(), _steal_s()
    threads0 = _thread_cpu() if Path("/proc/self/task").is_dir() else {}
    for _ in range(args.repeats * args.steps):
        ids = next(batches)
        _sync(device)
        t0, c0 = time.perf_counter(), time.thread_time()
        step(ids)
        t1, c1 = time.perf_counter(), time.thread_time()
        _sync(device)
        t2 = time.perf_counter()
        rows.append((t2 - t0, t1 - t0, c1 - c0))
    t_end = time.time()
    proc_cpu = time.process_time() - cpu0
    threads1 = _thread_cpu() if threads0 else {}
    per_thread = {
        k: round((v - threads0.get(k, 0.0)) * 1e3 / len(rows), 2)
        for k, v in threads1.items()
        if v - threads0.get(k, 0.0) > 0
    }
    steal = None if steal0 is None else _steal_s() - steal0
    wall = [r[0] * 1e3 for r in rows]
    issue = [r[1] * 1e3 for r in rows]
    thread = [r[2] * 1e3 for r in rows]
    phases = {"forward": [], "backward": [], "step": []}
    if phases_fn is not None:
        for _ in range(args.phase_steps):
            ids = next(batches)
            _sync(device)
            for k, v in phases_fn(ids).items():
                phases[k].append(v)
    rec = {
        "name": name,
        "rank": rank,
        "pid": os.getpid(),
        "timed_window_epoch_s": [t_start, t_end],
        "steps_timed": len(rows),
        "step_ms_median": statistics.median(wall),
        "step_ms_p10": _pct(wall, 0.1),
        "step_ms_p90": _pct(wall, 0.9),
        "step_ms_all": [round(w, 2) for w in wall],
        "issue_ms_median": statistics.median(issue),
        "issue_ms_p10": _pct(issue, 0.1),
        "issue_ms_p90": _pct(issue, 0.9),
        "thread_cpu_ms_median": statistics.median(thread),
        "thread_cpu_over_step": statistics.median(thread) / statistics.median(wall),
        "process_cpu_ms_per_step": proc_cpu * 1e3 / len(rows),
        "thread_cpu_ms_per_step_by_name": dict(sorted(per_thread.items(), key=lambda kv: -kv[1])),
        "cpus_pinned": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "profiler_activities": "cpu+cuda" if args.cpu_ops else ("cuda" if device.type == "cuda" else "cpu"),
        "steal_ms_per_step_all_cpus": None if steal is None else steal * 1e3 / len(rows),
        "phases_ms_median": {k: statistics.median(v) for k, v in phases.items() if v},
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "cpus_allowed": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
    }
    if device.type == "cuda":
        rec["peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    if args.prof_steps > 0:
        acts = ([ProfilerActivity.CPU] if args.cpu_ops or device.type != "cuda" else []) + (
            [ProfilerActivity.CUDA] if device.type == "cuda" else []
        )
        _sync(device)
        if comm is not None:
            comm.on = True
        t0 = time.perf_counter()
        with profile(activities=acts, record_shapes=False) as prof:
            for i in range(args.prof_steps):
                with record_function(f"probe_step_{i}"):
                    step(next(batches))
            _sync(device)
        rec["profiled_wall_ms_per_step"] = (time.perf_counter() - t0) * 1e3 / args.prof_steps
        if comm is not None:
            comm.on = False
            rec["ds_comm_calls"] = comm.report(args.prof_steps)
            comm.counts.clear()
        trace = Path(f"/tmp/probe_trace_{name}_r{rank}_{os.getpid()}.json")
        prof.export_chrome_trace(str(trace))
        try:
            rec["trace"] = analyze_trace(trace, args.prof_steps)
        except Exception as e:  # noqa: BLE001 - keep the timings even when the analysis breaks
            rec["trace"] = {"error": repr(e)}
        dev_key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        ka = prof.key_averages()
        tables = [
            f"== {name} rank {rank}: top-20 ops by self CPU time ({args.prof_steps} steps) ==",
            ka.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=70),
        ]
        if device.type == "cuda":
            try:
                t = ka.table(sort_by="self_device_time_total", row_limit=20, max_name_column_width=70)
            except Exception:  # noqa: BLE001 - older spelling
                t = ka.table(sort_by=dev_key, row_limit=20, max_name_column_width=70)
            tables += [f"== {name} rank {rank}: top-20 ops by self device time ==", t]
        (out / f"{name}.r{rank}.tables.txt").write_text("\n".join(tables) + "\n")
        if args.keep_traces:
            with open(trace, "rb") as f, gzip.open(out / f"{name}.r{rank}.trace.json.gz", "wb") as g:
                g.write(f.read())
        trace.unlink(missing_ok=True)
    seq = (rec.get("trace") or {}).pop("nccl_sequence", None)
    timeline = (rec.get("trace") or {}).pop("timeline", None)
    if seq is not None:
        with gzip.open(out / f"{name}.r{rank}.nccl.json.gz", "wt") as g:
            json.dump(seq, g)
    if timeline is not None:  # every kernel of the profiled steps, for analyses after the call
        with gzip.open(out / f"{name}.r{rank}.kernels.json.gz", "wt") as g:
            json.dump(timeline, g)
    path = out / f"{name}.r{rank}.json"
    path.write_text(json.dumps(rec, indent=1) + "\n")
    print(
        f"[{name} r{rank}] step {rec['step_ms_median']:.1f} ms (p10 {rec['step_ms_p10']:.1f}, p90 "
        f"{rec['step_ms_p90']:.1f}), issue {rec['issue_ms_median']:.1f}, thread cpu {rec['thread_cpu_ms_median']:.1f}, "
        f"threads {rec['torch_threads']}",
        flush=True,
    )
    return rec


def _meta(args, name: str, extra: dict) -> dict:
    from bench.common import versions

    return {
        "name": name,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "device": _device_words(),
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "versions": versions(),
        **extra,
    }


def _device_words() -> str:
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        nm = torch.cuda.get_device_name(0).replace("NVIDIA ", "")
        return f"{n} {nm}{'s' if n > 1 else ''}"
    return f"CPU ({os.cpu_count()} cores)"


# -- part A: FRoD under DeepSpeed ---------------------------------------------------------------------------


def cmd_ds(args) -> None:
    from bench.train_step import Stepper, _ds_config, _zero3, build_frod
    from frod_ds.runtime import distributed as dist

    dist.init_deepspeed()
    world, rank = dist.get_world_size(), dist.get_rank()
    device = dist.local_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ds_cfg = _ds_config(args.config, args.batch, world, args.ds_set)
    t0 = time.perf_counter()
    model, groups = build_frod(args, ds_cfg, rank)
    model.config.use_cache = False
    if _zero3(ds_cfg):
        from frod_ds.model.build import fetch_per_layer

        fetch_per_layer(model)
    step = Stepper(model, groups, ds_cfg, device)
    build_s = time.perf_counter() - t0
    comm = CommCounter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from bench.train_step import _batches

    vocab = step.model.config.vocab_size
    torch.distributed.barrier()
    rec = measure(
        step,
        lambda ids: step.phases(ids, lambda: _sync(device)),
        _batches(args.batch, args.seq, vocab, rank, device),
        device,
        args,
        args.name,
        rank,
        comm,
        out,
    )
    if rank == 0:
        meta = _meta(
            args,
            args.name,
            {
                "part": "A",
                "method": "frod",
                "config": args.config,
                "ds_set": args.ds_set,
                "ds_config": ds_cfg,
                "world_size": world,
                "batch": args.batch,
                "seq": args.seq,
                "sparsity": args.sparsity,
                "build_s": build_s,
                "warmup": args.warmup,
                "steps": args.steps,
                "repeats": args.repeats,
                "prof_steps": args.prof_steps,
                "trainable_tensors": sum(1 for p in step.model.parameters() if p.requires_grad),
            },
        )
        (out / f"{args.name}.meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    del rec
    dist.destroy()


# -- part B: LoRA, plain and DDP -------------------------------------------------------------------------------

# name -> (kind, torch threads (None: as launched), DDP keyword arguments)
VARIANTS: dict[str, tuple[str, int | None, dict]] = {
    "solo": ("solo", None, {}),
    "solo_t16": ("solo", 16, {}),
    "indep": ("indep", None, {}),
    "ddp": ("ddp", None, {"bucket_cap_mb": 25}),
    "ddp_t16": ("ddp", 16, {"bucket_cap_mb": 25}),
    "ddp_gabv_nobuf": ("ddp", None, {"bucket_cap_mb": 25, "gradient_as_bucket_view": True, "broadcast_buffers": False}),
    "ddp_b100_gabv_nobuf": (
        "ddp",
        None,
        {"bucket_cap_mb": 100, "gradient_as_bucket_view": True, "broadcast_buffers": False},
    ),
    # each rank's threads pinned to its own half of the machine's CPUs
    "indep_pin": ("indep", None, {"pin": True}),
    "ddp_pin": ("ddp", None, {"bucket_cap_mb": 25, "pin": True}),
}


def cmd_ddp(args) -> None:
    import inspect

    import torch.distributed as tdist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from bench.train_step import _batches, build_lora
    from frod_ds.runtime import distributed as dist

    dist.init_distributed()
    world, rank = dist.get_world_size(), dist.get_rank()
    device = dist.local_device()
    cuda = device.type == "cuda"
    gloo = tdist.new_group(backend="gloo") if world > 1 else None
    launched_threads = torch.get_num_threads()
    all_cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model, groups = build_lora(args, None, device)
    model.config.use_cache = False
    model = model.to(device).train()
    build_s = time.perf_counter() - t0
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=cuda or None)
    vocab = model.config.vocab_size
    ddp_kw_ok = set(inspect.signature(DDP.__init__).parameters)

    def barrier():
        if gloo is not None:
            tdist.barrier(group=gloo)

    done: list[str] = []
    for vi, vname in enumerate(args.variants.split(",")):
        kind, threads, kw = VARIANTS[vname]
        barrier()
        over = torch.tensor([int(time.perf_counter() - t0 > args.budget_s)])
        if gloo is not None:
            tdist.broadcast(over, 0, group=gloo)  # rank 0 decides, so both ranks skip together
        if int(over):
            print(f"[{vname}] skipped: budget", flush=True)
            continue
        torch.set_num_threads(threads or launched_threads)
        kw = dict(kw)
        pin = kw.pop("pin", False)
        if pin and hasattr(os, "sched_setaffinity"):
            half = len(all_cpus) // world
            _pin(all_cpus[rank * half : (rank + 1) * half])
        elif hasattr(os, "sched_setaffinity"):
            _pin(all_cpus)
        if kind == "solo" and rank != 0:
            barrier()
            continue
        if kind == "ddp" and world > 1:
            extra = {"init_sync": False} if "init_sync" in ddp_kw_ok else {}
            wrapped = DDP(
                model,
                device_ids=[device.index] if cuda else None,
                static_graph=True,
                find_unused_parameters=False,
                **kw,
                **extra,
            )
        else:
            wrapped = model

        def fwd(ids):
            return wrapped(input_ids=ids, labels=ids).loss

        def opt_step():
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        def step(ids):
            loss = fwd(ids)
            loss.backward()
            opt_step()
            return loss.detach()

        def phases(ids):
            a = time.perf_counter()
            loss = fwd(ids)
            _sync(device)
            b = time.perf_counter()
            loss.backward()
            _sync(device)
            c = time.perf_counter()
            opt_step()
            _sync(device)
            d = time.perf_counter()
            return {"forward": (b - a) * 1e3, "backward": (c - b) * 1e3, "step": (d - c) * 1e3}

        name = f"lora_{vname}_{world if kind != 'solo' else 1}gpu" + (
            f"_again{done.count(vname)}" if vname in done else ""
        )
        measure(
            step,
            phases,
            _batches(args.batch, args.seq, vocab, rank + 100 * vi, device),
            device,
            args,
            name,
            rank,
            None,
            out,
        )
        if rank == 0:
            meta = _meta(
                args,
                name,
                {
                    "part": "B",
                    "method": "lora",
                    "variant": vname,
                    "kind": kind,
                    "torch_threads": threads or launched_threads,
                    "ddp_kwargs": kw,
                    "pinned_to_half_of_cpus": pin,
                    "ddp_fixed": {"static_graph": True, "find_unused_parameters": False, "init_sync": False}
                    if kind == "ddp"
                    else None,
                    "world_size": world if kind != "solo" else 1,
                    "processes": world,
                    "batch": args.batch,
                    "seq": args.seq,
                    "build_s": build_s,
                    "trainable_tensors": len(params),
                    "trainable_params": sum(p.numel() for p in params),
                    "warmup": args.warmup,
                    "steps": args.steps,
                    "repeats": args.repeats,
                    "prof_steps": args.prof_steps,
                },
            )
            (out / f"{name}.meta.json").write_text(json.dumps(meta, indent=1) + "\n")
        if wrapped is not model:
            del wrapped
            gc.collect()
        done.append(vname)
        barrier()
    dist.destroy()


# -- summary ------------------------------------------------------------------------------------------------


def _smi_rows(path: Path) -> list[tuple[float, int, float, float, float, float]]:
    rows = []
    if not path.is_file():
        return rows
    for line in path.read_text().splitlines():
        p = [x.strip() for x in line.split(",")]
        if len(p) < 6:
            continue
        try:
            ts = _dt.datetime.strptime(p[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            rows.append((ts, int(p[1]), float(p[2]), float(p[3]), float(p[4]), float(p[5])))
        except ValueError:
            continue
    return rows


def match_nccl(a: list, b: list, steps: int) -> dict:
    """Pair the two ranks' NCCL kernels of each kind in launch order (a process group issues collectives of one kind
    in the same order on every rank): the shorter duration of a pair is the transfer, the other rank's excess is
    time it spent waiting for its peer to arrive."""
    kinds = sorted({x[0] for x in a} | {x[0] for x in b})
    out = {
        "kernels_per_step": len(a) / steps,
        "by_kind": {},
        "transfer_ms_per_step": 0.0,
        "wait_ms_per_step": [0.0, 0.0],
        "kernels_where_rank_waited_longer": [0.0, 0.0],
    }
    for k in kinds:
        xa, xb = [x[1] for x in a if x[0] == k], [x[1] for x in b if x[0] == k]
        if len(xa) != len(xb):
            out["by_kind"][k] = {"error": f"counts differ: {len(xa)} vs {len(xb)}"}
            continue
        t = sum(min(x, y) for x, y in zip(xa, xb)) / 1e3 / steps
        w = [
            sum(x - min(x, y) for x, y in zip(xa, xb)) / 1e3 / steps,
            sum(y - min(x, y) for x, y in zip(xa, xb)) / 1e3 / steps,
        ]
        n = [sum(x > y for x, y in zip(xa, xb)) / steps, sum(y > x for x, y in zip(xa, xb)) / steps]
        out["by_kind"][k] = {
            "per_step": len(xa) / steps,
            "transfer_ms_per_step": t,
            "wait_ms_per_step": w,
            "kernels_where_rank_waited_longer": n,
            "median_us": [statistics.median(xa), statistics.median(xb)] if xa else None,
        }
        out["transfer_ms_per_step"] += t
        out["wait_ms_per_step"] = [out["wait_ms_per_step"][i] + w[i] for i in (0, 1)]
        out["kernels_where_rank_waited_longer"] = [out["kernels_where_rank_waited_longer"][i] + n[i] for i in (0, 1)]
    return out


def summarize(directory: Path) -> dict:
    metas = {
        json.loads(p.read_text())["name"]: json.loads(p.read_text()) for p in sorted(directory.glob("*.meta.json"))
    }
    smi = _smi_rows(directory / "smi.csv")
    configs = {}
    for name, meta in metas.items():
        ranks = [json.loads(p.read_text()) for p in sorted(directory.glob(f"{name}.r[0-9].json"))]
        if not ranks:
            continue
        c = {"meta": {k: meta[k] for k in meta if k not in ("ds_config",)}, "per_rank": []}
        for r in ranks:
            t = r.get("trace") or {}
            row = {
                k: r.get(k)
                for k in (
                    "rank",
                    "step_ms_median",
                    "step_ms_p10",
                    "step_ms_p90",
                    "issue_ms_median",
                    "thread_cpu_ms_median",
                    "thread_cpu_over_step",
                    "process_cpu_ms_per_step",
                    "steal_ms_per_step_all_cpus",
                    "phases_ms_median",
                    "torch_threads",
                    "OMP_NUM_THREADS",
                    "profiled_wall_ms_per_step",
                    "peak_allocated_gib",
                    "thread_cpu_ms_per_step_by_name",
                    "profiler_activities",
                )
            }
            for k in (
                "window_ms_per_step",
                "compute_busy_ms",
                "copy_busy_ms",
                "work_busy_ms",
                "nccl_kernel_sum_ms",
                "nccl_busy_ms",
                "nccl_exposed_ms",
                "gpu_busy_any_ms",
                "gpu_idle_ms",
                "kernels_per_step",
                "nccl_kernels_per_step",
                "launches_per_step",
                "host_blocked_sync_ms",
                "host_blocked_memcpy_ms",
            ):
                row[k] = t.get(k)
            row["idle_gaps"] = t.get("idle_gaps")
            if "ds_comm_calls" in r:
                row["ds_comm_calls"] = r["ds_comm_calls"]
            row["collectives"] = t.get("collectives_record_param_comms")
            row["trace_error"] = t.get("error")
            lo, hi = r["timed_window_epoch_s"]
            gpu = r["rank"] if meta.get("world_size", 1) > 1 or meta.get("kind") == "indep" else 0
            sm = [s for s in smi if lo <= s[0] <= hi and s[1] == gpu]
            if sm:
                row["gpu_clock"] = {
                    "gpu_index": gpu,
                    "samples": len(sm),
                    "sm_mhz_median": statistics.median(s[2] for s in sm),
                    "sm_mhz_min": min(s[2] for s in sm),
                    "max_sm_mhz": sm[0][3],
                    "power_w_median": statistics.median(s[4] for s in sm),
                    "util_pct_median": statistics.median(s[5] for s in sm),
                }
            c["per_rank"].append(row)
        seqs = []
        for rk in range(len(ranks)):
            p = directory / f"{name}.r{rk}.nccl.json.gz"
            seqs.append(json.loads(gzip.open(p, "rt").read()) if p.is_file() else None)
        steps = meta.get("prof_steps") or 1
        if len(seqs) == 2 and all(s is not None for s in seqs) and seqs[0]:
            c["nccl_matched"] = match_nccl(seqs[0], seqs[1], steps)
        configs[name] = c
    summ = {"generated": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"), "configs": configs}
    (directory / "summary.json").write_text(json.dumps(summ, indent=1) + "\n")
    lines = [
        "| config | rank | step ms med (p10-p90) | issue ms | thread CPU ms | compute busy | nccl sum | nccl "
        "exposed | GPU idle | host blocked | nccl wait (matched) | SM MHz | W |",
        "|" + "---|" * 13,
    ]
    for name, c in configs.items():
        m = c.get("nccl_matched") or {}
        for r in c["per_rank"]:
            w = m.get("wait_ms_per_step")
            g = r.get("gpu_clock") or {}

            def f(x, d=1):
                return "-" if x is None else f"{x:.{d}f}"

            lines.append(
                f"| {name} | {r['rank']} | {f(r['step_ms_median'])} ({f(r['step_ms_p10'])}-"
                f"{f(r['step_ms_p90'])}) | {f(r['issue_ms_median'])} | {f(r['thread_cpu_ms_median'])} | "
                f"{f(r.get('compute_busy_ms'))} | {f(r.get('nccl_kernel_sum_ms'))} | "
                f"{f(r.get('nccl_exposed_ms'))} | {f(r.get('gpu_idle_ms'))} | "
                f"{f(r.get('host_blocked_sync_ms'))} | {f(w[r['rank']]) if w else '-'} | "
                f"{f(g.get('sm_mhz_median'), 0)} | {f(g.get('power_w_median'), 0)} |"
            )
    (directory / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return summ


# -- driver ---------------------------------------------------------------------------------------------------

TINY = ["--batch", "2", "--seq", "32"]
TINY_STEPS = ["--warmup", "1", "--steps", "2", "--repeats", "2", "--phase-steps", "1", "--prof-steps", "2"]


def cmd_drive(args) -> None:
    from bench.train_matrix import prepare

    t0 = time.perf_counter()
    out, work = Path(args.out), Path(args.work)
    res = work / "results"
    res.mkdir(parents=True, exist_ok=True)
    logs = res / "logs"
    logs.mkdir(exist_ok=True)
    smi = None
    if torch.cuda.is_available():
        (res / "gpus.txt").write_text(
            subprocess.run(
                ["nvidia-smi", "--query-gpu=index,name,clocks.max.sm,power.limit,persistence_mode", "--format=csv"],
                capture_output=True,
                text=True,
            ).stdout
        )
        smi_f = open(res / "smi.csv", "w")  # noqa: SIM115 - closed at the end
        smi = subprocess.Popen(
            [
                "nvidia-smi",
                "--query-gpu=timestamp,index,clocks.sm,clocks.max.sm,power.draw,utilization.gpu,temperature.gpu",
                "--format=csv,noheader,nounits",
                "-lms",
                "200",
            ],
            stdout=smi_f,
            stderr=subprocess.DEVNULL,
        )
    stages: dict = {"cpu_count": os.cpu_count()}

    def pack():
        try:
            summarize(res)
        except Exception as e:  # noqa: BLE001
            print(f"summarize failed: {e!r}", flush=True)
        stages["elapsed_s"] = time.perf_counter() - t0
        (res / "stages.json").write_text(json.dumps(stages, indent=1) + "\n")
        out.mkdir(parents=True, exist_ok=True)
        with tarfile.open(out / "profile.tgz.tmp", "w:gz") as tf:
            tf.add(res, arcname="profile")
        os.replace(out / "profile.tgz.tmp", out / "profile.tgz")

    model_args = ["--layers", "2", "--hidden", "64", "--inter", "128", "--heads", "4"] if args.tiny else []
    model, factors = prepare(argparse.Namespace(work=str(work), tiny=args.tiny), res, stages, model_args=model_args)
    stages["prepared_s"] = time.perf_counter() - t0
    print(f"prepared {stages}", flush=True)
    size = TINY if args.tiny else []
    steps = (
        TINY_STEPS
        if args.tiny
        else [
            "--warmup",
            str(args.warmup),
            "--steps",
            str(args.steps),
            "--repeats",
            str(args.repeats),
            "--phase-steps",
            "5",
            "--prof-steps",
            "3",
        ]
    )
    me = [sys.executable, "bench/profile_two_gpu.py"]
    run2 = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "bench/profile_two_gpu.py",
    ]
    plan = []
    if "A" in args.parts:
        a_all = {
            "zero2_2gpu": run2 + ["ds", "--config", "ds_configs/zero2.json"],
            "zero3_2gpu": run2 + ["ds", "--config", "ds_configs/zero3.json"],
            "zero3_1gpu": me + ["ds", "--config", "ds_configs/zero3.json"],
            "zero3_resident_2gpu": run2
            + ["ds", "--config", "ds_configs/zero3.json", "--ds-set=stage3_param_persistence_threshold=100000000000"],
        }
        plan += [(f"frod_{k}", a_all[k]) for k in args.a_configs.split(",") if k]
    if "B" in args.parts:
        plan.append(("lora_ddp", run2 + ["ddp", "--variants", args.variants, "--budget-s", str(args.b_budget_s)]))
    for name, cmd in plan:
        elapsed = time.perf_counter() - t0
        if elapsed > args.budget_s:
            stages[name] = "skipped: budget"
            continue
        full = cmd + [
            "--method",
            "frod" if name.startswith("frod") else "lora",
            "--model",
            str(model),
            "--factors",
            str(factors),
            "--out",
            str(res),
            "--name",
            name,
            *size,
            *steps,
            *(["--cpu-ops"] if args.cpu_ops else []),
        ]
        env = dict(os.environ)
        if name.endswith("_1gpu"):
            env["CUDA_VISIBLE_DEVICES"] = "0"
        left = args.deadline_s - elapsed
        log = logs / f"{name}.log"
        t1 = time.perf_counter()
        with log.open("w") as f:
            f.write(" ".join(full) + "\n")
            f.flush()
            try:
                rc = subprocess.run(
                    full, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=max(10.0, left)
                ).returncode
            except subprocess.TimeoutExpired:
                rc = 124
        stages[name] = {"rc": rc, "wall_s": time.perf_counter() - t1}
        lines = [
            ln
            for ln in log.read_text(errors="replace").splitlines()
            if ln.startswith("[") and " r" in ln and "step" in ln
        ]
        print(f"{name}: rc {rc}, {stages[name]['wall_s']:.0f} s\n  " + "\n  ".join(lines[-10:]), flush=True)
        if rc != 0:
            print("\n".join(log.read_text(errors="replace").splitlines()[-25:]), flush=True)
        pack()
    if smi is not None:
        smi.terminate()
    pack()
    print(f"done in {time.perf_counter() - t0:.0f} s", flush=True)


def main() -> None:
    from bench.train_step import add_run_args

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--local_rank", type=int, default=None)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("ds", "ddp"):
        p = sub.add_parser(name)
        add_run_args(p)
        p.add_argument("--phase-steps", type=int, default=5)
        p.add_argument("--prof-steps", type=int, default=3)
        p.add_argument("--keep-traces", action="store_true", help="also write the gzipped chrome traces")
        p.add_argument(
            "--cpu-ops",
            action="store_true",
            help="profile CPU ops too (torch.profiler's CPU activity: "
            "op tables, but 2-3x slower steps on the host); default CUDA activity only",
        )
        if name == "ddp":
            p.add_argument("--variants", default=",".join(VARIANTS))
            p.add_argument("--budget-s", type=float, default=1e9, help="start no variant after this many seconds")
    d = sub.add_parser("drive")
    d.add_argument("--work", required=True)
    d.add_argument("--out", required=True)
    d.add_argument("--parts", default="A,B")
    d.add_argument("--tiny", action="store_true")
    d.add_argument("--warmup", type=int, default=3)
    d.add_argument("--steps", type=int, default=10)
    d.add_argument("--repeats", type=int, default=2)
    d.add_argument("--variants", default="solo,indep,ddp,ddp_gabv_nobuf,ddp_t16,solo_t16,ddp_b100_gabv_nobuf,solo")
    d.add_argument("--budget-s", type=float, default=420, help="start no configuration after this many seconds")
    d.add_argument("--b-budget-s", type=float, default=150, help="part B: start no variant after this many seconds")
    d.add_argument("--deadline-s", type=float, default=540, help="kill the configuration running at this time")
    d.add_argument("--cpu-ops", action="store_true", help="profile CPU ops too (see ds/ddp --cpu-ops)")
    d.add_argument(
        "--a-configs",
        default="zero2_2gpu,zero3_2gpu,zero3_1gpu,zero3_resident_2gpu",
        help="part A configurations, in order",
    )
    s = sub.add_parser("summarize")
    s.add_argument("--dir", required=True)
    args = ap.parse_args()
    if args.cmd == "ds":
        cmd_ds(args)
    elif args.cmd == "ddp":
        cmd_ddp(args)
    elif args.cmd == "drive":
        cmd_drive(args)
    else:
        summarize(Path(args.dir))


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
