"""A suite's report, generated from its records: ``<results>/<suite>/<device>/report.md``.

One section per runner call (ratios are taken only between results of one call): every configuration's step
time (median, p10–p90), tokens/s per GPU, MFU and peak memory; then per GPU count FRoD's fastest against LoRA's
fastest, both named, and FRoD's N-GPU throughput against N × LoRA's fastest one-GPU throughput of that call.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from bench.predict import read_predictions
from bench.record import Record, read_records
from bench.suite import Suite, with_defaults

__all__ = ["headline", "render", "write_reports"]


def _peak(m: dict) -> float | None:
    """Peak GiB per GPU: allocated plus what the run added outside torch's allocator (records since that was
    measured), else allocated."""
    return m.get("peak_gib") or m.get("peak_allocated_gib")


def _ms(r: Record) -> str:
    m = r.metrics
    return f"{m['step_s_median'] * 1e3:.1f} ({m['step_s_p10'] * 1e3:.1f}–{m['step_s_p90'] * 1e3:.1f})"


def _zero2(r: Record, rows: list[Record]) -> Record | None:
    """The ``zero2`` record of ``r``'s method, GPUs and other settings in the same call: one profiled as ``r`` is
    if the call has it, else any (profiled steps run after the timed ones, so they leave the step time alone)."""
    skip = ("engine", "ds_set", "tag", "gather", "profile")
    same = {k: v for k, v in r.settings.items() if k not in skip}
    found = [
        b
        for b in rows
        if b.status == "ok" and b.settings["engine"] == "zero2" and not b.settings.get("ds_set")
        if {k: v for k, v in b.settings.items() if k not in skip} == same
    ]
    found.sort(key=lambda b: b.settings.get("profile") != r.settings.get("profile"))
    return found[0] if found else None


def _loss_gap(a: Record, b: Record) -> float | None:
    """The largest relative difference between two runs' losses (the same seeds and batches, step by step)."""
    la, lb = a.metrics.get("losses") or [], b.metrics.get("losses") or []
    if not la or len(la) != len(lb):
        return None
    return max(abs(x - y) / abs(y) for x, y in zip(la, lb))


def _memory_bound(r: Record, rows: list[Record]) -> str:
    """A partitioned row's peak against what partitioning is due to give: ``zero2``'s peak in the call less
    (1 − 1/N) of the frozen model (V counted in it, though every rank keeps V whole), plus two of its largest
    units and 1 GiB."""
    fs, b = r.metrics.get("frozen_shards") or {}, _zero2(r, rows)
    if b is None or "replicated_gib" not in fs or not _peak(r.metrics) or not _peak(b.metrics):
        return ""
    n = r.settings["gpus"]
    bound = _peak(b.metrics) - (1 - 1 / n) * (fs["full_gib"] + fs["replicated_gib"]) + 2 * fs["largest_unit_gib"] + 1
    return f" ({'≤' if _peak(r.metrics) <= bound else '>'} {bound:.1f} due)"


def _vs_zero2(r: Record, rows: list[Record]) -> str:
    """``r``'s step over its ``zero2`` step, and the largest relative difference of their losses."""
    b = _zero2(r, rows)
    if b is None:
        return "– | –"
    gap = _loss_gap(r, b)
    return f"{r.metrics['step_s_median'] / b.metrics['step_s_median']:.3f}× | {'–' if gap is None else f'{gap:.1e}'}"


def _zero2_spread(records: list[Record]) -> list[str]:
    """Per ``zero2`` configuration measured in several calls: the largest relative difference of its losses
    between calls, the spread a partitioned run's losses are held to."""
    out = []
    for name in sorted({r.config for r in records if r.settings["engine"] == "zero2" and r.status == "ok"}):
        runs = [r for r in records if r.config == name and r.status == "ok"]
        gaps = [g for i, a in enumerate(runs) for b in runs[i + 1 :] if (g := _loss_gap(a, b)) is not None]
        if gaps:
            out.append(f"- `{name}`: {max(gaps):.1e} over {len(runs)} calls")
    if not out:
        return []
    return ["", "`zero2`'s own run-to-run spread of the losses (largest relative difference between calls):", *out]


