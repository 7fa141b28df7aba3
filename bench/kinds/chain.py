"""The ``chain`` kind: FRoD on a synthetic LLaMA through the users' commands, in stages that resume from files.

``predict`` (the planner's figures, before anything runs), ``generate`` and ``hjd-<category>`` (one launch:
``bench/kinds/chain_prepare.py``), ``train`` (``frod train`` under torchrun, SIGKILLed after step ``kill_at``),
``resume`` (the same command to the end: losses equal to the killed run's bit for bit), ``mfu`` (at the planner's
micro-batch); one record each, ``<results>/<suite>/<device>/<config>.<stage>.json``. What each measures, how memory
is read and the disk order: docs/benchmarks.md, The chain kind.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.kinds import synthetic
from bench.kinds.chain_report import in_use_over_planner
from bench.kinds.shapes import SHAPES, Shape, launcher
from bench.record import Record, commit, device_facts, now, record_path, versions
from bench.runner import Outcome, kill_tree, proc_stat
from bench.suite import BenchError, Config, Suite, with_defaults

__all__ = ["CHAIN_KEYS", "STAGES", "Chain", "check", "config_name", "run_chain"]

REPO = Path(__file__).resolve().parents[2]
GiB = 2**30
H200_GIB = 139.8  # torch's figure for an H200: what the planner plans for on a machine without GPUs
TARGETS = synthetic.TARGETS
PREPARE = ("generate", *(f"hjd-{c}" for c in TARGETS))
STAGES = ("predict", *PREPARE, "train", "resume", "mfu")
PER_RANK = ("gpu_in_use_gib_per_rank", "host_peak_rss_gib_per_rank")
BUILT = r"model built in ([\d.]+) s"  # frod train's line (frod_ds/train/trainer.py)
ERROR_LINE = re.compile(r"^(?:\[[^\]]*\]:?\s*)?error: ")  # frod's one-line error, a rank prefix allowed
CHAIN_KEYS: dict[str, Any] = {
    "shape": "70b",  # bench/kinds/shapes.py
    "layers": 0,  # decoder layers instead of the shape's (0: the shape's)
    "gpus": 4,  # ranks, one per GPU (gloo ranks on a machine without GPUs)
    "config": "ds_configs/zero3.json",  # frod train's DeepSpeed JSON
    "dtype": "bfloat16",  # model.dtype (float32 under the CPU JSONs)
    "seq": 256,  # tokens of every example
    "batch": 4,  # micro-batch per GPU of the train and resume runs
    "steps": 20,
    "save_at": 10,  # the checkpoint interval: the checkpoint the resume starts from
    "kill_at": 14,  # the train run is SIGKILLed once this step is logged
    "mfu_batch_max": 32,  # the planner picks among micro-batches 1, 2, 4, ... up to this
    "mfu_steps": 4,  # steps of the run at the planner's micro-batch (the first is not timed)
    "gpu_mem_gib": 0.0,  # GPU memory the planner plans for; 0: this machine's (without GPUs: an H200's)
    "seed": 0,  # of the generated weights
    "timeout_s": 600,  # a launched stage still running after this is killed
    "est_s": 180,  # a training stage's wall time before it ever ran: none starts with less budget left
    "nvme_path": "",  # frod train's --nvme-path (an absolute folder on the machine's local disk), for NVMe JSONs
    "omp_threads": 0,  # OMP_NUM_THREADS of the training runs; 0: the launcher's (torchrun: 1 for several ranks)
    "sparsity": 0.02,  # FRoD's S rate in the recipe (and the planner's prediction)
    "phase_times": False,  # the runs' train.phase_times: rank 0's forward, backward and optimizer seconds per step
    "profile_step": 0,  # the train run's train.profile_step (each rank's cProfile summary kept in its record); 0: none
    "host_probe": False,  # time bench/host_device.py's short 7B step once per call before training (kept in records)
    "tag": "",
}


def check(s: dict[str, Any], where: str) -> None:
    """``BenchError`` naming the first setting a chain cannot run with."""
    if s["shape"] not in SHAPES:
        raise BenchError(f"{where}: shape {s['shape']!r} is not one of {', '.join(SHAPES)}")
    ints = ("layers", "gpus", "seq", "batch", "steps", "save_at", "kill_at", "mfu_batch_max", "mfu_steps")
    ints += ("omp_threads", "profile_step")
    zero_ok = ("layers", "omp_threads", "profile_step")
    bad = [k for k in ints if not isinstance(s[k], int) or s[k] < (0 if k in zero_ok else 1)]
    if bad:
        raise BenchError(f"{where}: {', '.join(bad)} must be positive integers")
    if not s["save_at"] < s["kill_at"] < min(2 * s["save_at"], s["steps"]):
        got = f"{s['save_at']}, {s['kill_at']}, {s['steps']}"
        raise BenchError(f"{where}: need save_at < kill_at < min(2 x save_at, steps), got {got}")
    if s["mfu_steps"] < 2 or s["dtype"] not in ("bfloat16", "float32"):
        raise BenchError(f"{where}: mfu_steps must be at least 2 and dtype bfloat16 or float32")
    if not (REPO / s["config"]).is_file():
        raise BenchError(f"{where}: config {s['config']!r} is not a file of the repository")
    if s["nvme_path"] and not Path(s["nvme_path"]).is_absolute():
        raise BenchError(f"{where}: nvme_path {s['nvme_path']!r} must be an absolute folder")
    if not isinstance(s["sparsity"], float) or not 0.0 < s["sparsity"] < 1.0:
        raise BenchError(f"{where}: sparsity must be a number between 0 and 1 (exclusive), got {s['sparsity']!r}")
    for k in ("phase_times", "host_probe"):
        if not isinstance(s[k], bool):
            raise BenchError(f"{where}: {k} must be true or false, got {s[k]!r}")
    if s["profile_step"] and not s["profile_step"] < s["kill_at"]:
        raise BenchError(f"{where}: profile_step must come before kill_at ({s['kill_at']}), got {s['profile_step']}")
    if s["tag"] and not re.fullmatch(r"[a-z0-9][a-z0-9_]*", s["tag"]):
        raise BenchError(f"{where}: tag {s['tag']!r} must be lower-case letters, digits or '_'")


def config_name(s: dict[str, Any]) -> str:
    """``70b-4g``, ``70b-l20-4g``, then ``-<tag>``."""
    return "-".join([s["shape"], f"l{s['layers']}", f"{s['gpus']}g", s["tag"]]).replace("-l0-", "-").rstrip("-")


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether settings ``a`` and ``b`` make the same chain: the limits of a call (``timeout_s``, ``est_s``) may
    change between calls without redoing what is done."""
    return {**a, "timeout_s": 0, "est_s": 0} == {**b, "timeout_s": 0, "est_s": 0}


