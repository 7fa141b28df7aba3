"""Sweep runs and final evaluations in worker processes that share one GPU.

A 135M model's training step is bound by the host launching kernels (hundreds of small kernels per layer),
not by the GPU: one process keeps an H100 busy a fraction of the time. Several processes, each training one
run at a time, fill it. Every worker loads the same ``RunContext`` file (the main process's batches, rows and
config) and its own copy of the base model, then takes jobs from one queue:

    ("train", method, lr index, deadline, state path)  → ("trained", method, index, entry, state path | None)
                                                         or ("skipped", method, index) if it cannot finish
    ("eval", method, state path)                        → ("evaluated", method, test results, seconds)
    None                                                → exit

A worker that raises sends ("error", traceback) and exits; the pool re-raises it in the main process.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback
from pathlib import Path
from typing import Any

import torch

__all__ = ["WorkerPool"]


def _worker(ctx_path: str, device: str, jobs, results, threads: int) -> None:
    torch.set_num_threads(threads)
    try:
        from bench.study.context import RunContext

        ctx = RunContext.load(Path(ctx_path), torch.device(device), log=lambda m: results.put(("log", m)))
        results.put(("ready", os.getpid()))
        longest = 0.0  # the longest run so far: a job that cannot finish before its deadline is skipped
        while (job := jobs.get()) is not None:
            if job[0] == "train":
                _, name, index, deadline, state_path = job
                if time.time() + longest > deadline:
                    results.put(("skipped", name, index))
                    continue
                entry, state = ctx.train_one(name, index, deadline)
                longest = max(longest, entry["wall_seconds"])
                if state is not None:
                    torch.save(state, state_path)
                results.put(("trained", name, index, entry, state_path if state is not None else None))
            else:
                _, name, state_path = job
                t = time.perf_counter()
                test = ctx.final_test(name, torch.load(state_path, weights_only=True))
                results.put(("evaluated", name, test, time.perf_counter() - t))
    except Exception:  # noqa: BLE001 - reported to the main process, which raises it
        results.put(("error", traceback.format_exc()))


class WorkerPool:
    """``n`` spawned workers on ``device`` sharing one job queue; ``get`` returns their messages in order."""

    def __init__(self, ctx_path: Path, n: int, device: torch.device, log):
        # Runs of different lengths come and go in each worker: expandable segments keep fragmentation down.
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        spawn = mp.get_context("spawn")
        self.jobs, self.results, self.log = spawn.Queue(), spawn.Queue(), log
        threads = max(1, min(4, (os.cpu_count() or 2) // (n + 1)))
        self.procs = [spawn.Process(target=_worker, args=(str(ctx_path), str(device), self.jobs, self.results, threads),
                                    daemon=True) for _ in range(n)]
        for p in self.procs:
            p.start()

    def submit(self, job: tuple) -> None:
        self.jobs.put(job)

    def get(self) -> tuple[Any, ...]:
        """The next non-log message; worker log lines are passed to ``log``; a worker's error is raised."""
        while True:
            try:
                msg = self.results.get(timeout=5)
            except queue.Empty:
                if not any(p.is_alive() for p in self.procs):
                    raise RuntimeError("every study worker exited without reporting; see its output above") from None
                continue
            if msg[0] == "log":
                self.log(msg[1])
            elif msg[0] == "error":
                raise RuntimeError(f"a study worker failed:\n{msg[1]}")
            elif msg[0] != "ready":
                return msg

    def close(self) -> None:
        for _ in self.procs:
            self.jobs.put(None)
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
