"""What each ZeRO-3 setting buys FRoD on one GPU, each beside its own baseline in one call, and the headline ratios
(the shipped ``zero3.json`` over ``zero2.json``, ``zero2.json`` over plain PyTorch) measured side by side.

    python bench/zero3_levers.py --work /tmp/frodbench --out "$OUT" --set main      # GPU machine, ~6 min
    python bench/zero3_levers.py --work /tmp/frodbench --out "$OUT" --set levers    # ~8 min
    DS_ACCELERATOR=cpu python bench/zero3_levers.py --tiny --work /tmp/fb --out /tmp/fb/lv --set main,levers
    python bench/zero3_levers.py --report bench/results/zero3_levers              # report + plot from the JSONs

Every configuration is one ``bench/train_step.py run`` process on the full-depth 7B shape (random bf16 weights,
4×512 tokens, no checkpointing; ``bench/train_matrix.py``'s checkpoint and factor store in ``--work``). A call
writes ``zero3_levers_<device>_<stamp>.json`` (each configuration's result, command, device, date, versions);
``--report DIR`` reads every such JSON in DIR and writes ``zero3_levers.md`` and ``zero3_levers.png``: per call,
the ratios of the main set and each lever's step time beside its baseline.

Ablations (``ABLATIONS``, ``--set ablations``): the shipped configuration with one of its changes undone.
Levers (``LEVERS``): each is ``BEFORE`` — the ``zero3.json`` this project shipped before V was replicated — plus one
change. ``--set main`` runs FRoD and LoRA r=16 under plain PyTorch, ``zero2.json`` and the shipped ``zero3.json``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import deepspeed_nvtx, read_results, trainables_per_decoder_layer  # noqa: E402
from bench.train_matrix import TINY_RUN, _run, _tail, prepare  # noqa: E402
from frod_ds.config.ds_config import bf16_overflow_check, load_ds_config, zero_settings  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# environment variables that change a run's host work, recorded with each call
ENV_RECORDED = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_LAUNCH_BLOCKING", "TORCH_CUDA_ARCH_LIST")
ZERO2, ZERO3 = "ds_configs/zero2.json", "ds_configs/zero3.json"
# The zero_optimization keys of the zero3.json shipped before this benchmark's changes (with V partitioned,
# DeepSpeed's per-submodule fetch and one σ and one S Parameter per FRoD layer, as the build and trainer did then).
BEFORE_KEYS = {
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_param_persistence_threshold": 100_000,
    "stage3_max_live_parameters": 1_000_000_000,
    "stage3_max_reuse_distance": 1_000_000_000,
}
BEFORE = [f"--ds-set={k}={v}" for k, v in BEFORE_KEYS.items()]
# name -> (what it changes, the arguments added to BEFORE's, methods it applies to)
LEVERS: dict[str, tuple[str, list[str], tuple[str, ...]]] = {
    "persist-2e6": (
        "stage3_param_persistence_threshold 2e6: every S_i (3.4e5 elements at 7B, 1.3e6 at 70B) resident",
        ["--ds-set=stage3_param_persistence_threshold=2000000"],
        ("frod", "lora"),
    ),
    "v-replicated": (
        "each category's shared V a persistent parameter (gathered once, never released)",
        ["--v-replicated"],
        ("frod",),
    ),
    "prefetch-2.5e8": (
        "stage3_prefetch_bucket_size 2.5e8: at least one 7B decoder layer's frozen elements (2.0e8)",
        ["--ds-set=stage3_prefetch_bucket_size=250000000"],
        ("frod", "lora"),
    ),
    "reuse-2e9": (
        "stage3_max_reuse_distance and stage3_max_live_parameters 2e9: above one 70B layer (0.86e9)",
        ["--ds-set=stage3_max_reuse_distance=2000000000", "--ds-set=stage3_max_live_parameters=2000000000"],
        ("frod", "lora"),
    ),
    "granularity-2e7": (
        "stage3_module_granularity_threshold 2e7 (modules below it fetched as one leaf)",
        ["--ds-set=stage3_module_granularity_threshold=20000000"],
        ("frod", "lora"),
    ),
    "leaf-layers": (
        "each decoder layer one ZeRO-3 fetch unit (set_z3_leaf_modules + the first layer's input "
        "requiring a gradient: frod_ds.model.build.fetch_per_layer)",
        ["--leaf-modules"],
        ("frod", "lora"),
    ),
}
# name -> (what it reverts, the arguments added to the shipped configuration's): the shipped zero3.json and build
# with one of their changes undone, beside the shipped configuration in the same call.
ABLATIONS: dict[str, tuple[str, list[str]]] = {
    "no-persist": (
        "stage3_param_persistence_threshold back to 1e5 (S_i gathered and released like frozen weights)",
        ["--ds-set=stage3_param_persistence_threshold=100000"],
    ),
    "no-prefetch": ("stage3_prefetch_bucket_size back to 5e7", ["--ds-set=stage3_prefetch_bucket_size=50000000"]),
    "v-partitioned": ("V partitioned like the other frozen weights (no replicate_shared_v)", ["--v-partitioned"]),
    "per-module-fetch": ("DeepSpeed's per-submodule fetch hooks (no fetch_per_layer)", ["--per-module-fetch"]),
    "bucket-5e7": (
        "reduce_bucket_size back to 5e7 (two gradient buckets for a 7B model's 6.6e7 σ and S elements)",
        ["--ds-set=reduce_bucket_size=50000000"],
    ),
    "per-member": (
        "one σ and one S Parameter per FRoD layer (12 per 7B decoder layer) instead of one each per "
        "decoder layer (FRoDTrainables)",
        ["--per-member-trainables"],
    ),
    "per-member-u": (
        "one frozen U Parameter per FRoD layer (6 per 7B decoder layer) instead of one per decoder layer (FRoDFrozen)",
        ["--per-member-frozen"],
    ),
    "linear-replaced": (
        "zero_optimization.memory_efficient_linear back to DeepSpeed's default, true: zero.Init "
        "replaces torch.nn.functional.linear process-wide with an autograd Function that keeps every "
        "linear's input for the backward",
        ["--ds-set=memory_efficient_linear=true"],
    ),
    "nvtx-on": (
        "DeepSpeed's NVTX ranges back on, its default (a range push and pop with two is_compiling checks "
        "around each ZeRO-3 fetch, release, hook and partition: 33,288 of 214,629 Python calls per zero3.json "
        "step on 7B's path, bench/host_calls.py; frod_ds.runtime.distributed turns them off unless "
        "FROD_DS_NVTX=1)",
        ["--nvtx"],
    ),
    "walk-parameters": (
        "DeepSpeed walks a decoder layer's modules for its parameters at every fetch and release, and "
        "the whole model's twice per optimizer step (no FixedParameters)",
        ["--walk-parameters"],
    ),
}
# Settings on top of the shipped JSON (name -> what it changes, the arguments added to the shipped JSON's), each beside
# the shipped zero2.json (zero3.json) in the same call; the first two leave the numerics alone and apply to either
# JSON, DeepCompile to zero3.json (DeepSpeed gathers and releases inside the compiled graph; compilation happens in
# the warm-up steps).
PLUS_LEVERS: dict[str, tuple[str, list[str]]] = {
    "no-overlap": (
        "overlap_comm false (one GPU has nothing to overlap; no side stream and its synchronisation)",
        ["--ds-set=overlap_comm=false"],
    ),
    "bucket-5e8": (
        "reduce_bucket_size and allgather_bucket_size 5e8 (one bucket for all of S and σ at 7B)",
        ["--ds-set=reduce_bucket_size=500000000", "--ds-set=allgather_bucket_size=500000000"],
    ),
    "prefetch-0": (
        "stage3_prefetch_bucket_size 0: no prefetching (one GPU has no transfer to hide; the prefetch "
        "coordinator's trace and lookahead are host work every module)",
        ["--ds-set=stage3_prefetch_bucket_size=0"],
    ),
    "no-overflow-check": (
        "bf16.check_grad_overflow false (DeepSpeed 0.19.8 checks every gradient for inf/NaN with "
        "a few kernels per trainable tensor and a host sync before each bf16 step; the step's "
        "global norm is still computed and clipped)",
        ["--ds-set=bf16.check_grad_overflow=false"],
    ),
    "no-check-no-overlap": (
        "both: bf16.check_grad_overflow false and overlap_comm false",
        ["--ds-set=bf16.check_grad_overflow=false", "--ds-set=overlap_comm=false"],
    ),
    "fast-sharding": (
        "stage3_module_granularity_threshold 1: no module made a fetch unit by size (every one is "
        "larger), but DeepSpeed's fast path for fetch units is on: no event per fetched parameter and no "
        "host sync on the third one in flight, a released unit's data dropped without record_stream",
        ["--ds-set=stage3_module_granularity_threshold=1"],
    ),
    "gc-freeze": (
        "gc.collect() and gc.freeze() after the warm-up (Python's collector no longer scans the model's "
        "and DeepSpeed's objects; its collections during the windows are recorded either way)",
        ["--gc-freeze"],
    ),
    "deepcompile": (
        '"compile": {"deepcompile": true} and engine.compile() (needs TORCH_CUDA_ARCH_LIST=9.0 on the H200 image)',
        ["--ds-set=compile.deepcompile=true", "--compile"],
    ),
}
# Why a lever's run failed, read from its log (shown under the failure in the report)
# What a failed lever's log shows, beyond its last line (printed under the failure in the report)
FAILURE_CAUSES = {
    "deepcompile": "the build's per-decoder-layer fetch (`fetch_per_layer`: `set_z3_leaf_modules` on the decoder "
    "layers). The frames show transformers' LlamaModel.forward resumed after a graph break and running "
    "`embed_tokens` eagerly on this rank's 1-D partition. The runs in \"DeepCompile, one layout choice "
    "at a time\" below put back the build's three ZeRO-3 choices one by one: with the per-decoder-layer "
    "fetch this error comes back; without it DeepCompile trains.",
}
EITHER_JSON = ("no-overlap", "bucket-5e8", "gc-freeze")
ZERO3_ONLY = ("prefetch-0", "fast-sharding")
HOST_LEVERS = ("no-overflow-check", "no-check-no-overlap")
SETS = {
    "main": [
        ("frod", "plain", []),
        ("frod", ZERO2, []),
        ("frod", ZERO3, []),
        ("lora", "plain", []),
        ("lora", ZERO2, []),
        ("lora", ZERO3, []),
    ],
    "levers": [("frod", ZERO3, ["before"])]
    + [("frod", ZERO3, [lever]) for lever in LEVERS]
    + [("lora", ZERO3, ["before"])]
    + [("lora", ZERO3, [lv]) for lv, (_, _, m) in LEVERS.items() if "lora" in m],
    "ablations": [("frod", ZERO3, [])]
    + [("frod", ZERO3, [a]) for a in ABLATIONS]
    + [("frod", ZERO2, []), ("frod", ZERO2, ["per-member"]), ("frod", ZERO2, ["nvtx-on"])],
    "zero2": [("frod", ZERO2, [])] + [("frod", ZERO2, [z]) for z in EITHER_JSON],
    "zero3plus": [("frod", ZERO3, [])] + [("frod", ZERO3, [z]) for z in EITHER_JSON + ZERO3_ONLY],
    "compile": [("frod", ZERO3, []), ("frod", ZERO3, ["deepcompile"])],
    # host-side work per trainable tensor: both shipped JSONs with DeepSpeed's per-gradient overflow check off
    # (ZeRO-3 checks no bf16 gradient for overflow in 0.19.8: only fp16 steps are checked there)
    "host": [
        ("frod", "plain", []),
        ("frod", ZERO2, []),
        *[("frod", ZERO2, [h]) for h in HOST_LEVERS],
        ("frod", ZERO3, []),
        ("frod", ZERO3, ["no-overlap"]),
        ("lora", "plain", []),
        ("lora", ZERO2, []),
        ("lora", ZERO2, ["no-check-no-overlap"]),
    ],
}


def run_args(method: str, tags: list[str]) -> list[str]:
    """The ``train_step.py run`` arguments of a configuration's tags ([] shipped, ["before"], or [lever])."""
    if not tags:
        return []
    if tags[0] in ABLATIONS:
        return list(ABLATIONS[tags[0]][1])
    if tags[0] in PLUS_LEVERS:
        return list(PLUS_LEVERS[tags[0]][1])
    args = list(BEFORE)
    v_replicated = False
    for tag in tags:
        if tag == "before":
            continue
        extra = LEVERS[tag][1]
        v_replicated |= "--v-replicated" in extra
        args += [a for a in extra if a != "--v-replicated"]
    if method == "frod" and not v_replicated:
        args.append("--v-partitioned")
    if method == "frod" and "--leaf-modules" not in args:
        args.append("--per-module-fetch")
    if method == "frod":
        args += ["--per-member-trainables", "--per-member-frozen"]  # as built before FRoDTrainables and FRoDFrozen
    return [a for a in args if not (method == "frod" and a == "--leaf-modules")]