def shape_of(s: dict[str, Any]) -> Shape:
    return replace(SHAPES[s["shape"]], layers=s["layers"] or SHAPES[s["shape"]].layers)


@dataclass
class Chain:
    """One configuration's stages: where its files and records are, and the runner call writing them."""

    suite: Suite
    cfg: Config
    results: Path
    work: Path
    device: dict[str, Any]
    call: str
    series: int = 1
    probe: dict | None = None  # this call's host probe (host_probe), taken before its first training stage

    @property
    def root(self) -> Path:  # model, store, data: shared by the series; the runs are each series' own
        return self.work / "chain" / self.cfg.name

    @property
    def runs(self) -> Path:
        return self.root / ("runs" if self.series == 1 else f"runs.s{self.series}")

    def record(self, stage: str) -> dict | None:
        path = record_path(self.results, self.suite.name, self.device["key"], self.cfg.name, self.series, stage)
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return doc if same(with_defaults(doc.get("settings", {}), "chain"), self.cfg.settings) else None

    def ok(self, stage: str) -> bool:
        return (self.record(stage) or {}).get("status") == "ok"

    def write(self, stage: str, status: str, metrics: dict, wall: float, command: list[str], error: str = "") -> None:
        who = dict(suite=self.suite.name, config=self.cfg.name, settings=self.cfg.settings, series=self.series)
        when = dict(call=self.call, device=self.device, date=now(), versions=versions(), commit=commit())
        what = dict(stage=stage, status=status, command=command, wall_s=wall, metrics=metrics, error=error)
        Record(**who, **when, **what).write(self.results)


