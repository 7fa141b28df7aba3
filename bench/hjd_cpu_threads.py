"""Single-process CPU HJD under different OpenMP settings, with and without another busy process.

    python bench/hjd_cpu_threads.py --model models/smollm2-135m --reps 3

Runs ``launch/hjd.py --device cpu`` on ``--model`` (all six categories) with: no OpenMP variables (the
launcher's own rule: torch's default thread count, passive waiting), ``OMP_NUM_THREADS=1``, and
``OMP_NUM_THREADS=<torch's default>`` (what a run got before the launcher set anything: the same threads,
spinning while they wait). Each setting runs alone and beside one CPU-bound process (a Python busy loop, as
another user's job on a shared machine), interleaved over ``--reps`` rounds. Wall seconds of the whole
command and the load average before each run go to ``bench/results/<name>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.common import write_result  # noqa: E402


def _one(model: str, out: Path, env: dict[str, str]) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "launch/hjd.py", "--model", model, "--out", str(out), "--device", "cpu", "--no-fsync"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"error: launch/hjd.py failed:\n{proc.stderr[-3000:]}")
    run = json.loads((out / "manifest.json").read_text())["run"]
    return {
        "wall_s": round(wall, 2),
        "stage_s": run["seconds"],
        "cpu_threads": run["ranks"][0]["cpu_threads"],
        "loadavg_1min_before": load,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="checkpoint directory (e.g. launch/convert_gguf.py's SmolLM2)")
    p.add_argument("--reps", type=int, default=3, help="interleaved rounds")
    p.add_argument("--name", default="hjd_cpu_threads", help="result name under bench/results/")
    args = p.parse_args()
    import torch

    default = torch.get_num_threads()
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    base.update(PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1")
    settings = {
        "launcher default (no OMP variables)": {},
        "OMP_NUM_THREADS=1": {"OMP_NUM_THREADS": "1"},
        f"OMP_NUM_THREADS={default} (spinning, as before)": {"OMP_NUM_THREADS": str(default)},
    }
    runs: dict[str, dict[str, list]] = {s: {"alone": [], "beside a busy process": []} for s in settings}
    out = Path(tempfile.mkdtemp(prefix="hjd_threads.")) / "store"
    for _ in range(args.reps):
        for load in ("alone", "beside a busy process"):
            busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if load != "alone" else None
            try:
                for s, extra in settings.items():
                    runs[s][load].append(_one(args.model, out, {**base, **extra}))
                    print(s, load, runs[s][load][-1], flush=True)
            finally:
                if busy is not None:
                    busy.kill()
                    busy.wait()
    shutil.rmtree(out.parent, ignore_errors=True)
    summary = {
        s: {load: statistics.median(r["wall_s"] for r in rs) for load, rs in by.items()} for s, by in runs.items()
    }
    path = write_result(
        args.name,
        {
            "model": args.model,
            "torch_default_threads": default,
            "cpus": os.cpu_count(),
            "median_wall_s": summary,
            "runs": runs,
        },
    )
    print(json.dumps(summary, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
