"""The training-step matrix in one command: a random full-depth LLaMA-2-7B-shaped checkpoint and its factor
store, the layer profile, then FRoD (s=0.02) and PEFT LoRA r=16 each under plain PyTorch, ``ds_configs/zero2.json``
and ``ds_configs/zero3.json`` (one process per configuration, ``bench/train_step.py run``), and a Markdown
table of FRoD/LoRA ratios against LoRA's best configuration on the same GPU count.

    python bench/train_matrix.py --work /tmp/frodbench --out "$OUT"              # GPU machine, 1 GPU, ~8 min (H100)
    python bench/train_matrix.py --work /tmp/frodbench --out "$OUT" --gpus 2     # ZeRO rows on 2 GPUs as well
    python bench/train_matrix.py --work /tmp/frodbench --out "$OUT" --link \\
        --plan "1:plain,zero2;4:zero2,zero3;2:zero3-keep/frod"
    DS_ACCELERATOR=cpu python bench/train_matrix.py --tiny --work /tmp/fb --out /tmp/fb/out   # CPU rehearsal
    python bench/train_matrix.py --table-only --out DIR                         # the table again from DIR/configs

Order: zero2, plain, zero3 (FRoD then LoRA), then the extras (``--extras``: FRoD layer variants, and quantized
frozen weights for both methods under ZeRO-2: ``nf4``, ``int8``, ``nf4-base``, ``int8-base``); a configuration
is not started once ``--budget-s`` seconds have passed and is killed at ``--deadline-s``, so the command
ends within a 10-minute slot and what ran is tabulated. The table and ``train_step_matrix_<device>.json`` (every
configuration's result, stage times,
failures, command, device, date, versions) are rewritten after each configuration. Per-configuration
JSONs go to ``OUT/configs/``, logs to ``OUT/logs/``. The checkpoint and store in ``--work`` are reused when
complete.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from frod_ds.config.ds_config import load_ds_config  # noqa: E402

ENGINES = {"plain": "plain", "zero2": "ds_configs/zero2.json", "zero3": "ds_configs/zero3.json"}
MAIN = [(e, m, ()) for e in ("zero2", "plain", "zero3") for m in ("frod", "lora")]
EXTRAS = {
    "save-x": [("zero2", "frod", ("--frod-save", "x"))],
    "sampled": [("zero2", "frod", ("--frod-dgrad", "sampled"))],
    "autograd": [("zero2", "frod", ("--frod-impl", "autograd"))],
    # quantized frozen weights, FRoD and LoRA alike: U_i / the targeted W in NF4 or int8; "-base": every decoder
    # linear (QLoRA for LoRA, model.quantize_base for FRoD)
    **{
        f"{q}{b}": [("zero2", m, ("--frozen-quant", q, *(("--quantize-base",) if b else ()))) for m in ("frod", "lora")]
        for q in ("nf4", "int8")
        for b in ("", "-base")
    },
}
# ZeRO-3 variants (bench/train_matrix.py writes each as OUT/ds_variants/<name>.json: zero3.json + these keys)
ZERO3_VARIANTS = {
    # keep gathered weights from forward to backward: one gather per step instead of two (memory of ZeRO-2)
    "zero3-keep": {
        "stage3_max_live_parameters": 20_000_000_000,
        "stage3_max_reuse_distance": 20_000_000_000,
        "stage3_prefetch_bucket_size": 500_000_000,
    },
    # bigger prefetch buckets only
    "zero3-prefetch": {"stage3_prefetch_bucket_size": 500_000_000},
    # ZeRO++ qwZ: all-gather the frozen weights in int8 blocks (halves the gathered bytes)
    "zero3-qwz": {"zero_quantized_weights": True},
}
TINY_MODEL = ["--layers", "2", "--hidden", "64", "--inter", "128", "--heads", "4"]
TINY_RUN = ["--batch", "2", "--seq", "32", "--warmup", "1", "--steps", "2", "--repeats", "2"]
TINY_PROFILE = ["--n", "64", "--m", "64", "128", "--tokens", "96", "--layers", "2", "--inter", "128"]


def _run(cmd: list[str], log: Path, timeout: float) -> tuple[int, float]:
    """Run ``cmd`` from the repo root with stdout+stderr into ``log``; (exit code, seconds); 124 on timeout."""
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with log.open("w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        try:
            rc = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, time.perf_counter() - t0


def _tail(log: Path, n: int = 15) -> str:
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if "warn" not in ln.lower()]
    return "\n".join(lines[-n:])


def prepare(args, out: Path, stages: dict, model_args: list[str] | None = None) -> tuple[Path, Path]:
    """The checkpoint and its factor store in ``--work`` (reused when complete); ``model_args``: make-model's shape
    arguments (default: the 7B shape, or ``TINY_MODEL`` with ``--tiny``)."""
    work = Path(args.work)
    model, factors = work / "model", work / "factors"
    if model_args is None:
        model_args = TINY_MODEL if args.tiny else []
    if not (model / "MADE").is_file():
        cmd = [sys.executable, "bench/train_step.py", "make-model", "--out", str(model)] + model_args
        rc, s = _run(cmd, out / "logs" / "make_model.log", 900)
        stages["make_model_s"] = s
        if rc != 0:
            raise SystemExit(f"error: make-model failed (exit {rc}):\n{_tail(out / 'logs' / 'make_model.log')}")
        (model / "MADE").write_text("complete\n")
    if not (factors / "manifest.json").is_file() or not json.loads((factors / "manifest.json").read_text()).get(
        "complete"
    ):
        rc, s = _run(
            [sys.executable, "launch/hjd.py", "--model", str(model), "--out", str(factors)],
            out / "logs" / "hjd.log",
            900,
        )
        stages["hjd_s"] = s
        if rc != 0:
            raise SystemExit(f"error: HJD failed (exit {rc}):\n{_tail(out / 'logs' / 'hjd.log')}")
    return model, factors


def engine_config(engine: str, out: Path) -> str:
    """The DeepSpeed JSON (or ``plain``) of an engine name; a ZeRO-3 variant is written under OUT/ds_variants."""
    if engine in ENGINES:
        return ENGINES[engine]
    base = load_ds_config(REPO / ENGINES["zero3"])
    base["zero_optimization"].update(ZERO3_VARIANTS[engine])
    path = out / "ds_variants" / f"{engine}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(base, indent=2) + "\n")
    return str(path)


def parse_plan(spec: str) -> list[tuple[str, str, tuple, int]]:
    """``"1:plain,zero2;4:zero2,zero3;2:zero3-keep/frod"`` → [(engine, method, extra, gpus)], in that order.
    ``ENGINE/frod`` or ``ENGINE/lora`` runs one method only; otherwise FRoD then LoRA."""
    plan = []
    for group in filter(None, (g.strip() for g in spec.split(";"))):
        gpus, _, engines = group.partition(":")
        for item in filter(None, (e.strip() for e in engines.split(","))):
            engine, _, only = item.partition("/")
            if engine not in ENGINES and engine not in ZERO3_VARIANTS:
                raise SystemExit(
                    f"error: --plan: unknown engine {engine!r} (one of {', '.join([*ENGINES, *ZERO3_VARIANTS])})"
                )
            if engine == "plain" and int(gpus) != 1:
                raise SystemExit("error: --plan: plain PyTorch runs on one GPU only")
            for method in [only] if only else ["frod", "lora"]:
                plan.append((engine, method, (), int(gpus)))
    return plan


def run_config(
    args, out: Path, engine: str, method: str, extra: tuple, gpus: int, model: Path, factors: Path, timeout: float
) -> dict:
    """One ``train_step.py run`` process (torchrun for several GPUs); its result or a failure record."""
    tag = "-".join(a.strip("-") for a in extra).replace("frozen-quant-", "").replace("-quantize-base", "-base")
    label = f"{method}{'_' + tag if extra else ''}_{engine.replace('-', '_')}{'_gc' if args.gc else ''}_{gpus}gpu"
    name = f"train_step_{label}"
    cmd = [sys.executable]
    if gpus > 1:
        cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}"]
    cmd += [
        "bench/train_step.py",
        "run",
        "--method",
        method,
        "--config",
        engine_config(engine, out),
        "--model",
        str(model),
        "--factors",
        str(factors),
        "--out",
        str(out / "configs"),
        "--name",
        name,
        *extra,
    ]
    cmd += (
        TINY_RUN
        if args.tiny
        else ["--steps", str(args.steps), "--repeats", str(args.repeats), "--warmup", str(args.warmup)]
    )
    cmd += ["--gc"] if args.gc else []
    log = out / "logs" / f"{name}.log"
    rc, s = _run(cmd, log, timeout)
    res = out / "configs" / f"{name}.json"
    if rc == 0 and res.is_file():
        print(f"  {label}: {_tail(log, 1)} ({s:.0f} s)", flush=True)
        return {"name": name, "status": "ok", "wall_s": s}
    print(f"  {label}: FAILED (exit {rc}, {s:.0f} s), log {log}", flush=True)
    return {
        "name": name,
        "status": "timeout" if rc == 124 else f"failed (exit {rc})",
        "wall_s": s,
        "log_tail": _tail(log),
    }


# -- table -------------------------------------------------------------------------------------------------


def _label(d: dict) -> str:
    m = "FRoD" if d["method"] == "frod" else "LoRA r=16"
    f = d.get("frod") or {}
    variant = [
        k for k, default in (("impl", "function"), ("save", "z"), ("dgrad", "dense")) if f.get(k, default) != default
    ]
    tags = [f"{k}={f[k]}" for k in variant]
    if d.get("frozen_quant", "none") != "none":
        tags.append(f"{d['frozen_quant']} {'whole base' if d.get('quantize_base') else 'targets'}")
    variant = Path(d.get("config") or "").stem
    engine = variant if variant in ZERO3_VARIANTS else d["engine"]
    return f"{m} {engine}" + (f" ({', '.join(tags)})" if tags else "")


def load_results(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((out / "configs").glob("train_step_*.json"))]


def table(results: list[dict], links: dict[int, float] | None = None) -> tuple[str, list[dict]]:
    """Markdown table per (GPU count, checkpointing) group, ratios against that group's fastest bf16 LoRA config;
    ``links``: measured all-gather bus bandwidth (bytes/s) per GPU count, for the ZeRO-3 link floor."""
    lines, groups = [], []
    for key in sorted({(d["world_size"], d["gradient_checkpointing"]) for d in results}):
        rows = [d for d in results if (d["world_size"], d["gradient_checkpointing"]) == key]
        loras = [d for d in rows if d["method"] == "lora" and d.get("frozen_quant", "none") == "none"]
        best = min(loras, key=lambda d: d["step_s_median"]) if loras else None
        gpus, gc = key
        head = (
            f"**{gpus} GPU{'s' if gpus > 1 else ''}, gradient checkpointing {'on' if gc else 'off'}** "
            f"({rows[0]['device']})"
        )
        if best:
            head += (
                f" — LoRA's best: **{best['engine']}** ({best['step_s_median'] * 1e3:.0f} ms); ratios are against it"
            )
        lines += [
            "",
            head,
            "",
            "| config | step ms, median (p10–p90) | window spread | tok/s per GPU | peak alloc / reserved GiB "
            "| MFU | GFLOP/token | step ÷ LoRA best | peak alloc ÷ LoRA best |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for d in sorted(rows, key=lambda d: (d["method"] != "frod", d["step_s_median"])):
            r_step = d["step_s_median"] / best["step_s_median"] if best else None
            pa, pr, pa_best = (
                d.get("peak_allocated_gib"),
                d.get("peak_reserved_gib"),
                best and best.get("peak_allocated_gib"),
            )
            r_mem = pa / pa_best if pa and pa_best else None
            mfu = d.get("mfu")
            lines.append(
                f"| {_label(d)} | {d['step_s_median'] * 1e3:.0f} "
                f"({d['step_s_p10'] * 1e3:.0f}–{d['step_s_p90'] * 1e3:.0f}) "
                f"| {d['window_spread'] * 100:.1f}% | {d['tokens_per_s_per_gpu']:,.0f} "
                f"| {f'{pa:.1f} / {pr:.1f}' if pa else 'n/a (CPU)'} | {f'{mfu * 100:.1f}%' if mfu else 'n/a'} "
                f"| {d['flops_per_token']['total'] / 1e9:.3g} | {f'{r_step:.2f}×' if r_step else '–'} "
                f"| {f'{r_mem:.2f}×' if r_mem else '–'} |"
            )
        groups.append(
            {
                "world_size": gpus,
                "gradient_checkpointing": gc,
                "lora_best": best
                and {
                    "engine": best["engine"],
                    "step_s_median": best["step_s_median"],
                    "peak_allocated_gib": best.get("peak_allocated_gib"),
                },
                "rows": [
                    {
                        "config": _label(d),
                        "step_s_median": d["step_s_median"],
                        "tokens_per_s_per_gpu": d["tokens_per_s_per_gpu"],
                        "peak_allocated_gib": d.get("peak_allocated_gib"),
                        "mfu": d.get("mfu"),
                        "step_over_lora_best": best and d["step_s_median"] / best["step_s_median"],
                    }
                    for d in rows
                ],
            }
        )
    scaling_md, scaling = scaling_table(results, links or {})
    return ("\n".join(lines).strip() + "\n" + scaling_md), groups + ([{"scaling": scaling}] if scaling else [])


def link_bandwidths(out: Path) -> dict[int, float]:
    """All-gather bus bandwidth (bytes/s) per GPU count from ``OUT/link_<N>gpu.json`` (bench/link.py), at its largest
    message size (ZeRO-3 gathers whole layers' weights)."""
    found = {}
    for f in out.glob("link_*gpu.json"):
        d = json.loads(f.read_text())
        biggest = max(d["sizes"], key=lambda s: s["size_mib"])
        found[int(d["world_size"])] = biggest["busbw_gbs"] * 1e9
    return found


def link_floor_s(d: dict, busbw: float) -> float:
    """The least time one step of ZeRO-3 spends on the link: every pass over the model (forward, backward, and the
    recomputation under gradient checkpointing) all-gathers the frozen bf16 weights this rank does not hold,
    ``frozen_params * 2 B * (N-1)/N``, at the measured bus bandwidth; nothing overlapped, nothing kept resident."""
    n = d["world_size"]
    passes = 3 if d["gradient_checkpointing"] else 2
    return passes * d["frozen_params"] * 2 * (n - 1) / n / busbw


def scaling_table(results: list[dict], links: dict[int, float] | None = None) -> tuple[str, list[dict]]:
    """Total tokens/s on N GPUs over 1 GPU per (method, config), ZeRO-3 ÷ ZeRO-2 tokens/s per GPU count, and the
    link floor of each multi-GPU ZeRO-3 step (``link_floor_s``) where the link was measured."""
    by = {(_label(d), d["world_size"], d["gradient_checkpointing"]): d for d in results}
    rows = []
    for (label, n, gc), d in sorted(by.items()):
        one = by.get((label, 1, gc))
        z2 = by.get((label.split(" zero3")[0] + " zero2", n, gc)) if " zero3" in label else None
        if n == 1 and not z2:
            continue
        bf16 = d.get("frozen_quant", "none") == "none"
        ones = [
            o
            for o in results
            if o["world_size"] == 1
            and o["method"] == d["method"]
            and o["gradient_checkpointing"] == gc
            and o.get("frozen_quant", "none") == "none"
        ]
        best1 = max(ones, key=lambda o: o["tokens_per_s_per_gpu"]) if ones and n > 1 else None
        links = links or {}
        floor = link_floor_s(d, links[n]) if z2 and n > 1 and n in links and bf16 and d.get("frozen_params") else None
        rows.append(
            {
                "config": label,
                "gpus": n,
                "gradient_checkpointing": gc,
                "step_s_median": d.get("step_s_median"),
                "tokens_per_s_total": d["tokens_per_s_per_gpu"] * n,
                "scaling_vs_1gpu": d["tokens_per_s_per_gpu"] * n / one["tokens_per_s_per_gpu"] if one else None,
                "best_1gpu": best1 and _label(best1),
                "scaling_vs_best_1gpu": d["tokens_per_s_per_gpu"] * n / best1["tokens_per_s_per_gpu"]
                if best1
                else None,
                "over_zero2": d["tokens_per_s_per_gpu"] / z2["tokens_per_s_per_gpu"] if z2 else None,
                "step_over_zero2": d["step_s_median"] / z2["step_s_median"] if z2 and "step_s_median" in d else None,
                "link_floor_s": floor,
            }
        )
    if not rows:
        return "", []
    md = [
        "",
        "**Scaling** (total tokens/s; N GPUs ÷ 1 GPU of the same config, and ÷ the same method's fastest 1-GPU "
        "config; ZeRO-3 variants against ZeRO-2 of the "
        "same method and GPU count; link floor: the frozen bf16 weights a rank does not hold, gathered once per pass "
        "at the measured all-gather bus bandwidth)",
        "",
        "| config | GPUs | step ms | tokens/s total | ÷ 1 GPU | ÷ fastest 1 GPU | tokens/s ÷ ZeRO-2 | step ÷ ZeRO-2 "
        "| link floor ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        sc, z2, st, fl = r["scaling_vs_1gpu"], r["over_zero2"], r["step_over_zero2"], r["link_floor_s"]
        sb = r["scaling_vs_best_1gpu"]
        best = f"{sb:.2f}× ({r['best_1gpu'].split(' ', 1)[-1]})" if sb else "–"
        step = f"{r['step_s_median'] * 1e3:.0f}" if r["step_s_median"] else "–"
        md.append(
            f"| {r['config']} | {r['gpus']} | {step} | {r['tokens_per_s_total']:,.0f} "
            f"| {f'{sc:.2f}×' if sc else '–'} | {best} | {f'{z2:.2f}×' if z2 else '–'} | {f'{st:.2f}×' if st else '–'} "
            f"| {f'{fl * 1e3:.0f}' if fl else '–'} |"
        )
    return "\n".join(md) + "\n", rows


def write_matrix(out: Path, results: list[dict], stages: dict, runs: list[dict], started: str) -> Path:
    """``train_step_matrix_<device>.json`` and ``train_step_table.md`` in ``out`` (atomic replace)."""
    md, groups = table(results, link_bandwidths(out)) if results else ("(no configuration finished)\n", [])
    first = results[0] if results else {}
    device = first.get("device", "unknown")
    slug = next((k.lower() for k in ("H200", "H100", "A100") if k in device), "cpu")
    doc = {
        "benchmark": "train_step_matrix",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "device": device,
        "started": started,
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "versions": first.get("versions"),
        "stages": stages,
        "runs": runs,
        "groups": groups,
        "table_md": md,
        "configs": results,
    }
    path = out / f"train_step_matrix_{slug}.json"
    for p, text in ((path, json.dumps(doc, indent=2) + "\n"), (out / "train_step_table.md", md)):
        tmp = p.with_suffix(p.suffix + ".tmp")
        tmp.write_text(text)
        tmp.replace(p)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="results dir (e.g. $OUT on the GPU machine)")
    ap.add_argument("--work", default="/tmp/frodbench", help="dir for the checkpoint and the factor store")
    ap.add_argument("--tiny", action="store_true", help="2 layers, hidden 64, few steps: the CPU rehearsal")
    ap.add_argument("--gpus", type=int, default=1, help="also run the ZeRO configs on this many GPUs (torchrun)")
    ap.add_argument("--gc", action="store_true", help="gradient checkpointing for both methods")
    ap.add_argument("--engines", default="zero2,plain,zero3", help="comma list of plain, zero2, zero3, in order")
    ap.add_argument(
        "--extras",
        default="save-x,autograd",
        help=f"comma list of extra zero2 configurations after the main six ({', '.join(EXTRAS)}; '' none): "
        "FRoD layer variants, and quantized frozen weights for FRoD and LoRA",
    )
    ap.add_argument("--steps", type=int, default=20, help="timed steps per window")
    ap.add_argument("--repeats", type=int, default=2, help="timed windows")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    ap.add_argument("--no-profile", action="store_true", help="skip bench/layer_profile.py")
    ap.add_argument("--budget-s", type=float, default=480, help="start no configuration after this many seconds")
    ap.add_argument("--config-timeout-s", type=float, default=300, help="kill one configuration after this long")
    ap.add_argument(
        "--deadline-s",
        type=float,
        default=570,
        help="kill a running configuration when the whole command reaches this many seconds",
    )
    ap.add_argument(
        "--plan",
        default=None,
        help="explicit order, e.g. '1:plain,zero2;4:zero2,zero3;1:zero3;2:zero3-keep/frod' "
        f"(ZeRO-3 variants: {', '.join(ZERO3_VARIANTS)}); replaces --engines/--extras/--gpus",
    )
    ap.add_argument(
        "--link",
        action="store_true",
        help="first measure NCCL all-gather bandwidth (bench/link.py) on every multi-GPU count of the plan",
    )
    ap.add_argument("--table-only", action="store_true", help="only rebuild the table from OUT/configs")
    args = ap.parse_args()
    unknown = [k for k in args.extras.split(",") if k and k not in EXTRAS]
    if unknown:
        ap.error(f"--extras {unknown[0]!r} is not one of {', '.join(EXTRAS)}")
    out = Path(args.out)
    started = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    if args.table_only:
        print(table(load_results(out), link_bandwidths(out))[0])
        return
    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    stages: dict = {}
    model, factors = prepare(args, out, stages)
    if not args.no_profile:
        rc, stages["layer_profile_s"] = _run(
            [sys.executable, "bench/layer_profile.py", "--out", str(out)] + (TINY_PROFILE if args.tiny else []),
            out / "logs" / "layer_profile.log",
            180,
        )
        print(f"layer profile: exit {rc}, {stages['layer_profile_s']:.0f} s", flush=True)
    if args.plan:
        plan = parse_plan(args.plan)
    else:
        engines = [e for e in args.engines.split(",") if e]
        plan = [(e, m, x, 1) for e, m, x in MAIN if e in engines]
        plan += [(*x, 1) for k in args.extras.split(",") if k for x in EXTRAS[k]]
        if args.gpus > 1:
            plan += [(e, m, x, args.gpus) for e, m, x in MAIN if e in engines and e != "plain"]
    if args.link:
        for n in sorted({g for *_, g in plan if g > 1}):
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc_per_node={n}",
                "bench/link.py",
                "--out",
                str(out),
            ] + (["--sizes-mib", "1", "4"] if args.tiny else [])
            rc, stages[f"link_{n}gpu_s"] = _run(cmd, out / "logs" / f"link_{n}gpu.log", 120)
            print(f"link {n} GPUs: exit {rc}\n{_tail(out / 'logs' / f'link_{n}gpu.log', 5)}", flush=True)
    runs: list[dict] = []
    for engine, method, extra, gpus in plan:
        if time.perf_counter() - t0 > args.budget_s:
            runs.append(
                {
                    "engine": engine,
                    "method": method,
                    "extra": list(extra),
                    "gpus": gpus,
                    "status": "skipped: time budget",
                }
            )
            continue
        left = args.deadline_s - (time.perf_counter() - t0)
        rec = run_config(args, out, engine, method, extra, gpus, model, factors, min(args.config_timeout_s, left))
        runs.append({"engine": engine, "method": method, "extra": list(extra), "gpus": gpus, **rec})
        write_matrix(out, load_results(out), stages, runs, started)
    stages["total_s"] = time.perf_counter() - t0
    path = write_matrix(out, load_results(out), stages, runs, started)
    print(f"{path} ({stages['total_s']:.0f} s in all)\n")
    print((out / "train_step_table.md").read_text())
    skipped = [r for r in runs if r["status"] != "ok"]
    for r in skipped:
        print(f"not measured: {r['method']} {r['engine']} {r.get('extra', [])} on {r['gpus']} GPU(s): {r['status']}")


if __name__ == "__main__":
    main()