def predict(ch: Chain) -> dict[str, Any]:
    """The planner's memory and step time for the run and for each candidate micro-batch, its pick (the most
    predicted tokens/s among those that fit), and the disk the chain needs at its peak."""
    from frod_ds.config.ds_config import load_ds_config
    from frod_ds.plan.memory import plan_memory
    from frod_ds.plan.shapes import TrainShape, engine_from_ds_config, model_shape_from_config
    from frod_ds.plan.step_time import Link, step_time

    s, shape = ch.cfg.settings, shape_of(ch.cfg.settings)
    model = model_shape_from_config(synthetic.config_json(shape))
    engine = engine_from_ds_config(load_ds_config(REPO / s["config"]), s["config"])
    gpu_gib = s["gpu_mem_gib"] or ch.device["memory_gib"] or H200_GIB

    def plan(mb: int) -> dict[str, Any]:
        train = TrainShape(mb, s["seq"], s["dtype"], sparsity=s["sparsity"], checkpointing=True)
        p = plan_memory(model, train, engine, s["gpus"], gpu_gib * GiB)
        t = step_time(model, train, engine, s["gpus"], Link(cpu_threads=s["omp_threads"] or None))
        out = dict(allocated_gib=p.allocated / GiB, needed_gib=p.needed / GiB, fits=p.fits, step_s=t.seconds)
        return {
            **out,
            "tokens_per_s_per_gpu": mb * s["seq"] / t.seconds,
            "parts_gib": {k: v / GiB for k, v in p.parts.items()},
        }

    cand = {2**k: plan(2**k) for k in range(s["mfu_batch_max"].bit_length())}
    fitting = [mb for mb, c in cand.items() if c["fits"]]
    size = {c: synthetic.part_bytes(shape, c) / GiB for c in ("base", *TARGETS)}
    return {
        "gpu_gib": gpu_gib,
        "layout": "layer partition" if engine.layers else f"ZeRO-{engine.stage}",
        "train": plan(s["batch"]),
        "candidates": {str(mb): c for mb, c in cand.items()},
        "mfu_batch": max(fitting, key=lambda mb: cand[mb]["tokens_per_s_per_gpu"]) if fitting else None,
        "disk_gib": {**size, "peak": sum(size.values()) + max(size[c] for c in TARGETS)},
    }


# ---- training runs, watched from outside --------------------------------------------------------------------------