def _row(r: Record, rows: list[Record]) -> str:
    s = r.settings
    if r.status != "ok":
        lines = r.error.strip().splitlines() or [""]
        why = lines[-1]
        if r.status == "timeout":  # what stopped it; records before the runner said so have the log's tail only
            why = lines[0] if lines[0].startswith("stopped after") else f"stopped after {r.wall_s:.0f} s"
        why = why[:100].replace("|", "/")
        return f"| `{r.config}` | {s['method']} | {s['engine']} | {s['gpus']} | {r.status}: {why} | | | | | |"
    m = r.metrics
    mfu = f"{m['mfu'] * 100:.1f}%" if m.get("mfu") else "–"
    peak = (f"{_peak(m):.1f}" if _peak(m) else "–") + _memory_bound(r, rows)
    if s.get("gather", "collective") == "peer" and not m.get("peak_gib") and m.get("frozen_shards"):
        peak += f" + {m['frozen_shards']['shard_gib']:.1f} shards (not in torch's count)"  # before the driver's figure
    tok = f"{m['tokens_per_s_per_gpu']:,.0f}"
    vs = _vs_zero2(r, rows)
    engine = s["engine"] + (f" ({s['gather']})" if s.get("gather", "collective") != "collective" else "")
    return f"| `{r.config}` | {s['method']} | {engine} | {s['gpus']} | {_ms(r)} | {vs} | {tok} | {mfu} | {peak} |"


def _fastest(rows: list[Record], method: str, gpus: int, batch: int | None = None) -> Record | None:
    ok = [r for r in rows if r.status == "ok" and r.settings["method"] == method and r.settings["gpus"] == gpus]
    ok = [r for r in ok if batch is None or r.settings["batch"] == batch]
    return min(ok, key=lambda r: r.metrics["step_s_median"], default=None)


def _comparison(rows: list[Record]) -> list[str]:
    """Per GPU count (and micro-batch, where the call measured several) FRoD's fastest against LoRA's."""
    out = [
        "| GPUs | FRoD's fastest | step ms | LoRA's fastest | step ms | FRoD ÷ LoRA (step) | "
        "FRoD tokens/s ÷ (N × LoRA's fastest on 1 GPU) | FRoD's N-GPU tokens/s ÷ its fastest on 1 GPU |",
        "|---|---|---|---|---|---|---|---|",
    ]
    batches = sorted({r.settings["batch"] for r in rows})
    for n, b in sorted({(r.settings["gpus"], r.settings["batch"]) for r in rows}):
        f, lo = _fastest(rows, "frod", n, b), _fastest(rows, "lora", n, b)
        lora1, frod1 = _fastest(rows, "lora", 1, b), _fastest(rows, "frod", 1, b)
        if f is None or lo is None:
            continue
        ratio = f.metrics["step_s_median"] / lo.metrics["step_s_median"]
        vs_n = "–"
        if lora1 is not None:
            vs_n = f"{f.metrics['tokens_per_s_per_gpu'] / lora1.metrics['tokens_per_s_per_gpu']:.2f}× "
            vs_n += f"(LoRA `{lora1.settings['engine']}`)"
        scale = "–"
        if frod1 is not None:
            scale = f"{n * f.metrics['tokens_per_s_per_gpu'] / frod1.metrics['tokens_per_s_per_gpu']:.2f}× "
            scale += f"(`{frod1.settings['engine']}`)"
        at = f"{n} ({b}×{f.settings['seq']})" if len(batches) > 1 else str(n)
        out.append(
            f"| {at} | `{f.settings['engine']}` | {f.metrics['step_s_median'] * 1e3:.1f} | `{lo.settings['engine']}` | "
            f"{lo.metrics['step_s_median'] * 1e3:.1f} | {ratio:.2f}× | {vs_n} | {scale} |"
        )
    return out if len(out) > 2 else []