def name_of(method: str, config: str, tags: list[str]) -> str:
    engine = "plain" if config == "plain" else Path(config).stem
    return "_".join([method, engine, *tags]).replace(".", "p")


def _command(args, out: Path, model: Path, factors: Path, method: str, config: str, tags: list[str]) -> list[str]:
    name = name_of(method, config, tags)
    cmd = [
        sys.executable,
        "bench/train_step.py",
        "run",
        "--method",
        method,
        "--config",
        config,
        "--model",
        str(model),
        "--out",
        str(out / "configs"),
        "--name",
        name,
        *run_args(method, tags),
    ]
    cmd += ["--factors", str(factors)] if method == "frod" else []
    cmd += TINY_RUN if args.tiny else ["--steps", str(args.steps), "--warmup", "3"]
    cmd += ["--repeats", str(args.repeats)]  # after TINY_RUN's: the last one counts
    cmd += ["--profile"] if args.profile and config != "plain" else []
    cmd += ["--phases"] * args.phases + ["--pyprofile"] * args.pyprofile
    return cmd


def measure(
    args, out: Path, model: Path, factors: Path, method: str, config: str, tags: list[str], timeout: float
) -> dict:
    name = name_of(method, config, tags)
    cmd = _command(args, out, model, factors, method, config, tags)
    log = out / "logs" / f"{name}.log"
    rc, wall = _run(cmd, log, timeout)
    return _record(out, name, method, config, tags, cmd, rc, wall, log)


