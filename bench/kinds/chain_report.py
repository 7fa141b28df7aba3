"""The chain kind's report: per configuration and series, each stage's outcome, then step, MFU, memory per rank
and build time of the training runs, from the stage records alone (``bench/kinds/chain.py`` writes them)."""

from __future__ import annotations

from typing import Any

from bench.record import Record
from bench.suite import Suite

__all__ = ["in_use_over_planner", "per_rank", "render"]


def per_rank(fig: dict[str, Any], key: str, ranks: int) -> dict[str, float]:
    """``fig[key]`` for the run's ``ranks`` alone: records before ``chain.run_gpus`` hold every GPU of the machine."""
    return dict(list(fig[key].items())[:ranks])


def in_use_over_planner(fig: dict[str, Any], plan: dict[str, Any], ranks: int) -> float | None:
    """The most GPU memory a rank's run had in use, read off the driver, over the planner's figure for everything on
    the GPU (``needed``: allocated, fragmentation, CUDA context): torch's own peak misses the peer banks."""
    used = max(per_rank(fig, "gpu_in_use_gib_per_rank", ranks).values(), default=0.0)
    return used / plan["needed_gib"] if used > 0 else None  # 0: not read (the records before the base settled)


SUMMARY = {  # what a stage's row of the report shows: metric, format
    "predict": (("mfu_batch", ""), ("gpu_gib", ".1f")),
    "generate": (("untargeted_gib", ".2f"), ("written_gib", ".2f")),
    "hjd": (("hjd_s", ".0f"), ("freed_gib", ".2f"), ("category_tensors_in_checkpoint", ""), ("store_gib", ".1f")),
    "train": (("killed_after_step", ""),),
    "resume": (("resumed_from", ""), ("compared_steps", ""), ("bitwise_equal", "")),
    "mfu": (),
}


def _summary(stage: str, r: Record) -> str:
    if r.status != "ok":
        return (r.error.strip().splitlines() or [""])[0][:120]
    pairs = SUMMARY[stage.split("-")[0]]
    return ", ".join(f"{k} {format(r.metrics[k], f)}" for k, f in pairs if r.metrics.get(k) is not None)


def render(suite: Suite, device: str, records: list[Record]) -> str:
    """Per configuration and series: each stage's outcome, then step, MFU and memory of the training runs."""
    from bench.kinds.chain import PER_RANK, STAGES, shape_of  # the stages' module imports this one

    g = lambda x: "–" if x is None else f"{x:.1f}"  # noqa: E731
    lines = [f"# `{suite.name}` on `{device}`", "", suite.description, "", f"`python -m bench report {suite.name}`."]
    by: dict[tuple[str, int], dict[str, Record]] = {}
    for r in records:
        by.setdefault((r.config, r.series), {})[r.stage] = r
    for (name, series), st in sorted(by.items()):
        s = next(iter(st.values())).settings
        head = f"{shape_of(s).layers} layers of `{s['shape']}`, {s['dtype']}, {s['gpus']} ranks, `{s['config']}`"
        lines += ["", f"## `{name}`" + f", series {series}" * (series > 1), "", head + ".", ""]
        lines += ["| stage | status | wall s | commit | date | figures |", "|---|---|---|---|---|---|"]
        for x, r in ((x, st[x]) for x in STAGES if x in st):
            lines.append(f"| {x} | {r.status} | {r.wall_s:.0f} | `{r.commit[:12]}` | {r.date} | {_summary(x, r)} |")
        runs = [(x, st[x].metrics) for x in ("train", "resume", "mfu") if x in st and "figures" in st[x].metrics]
        if runs:
            head = "run | tokens per GPU | step s (planner) | tokens/s per GPU | MFU | GPU in use GiB, per rank"
            head += " | planner GiB | in use ÷ planner | rank 0 peak GiB, torch | peak RSS GiB, per rank | build s"
            lines += ["", f"| {head} |", "|---" * 11 + "|"]
        for x, m in runs:
            f, p = m["figures"], m["planner"]
            gpu, rss = (", ".join(map(g, per_rank(f, k, s["gpus"]).values())) or "–" for k in PER_RANK)
            if f[PER_RANK[0]] and not any(f[PER_RANK[0]].values()):
                gpu = "– (not read)"
            mfu = "–" if f["mfu"] is None else f"{100 * f['mfu']:.1f}%"
            tok, step = f"{f['micro_batch']} x {s['seq']}", f"{f['step_s_median']:.3f} ({p['step_s']:.3f})"
            ratio = in_use_over_planner(f, p, s["gpus"])
            over = "–" if ratio is None else f"{ratio:.2f}"
            cells = [x, tok, step, f"{f['tokens_per_s_per_gpu']:,.0f}", mfu, gpu, f"{p['needed_gib']:.1f}", over]
            build = "–" if f.get("build_s") is None else f"{f['build_s']:.0f}"
            lines.append("| " + " | ".join([*cells, g(f["rank0_peak_mem_gib"]), rss, build]) + " |")
        if runs:
            disk = st["predict"].metrics["disk_gib"] if "predict" in st else {}
            whole = sum(v for k, v in disk.items() if k != "peak")
            lines += ["", "Planner GiB: the planner's figure for everything on a GPU (allocated, fragmentation, CUDA "]
            lines[-1] += "context), written before the runs; GPU in use: read off the driver while the run ran, less "
            lines[-1] += f"what was in use before it. Rank 0 peak, torch: {runs[0][1]['figures']['rank0_peak_mem_is']}"
            lines[-1] += " (memory outside torch's allocator, such as the layer partition's peer banks, not in it)."
            if whole:
                lines[-1] += f" The checkpoint the ranks read is {whole:.1f} GiB."
            lines[-1] += " Build s: `frod train`'s own figure for building the model (skeleton, factor store and"
            lines[-1] += " checkpoint reads) before its first step; – where the run predates it."
        lines += _phases(runs)
        lines += _profiles(runs)
    return "\n".join(lines) + "\n"