def _predicted(rows: list[Record], predictions: dict[str, dict]) -> list[str]:
    """Each measured configuration the planner predicted, beside its prediction (written before the call?)."""
    out = []
    for r in rows:
        p = predictions.get(r.config)
        if r.status != "ok" or p is None or with_defaults(p.get("settings") or {}) != with_defaults(r.settings):
            continue
        m = r.metrics
        ms, pms = m["step_s_median"] * 1e3, p["step_s"] * 1e3
        gib, pgib = _peak(m), p["peak_allocated_gib"]
        mem = f"{gib:.1f} | {pgib:.1f} | {(pgib - gib) / gib:+.1%}" if gib else f"– | {pgib:.1f} | –"
        before = "yes" if p["date"] < r.date else "no"
        out.append(f"| `{r.config}` | {ms:.1f} | {pms:.1f} | {(pms - ms) / ms:+.1%} | {mem} | {before} |")
    if not out:
        return []
    return [
        "The planner's predictions (`python -m bench predict`, `predictions.json`) beside the measurements:",
        "",
        "| configuration | step ms | predicted | error | peak GiB | predicted | error | predicted before |",
        "|---|---|---|---|---|---|---|---|",
        *out,
    ]


def _profiles(rows: list[Record]) -> list[str]:
    """Per rank of each profiled configuration: host CPU per timed step and where its GPU time went."""
    out = []
    for r in rows:
        for rank, m in enumerate(r.metrics.get("memory_per_rank") or [] if r.status == "ok" else []):
            p = m.get("profile")
            if p:
                keys = ("gpu_busy_ms", "compute_ms", "nccl_ms", "compute_beside_nccl_ms", "copy_ms")
                cells = " | ".join(f"{p[k]:.0f}" for k in keys)
                out.append(f"| `{r.config}` | {rank} | {m['host_cpu_ms_per_step']:.0f} | {cells} |")
    if not out:
        return []
    return [
        "Profiled steps (CUDA activity only; ms per step; host CPU from the unprofiled timed steps, all threads):",
        "",
        "| configuration | rank | host CPU | GPU busy | compute kernels | NCCL kernels | compute beside NCCL | "
        "copies |",
        "|---|---|---|---|---|---|---|---|",
        *out,
    ]


def _machine(device: dict) -> str:
    return f"{device['count']} × {device['name']}" if device["count"] else device["name"]


def render(suite: Suite, device: str, records: list[Record], predictions: dict[str, dict] | None = None) -> str:
    order = {c.name: i for i, c in enumerate(suite.configs)}
    first = records[0]
    lines = [
        f"# `{suite.name}` on {_machine(first.device)} (`{device}`)",
        "",
        f"{suite.description}",
        "",
        f"Generated by `python -m bench report {suite.name}` from the JSON records beside this file; "
        "ratios only between results of one call. Peak: torch.cuda's peak allocated per GPU plus what the run added "
        "outside torch's allocator (NCCL's buffers, the layer partition's peer banks; read off the driver), where the "
        "record has it; a partitioned row's peak is followed by what partitioning is due to give: `zero2`'s peak in "
        "the call less (1 − 1/N) of the frozen model (V counted in it), plus two of its largest units and 1 GiB.",
    ]
    calls: dict[str, list[Record]] = defaultdict(list)
    for r in records:
        calls[r.call].append(r)
    for call in sorted(calls):
        rows = sorted(calls[call], key=lambda r: order.get(r.config, len(order)))
        v = rows[0].versions
        lines += [
            "",
            f"## Call {call}",
            "",
            f"Commit `{rows[0].commit[:12]}`; torch {v.get('torch')}, DeepSpeed {v.get('deepspeed')}, "
            f"transformers {v.get('transformers')}, PEFT {v.get('peft')}.",
            "",
            "| configuration | method | engine | GPUs | step ms, median (p10–p90) | ÷ `zero2` | losses vs `zero2` "
            "(max rel.) | tokens/s per GPU | MFU | peak GiB (max rank) |",
            "|---|---|---|---|---|---|---|---|---|---|",
            *(_row(r, rows) for r in rows),
        ]
        comparison = _comparison(rows)
        if comparison:
            lines += ["", *comparison]
        profiles = _profiles(rows)
        if profiles:
            lines += ["", *profiles]
        planner = _predicted(rows, predictions or {})
        if planner:
            lines += ["", *planner]
    lines += _zero2_spread(records)
    return "\n".join(lines) + "\n"