def _record(
    out: Path,
    name: str,
    method: str,
    config: str,
    tags: list[str],
    cmd: list[str],
    rc: int,
    wall: float,
    log: Path,
    **extra,
) -> dict:
    res = out / "configs" / f"{name}.json"
    record = {"name": name, "method": method, "config": config, "tags": tags, "argv": cmd[1:], "wall_s": wall, **extra}
    if rc == 0 and res.is_file():
        d = json.loads(res.read_text())
        record.update(status="ok", result=d)
        print(f"  {name}: {d['step_s_median'] * 1e3:.0f} ms ({wall:.0f} s)", flush=True)
    else:
        record.update(status="timeout" if rc == 124 else f"failed (exit {rc})", log_tail=_tail(log, 25))
        print(f"  {name}: {record['status']} ({wall:.0f} s), log {log}", flush=True)
    return record


def measure_interleaved(
    args, out: Path, model: Path, factors: Path, group: list[tuple[str, str, list[str]]], timeout: float
) -> list[dict]:
    """The configurations of ``group`` at once on one GPU, their timed windows taken in turn (``--gate``): every
    process builds and warms up, then window k of each runs alone while the others wait, the order rotated by one
    per round. A ratio of two of them is then a ratio of windows that alternated within seconds of each other,
    which a machine slowing down for a minute (seen as 20-30% between the two windows of one configuration run
    alone) moves together. Each process holds its memory while it waits: the group must fit on the GPU at once."""
    gate = out / "gates" / f"g{int(time.time() * 1e3) % 10**9}"
    gate.mkdir(parents=True)
    names = [name_of(*c) for c in group]
    cmds = {n: _command(args, out, model, factors, *c) + ["--gate", str(gate)] for n, c in zip(names, group)}
    logs = {n: out / "logs" / f"{n}.log" for n in names}
    t0 = time.perf_counter()
    deadline = t0 + timeout
    procs, files = {}, []
    for n in names:
        logs[n].parent.mkdir(parents=True, exist_ok=True)
        f = logs[n].open("w")
        f.write(" ".join(cmds[n]) + "\n")
        f.flush()
        files.append(f)
        procs[n] = subprocess.Popen(cmds[n], cwd=REPO, stdout=f, stderr=subprocess.STDOUT)

    def wait_for(n: str, k: int) -> bool:  # True: n is at its gate k; False: it exited or the deadline passed
        flag = gate / f"{n}.ready{k}"
        while not flag.exists():
            if procs[n].poll() is not None or time.perf_counter() > deadline:
                return False
            time.sleep(0.005)
        return True

    order: list[list[str]] = []
    try:
        for k in range(args.repeats):
            ready = [n for n in names if wait_for(n, k)]
            turn = [names[(i + k) % len(names)] for i in range(len(names))]
            order.append([n for n in turn if n in ready])
            for n in order[-1]:
                (gate / f"{n}.go{k}").touch()
                wait_for(n, k + 1)
        for n in names:
            try:
                procs[n].wait(timeout=max(1.0, deadline - time.perf_counter()))
            except subprocess.TimeoutExpired:
                pass
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in files:
            f.close()
    wall = time.perf_counter() - t0
    shutil.rmtree(gate, ignore_errors=True)  # a few files per window: not results
    records = []
    for n, (method, config, tags) in zip(names, group):
        rc = procs[n].returncode
        rc = 124 if rc in (-9, None) and time.perf_counter() > deadline else rc
        records.append(
            _record(
                out, n, method, config, tags, cmds[n], rc, wall, logs[n], interleaved_with=names, window_order=order
            )
        )
    return records


def write_call(out: Path, doc: dict) -> Path:
    path = out / f"zero3_levers_{doc['slug']}_{doc['started'].replace(':', '').replace('-', '')[:15]}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)
    return path


# -- report -------------------------------------------------------------------------------------------------------


def _ms(rec: dict | None) -> float | None:
    return rec["result"]["step_s_median"] * 1e3 if rec and rec.get("status") == "ok" else None


