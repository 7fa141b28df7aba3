"""Jobs of the study (train one run, score one run on the test sets) and the executors that run them.

A 135M model's training step is bound by the host launching kernels (thousands of small kernels per step),
not by the GPU: one process keeps an H100 busy a fraction of the time. Several worker processes, each
running one job at a time, fill it. Every worker loads the same ``RunContext`` file (the main process's
batches, rows and config) and its own copy of the base model. The main process hands out one job per idle
worker and decides the next one from the results (``runner``):

    ("context", path)                            → (nothing: the next jobs use that study's context)
    ("train", method, lr, deadline, state path)  → ("trained", method, lr, entry, state path | None)
    ("eval", method, lr, state path)             → ("evaluated", method, lr, test results, seconds)
    None                                         → exit

A pool outlives a study: ``load`` hands every worker the next study's context, and a worker keeps its base model
and factored templates while the model path stays the same (one interpreter and model start-up per worker and
command; FRoD's HJD and PEFT's initialisation once per seed).
``LocalExecutor`` runs the same jobs in the main process, one at a time (CPU, ``--workers 1``). A worker that
raises sends ("error", traceback) and exits; the pool re-raises it in the main process.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import shutil
import tempfile
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


def _worker(wid: int, device: str, jobs, results, threads: int) -> None:
    torch.set_num_threads(threads)
    try:
        from studies.context import RunContext

        ctx, cache = None, {}
        results.put((wid, ("ready", os.getpid())))
        while (job := jobs.get()) is not None:
            if job[0] == "context":
                ctx = None  # the last study's batches and templates go before the next ones arrive
                log = lambda m: results.put((wid, ("log", m)))  # noqa: E731
                ctx = RunContext.load(Path(job[1]), torch.device(device), log=log, cache=cache)
                continue
            results.put((wid, execute(ctx, job)))
    except Exception:  # noqa: BLE001 - reported to the main process, which raises it
        results.put((wid, ("error", traceback.format_exc())))


class WorkerPool:
    """``n`` spawned workers on ``device``, one job queue each; ``submit`` gives a job to the least busy worker,
    ``get`` returns the results in the order they come. ``load(path)`` before each study's first job."""

    def __init__(self, n: int, device: torch.device, log):
        # Runs of different lengths come and go in each worker: expandable segments keep fragmentation down.
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        spawn = mp.get_context("spawn")
        self.results, self.log, self.capacity, self.device = spawn.Queue(), log, n, device
        # contexts live as long as the pool: a worker given no job by a study loads its context late
        self.tmp, self.loaded = Path(tempfile.mkdtemp(prefix="study_pool_")), 0
        self.jobs = [spawn.Queue() for _ in range(n)]
        self.busy = [0] * n
        threads = max(1, min(4, (os.cpu_count() or 2) // (n + 1)))
        self.procs = [
            spawn.Process(target=_worker, args=(i, str(device), self.jobs[i], self.results, threads), daemon=True)
            for i in range(n)
        ]
        for p in self.procs:
            p.start()

    def load(self, ctx) -> None:
        """Every worker's next jobs use the study context ``ctx`` (a ``RunContext``; no job may be out)."""
        assert not any(self.busy), "a study's context changed while its jobs were out"
        path = self.tmp / f"context{self.loaded}.pt"
        ctx.save(path)
        self.loaded += 1
        for q in self.jobs:
            q.put(("context", str(path)))

    def submit(self, job: tuple) -> None:
        i = min(range(self.capacity), key=lambda k: self.busy[k])
        self.busy[i] += 1
        self.jobs[i].put(job)

    def get(self) -> tuple[Any, ...]:
        """The next result; worker log lines are passed to ``log``; a worker's error is raised."""
        while True:
            try:
                wid, msg = self.results.get(timeout=5)
            except queue.Empty:
                if not all(p.is_alive() for p in self.procs):
                    raise RuntimeError("a study worker exited without reporting; see its output above") from None
                continue
            if msg[0] == "log":
                self.log(msg[1])
            elif msg[0] == "error":
                raise RuntimeError(f"a study worker failed:\n{msg[1]}")
            elif msg[0] != "ready":
                self.busy[wid] -= 1
                return msg

    def close(self) -> None:
        for q in self.jobs:
            q.put(None)
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
        shutil.rmtree(self.tmp, ignore_errors=True)  # made by mkdtemp above