def write_reports(results: Path, suite: Suite) -> list[Path]:
    """Regenerate ``report.md`` in every device folder of ``suite`` that holds records (a chain suite's by
    ``bench/kinds/chain.py``'s ``render``)."""
    if suite.kind == "chain":
        from bench.kinds.chain_report import render as render_chain

        def text(device: str, records: list[Record]) -> str:
            return render_chain(suite, device, records)
    else:
        predictions = read_predictions(results, suite.name)

        def text(device: str, records: list[Record]) -> str:
            return render(suite, device, records, predictions)

    written = []
    for folder in sorted(p for p in (Path(results) / suite.name).glob("*") if p.is_dir()):
        records = read_records(results, suite.name, folder.name)
        if records:
            path = folder / "report.md"
            path.write_text(text(folder.name, records))
            written.append(path)
    return written


def headline(results: Path, suite: Suite, device: str) -> str:
    """Per GPU count, FRoD's fastest configuration that ``frod train`` runs (a DeepSpeed JSON) against LoRA's
    fastest of any engine, from the call of ``suite`` on ``device`` that measured the most configurations."""
    calls: dict[str, list[Record]] = defaultdict(list)
    for r in read_records(results, suite.name, device):
        if r.status == "ok":
            calls[r.call].append(r)
    rows = max(calls.values(), key=len)
    trainer = [r for r in rows if r.settings["method"] == "lora" or r.settings["engine"].startswith("zero")]
    lora1 = _fastest(rows, "lora", 1)
    lines = [
        f"Call {rows[0].call} on {_machine(rows[0].device)}; LLaMA-2-7B shape (random bf16 weights), "
        f"{rows[0].settings['batch']}×{rows[0].settings['seq']} tokens per GPU; FRoD s=0.02 vs PEFT LoRA r=16.",
        "",
        "| GPUs | LoRA's fastest | LoRA step / tok/s per GPU / peak | FRoD's fastest in `frod train` | "
        "FRoD step / tok/s per GPU / peak | FRoD step ÷ LoRA's | FRoD peak ÷ LoRA's | "
        "FRoD tok/s ÷ N × LoRA's 1-GPU |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def cell(r: Record) -> str:
        m = r.metrics
        return f"{m['step_s_median'] * 1e3:.0f} ms / {m['tokens_per_s_per_gpu']:,.0f} / {_peak(m):.1f} GiB"

    for n in sorted({r.settings["gpus"] for r in rows}):
        f, lo = _fastest(trainer, "frod", n), _fastest(rows, "lora", n)
        if f is None or lo is None or lora1 is None:
            continue
        fm, lm = f.metrics, lo.metrics
        lines.append(
            f"| {n} | {_engine(lo)} | {cell(lo)} | {_engine(f)} | {cell(f)} "
            f"| **{fm['step_s_median'] / lm['step_s_median']:.2f}×** "
            f"| {_peak(fm) / _peak(lm):.2f}× "
            f"| {fm['tokens_per_s_per_gpu'] / lora1.metrics['tokens_per_s_per_gpu']:.2f}× |"
        )
    return "\n".join(lines) + "\n"


def _engine(r: Record) -> str:
    e = r.settings["engine"]
    name = {"plain": "plain PyTorch", "ddp": "torch DDP"}.get(e, f"`{e}.json`")
    return name + (f" ({r.settings['tag']})" if r.settings["tag"] else "")