def _gpu_used() -> dict[str, float]:
    cmd = ["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout
        return {i.strip(): float(m) / 1024 for i, m in (line.split(",") for line in out.strip().splitlines())}
    except (OSError, ValueError, subprocess.SubprocessError):
        return {}


def run_gpus(n: int, env: dict[str, str]) -> list[str]:
    """The driver's indices of the GPUs ``n`` launched ranks use: the first ``n`` of ``CUDA_VISIBLE_DEVICES`` where it
    lists indices, else 0 … n-1. The driver reads every GPU of the machine; another job's memory is not the run's."""
    visible = [x.strip() for x in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if x.strip()]
    return visible[:n] if visible and all(x.isdigit() for x in visible) else [str(i) for i in range(n)]


def _settled_gpu_used(wait_s: float = 60.0) -> dict[str, float]:
    """GPU memory in use once it stops falling (two samples a second apart agree, at most ``wait_s``): a killed
    run's memory is freed by the driver a while after its processes are gone, and the next run's base is read here."""
    before, deadline = _gpu_used(), time.monotonic() + wait_s
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now_used = _gpu_used()
        if now_used == before:
            break
        before = now_used
    return before


def _rank_rss(launched: int) -> dict[str, float]:
    """Peak RSS in GiB of each child of process ``launched`` that is a rank (``RANK`` in its environment)."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if proc_stat(pid)[1:2] != [str(launched)]:
            continue
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            hwm = re.search(r"VmHWM:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())
        except OSError:
            continue
        rank = next((kv[5:].decode() for kv in env if kv.startswith(b"RANK=")), None)
        if rank is not None and hwm:
            out[rank] = int(hwm.group(1)) / 2**20
    return out


def watch(
    cmd: list[str], log: Path, timeout: float, stop=None, gpus: int = 0, extra_env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run ``cmd`` in its own session (output to ``log``), sampling memory twice a second (of its ``gpus`` GPUs,
    ``run_gpus``); SIGKILL the session when ``stop()`` turns true, at ``timeout``, or when the runner is stopped.
    ``rc``: None on time-out, -9 if stopped."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.update(extra_env or {})
    mine = set(run_gpus(gpus, env))
    base, rss, used = _settled_gpu_used() if gpus else {}, {}, {}
    rc, t0, sampled = None, time.perf_counter(), 0.0
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            while rc is None and time.perf_counter() - t0 < timeout:
                if time.perf_counter() - sampled > 0.5:
                    sampled = time.perf_counter()
                    rss.update({r: max(rss.get(r, 0.0), g) for r, g in _rank_rss(proc.pid).items()})
                    now_used = _gpu_used() if gpus else {}
                    used.update(
                        {i: max(used.get(i, 0.0), g - base.get(i, 0.0)) for i, g in now_used.items() if i in mine}
                    )
                if stop is not None and stop():
                    rc = -9
                    break
                time.sleep(0.05)
                rc = proc.poll()
        finally:
            if proc.poll() is None:
                kill_tree(proc.pid)  # every rank, as a lost node would
                proc.wait()
    return {"rc": rc, "wall_s": time.perf_counter() - t0, "rss_gib": dict(sorted(rss.items())), "gpu_gib": used}


def _rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")] if path.is_file() else []


def failure(what: str, log: list[str]) -> str:
    """A failed run's record error: ``what`` with frod's own one-line error where the log has one (the launcher's
    banner comes after it and would hide it), then the log's last 30 lines."""
    said = next((line for line in log if ERROR_LINE.match(line)), None)
    return "\n".join([what + (f": {said}" if said else ""), *log[-30:]])


def _run(ch: Chain, stage: str, out: Path, extra: list[str], stop_at: int, left: float) -> dict | str:
    """``frod train`` into ``out``, SIGKILLed once step ``stop_at`` is logged (for ``train``: with the checkpoint of
    ``save_at`` sealed); its rows, memory and command, kept as ``runs/<stage>.json``. A string when it failed (the
    train run must be killed, the resume run must end by itself, the mfu run either)."""
    from frod_ds.train.checkpoints import COMPLETE, tag_of

    s, kept = ch.cfg.settings, ch.runs / f"{stage}.json"
    if kept.is_file() and same(json.loads(kept.read_text())["settings"], s):
        return json.loads(kept.read_text())
    if stage != "resume":  # from the start: an earlier attempt was cut short, or had other settings
        shutil.rmtree(out, ignore_errors=True)
    if stage == "train":  # a new killed run: its resume runs again
        (ch.runs / "resume.json").unlink(missing_ok=True)
    recipe = ["--recipe", str(ch.root / "recipe.yaml"), f"output_dir={out}", *extra]
    nvme = ["--nvme-path", s["nvme_path"]] if s["nvme_path"] else []
    cmd = [*launcher(s["gpus"]), "-m", "frod_ds", "train", "--config", s["config"], *nvme, *recipe]
    sealed = out / "checkpoints" / tag_of(s["save_at"]) / COMPLETE

    def stop() -> bool:
        return max((r["step"] for r in _rows(out)), default=0) >= stop_at and (stage != "train" or sealed.is_file())

    log = ch.runs / f"{stage}.log"
    start = log.stat().st_size if log.is_file() else 0
    omp = {"OMP_NUM_THREADS": str(s["omp_threads"])} if s["omp_threads"] else {}
    w = watch(cmd, log, min(s["timeout_s"], left), stop, s["gpus"] if ch.device["count"] > 0 else 0, omp)
    text = log.read_bytes()[start:].decode(errors="replace")
    rows, said, built = _rows(out), re.findall(r"resumed from step(\d+)", text), re.findall(BUILT, text)
    if w["rc"] not in {"train": (-9,), "resume": (0,)}.get(stage, (-9, 0)):
        return "timeout" if w["rc"] is None else f"exit code {w['rc']}"
    if stage == "train" and max(r["step"] for r in rows) >= s["steps"]:
        return f"the run logged its last step before it was killed: make kill_at earlier than {s['kill_at']}"
    doc = {"settings": s, "rows": rows, "command": cmd, "resumed_from": int(said[-1]) if said else None, **w}
    doc["build_s"] = float(built[-1]) if built else None
    kept.write_text(json.dumps(doc) + "\n")
    return doc


PHASES = ("data_s", "forward_s", "backward_s", "optimizer_s")  # train.phase_times' keys of a metrics row


def _figures(ch: Chain, run: dict, rows: list[dict], batch: int) -> dict[str, Any]:
    """Median step after the first of ``rows``, tokens/s and MFU per GPU at ``batch`` x ``seq``; memory per rank."""
    from frod_ds.plan.flops import flops_per_token, peak_bf16_flops

    s, world = ch.cfg.settings, ch.cfg.settings["gpus"]
    timed = [r for r in rows[1:] if r["step"] != s["profile_step"]]  # a profiled step is not a timing
    tok = statistics.median(r["tokens_per_s"] for r in timed) / world
    cfg = synthetic.config_json(shape_of(s))
    fl = flops_per_token(cfg, s["seq"], "frod", batch * s["seq"], targets=TARGETS, sparsity=s["sparsity"])["total"]
    peak = peak_bf16_flops(ch.device["name"]) if ch.device["count"] else None
    return {
        "micro_batch": batch,
        "tokens_per_step_per_gpu": statistics.median(r["tokens_per_s"] * r["step_time_s"] for r in timed) / world,
        "step_s_median": statistics.median(r["step_time_s"] for r in timed),
        "tokens_per_s_per_gpu": tok,
        "flops_per_token": fl,
        "mfu": fl * tok / peak if peak else None,
        "rank0_peak_mem_gib": max(r["peak_mem_gb"] for r in rows),
        "rank0_peak_mem_is": "torch.cuda.max_memory_allocated" if ch.device["count"] else "host max RSS",
        "host_peak_rss_gib_per_rank": run["rss_gib"],
        "gpu_in_use_gib_per_rank": run["gpu_gib"],
        "build_s": run.get("build_s"),  # frod train's own "model built in" line (runs kept before it: None)
        **{f"{k}_median": statistics.median(r[k] for r in timed) for k in PHASES if all(k in r for r in timed)},
    }


def _profiles(out: Path, step: int, ranks: int) -> dict[str, str]:
    """Each of the ``ranks`` ranks' cProfile summary of optimizer step ``step`` of the run in ``out``
    (``train.profile_step``)."""
    from frod_ds.train.profile import profile_path

    found = {r: profile_path(out, step, r) for r in range(ranks)} if step else {}
    return {f"rank{r}": p.read_text() for r, p in found.items() if p.is_file()}


PROBE_TIMEOUT_S = 300


def host_probe(ch: Chain) -> dict[str, Any]:
    """The host's speed in this call: ``bench/host_device.py``'s step of 7B-width layers on 1 x 8 tokens (its
    ``host`` row: the host's time to issue a step, which the step-time model's ``Link.host`` scales), on GPU 0
    before any rank starts; the tiny shape without GPUs. A probe that fails is recorded as such, not fatal."""
    out = ch.runs / "host_probe"
    shutil.rmtree(out, ignore_errors=True)  # the chain's own folder: the last call's probe
    cmd = [sys.executable, "-m", "bench.host_device", "--quants", "none", "--out", str(out)]
    cmd += ["--shapes", "7b"] if ch.device["count"] else ["--tiny"]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"error": f"no result within {PROBE_TIMEOUT_S} s", "command": cmd}
    try:
        (row,) = json.loads((out / "host_device.json").read_text())["runs"]
    except (OSError, ValueError, KeyError) as e:
        return {"error": f"exit code {p.returncode}, no result ({e})\n{p.stderr[-2000:]}", "command": cmd}
    return {
        "shape": row["shape"],
        "host_step_ms": row["host"]["step_ms"],
        "host_step_ms_all": row["host"]["all"]["step_ms"],
        "step_ms": row["step_ms"],
        "device_ms": row["device_ms"],
        "wall_s": time.perf_counter() - t0,
        "command": cmd,
    }