def _phases(runs: list[tuple[str, dict]]) -> list[str]:
    """Rank 0's median seconds per phase of a step (``train.phase_times``) for the runs that recorded them."""
    from bench.kinds.chain import PHASES as keys  # the stages' module imports this one

    timed = [(x, m["figures"]) for x, m in runs if all(f"{k}_median" in m["figures"] for k in keys)]
    if not timed:
        return []
    out = ["", "| run | data s | forward s | backward s | optimizer s | their sum ÷ step |", "|---" * 6 + "|"]
    for x, f in timed:
        t = [f[f"{k}_median"] for k in keys]
        out.append(f"| {x} | " + " | ".join(f"{v:.3f}" for v in t) + f" | {sum(t) / f['step_s_median']:.2f} |")
    out += ["", "Phases: rank 0's seconds per step, median over the timed steps, each phase ending when the device"]
    out[-1] += " has finished its work (the step's metrics all-reduce is in none)."
    return out


PROFILE_TOP = 8  # functions per rank in the report (the record keeps each rank's whole summary)


def _top_own(text: str) -> list[list[str]]:
    """The first ``PROFILE_TOP`` rows (calls, own s, cumulative s, function) of a cProfile summary's own-time list."""
    rows, started = [], False
    for line in text[text.index("by tottime") :].splitlines():
        started = started or line.lstrip().startswith("ncalls")
        cells = line.split(None, 5)
        if started and len(cells) == 6 and cells[1].replace(".", "").isdigit():
            rows.append([cells[0], cells[1], cells[3], cells[5]])
    return rows[:PROFILE_TOP]


def _profiles(runs: list[tuple[str, dict]]) -> list[str]:
    """Each rank's most expensive functions (own time) in the step profiled under cProfile (``profile_step``)."""
    found = [(x, r, t) for x, m in runs for r, t in sorted(m.get("profiles", {}).items())]
    if not found:
        return []
    out = ["", "| run | rank | function | calls | own s | cumulative s |", "|---" * 6 + "|"]
    for x, rank, text in found:
        for calls, own, cum, fn in _top_own(text):
            out.append(f"| {x} | {rank[4:]} | `{fn.replace('|', '/')}` | {calls} | {own} | {cum} |")
    out += ["", f"Profiled: the train run's step `profile_step` under cProfile on each rank, the {PROFILE_TOP}"]
    out[-1] += " functions with the most own time (the record keeps each rank's whole summary; that step is left out"
    out[-1] += " of the step times above)."
    return out
