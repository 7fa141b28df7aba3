"""The host's share of a training step, counted: Python function calls per step (``cProfile``'s count over steady
steps) for FRoD under plain PyTorch, ``zero2.json`` and ``zero3.json``, and ZeRO-3 with each of the build's host-side
changes undone. A call count does not depend on the machine's speed or its neighbours, so it separates what the
code asks of the host from how fast a given host is. It is a proxy, not a time: calls differ in cost (on the H200,
undoing ``FixedParameters`` added a quarter more calls and no measurable step time, undoing ``FRoDFrozen`` about as
many and 15%: ``bench/results/zero3_levers``).

    python bench/host_calls.py --work /tmp/hc --out bench/results/host_calls     # CPU or GPU, ~4 min on 2 cores
    python bench/host_calls.py --report bench/results/host_calls                  # the report from the JSONs

The model is the full depth of LLaMA-2-7B (32 decoder layers, FRoD on q/k/v/o/gate/up) at tiny widths (64 / 176,
one sequence of 8 tokens): every per-layer and per-parameter cost of the step is there, the arithmetic is not.
Each configuration is one ``bench/train_step.py run --pyprofile`` process (2 warm-up steps, then 3 profiled ones).
A call writes ``host_calls_<device>_<stamp>.json`` (command, device, date, versions, per configuration its
arguments, calls per step and the profiled step's wall time).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import device_name, read_results, versions  # noqa: E402
from bench.train_matrix import _run, _tail, prepare  # noqa: E402

MODEL = ["--layers", "32", "--hidden", "64", "--inter", "176", "--heads", "4", "--vocab", "256"]
RUN = ["--batch", "1", "--seq", "8", "--warmup", "2", "--steps", "1", "--repeats", "1", "--pyprofile"]
ZERO2, ZERO3 = "ds_configs/zero2.json", "ds_configs/zero3.json"
# At these widths every parameter is below zero3.json's stage3_param_persistence_threshold (2e6), so ZeRO-3 would
# keep all of them gathered and skip the fetch and release of the large ones. 200 makes the same ones persistent as
# at 7B (σ, S per member and the norms; not U, down_proj, the embeddings): ZeRO-3's path is then 7B's.
ZERO3_PERSISTENCE = ["--ds-set=stage3_param_persistence_threshold=200"]
# name -> (what it is, config, extra train_step arguments)
CONFIGS: dict[str, tuple[str, str, list[str]]] = {
    "plain": ("plain PyTorch, AdamW", "plain", []),
    "zero2": ("the shipped zero2.json", ZERO2, []),
    "zero2-per-member": (
        "zero2.json, one σ and one S Parameter per FRoD layer (no FRoDTrainables)",
        ZERO2,
        ["--per-member-trainables"],
    ),
    "zero3": ("the shipped zero3.json and build", ZERO3, [*ZERO3_PERSISTENCE]),
    "zero3-linear-replaced": (
        "zero3.json with memory_efficient_linear true, DeepSpeed's default "
        "(torch.nn.functional.linear replaced by an autograd Function)",
        ZERO3,
        [*ZERO3_PERSISTENCE, "--ds-set=memory_efficient_linear=true"],
    ),
    "zero3-nvtx-on": (
        "zero3.json with DeepSpeed's NVTX ranges on, its default (frod_ds turns them off unless FROD_DS_NVTX=1)",
        ZERO3,
        [*ZERO3_PERSISTENCE, "--nvtx"],
    ),
    "zero3-walk-parameters": (
        "zero3.json, DeepSpeed walking the modules for their parameters at every fetch and "
        "release (no FixedParameters)",
        ZERO3,
        [*ZERO3_PERSISTENCE, "--walk-parameters"],
    ),
    "zero3-per-member-u": (
        "zero3.json, one frozen U Parameter per FRoD layer (no FRoDFrozen)",
        ZERO3,
        [*ZERO3_PERSISTENCE, "--per-member-frozen"],
    ),
    "zero3-per-member": (
        "zero3.json, one σ and one S Parameter per FRoD layer (no FRoDTrainables)",
        ZERO3,
        [*ZERO3_PERSISTENCE, "--per-member-trainables"],
    ),
    "zero3-per-module-fetch": (
        "zero3.json, DeepSpeed's fetch hooks on every submodule (no fetch_per_layer)",
        ZERO3,
        [*ZERO3_PERSISTENCE, "--per-module-fetch"],
    ),
}


def measure(args) -> Path:
    work, out = Path(args.work), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logs = work / "logs"
    model, factors = prepare(argparse.Namespace(work=work, tiny=False), work, {}, model_args=MODEL)
    rows = []
    for name in args.only.split(",") if args.only else CONFIGS:
        what, config, extra = CONFIGS[name]
        res_dir = work / "runs"
        cmd = [
            sys.executable,
            "bench/train_step.py",
            "run",
            "--method",
            "frod",
            "--model",
            str(model),
            "--factors",
            str(factors),
            "--config",
            config,
            *RUN,
            *extra,
            "--out",
            str(res_dir),
            "--name",
            name,
        ]
        rc, seconds = _run(cmd, logs / f"{name}.log", 900)
        if rc != 0:
            raise SystemExit(f"error: {name} failed (exit {rc}):\n{_tail(logs / f'{name}.log')}")
        res = json.loads((res_dir / f"{name}.json").read_text())
        prof = res["python_profile"]
        rows.append(
            {
                "name": name,
                "what": what,
                "config": config,
                "args": extra,
                "python_calls_per_step": prof["python_calls_per_step"],
                "trainable_tensors": res["trainable_tensors"],
                "profiled_wall_s_per_step": prof["wall_s_per_step"],
                "run_s": seconds,
            }
        )
        print(f"{name}: {prof['python_calls_per_step']:,.0f} Python calls per step", flush=True)
    device = device_name()
    stamp = _dt.datetime.now(_dt.UTC)
    doc = {
        "benchmark": "host_calls",
        "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "device": device,
        "date": stamp.isoformat(timespec="seconds"),
        "versions": versions(),
        "model": MODEL,
        "run": RUN,
        "runs": rows,
    }
    tag = "cpu" if device.startswith("cpu") else device.split()[-1].lower()
    path = out / f"host_calls_{tag}_{stamp:%Y%m%dT%H%M%S}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def report(directory: Path) -> Path:
    docs = read_results(directory, "host_calls_*.json", f": run bench/host_calls.py --out {directory} first")
    lines = [
        "# Host work per training step, counted",
        "",
        f"Generated by `python bench/host_calls.py --report {directory.as_posix()}` from the JSON files beside "
        "this report; do not edit by hand. Python function calls per step (`cProfile`'s count over 3 steady "
        "steps) of FRoD on LLaMA-2-7B's depth (32 decoder layers, q/k/v/o/gate/up) at tiny widths, one "
        "sequence of 8 tokens: the host's work, which a machine's speed does not change. Relative to plain "
        "PyTorch's count in the same call. A proxy, not a time: calls differ in cost (step times beside each "
        "ablation are in `bench/results/zero3_levers/zero3_levers.md`). `zero2` is the shipped `zero2.json` of its "
        "call: σ and S per FRoD layer until 2026-11-28, per decoder layer (`FRoDTrainables`) from the call of "
        "2026-11-28T02:39 on, whose `zero2-per-member` row is the layout before. Trainable tensors (σ and S "
        "Parameters at 32 layers: 64 with two per decoder layer, 384 with two per FRoD layer) are recorded by the "
        "calls after that one. ZeRO-3 rows run with `stage3_param_persistence_threshold` 200 from the CPU call of "
        "2026-11-28T03:42 on, so that the same parameters stay gathered as at 7B (σ, S, norms); before, "
        "the JSON's 2e6 kept every parameter of these widths gathered, and the counts missed the fetch and "
        "release of U, down_proj and the embeddings (5% of `zero3`'s calls on the CPU).",
        "",
    ]
    for doc in docs:
        runs = {r["name"]: r for r in doc["runs"]}
        base = runs.get("plain", {}).get("python_calls_per_step")
        lines += [
            f"## Call of {doc['date']} — {doc['device']} (`{doc['command']}`)",
            "",
            "| configuration | what | trainable tensors | Python calls per step | ÷ plain |",
            "|---|---|---|---|---|",
        ]
        for r in doc["runs"]:
            ratio = f"{r['python_calls_per_step'] / base:.2f}×" if base else "–"
            lines.append(
                f"| {r['name']} | {r['what']} | {r.get('trainable_tensors', '–')} "
                f"| {r['python_calls_per_step']:,.0f} | {ratio} |"
            )
        lines.append("")
    path = directory / "host_calls.md"
    path.write_text("\n".join(lines))
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", help="model, factor store, logs and per-run results (reused when complete)")
    ap.add_argument("--out", help="where the call's JSON goes")
    ap.add_argument("--only", default=None, help="comma-separated configurations (default: all): " + ", ".join(CONFIGS))
    ap.add_argument("--report", default=None, metavar="DIR", help="write DIR/host_calls.md from DIR's JSONs and exit")
    args = ap.parse_args()
    if args.report:
        print(report(Path(args.report)))
        return 0
    if not (args.work and args.out):
        ap.error("--work and --out are needed to measure (or --report DIR)")
    bad = [n for n in (args.only.split(",") if args.only else []) if n not in CONFIGS]
    if bad:
        ap.error(f"unknown configuration(s) {bad}; known: {', '.join(CONFIGS)}")
    print(measure(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