def _train_stage(ch: Chain, stage: str, left: float) -> tuple[str, float]:
    """``train``, ``resume`` or ``mfu``: run it (or read its kept run) and write its record."""
    s, pred = ch.cfg.settings, ch.record("predict")["metrics"]
    batch = pred["mfu_batch"] if stage == "mfu" else s["batch"]
    if stage == "mfu" and batch == s["batch"]:  # the resume run measured it
        ch.write(stage, "ok", {**ch.record("resume")["metrics"], "same_run_as": "resume"}, 0.0, [])
        return "ok", 0.0
    if stage == "mfu":
        extra = [f"train.micro_batch_size={batch}", f"train.max_steps={s['mfu_steps']}", "train.save_every=0"]
        run = _run(ch, stage, ch.runs / "mfu", extra, s["mfu_steps"], left)
    else:
        run = _run(ch, stage, ch.runs / "train", [], s["kill_at"] if stage == "train" else s["steps"] + 1, left)
    if isinstance(run, str):
        log = (ch.runs / f"{stage}.log").read_text(errors="replace").splitlines()
        status = "timeout" if run == "timeout" else "failed"
        ch.write(stage, status, {}, 0.0, [], failure(run, log))
        return status, 0.0
    rows, own = run["rows"], [r for r in run["rows"] if stage != "resume" or r["step"] > s["save_at"]]
    plan = pred["candidates"][str(batch)] if stage == "mfu" else pred["train"]
    fig = _figures(ch, run, own, batch)
    m = {"figures": fig, "planner": plan, "gpu_in_use_over_planner": in_use_over_planner(fig, plan, s["gpus"])}
    m.update(losses={r["step"]: r["loss"] for r in rows}, grad_norms={r["step"]: r["grad_norm"] for r in rows})
    if ch.probe is not None:
        m["host_probe"] = ch.probe
    status, error = "ok", ""
    if stage == "train":
        m["killed_after_step"] = max(r["step"] for r in rows)
        m["profiles"] = _profiles(ch.runs / "train", s["profile_step"], s["gpus"])
    if stage == "resume":
        before, after = {r["step"]: r for r in json.loads((ch.runs / "train.json").read_text())["rows"]}, m["losses"]
        overlap = [k for k in sorted(before) if k > s["save_at"] and k in after]
        differ = [k for k in overlap if (after[k], m["grad_norms"][k]) != (before[k]["loss"], before[k]["grad_norm"])]
        m.update(compared_steps=overlap, differing_steps=differ, bitwise_equal=bool(overlap) and not differ)
        m["resumed_from"] = run["resumed_from"]  # frod train's own line: not a later checkpoint an orphan wrote
        if not m["bitwise_equal"] or m["resumed_from"] != s["save_at"]:
            status = "failed"
            error = f"resumed from step {m['resumed_from']}; losses differ from the killed run's at {differ or 'none'}"
    ch.write(stage, status, m, run["wall_s"], run["command"], error)
    return status, run["wall_s"]


