"""One configuration of a suite, in the process of one rank: ``python -m bench.worker`` (the runner starts it, under
``torch.distributed.run`` for several ranks). Rank 0 writes the configuration's record."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from bench.kinds import shapes, step
from bench.record import Record, commit, device_facts, now, versions
from bench.suite import load_suite
from frod_ds.runtime import distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--suite", required=True, help="suite name or TOML path")
    ap.add_argument("--config", required=True, help="configuration name")
    ap.add_argument("--results", required=True, type=Path, help="results root")
    ap.add_argument("--work", required=True, type=Path, help="where the shape's checkpoint and store are")
    ap.add_argument("--call", required=True, help="the runner call's id")
    ap.add_argument("--series", type=int, default=1, help="which measurement series of the suite this call makes")
    args = ap.parse_args()
    t0 = time.perf_counter()
    suite = load_suite(args.suite)
    cfg = suite.config(args.config)
    model, factors = shapes.prepared(cfg["shape"], args.work)
    metrics = step.measure(cfg.settings, model, factors)
    if metrics is not None:
        Record(
            suite=suite.name,
            config=cfg.name,
            settings=cfg.settings,
            status="ok",
            call=args.call,
            device=device_facts(),
            command=[Path(sys.executable).name, "-m", "bench", "run", suite.name, "--only", cfg.name],
            date=now(),
            versions=versions(),
            commit=commit(),
            wall_s=time.perf_counter() - t0,
            metrics=metrics,
            series=args.series,
        ).write(args.results)
    dist.destroy()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    # the record is written and the group left: skip the interpreter's teardown, where a native thread pool left
    # joinable at exit occasionally aborts a gloo rank or hangs a finished multi-GPU run past its deadline
    os._exit(0)
