"""Run a suite: each configuration not yet measured on this device, in declared order, one process group each.

Resumable: a configuration whose record is ``ok`` for the same settings is skipped, so a cut-off call is continued
by running the same command again. Bounded: no configuration starts once ``budget_s`` has passed or when fewer
seconds remain than it took last time (``est_s`` before it ever ran), and a running one is killed at the budget's
end or its own ``timeout_s``, whichever comes first, and recorded as ``timeout``. A configuration that fails is
recorded as ``failed`` with the tail of its log; the next run tries it again.
"""

from __future__ import annotations

import fnmatch
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.kinds import shapes
from bench.record import Record, commit, device_facts, now, record_path, versions
from bench.suite import BenchError, Config, Suite, with_defaults

__all__ = ["Outcome", "kill_tree", "proc_stat", "run_suite"]

REPO = Path(__file__).resolve().parents[1]
EST_S = 60.0  # a first run's guess of one configuration's wall time, start-up included
LOG_TAIL = 30


@dataclass(frozen=True)
class Outcome:
    config: str
    status: str  # ok | failed | timeout | done (measured before) | skipped: <why>
    wall_s: float = 0.0


def _previous(path: Path, cfg: Config) -> dict | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if with_defaults(doc.get("settings", {})) == cfg.settings else None


def _command(suite: Suite, cfg: Config, results: Path, work: Path, call: str, series: int) -> list[str]:
    worker = ["-m", "bench.worker", "--suite", str(suite.path), "--config", cfg.name]
    worker += ["--results", str(results), "--work", str(work), "--call", call, "--series", str(series)]
    if cfg["gpus"] == 1:
        return [sys.executable, *worker]
    launch = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(cfg["gpus"])]
    return [sys.executable, *launch, *worker]


def _run(cmd: list[str], log: Path, timeout: float) -> tuple[int | None, float]:
    """``cmd`` in its own session from the repository root, output into ``log``; (exit code or None on timeout,
    seconds). On timeout, or when the runner is stopped, the whole session is killed (every rank)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    with log.open("w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        rc: int | None = None
        try:
            rc = proc.wait(timeout=max(timeout, 1.0))
        except subprocess.TimeoutExpired:
            pass
        finally:  # timed out, or the runner itself is stopped (SIGTERM, Ctrl-C): no rank outlives it
            if proc.poll() is None:
                kill_tree(proc.pid)
                proc.wait()
    return rc, time.perf_counter() - t0


def proc_stat(pid: int | str) -> list[str]:
    """``/proc/<pid>/stat``'s fields after the command name (state, ppid, pgrp, ...); [] once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def kill_tree(pid: int) -> None:
    """SIGKILL the process group of ``pid`` and of every descendant, and wait until they are gone: torchrun starts
    each rank in a session of its own, which a signal to the launcher's group does not reach."""
    children: dict[int, list[int]] = {}
    for d in filter(str.isdigit, os.listdir("/proc")):
        if st := proc_stat(d):
            children.setdefault(int(st[1]), []).append(int(d))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    for g in {int(st[2]) for st in map(proc_stat, tree) if st} - {os.getpgid(0)}:
        try:
            os.killpg(g, signal.SIGKILL)
        except ProcessLookupError:
            continue
    deadline = time.monotonic() + 30  # what the ranks held (GPU memory) is free for the next launch
    while time.monotonic() < deadline and any(proc_stat(p)[:1] not in ([], ["Z"], ["X"]) for p in tree[1:]):
        time.sleep(0.1)


def _tail(log: Path) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-LOG_TAIL:])
    except OSError:
        return ""


def _failure(rc: int | None, limit: float, timeout_s: float, log: Path) -> str:
    """A failed configuration's error: its first line says what ended it (the report shows that line), then the
    log's tail."""
    if rc is not None:
        return f"exit code {rc}\n{_tail(log)}"
    why = "its timeout_s" if limit >= timeout_s else "what was left of the suite's --budget-s"
    return f"stopped after {limit:.0f} s ({why}); the log's last lines follow\n{_tail(log)}"


def run_suite(
    suite: Suite,
    results: Path,
    work: Path,
    *,
    budget_s: float = float("inf"),
    only: str | None = None,
    series: int = 1,
    log: Callable[[str], None] = print,
) -> list[Outcome]:
    """Measure every configuration of ``suite`` (or those matching one of the comma-separated globs ``only``) not
    yet measured here."""
    if suite.kind == "chain":
        from bench.kinds.chain import run_chain

        return run_chain(suite, results, work, budget_s=budget_s, only=only, series=series, log=log)
    t_start = time.monotonic()
    dev = device_facts()
    call = f"{now()}@{os.uname().nodename}"
    globs = None if only is None else [g.strip() for g in only.split(",") if g.strip()]
    picked = [c for c in suite.configs if globs is None or any(fnmatch.fnmatch(c.name, g) for g in globs)]
    if not picked:
        raise BenchError(f"no configuration of {suite.name} matches {only!r}")
    outcomes: list[Outcome] = []
    for cfg in picked:
        path = record_path(results, suite.name, dev["key"], cfg.name, series)
        before = _previous(path, cfg)
        if before is not None and before["status"] == "ok":
            outcomes.append(Outcome(cfg.name, "done"))
            continue
        if dev["count"] and cfg["gpus"] > dev["count"]:
            outcomes.append(Outcome(cfg.name, f"skipped: needs {cfg['gpus']} GPUs, this machine has {dev['count']}"))
            continue
        left = budget_s - (time.monotonic() - t_start)
        need = before["wall_s"] if before is not None and before["status"] == "ok" else EST_S
        if left < min(need, cfg["timeout_s"]):
            outcomes.append(Outcome(cfg.name, f"skipped: {max(left, 0.0):.0f} s of the budget left"))
            continue
        shapes.prepare(cfg["shape"], work, log=log, ranks=cfg["gpus"])
        left = budget_s - (time.monotonic() - t_start)
        cmd = _command(suite, cfg, results, work, call, series)
        logfile = Path(work) / "logs" / suite.name / f"{cfg.name}.log"
        log(f"{suite.name}/{cfg.name}: running ({logfile})")
        limit = min(cfg["timeout_s"], left)
        rc, wall = _run(cmd, logfile, limit)
        written = _previous(path, cfg)
        if rc == 0 and written is not None and written["call"] == call:
            outcomes.append(Outcome(cfg.name, "ok", wall))
        else:
            status = "timeout" if rc is None else "failed"
            Record(
                suite=suite.name,
                config=cfg.name,
                settings=cfg.settings,
                status=status,
                call=call,
                device=dev,
                command=cmd,
                date=now(),
                versions=versions(),
                commit=commit(),
                wall_s=wall,
                error=_failure(rc, limit, cfg["timeout_s"], logfile),
                series=series,
            ).write(results)
            outcomes.append(Outcome(cfg.name, status, wall))
        log(f"{suite.name}/{cfg.name}: {outcomes[-1].status} in {wall:.0f} s")
    return outcomes