def _prepare_stage(ch: Chain, left: float) -> tuple[str, float]:
    """Launch ``bench/kinds/chain_prepare.py`` on ``gpus`` ranks; the first stage it did not finish gets a failed or
    timeout record."""
    args = {"suite": str(ch.suite.path), "config": ch.cfg.name, "results": str(ch.results), "work": str(ch.work)}
    (ch.runs / "prepare.json").write_text(
        json.dumps({**args, "device": ch.device, "call": ch.call, "series": ch.series})
    )
    log = ch.runs / "prepare.log"
    cmd = [*launcher(ch.cfg["gpus"]), "-m", "bench.kinds.chain_prepare", str(ch.runs / "prepare.json")]
    w = watch(cmd, log, min(ch.cfg["timeout_s"], left))
    missing = [st for st in PREPARE if not ch.ok(st)]
    if not missing:
        return "ok", w["wall_s"]
    status = "timeout" if w["rc"] is None else "failed"
    tail = log.read_text(errors="replace").splitlines()[-30:]
    ch.write(missing[0], status, {}, w["wall_s"], cmd, "\n".join([f"exit code {w['rc']}", *tail]))
    return status, w["wall_s"]


def _gone(ch: Chain) -> set[str]:
    """The done stages whose files a pending later stage needs but this machine lacks (an earlier call ran them on
    another): the prepared model, store and recipe for the resume and mfu runs, the killed run's sealed checkpoint
    for the resume."""
    from frod_ds.train.checkpoints import COMPLETE, tag_of

    gone = set()
    if not all(ch.ok(st) for st in ("resume", "mfu")) and not (ch.root / "recipe.yaml").is_file():
        gone |= {"prepare", "train"}  # a train run over a model prepared anew is another run: it runs again too
    sealed = ch.runs / "train" / "checkpoints" / tag_of(ch.cfg.settings["save_at"]) / COMPLETE
    if not ch.ok("resume") and not sealed.is_file():
        gone.add("train")
    return gone


