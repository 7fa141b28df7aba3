"""Jobs of the study (train one run, score one run on the test sets) and the executors that run them.

A 135M model's training step is bound by the host launching kernels (thousands of small kernels per step),
not by the GPU: one process keeps an H100 busy a fraction of the time. Several worker processes, each
running one job at a time, fill it. Every worker loads the same ``RunContext`` file (the main process's
batches, rows and config) and its own copy of the base model. The main process hands out one job per idle
worker and decides the next one from the results (``runner``):

    ("train", method, lr, deadline, state path)  → ("trained", method, lr, entry, state path | None)
    ("eval", method, lr, state path)             → ("evaluated", method, lr, test results, seconds)
    None                                         → exit

``LocalExecutor`` runs the same jobs in the main process, one at a time (CPU, ``--workers 1``). A worker that
raises sends ("error", traceback) and exits; the pool re-raises it in the main process.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback
from collections import deque
from pathlib import Path
from typing import Any

import torch

__all__ = ["execute", "LocalExecutor", "WorkerPool"]


def execute(ctx, job: tuple) -> tuple:
    """Run one job with ``ctx`` (a ``RunContext``); the result message."""
    if job[0] == "train":
        _, name, lr, deadline, state_path = job
        entry, state = ctx.train_one(name, lr, deadline)
        if state is not None:
            torch.save(state, state_path)
        return ("trained", name, lr, entry, state_path if state is not None else None)
    assert job[0] == "eval", job
    _, name, lr, state_path = job
    t = time.perf_counter()
    test = ctx.final_test(name, torch.load(state_path, weights_only=True))
    return ("evaluated", name, lr, test, time.perf_counter() - t)


class LocalExecutor:
    """The jobs in the main process, one at a time: ``get`` runs the oldest submitted job."""

    def __init__(self, ctx):
        self.ctx, self.capacity, self.jobs = ctx, 1, deque()

    def submit(self, job: tuple) -> None:
        self.jobs.append(job)

    def get(self) -> tuple[Any, ...]:
        return execute(self.ctx, self.jobs.popleft())

    def close(self) -> None:
        pass


def _worker(ctx_path: str, device: str, jobs, results, threads: int) -> None:
    torch.set_num_threads(threads)
    try:
        from studies.context import RunContext

        ctx = RunContext.load(Path(ctx_path), torch.device(device), log=lambda m: results.put(("log", m)))
        results.put(("ready", os.getpid()))
        while (job := jobs.get()) is not None:
            results.put(execute(ctx, job))
    except Exception:  # noqa: BLE001 - reported to the main process, which raises it
        results.put(("error", traceback.format_exc()))


class WorkerPool:
    """``n`` spawned workers on ``device`` sharing one job queue; ``get`` returns their results in order."""

    def __init__(self, ctx_path: Path, n: int, device: torch.device, log):
        # Runs of different lengths come and go in each worker: expandable segments keep fragmentation down.
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        spawn = mp.get_context("spawn")
        self.jobs, self.results, self.log, self.capacity = spawn.Queue(), spawn.Queue(), log, n
        threads = max(1, min(4, (os.cpu_count() or 2) // (n + 1)))
        self.procs = [
            spawn.Process(
                target=_worker, args=(str(ctx_path), str(device), self.jobs, self.results, threads), daemon=True
            )
            for _ in range(n)
        ]
        for p in self.procs:
            p.start()

    def submit(self, job: tuple) -> None:
        self.jobs.put(job)

    def get(self) -> tuple[Any, ...]:
        """The next result; worker log lines are passed to ``log``; a worker's error is raised."""
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