def _window_ms(rec: dict) -> str:
    return ", ".join(f"{w * 1e3:.0f}" for w in rec["result"]["window_medians_s"])


def call_report(doc: dict) -> tuple[list[str], dict]:
    """Markdown lines and the ratios of one call."""
    by = {r["name"]: r for r in doc["runs"]}
    lines = [f"### Call of {doc['started']} — {doc['device']} (`{doc['command']}`)", ""]
    ratios: dict = {}
    main = [r for r in doc["runs"] if not r["tags"]]
    if main:
        lines += [
            "| method | engine | step ms (window medians) | tok/s | MFU | peak GiB | device busy / step |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in main:
            if r["status"] != "ok":
                lines.append(
                    f"| {'FRoD' if r['method'] == 'frod' else 'LoRA r=16'} | {Path(r['config']).stem} "
                    f"| {r['status']} | | | | |"
                )
                continue
            d = r["result"]
            mfu = f"{d['mfu'] * 100:.1f}%" if d.get("mfu") else "n/a"
            prof = d.get("profile") or {}
            busy = (
                f"{prof['device_busy_s_per_step'] / prof['wall_s_per_step'] * 100:.0f}%"
                if prof.get("device_busy_s_per_step")
                else "–"
            )
            peak = f"{d['peak_allocated_gib']:.1f}" if d.get("peak_allocated_gib") else "n/a"
            lines.append(
                f"| {'FRoD' if r['method'] == 'frod' else 'LoRA r=16'} | {Path(r['config']).stem} "
                f"| {_ms(r):.0f} ({_window_ms(r)}) | {d['tokens_per_s_per_gpu']:,.0f} | {mfu} | {peak} | {busy} |"
            )
        for method in ("frod", "lora"):
            p, z2, z3 = (_ms(by.get(name_of(method, c, []))) for c in ("plain", ZERO2, ZERO3))
            ratios[method] = {
                "zero3_over_zero2": z3 / z2 if z3 and z2 else None,
                "zero2_over_plain": z2 / p if z2 and p else None,
            }
        loras = [m for m in (_ms(by.get(name_of("lora", c, []))) for c in ("plain", ZERO2, ZERO3)) if m]
        if loras and _ms(by.get(name_of("lora", "plain", []))):  # LoRA's best on one GPU is among those run
            ratios["frod_zero3_over_lora_best"] = (_ms(by.get(name_of("frod", ZERO3, []))) or float("nan")) / min(loras)
        f = ratios.get("frod", {})
        if f.get("zero3_over_zero2") or f.get("zero2_over_plain"):
            lines += [
                "",
                f"FRoD: `zero3.json` ÷ `zero2.json` = **{_fmt(f.get('zero3_over_zero2'))}** (goal ≤ 1.25×); "
                f"`zero2.json` ÷ plain = **{_fmt(f.get('zero2_over_plain'))}** (goal ≤ 1.15×). LoRA r=16: "
                f"{_fmt(ratios.get('lora', {}).get('zero3_over_zero2'))} and "
                f"{_fmt(ratios.get('lora', {}).get('zero2_over_plain'))}. FRoD `zero3.json` ÷ LoRA's fastest "
                f"configuration in this call (only where its plain-PyTorch run was measured): "
                f"{_fmt(ratios.get('frod_zero3_over_lora_best'))}.",
            ]
        lines.append("")
    ablations = [r for r in doc["runs"] if r["tags"] and r["tags"][0] in ABLATIONS]
    if ablations:
        lines += [
            "| method | engine | shipped build without | what is undone | shipped ms | undone ms | change |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in ablations:
            b, w = _ms(by.get(name_of("frod", r["config"], []))), _ms(r)
            change = f"{(w / b - 1) * 100:+.1f}%" if b and w else r["status"]
            lines.append(
                f"| FRoD | {Path(r['config']).stem} | {r['tags'][0]} | {ABLATIONS[r['tags'][0]][0]} "
                f"| {_fmt(b, 'ms')} | {_fmt(w, 'ms')} | {change} |"
            )
        lines.append("")
    plus = [r for r in doc["runs"] if r["tags"] and r["tags"][0] in PLUS_LEVERS]
    if plus:
        lines += [
            "| method | shipped JSON plus | what it changes | shipped ms | with it ms | change |",
            "|---|---|---|---|---|---|",
        ]
        for r in plus:
            shipped = by.get(name_of(r["method"], r["config"], []))
            b, w = _ms(shipped), _ms(r)
            change = f"{(w / b - 1) * 100:+.1f}%" if b and w else r["status"]
            label = "FRoD" if r["method"] == "frod" else "LoRA r=16"
            lines.append(
                f"| {label} | {Path(r['config']).name} + {r['tags'][0]} | {PLUS_LEVERS[r['tags'][0]][0]} "
                f"| {_fmt(b, 'ms')} | {_fmt(w, 'ms')} | {change} |"
            )
            if not w:
                tail = [ln for ln in (r.get("log_tail") or "").splitlines() if ln.strip()][-1:] or ["?"]
                lines.append(f"|  | failure | `{tail[0][:300]}` | | | |")
                if r["tags"][0] in FAILURE_CAUSES:
                    lines.append(f"|  | log | {FAILURE_CAUSES[r['tags'][0]]} | | | |")
        lines.append("")
    levers = [r for r in doc["runs"] if r["tags"] and r["tags"][0] in LEVERS]
    if levers:
        lines += [
            "| method | lever | what it changes | baseline ms | with lever ms | change |",
            "|---|---|---|---|---|---|",
        ]
        for r in levers:
            base = by.get(name_of(r["method"], r["config"], ["before"]))
            b, w = _ms(base), _ms(r)
            change = f"{(w / b - 1) * 100:+.1f}%" if b and w else (r["status"] if not w else "–")
            lines.append(
                f"| {'FRoD' if r['method'] == 'frod' else 'LoRA r=16'} | {r['tags'][0]} "
                f"| {LEVERS[r['tags'][0]][0]} | {_fmt(b, 'ms')} | {_fmt(w, 'ms')} | {change} |"
            )
            if not w:
                lines.append(f"|  |  | failure: `{(r.get('log_tail') or '').splitlines()[-1:] or ['?']}` | | | |")
        lines.append("")
    return lines, ratios


def _seventy_b_label(d: dict) -> str:
    quant = "bf16" if d["frozen_quant"] == "none" else d["frozen_quant"].upper()
    if d["method"] == "lora":
        return "QLoRA r=16 (NF4 base)" if d.get("quantize_base") else f"LoRA r=16 ({quant} base)"
    return f"FRoD ({quant} U_i" + (" and base)" if d.get("quantize_base") else ")")


def seventy_b_report(directory: Path) -> list[str]:
    """The 70B-widths step runs (``bench/seventy_b.py step|qlora --gpus 1 …``), one folder per device call."""
    from bench.planner_check import check as check_planner

    calls = sorted(p for p in directory.glob("*") if p.is_dir() and any(p.glob("seventy_b_step_*.json")))
    if not calls:
        return []
    first = json.loads(next(calls[0].glob("seventy_b_step_*.json")).read_text())
    m = first["model"]
    lines = [
        "## 70B widths on one GPU",
        "",
        f"{m['num_hidden_layers']} layers of LLaMA-2-70B's widths ({m['hidden_size']} / {m['intermediate_size']}, "
        f"{m['num_key_value_heads']} KV heads), gradient checkpointing, {first['micro_batch']}×{first['seq_len']} "
        "random tokens, one configuration after another in `bench/train_step.py` (`bench/seventy_b.py step` for "
        "FRoD, `qlora` for PEFT LoRA r=16 on the NF4 base; `bench/run_one_gpu.sh 70b-a|70b-b|70b-nf4`). One folder per "
        "device call. MFU from the model's FLOPs without recomputation (`bench/flops.py`); planner: "
        "`frod plan`'s allocated-memory prediction for that run (`bench/planner_check.py`). Goals: FRoD bf16 "
        "`zero3.json` ÷ `zero2.json` ≤ 1.15× with ZeRO-3 MFU ≥ 30%; FRoD with NF4 U_i and base beside QLoRA r=16 "
        "in the same call, and each method's fastest configuration (plain PyTorch on one GPU) beside the other's. "
        "Read a call's ratios only from its own rows: QLoRA's `zero2.json` step was 431 ms in one call (steps "
        "from 340 to 440 ms inside each window) and 296 ms in the next.",
        "",
    ]
    for call in calls:
        runs = [json.loads(p.read_text()) | {"_file": p.name} for p in sorted(call.glob("seventy_b_step_*.json"))]
        lines += [
            f"### Call {call.name} ({runs[0]['device']}, {runs[0]['date'][:16]})",
            "",
            "| method | config | step ms (window medians) | p10–p90 ms | tok/s | MFU | GFLOP/token | peak GiB "
            "| planner GiB |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for d in sorted(
            runs, key=lambda d: (d["method"], d["frozen_quant"], ("plain", "zero2", "zero3").index(d["engine"]))
        ):
            checked = check_planner(d)
            planned = f"{checked['predicted_gib']:.1f} ({checked['error'] * 100:+.0f}%)" if checked else "–"
            windows = ", ".join(f"{w * 1e3:.0f}" for w in d["window_medians_s"])
            lines.append(
                f"| {_seventy_b_label(d)} | {d['engine']} | {d['step_s_median'] * 1e3:.0f} ({windows}) "
                f"| {d['step_s_p10'] * 1e3:.0f}–{d['step_s_p90'] * 1e3:.0f} "
                f"| {d['tokens_per_s_per_gpu']:,.0f} | {d['mfu'] * 100:.1f}% "
                f"| {d['flops_per_token']['total'] / 1e9:.1f} | {d['peak_allocated_gib']:.1f} | {planned} |"
            )
        frod_bf16 = {d["engine"]: d for d in runs if d["method"] == "frod" and d["frozen_quant"] == "none"}
        frod_nf4 = {d["engine"]: d for d in runs if d["method"] == "frod" and d.get("quantize_base")}
        qlora = {d["engine"]: d for d in runs if d["method"] == "lora" and d.get("quantize_base")}
        notes = []
        if "zero3" in frod_bf16 and "zero2" in frod_bf16:
            z3, z2 = frod_bf16["zero3"], frod_bf16["zero2"]
            r = z3["step_s_median"] / z2["step_s_median"]
            notes.append(
                f"FRoD bf16 `zero3.json` ÷ `zero2.json` = **{r:.2f}×** "
                f"({'met' if r <= 1.15 else 'not met'}: ≤ 1.15×), ZeRO-3 MFU **{z3['mfu'] * 100:.1f}%** "
                f"({'met' if z3['mfu'] >= 0.30 else 'not met'}: ≥ 30%)"
                + (f"; plain {frod_bf16['plain']['step_s_median'] * 1e3:.0f} ms" if "plain" in frod_bf16 else "")
            )
        if "zero2" in frod_nf4 and "zero2" in qlora:
            f2, q2 = frod_nf4["zero2"], qlora["zero2"]
            notes.append(
                f"like for like, `zero2.json` with NF4 U_i and base ÷ QLoRA r=16 `zero2.json`: "
                f"**{f2['step_s_median'] / q2['step_s_median']:.2f}×** at "
                f"{f2['flops_per_token']['total'] / q2['flops_per_token']['total']:.2f}× the FLOPs"
            )
        if frod_nf4 and len(qlora) > 1:
            fb = min(frod_nf4.values(), key=lambda d: d["step_s_median"])
            qb = min(qlora.values(), key=lambda d: d["step_s_median"])
            notes.append(
                f"FRoD NF4's fastest ({fb['engine']}) ÷ QLoRA's fastest ({qb['engine']}): "
                f"**{fb['step_s_median'] / qb['step_s_median']:.2f}×**"
            )
        spread = max(d["window_spread"] for d in runs)
        lines += (
            [""]
            + [f"- {n}." for n in notes]
            + [
                f"- Largest gap between one run's window medians: {spread * 100:.0f}%; "
                "steps inside a window: the p10–p90 column.",
                "",
            ]
        )
    return lines


def _fmt(x: float | None, unit: str = "×") -> str:
    if x is None or x != x:
        return "–"
    return f"{x:.0f}" if unit == "ms" else f"{x:.2f}×"


def _zero3_build(result: dict) -> str:
    """How a run's ZeRO-3 held σ and S, and its gradient bucket: what changed between the calls of this report."""
    levers = result.get("levers", {})
    per_member = levers.get("per_member_trainables", True)  # runs before FRoDTrainables: per member
    per_member_u = levers.get("per_member_frozen", True)  # runs before FRoDFrozen: per member
    zo = (result.get("ds_config") or {}).get("zero_optimization", {})
    bucket = zo.get("reduce_bucket_size")
    walks = levers.get("walk_parameters", True)  # runs before FixedParameters: DeepSpeed walked the modules
    replaced = zo.get("memory_efficient_linear", True)  # DeepSpeed's default until zero3.json turned it off
    held = (
        ("σ, S per FRoD layer" if per_member else "σ, S per decoder layer")
        + ("" if per_member_u else "; U per decoder layer")
        + ("" if walks else "; parameter walks replayed")
        + ("" if replaced else "; F.linear not replaced")
        + ("" if deepspeed_nvtx(result) else "; NVTX off")
    )
    return f"{held}; reduce bucket {bucket:.0e}" if isinstance(bucket, (int, float)) else held


def _zero2_trainables(result: dict) -> str:
    """How a run's ZeRO-2 held σ and S: per decoder layer (``FRoDTrainables``, two trainable tensors per layer) since
    2026-11-28, per FRoD layer before (runs from before then did not record their tensor count)."""
    return "per decoder layer" if trainables_per_decoder_layer(result) else "per FRoD layer"


DEEPCOMPILE_LAYOUT = (
    ("v_partitioned", "V partitioned", "V replicated"),
    ("per_member_trainables", "σ/S per FRoD layer", "σ/S per decoder layer"),
    ("per_module_fetch", "per-module fetch", "per-decoder-layer fetch"),
)


def deepcompile_report(directory: Path) -> list[str]:
    """``bench/run_one_gpu.sh deepcompile`` calls (``deepcompile_<L>_layers/<call>/``): FRoD under zero3.json with and
    without DeepCompile, the build's ZeRO-3 layout choices put back one at a time; failed runs from their logs."""
    depths = sorted(directory.glob("deepcompile_*_layers"), key=lambda p: int(p.name.split("_")[1]))
    if not depths:
        return []
    lines = [
        "## DeepCompile, one layout choice at a time",
        "",
        "`bash bench/run_one_gpu.sh deepcompile` (`DC_LAYERS` layers of LLaMA-2-7B's widths, 4×512 tokens, "
        "`zero3.json` unless named, 5 steps × 2 windows after 2 warm-up steps; DeepCompile: "
        "`compile.deepcompile=true` and `engine.compile()`). The shipped build holds V replicated, σ/S per decoder "
        "layer and fetches per decoder layer; DeepSpeed's own layout is the other side of each. Losses: the first "
        "steps, against the first FRoD run of the same depth without DeepCompile in the shipped layout. Peak: "
        "`torch.cuda.max_memory_allocated`.",
        "",
        "| layers | call | run | layout | DeepCompile | step ms (window medians) | peak GiB | max rel. loss diff "
        "| status |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    ratios = []  # (layers, call, zero3.json ÷ zero2.json) where a call timed both in the shipped layout
    for depth in depths:
        layers, ref = depth.name.split("_")[1], None
        for call in sorted(p for p in depth.glob("*") if p.is_dir()):
            pair = {
                n: json.loads((call / f"frod_{n}.json").read_text())["step_s_median"]
                for n in ("zero2", "zero3")
                if (call / f"frod_{n}.json").is_file()
            }
            if len(pair) == 2:
                ratios.append((layers, call.name, pair["zero3"] / pair["zero2"]))
            for path in sorted([*call.glob("*.json"), *call.glob("*.log")], key=lambda p: p.stem):
                if path.suffix == ".log" and path.with_suffix(".json").is_file():
                    continue
                if path.suffix == ".log":
                    text = path.read_text(errors="replace").strip().splitlines()
                    last = next((ln for ln in reversed(text) if "Error" in ln), None)
                    status = last.split("]: ", 1)[-1] if last else "did not finish (killed at the stage's time limit)"
                    lines.append(f"| {layers} | {call.name} | {path.stem} | – | on | – | – | – | {status} |")
                    continue
                d = json.loads(path.read_text())
                lv = d.get("levers", {})
                frod = d["method"] == "frod"
                if (
                    frod
                    and ref is None
                    and not lv.get("compile")
                    and not any(lv.get(k) for k, *_ in DEEPCOMPILE_LAYOUT)
                ):
                    ref = d["losses"]
                layout = (
                    ", ".join(on if lv.get(k) else off for k, on, off in DEEPCOMPILE_LAYOUT) if frod else "LoRA r=16"
                )
                diff = max(abs(a - b) / abs(b) for a, b in zip(d["losses"], ref)) if ref and frod else None
                windows = ", ".join(f"{w * 1e3:.1f}" for w in d["window_medians_s"])
                lines.append(
                    f"| {layers} | {call.name} | {path.stem} ({d['engine']}) | {layout} "
                    f"| {'on' if lv.get('compile') else 'off'} | {d['step_s_median'] * 1e3:.1f} ({windows}) "
                    f"| {d.get('peak_allocated_gib', 0):.2f} | {'–' if diff is None else f'{diff:.1e}'} | ok |"
                )
    lines += [
        "",
        "DeepCompile's `selective_gather` pass keeps parameters gathered while memory allows (the log's "
        "`schedule_prefetch … available_memory … total_param_size`): its peak here is about the gathered model "
        "above `zero3.json`'s, which the ZeRO-3 goal does not count as partitioning; it is measured as a lever, "
        "not shipped. Replicated V under DeepCompile (whose set-up resets every `ds_persist`) did not finish "
        "within 200 s; not explained. At 32 layers DeepCompile's first step did not finish within 300 s (it "
        "was still compiling when it was stopped). LoRA r=16 with DeepCompile ran in the 4-layer call (exit 0); "
        "its result "
        "file did not come back from the machine.",
        "",
    ]
    lines += [
        f"With these calls' short windows (2 warm-up steps), `zero3.json` ÷ `zero2.json` at {layers} layers "
        f"({call}): **{r:.2f}×**; compare the levers calls above."
        for layers, call, r in ratios
    ]
    lines += [""] if ratios else []
    return lines


def report(directory: Path) -> Path:
    docs = read_results(directory, "zero3_levers_*.json")
    lines = [
        "# ZeRO-3 levers for FRoD on one GPU",
        "",
        f"Generated by `python bench/zero3_levers.py --report {directory.as_posix()}` from the JSON files beside "
        "this report; do not edit by hand. Full-depth LLaMA-2-7B shape (random bf16 weights), FRoD s=0.02 and "
        "PEFT LoRA r=16 on q/k/v/o/gate/up, 4×512 tokens, bf16, no checkpointing; median step over its windows "
        "(2 or 3; each window's median in brackets). "
        "Levers: the previously shipped `zero3.json` (V partitioned) plus one change, beside that baseline in "
        "the same call.",
        "",
    ]
    calls, summary = [], []
    for doc in docs:
        md, ratios = call_report(doc)
        calls += md
        by = {r["name"]: r for r in doc["runs"] if r.get("status") == "ok"}
        z2 = by.get(name_of("frod", ZERO2, []))
        check = ("on" if bf16_overflow_check(z2["result"]["ds_config"]) else "off") if z2 else "–"
        overlap = ("on" if zero_settings(z2["result"]["ds_config"]).overlap_comm else "off") if z2 else "–"
        rewarm = max((r["result"].get("rewarm_steps", 0) for r in by.values()), default=0)
        spread = max(
            (r["result"].get("window_spread", 0) for r in by.values() if not r["tags"] and r["method"] == "frod"),
            default=None,
        )
        z3 = by.get(name_of("frod", ZERO3, []))
        build = _zero3_build(z3["result"]) if z3 else None
        z2_held = _zero2_trainables(z2["result"]) if z2 else "–"
        summary.append(
            {
                "started": doc["started"],
                "device": doc["device"],
                "zero2_check": check,
                "zero2_overlap": overlap,
                "zero2_held": z2_held,
                "rewarm": rewarm,
                "frod_spread": spread,
                "zero3_build": build,
                "interleave": doc.get("interleave", 0),
                **ratios,
            }
        )
    lines += [
        "## The goals per call",
        "",
        "FRoD on the full-depth 7B shape, one GPU; each ratio is a pair measured in the "
        "same call. ZeRO-3 build: how that call's ZeRO-3 held σ, S and U and the shipped `reduce_bucket_size`. "
        "Windows: interleaved calls ran several configurations at once on the GPU, taking turns window by window "
        "(ZeRO-3 came out slower that way than alone: a host-bound process resuming after seconds idle); the "
        "goals were read from calls timed one configuration after another until 2026-11-27T22:50, when each turn "
        'started to begin with an untimed step ("in turn, re-warmed"); both kinds are counted below, apart. '
        "(The 10:39 call's per-decoder-layer σ and S "
        "were a first version that ZeRO-3 still gathered and released layer by layer; since the next call they "
        "are persistent, as each member's were.) Goals: `zero3.json` ÷ `zero2.json` ≤ 1.25×, `zero2.json` ÷ plain "
        "≤ 1.15×. `zero2.json` overflow check: DeepSpeed's per-gradient bf16 check in the shipped `zero2.json` "
        "of that call (off since 2026-11-27); `zero2.json` overlap: its `overlap_comm` (off since 2026-11-27T22:35: "
        "one GPU has nothing to overlap, and FRoD's gradients are small on any number); `zero2.json` σ, S: how "
        "that call's ZeRO-2 held them (per decoder layer since 2026-11-28, `FRoDTrainables`, as ZeRO-3 does). "
        "Window spread: the largest relative gap between a FRoD "
        "configuration's window medians in that call (a noisy machine shows here first).",
        "",
        "| call | device | FRoD zero3 ÷ zero2 | FRoD zero2 ÷ plain | LoRA zero3 ÷ zero2 "
        "| FRoD zero3 ÷ LoRA's fastest | `zero2.json` overflow check | `zero2.json` overlap | `zero2.json` σ, S "
        "| ZeRO-3 build | windows | window spread |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    shipped_overlap = "on" if zero_settings(load_ds_config(REPO / ZERO2)).overlap_comm else "off"
    shipped = _zero3_build(
        {
            "ds_config": load_ds_config(REPO / ZERO3),
            "levers": {
                "per_member_trainables": False,
                "per_member_frozen": False,
                "walk_parameters": False,
                "nvtx": False,
            },
        }
    )
    current: dict[str, list[dict]] = {"timed one configuration after another": [], "windows in turn, re-warmed": []}
    for r in summary:
        f, lo = r.get("frod", {}), r.get("lora", {})
        spread = "–" if r["frod_spread"] is None else f"{r['frod_spread'] * 100:.0f}%"
        windows = (
            "one configuration after another"
            if not r["interleave"]
            else f"in turn, {r['interleave']} at a time" + (", re-warmed" if r["rewarm"] else "")
        )
        if f.get("zero3_over_zero2") or f.get("zero2_over_plain"):
            lines.append(
                f"| {r['started'][:16]} | {r['device']} | {_fmt(f.get('zero3_over_zero2'))} "
                f"| {_fmt(f.get('zero2_over_plain'))} | {_fmt(lo.get('zero3_over_zero2'))} "
                f"| {_fmt(r.get('frod_zero3_over_lora_best'))} | {r['zero2_check']} | {r['zero2_overlap']} "
                f"| {r['zero2_held']} | {r['zero3_build'] or '–'} | {windows} | {spread} |"
            )
            if (
                r["zero3_build"] == shipped
                and r["zero2_overlap"] == shipped_overlap
                and r["zero2_check"] == "off"
                and r["zero2_held"] == "per decoder layer"
            ):
                if not r["interleave"]:
                    current["timed one configuration after another"].append(r)
                elif r["rewarm"]:
                    current["windows in turn, re-warmed"].append(r)
    for how, calls_now in current.items():
        if not calls_now:
            continue
        met = [
            r
            for r in calls_now
            if (r["frod"].get("zero3_over_zero2") or 9) <= 1.25 and (r["frod"].get("zero2_over_plain") or 9) <= 1.15
        ]
        lines += [
            "",
            f"With the build and JSONs shipped now ({shipped}; `zero2.json` overlap {shipped_overlap}, σ and S "
            f"per decoder layer), {how}: "
            f"{len(calls_now)} call(s); `zero3.json` ÷ `zero2.json` "
            + ", ".join(_fmt(r["frod"].get("zero3_over_zero2")) for r in calls_now)
            + "; `zero2.json` ÷ plain "
            + ", ".join(_fmt(r["frod"].get("zero2_over_plain")) for r in calls_now)
            + f"; both goals met in {len(met)} of them.",
        ]
    lines += ["", "## Each call", ""] + calls
    lines += seventy_b_report(directory / "70b_widths")
    lines += deepcompile_report(directory)
    (directory / "zero3_levers.md").write_text("\n".join(lines) + "\n")
    _plot(docs, directory / "zero3_levers.png")
    return directory / "zero3_levers.md"


def _plot(docs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(f"{doc['started'][11:16]} {r['name']}", _ms(r)) for doc in docs for r in doc["runs"] if _ms(r)]
    if not runs:
        return
    fig, ax = plt.subplots(figsize=(9, 0.3 * len(runs) + 1.2))
    ax.barh(
        [n for n, _ in runs][::-1],
        [m for _, m in runs][::-1],
        color=["tab:blue" if " frod" in n else "tab:gray" for n, _ in runs][::-1],
    )
    ax.set_xlabel("step time, ms (median)")
    ax.set_title("FRoD (blue) and LoRA r=16 (gray) on one GPU, per call")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="results dir (e.g. $OUT on the GPU machine)")
    ap.add_argument("--work", default="/tmp/frodbench", help="dir for the checkpoint and the factor store")
    ap.add_argument("--tiny", action="store_true", help="tiny model, few steps: the CPU rehearsal")
    ap.add_argument("--set", default="main", help=f"comma list of {', '.join(SETS)}")
    ap.add_argument("--only", default="", help="comma list of configuration names to run, in this order (name_of)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per window")
    ap.add_argument("--repeats", type=int, default=2, help="timed windows")
    ap.add_argument("--profile", action="store_true", help="profile 3 steps of each DeepSpeed configuration")
    ap.add_argument("--phases", action="store_true", help="time forward, backward and step apart (5 more steps)")
    ap.add_argument("--pyprofile", action="store_true", help="3 more steps under cProfile (host time by function)")
    ap.add_argument(
        "--interleave",
        type=int,
        default=0,
        metavar="K",
        help="run the configurations K at a time on the one GPU, their timed windows alternating "
        "(measure_interleaved; K of them must fit in its memory at once); 0: one after another",
    )
    ap.add_argument("--budget-s", type=float, default=500, help="start no configuration after this many seconds")
    ap.add_argument("--deadline-s", type=float, default=570, help="kill the running configuration at this second")
    ap.add_argument("--report", default=None, metavar="DIR", help="only write the report from DIR's JSONs")
    args = ap.parse_args()
    if args.report:
        print(report(Path(args.report)).read_text())
        return
    if not args.out:
        ap.error("--out is required")
    if args.interleave and (args.profile or args.phases or args.pyprofile):
        ap.error(
            "--profile, --phases and --pyprofile with --interleave would run the configurations' extra steps at "
            "once; use one or the other"
        )
    if args.interleave < 0:
        ap.error("--interleave must be 0 (one configuration after another) or the configurations run at once")
    unknown = [s for s in args.set.split(",") if s not in SETS]
    if unknown:
        ap.error(f"--set {unknown[0]!r} is not one of {', '.join(SETS)}")
    t0 = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    stages: dict = {}
    model, factors = prepare(argparse.Namespace(work=args.work, tiny=args.tiny), out, stages)
    plan = [c for s in args.set.split(",") for c in SETS[s]]
    only = [x for x in args.only.split(",") if x]
    if only:  # in the order given
        known = {name_of(*c): c for c in plan}
        missing = [x for x in only if x not in known]
        if missing:
            ap.error(f"--only {missing[0]!r} is not a configuration of --set {args.set} ({', '.join(known)})")
        plan = [known[x] for x in only]
    doc = {
        "benchmark": "zero3_levers",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "env": {k: os.environ[k] for k in ENV_RECORDED if k in os.environ},
        "started": started,
        "device": None,
        "slug": "cpu",
        "versions": None,
        "stages": stages,
        "before_keys": BEFORE_KEYS,
        "shipped_zero3": load_ds_config(REPO / ZERO3),
        "levers": {k: {"what": v[0], "args": v[1]} for k, v in LEVERS.items()},
        "ablations": {k: {"what": v[0], "args": v[1]} for k, v in ABLATIONS.items()},
        "plus_levers": {k: {"what": v[0], "args": v[1]} for k, v in PLUS_LEVERS.items()},
        "runs": [],
    }
    doc["interleave"] = args.interleave
    size = args.interleave or 1
    for group in [plan[i : i + size] for i in range(0, len(plan), size)]:
        if time.perf_counter() - t0 > args.budget_s:
            doc["runs"] += [
                {
                    "name": name_of(method, config, tags),
                    "method": method,
                    "config": config,
                    "tags": tags,
                    "status": "skipped: time budget",
                }
                for method, config, tags in group
            ]
            continue
        left = args.deadline_s - (time.perf_counter() - t0)
        recs = (
            measure_interleaved(args, out, model, factors, group, left)
            if args.interleave
            else [measure(args, out, model, factors, *group[0], left)]
        )
        for rec in recs:
            doc["runs"].append(rec)
            if rec["status"] == "ok" and doc["device"] is None:
                doc["device"], doc["versions"] = rec["result"]["device"], rec["result"]["versions"]
                doc["slug"] = next((k.lower() for k in ("H200", "H100") if k in doc["device"]), "cpu")
        doc["date"] = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
        path = write_call(out, doc)
    stages["total_s"] = time.perf_counter() - t0
    path = write_call(out, doc)
    print(f"{path} ({stages['total_s']:.0f} s)")
    print("\n".join(call_report(doc)[0]))


if __name__ == "__main__":
    main()