def run_chain(suite: Suite, results: Path, work: Path, *, budget_s: float, only: str | None, series: int, log=print):
    """Every stage not yet ``ok`` of each configuration (or of those matching the globs ``only``), in order; a stage
    that fails, or would not fit the budget left, ends its configuration's call. A new killed run is resumed again."""
    t_start, dev, call = time.monotonic(), device_facts(), f"{now()}@{os.uname().nodename}"
    globs = None if only is None else [g.strip() for g in only.split(",") if g.strip()]
    picked = [c for c in suite.configs if globs is None or any(fnmatch.fnmatch(c.name, g) for g in globs)]
    if not picked:
        raise BenchError(f"no configuration of {suite.name} matches {only!r}")
    outcomes = []
    for cfg in picked:
        ch, ran_train = Chain(suite, cfg, Path(results), Path(work), dev, call, series), False
        if dev["count"] and cfg["gpus"] > dev["count"]:
            outcomes.append(Outcome(cfg.name, f"skipped: needs {cfg['gpus']} GPUs, this machine has {dev['count']}"))
            continue
        redo = _gone(ch)  # a later stage needs files an earlier call's machine had: those stages run again here
        ch.runs.mkdir(parents=True, exist_ok=True)
        if "train" in redo:  # its record is replaced by the run the resume is compared with
            (ch.runs / "train.json").unlink(missing_ok=True)
        for group in ("predict", "prepare", "train", "resume", "mfu"):
            stages = PREPARE if group == "prepare" else (group,)
            if all(ch.ok(st) for st in stages) and not (group == "resume" and ran_train) and group not in redo:
                outcomes += [Outcome(f"{cfg.name}.{st}", "done") for st in stages]
                continue
            left = budget_s - (time.monotonic() - t_start)
            need = max([r["wall_s"] for r in map(ch.record, stages) if r] + [cfg["est_s"]])
            same_run = group == "mfu" and ch.record("predict")["metrics"]["mfu_batch"] == cfg["batch"]
            free = group == "predict" or same_run  # the mfu stage then copies the resume run's figures
            if not free and left < min(60.0 if group == "prepare" else need, cfg["timeout_s"]):
                outcomes.append(Outcome(f"{cfg.name}.{group}", f"skipped: {max(left, 0.0):.0f} s of the budget left"))
                break
            log(f"{suite.name}/{cfg.name}: {group}")
            if group == "predict":
                ch.write(group, "ok", predict(ch), 0.0, [Path(sys.executable).name, "-m", "bench", "run", suite.name])
                status, wall = "ok", 0.0
            elif group == "prepare":
                status, wall = _prepare_stage(ch, left)
            else:
                if cfg["host_probe"] and ch.probe is None and not same_run:  # a copied record keeps its probe
                    log(f"{suite.name}/{cfg.name}: host probe")
                    ch.probe = host_probe(ch)
                status, wall = _train_stage(ch, group, left)
                ran_train = ran_train or group == "train"
            outcomes.append(Outcome(f"{cfg.name}.{group}", status, wall))
            log(f"{suite.name}/{cfg.name}: {group} {status} in {wall:.0f} s")
            if status != "ok":
                break
    return outcomes
