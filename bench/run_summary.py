"""Summarise one ``launch/train.py`` run on the GPU machine into a result JSON: step time, tokens/s and GPU peak
from its ``metrics.jsonl``, the build time from its log, and the host memory peak from a sampler file.

    ( while :; do free -m | awk '/Mem/{print $3}' >> host.txt; sleep 1; done ) &   # host "used" MiB, 1 Hz
    deepspeed launch/train.py --config ds_configs/zero3_offload.json --recipe R train.max_steps=8 > run.log 2>&1
    python -m bench.run_summary --metrics OUT/metrics.jsonl --log run.log --host-mem host.txt \
        --device "1x NVIDIA H100 80GB HBM3" --versions-from other_result.json --command "..." --out DIR --name N

The host peak is the machine's used memory (``free``: without page cache) at its highest minus at the first sample
(before the launcher started): the run's own resident and pinned memory, with the launcher's. Steps 1-2 (allocation,
the optimizer's first state) are left out of the medians. Writes ``N.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

from bench.common import write_result
from frod_ds.config.ds_config import load_ds_config


def summarise(metrics: list[dict], log: str, host_mib: list[float], skip: int = 2) -> dict:
    steady = [r for r in metrics if r["step"] > skip] or metrics
    built = re.search(r"model built in ([0-9.]+) s", log)
    return {
        "steps": len(metrics),
        "step_s_median": statistics.median(r["step_time_s"] for r in steady) if steady else None,
        "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in steady) if steady else None,
        "gpu_peak_alloc_gib": max((r["peak_mem_gb"] for r in metrics), default=None),
        "build_s": float(built.group(1)) if built else None,
        "host_used_peak_gib": (max(host_mib) - host_mib[0]) / 1024 if host_mib else None,
        "losses": [r["loss"] for r in metrics],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--metrics", required=True, type=Path, help="the run's metrics.jsonl (may be absent: a failed run)")
    ap.add_argument("--log", required=True, type=Path, help="the run's log (stdout and stderr)")
    ap.add_argument("--host-mem", type=Path, default=None, help="sampler file: used host MiB, one line per second")
    ap.add_argument("--device", required=True, help="the GPU the run used, as bench results name it")
    ap.add_argument("--versions-from", type=Path, default=None, help="a result JSON from the same machine image")
    ap.add_argument("--command", required=True, help="the command that ran")
    ap.add_argument("--config", default=None, help="DeepSpeed JSON of the run (recorded)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--name", required=True)
    args = ap.parse_args(argv)
    metrics = (
        [json.loads(x) for x in args.metrics.read_text().splitlines() if x.strip()] if args.metrics.is_file() else []
    )
    log = args.log.read_text(errors="replace")
    host = [float(x) for x in args.host_mem.read_text().split()] if args.host_mem else []
    errors = [ln.strip() for ln in log.splitlines() if re.search(r"(Error|error):", ln)][-1:]
    started = re.search(r"\[(\d{4}-\d\d-\d\d) (\d\d:\d\d:\d\d)", log)  # the launcher's first log line
    payload = {
        "command": args.command,
        "device": args.device,
        **({"date": f"{started.group(1)}T{started.group(2)}+00:00"} if started else {}),
        "versions": json.loads(args.versions_from.read_text())["versions"] if args.versions_from else None,
        "config": load_ds_config(args.config) if args.config else None,
        "completed": bool(metrics),
        "error": errors[0] if errors and not metrics else None,
        **summarise(metrics, log, host),
    }
    path = write_result(args.name, payload, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
