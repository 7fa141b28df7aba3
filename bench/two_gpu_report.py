"""The 2-GPU report: what ``bench/run_two_gpu.sh`` measured, set against the goals, from its result JSONs only.

    python bench/two_gpu_report.py bench/results/two_gpu_2xh200     # writes report.md, report.json, steps.png there

Reads ``DIR/matrix`` (``bench/train_matrix.py``: full-depth 7B, FRoD s=0.02 and PEFT LoRA r=16, plain / zero2 / zero3
on 1 and 2 GPUs, ``link_2gpu.json``) and ``DIR/70b_bf16_*`` (``bench/seventy_b.py``: 70B widths, bf16 U_i, FRoD and
LoRA r=16 under ``zero3.json`` with checkpointing; the training run killed and resumed). Every ratio is a pair measured
in one device call. The planner's prediction is computed here for every FRoD ZeRO point (``bench/planner_check.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.planner_check import GOAL as PLANNER_GOAL  # noqa: E402
from bench.planner_check import check as check_planner
from bench.train_matrix import link_bandwidths, link_floor_s, load_results  # noqa: E402
from frod_ds.config.ds_config import bf16_overflow_check  # noqa: E402

GOALS = {  # (description, comparison, bound)
    "7b_zero3_over_zero2_2gpu": ("FRoD zero3 step ÷ FRoD zero2 step, 2 GPUs", "<=", 1.25),
    "7b_zero2_2gpu_over_best_1gpu": ("FRoD zero2 tokens/s on 2 GPUs ÷ fastest 1-GPU FRoD config", ">=", 1.9),
    "70b_mfu": ("70B widths bf16, FRoD zero3 MFU (2 GPUs)", ">=", 0.35),
    "70b_frod_over_lora": ("70B widths bf16, FRoD step ÷ LoRA r=16 step (same zero3.json)", "<=", 1.5),
    "70b_resume_rel_diff": ("70B widths bf16, resumed losses vs the killed run's, max relative difference", "<=", 0.0),
    "70b_nf4_frod_over_qlora": (
        "LLaMA-2-70B (80 layers) NF4 U_i + NF4 base, FRoD step ÷ QLoRA r=16 step (zero2.json, same call)",
        "<=",
        1.4,
    ),
    "planner_worst_error": ("planner |prediction ÷ peak − 1|, worst FRoD point", "<=", PLANNER_GOAL),
}


NF4_DIR = "70b_nf4_80_layers"


def _nf4_chain(root: Path) -> dict:
    """FRoD (NF4 U_i and base) and QLoRA r=16 under ``zero2.json`` on the 80-layer chain: ``same_call`` (both timed in
    one device call, the compared pair) and ``separate_calls`` (FRoD and QLoRA each timed at the end of its own call,
    before ``zero2.json`` turned DeepSpeed's bf16 overflow check off: context only)."""
    out = {}
    for part in ("same_call", "separate_calls"):
        frod = json.loads((root / part / "seventy_b_step_frod_zero2_base.json").read_text())
        qlora = json.loads((root / part / "seventy_b_step_lora_zero2.json").read_text())
        flops = [d["flops_per_token"]["total"] for d in (frod, qlora)]
        out[part] = {
            "frod": frod,
            "qlora": qlora,
            "frod_ms": frod["step_s_median"] * 1e3,
            "qlora_ms": qlora["step_s_median"] * 1e3,
            "ratio": frod["step_s_median"] / qlora["step_s_median"],
            "flops_ratio": flops[0] / flops[1],
            "frod_peak_gib": frod["peak_allocated_gib"],
            "qlora_peak_gib": qlora["peak_allocated_gib"],
            "date": frod["date"],
            "zero2_overflow_check": "on" if bf16_overflow_check(frod["ds_config"]) else "off",
        }
    return out


def _met(op: str, value: float, bound: float) -> bool:
    return value <= bound if op == "<=" else value >= bound


def _pick(results: list[dict], method: str, engine: str, gpus: int) -> dict:
    (d,) = [
        r
        for r in results
        if (r["method"], r["engine"], r["world_size"]) == (method, engine, gpus)
        and r.get("frozen_quant", "none") == "none"
    ]
    return d


def collect(root: Path) -> dict:
    """Every number of the report, from the JSONs under ``root``."""
    results = load_results(root / "matrix")
    links = link_bandwidths(root / "matrix")
    f = {
        (e, g): _pick(results, "frod", e, g)
        for e, g in (("plain", 1), ("zero2", 1), ("zero3", 1), ("zero2", 2), ("zero3", 2))
    }
    best1 = max((f[k] for k in f if k[1] == 1), key=lambda d: d["tokens_per_s_per_gpu"])
    (chain,) = sorted(p for p in root.glob("70b_bf16_*") if p.is_dir())
    seventy = {p.stem.removeprefix("seventy_b_"): json.loads(p.read_text()) for p in chain.glob("seventy_b_*.json")}
    frod70, lora70, resume = seventy["step_frod"], seventy["step_lora_bf16"], seventy["train_resume"]
    nf4 = _nf4_chain(root / NF4_DIR)
    planner = [c for c in (check_planner({**d, "_file": "matrix"}) for d in results) if c]
    planner += [c for c in (check_planner({**nf4["same_call"]["frod"], "_file": f"{NF4_DIR}/same_call"}),) if c]
    planner += [c for c in (check_planner({**frod70, "_file": chain.name}),) if c]
    planner.append(
        {
            "file": chain.name,
            "config": "zero3.json (launch/train.py run)",
            "gpus": 2,
            "measured_gib": resume["peak_alloc_gib_rank0"],
            "predicted_gib": resume["planner"]["allocated_gib"],
            "error": resume["planner"]["allocated_gib"] / resume["peak_alloc_gib_rank0"] - 1,
        }
    )
    value = {
        "7b_zero3_over_zero2_2gpu": f[("zero3", 2)]["step_s_median"] / f[("zero2", 2)]["step_s_median"],
        "7b_zero2_2gpu_over_best_1gpu": 2 * f[("zero2", 2)]["tokens_per_s_per_gpu"] / best1["tokens_per_s_per_gpu"],
        "70b_mfu": frod70["mfu"],
        "70b_frod_over_lora": frod70["step_s_median"] / lora70["step_s_median"],
        "70b_resume_rel_diff": resume["max_rel_loss_diff"],
        "70b_nf4_frod_over_qlora": nf4["same_call"]["ratio"],
        "planner_worst_error": max(abs(c["error"]) for c in planner),
    }
    goals = [
        {"key": k, "goal": f"{desc} {op} {bound:g}", "value": value[k], "met": _met(op, value[k], bound)}
        for k, (desc, op, bound) in GOALS.items()
    ]
    return {
        "device": f[("zero2", 2)]["device"],
        "date": f[("zero2", 2)]["date"],
        "versions": f[("zero2", 2)]["versions"],
        "goals": goals,
        "best_1gpu": best1["engine"],
        "link_busbw_gbs": {n: bw / 1e9 for n, bw in links.items()},
        "link_floor_ms_7b_zero3_2gpu": link_floor_s(f[("zero3", 2)], links[2]) * 1e3 if 2 in links else None,
        "link_floor_ms_70b_zero3_2gpu": (
            link_floor_s(frod70, links[2]) * 1e3 if 2 in links and frod70.get("frozen_params") else None
        ),
        "seventy_b": {
            "layers": frod70["model"]["num_hidden_layers"],
            "steps": resume["steps"],
            "resumed_from": resume["resumed_from"],
            "compared_steps": resume["compared_steps"],
            "frod_step_ms": frod70["step_s_median"] * 1e3,
            "lora_step_ms": lora70["step_s_median"] * 1e3,
            "frod_peak_gib": frod70["peak_allocated_gib"],
            "lora_peak_gib": lora70["peak_allocated_gib"],
            "train_step_ms": resume["step_s_median"] * 1e3,
        },
        "seventy_b_nf4": {
            k: {
                kk: vv
                for kk, vv in v.items()
                if kk
                in (
                    "frod_ms",
                    "qlora_ms",
                    "ratio",
                    "flops_ratio",
                    "frod_peak_gib",
                    "qlora_peak_gib",
                    "zero2_overflow_check",
                    "date",
                )
            }
            for k, v in nf4.items()
        },
        "planner": planner,
        "matrix_table_md": (root / "matrix" / "train_step_table.md").read_text(),
        "seventy_b_table_md": seventy["report"]["table_md"],
        "sources": sorted(str(p.relative_to(root)) for p in root.rglob("*.json")),
    }


def plot(doc: dict, results: list[dict], png: Path) -> None:
    """Step time per configuration, 1 and 2 GPUs side by side, FRoD and LoRA (7B matrix)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), sharey=True)
    for ax, method, title in zip(axes, ("frod", "lora"), ("FRoD s=0.02", "LoRA r=16")):
        labels, one, two = [], [], []
        for engine in ("plain", "zero2", "zero3"):
            by = {
                r["world_size"]: r["step_s_median"] * 1e3
                for r in results
                if (r["method"], r["engine"]) == (method, engine) and r.get("frozen_quant", "none") == "none"
            }
            labels.append(engine)
            one.append(by.get(1, 0))
            two.append(by.get(2, 0))
        x = range(len(labels))
        ax.bar([i - 0.2 for i in x], one, 0.4, label="1 GPU")
        ax.bar([i + 0.2 for i in x], two, 0.4, label="2 GPUs")
        ax.set_xticks(list(x), labels)
        ax.set_title(f"{title}, full-depth 7B, 4×512 tokens per GPU", fontsize=9)
        ax.set_ylabel("step ms (median)")
    axes[0].legend(frameon=False)
    fig.suptitle(doc["device"], fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def render(doc: dict) -> str:
    s = doc["seventy_b"]
    lines = [
        f"# Two GPUs: ZeRO-3 against ZeRO-2, 70B widths in bf16, 70B NF4 against QLoRA ({doc['device']})",
        "",
        f"Generated by `python bench/two_gpu_report.py` from the JSONs in this folder; measured {doc['date'][:10]} "
        "with `bash bench/run_two_gpu.sh matrix|70b-bf16-a|70b-bf16-b`, later `70b-nf4-a|70b-nf4-b|pair` (device calls "
        "on one 2-GPU machine each time; each compared pair inside one call).",
        "",
        "## Goals",
        "",
        "| goal | measured | met |",
        "|---|---|---|",
    ]
    for g in doc["goals"]:
        v = g["value"]
        shown = (
            f"{v * 100:.1f}%"
            if g["key"] == "70b_mfu"
            else (f"{v:.2e}" if g["key"] == "70b_resume_rel_diff" else f"{v:.2f}")
        )
        lines.append(f"| {g['goal']} | {shown} | {'yes' if g['met'] else '**no**'} |")
    floor7, floor70 = doc["link_floor_ms_7b_zero3_2gpu"], doc["link_floor_ms_70b_zero3_2gpu"]
    bw = doc["link_busbw_gbs"].get(2) or doc["link_busbw_gbs"].get("2")
    lines += [
        "",
        f"Link: all-gather bus bandwidth {bw:.0f} GB/s on 2 GPUs (1 GiB messages). Link floor of a ZeRO-3 "
        "step (every pass gathers the half of the frozen bf16 weights a rank does not hold): "
        f"7B {floor7:.0f} ms, 70B widths × {s['layers']} layers with checkpointing {floor70:.0f} ms.",
        "",
        "## Full-depth 7B (FRoD s=0.02 vs PEFT LoRA r=16, no checkpointing)",
        "",
        "![step times](steps.png)",
        "",
        doc["matrix_table_md"].strip(),
        "",
        f"## 70B widths, {s['layers']} layers, bf16 U_i, `zero3.json`, checkpointing, 4×256 tokens per GPU",
        "",
        f"The training run (`launch/train.py`, {s['steps']} steps) was killed after step 18 and resumed from its "
        f"step-{s['resumed_from']} checkpoint; losses of steps {s['compared_steps'][0]}–{s['compared_steps'][-1]} "
        "against the killed run's are in the goals above. LoRA r=16 runs under the same `zero3.json`: the "
        "like-for-like baseline, not LoRA's best setting (a bf16 70B LoRA needs ZeRO-3 or FSDP on 2 GPUs; QLoRA "
        "under ZeRO-2 is below).",
        "",
        "![resume](70b_bf16_40_layers/seventy_b_resume_losses.png)",
        "",
        doc["seventy_b_table_md"].strip(),
        "",
        *_nf4_lines(doc),
        "## Planner",
        "",
        "| run | GPUs | measured peak GiB | planner GiB | error |",
        "|---|---|---|---|---|",
    ]
    for c in doc["planner"]:
        lines.append(
            f"| {c['file']}: {c['config']} | {c['gpus']} | {c['measured_gib']:.1f} | {c['predicted_gib']:.1f} "
            f"| {c['error'] * 100:+.1f}% |"
        )
    return "\n".join(lines) + "\n"


def _nf4_lines(doc: dict) -> list[str]:
    n = doc["seventy_b_nf4"]
    lines = [
        "## LLaMA-2-70B, 80 layers, NF4: FRoD vs QLoRA r=16 under `zero2.json`",
        "",
        "Both methods in `bench/train_step.py` on 2 GPUs, gradient checkpointing, 4×256 tokens per GPU: FRoD s=0.02 "
        "with NF4 U_i and the NF4 base (`quantize_base`), QLoRA r=16 on the same synthetic weights (NF4 base, "
        "bitsandbytes). `bash bench/run_two_gpu.sh 70b-nf4-a` (generate + HJD, 80 layers) then `pair` (both "
        "steps in one call). QLoRA under ZeRO-2 is QLoRA's usual multi-GPU setting (its base is replicated).",
        "",
        "| timing | FRoD step ms | QLoRA step ms | FRoD ÷ QLoRA | FLOPs per token FRoD ÷ QLoRA | FRoD peak GiB "
        "| QLoRA peak GiB | `zero2.json` overflow check |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for part, label in (
        ("same_call", "one call (the compared pair)"),
        ("separate_calls", "two consecutive calls (context)"),
    ):
        r = n[part]
        lines.append(
            f"| {label} | {r['frod_ms']:.0f} | {r['qlora_ms']:.0f} | {r['ratio']:.2f}× | {r['flops_ratio']:.2f}× "
            f"| {r['frod_peak_gib']:.1f} | {r['qlora_peak_gib']:.1f} | {r['zero2_overflow_check']} |"
        )
    return lines + [""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root", type=Path, help="the folder bench/run_two_gpu.sh's results were unpacked into")
    args = ap.parse_args()
    doc = collect(args.root)
    plot(doc, load_results(args.root / "matrix"), args.root / "steps.png")
    (args.root / "report.json").write_text(json.dumps(doc, indent=1) + "\n")
    (args.root / "report.md").write_text(render(doc))
    print(render(doc))


if __name__ == "__main__":
    main()
