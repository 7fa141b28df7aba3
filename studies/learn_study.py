"""Does frod-ds' FRoD learn like FRoD? Generated tasks a small real model can learn, every method (issue #26, 2-4).

    python -m studies.learn_study gen --work W                                  # tasks from their seed (seconds)
    python -m studies.learn_study run --model M --work W --out OUT              # as much as --max-minutes allows
    python -m studies.learn_study run --model M --work W --out OUT2 --resume-from OUT   # goes on from a copy
    python -m studies.learn_study report --out OUT                              # learn_study.json, report.md, plots
    python -m studies.learn_study estimate                                      # GPU calls the defaults need

Tasks (``studies/tasks.py``): ``arith`` (a+b, a*b; held out: unseen pairs, longer operands) and ``facts<N>``
(N made-up people × 3 attributes; held out: recall of the stored sentences, questions never trained). Methods
(``studies/learn.py``): frod-ds FRoD (s=0.02, S LR = σ LR / 10), stock PEFT FRoD on frod-ds' factors, PEFT
LoRA r=16 and r=64, full fine-tuning; LR sweeps selected on held-out answer loss and extended past an end; FRoD's
S rate at σ/3 and σ/30 too; ``--seeds`` seeds of every chosen setting. Same batches, steps and tokens for every
method of a task. Each ``run`` command resumes from its ``--out`` (or ``--resume-from``) records.

On one H100 (calls of at most 10 minutes; /tmp lasts only while the machine stays warm; a call carries at most
64 MiB, so the 98 MB GGUF of SmolLM2-135M travels in two parts, split here with `split -b 50m`, see
../shared/notes/REAL_MODEL.md). RES is a folder in the checkout holding the previous call's results (empty at
first); after each call, copy that call's $OUT/ls over RES:

    call 1 (carry gguf wheel + part aa):  pip install --no-deps GGUF_WHEEL; mkdir -p /tmp/m; cp PART_aa /tmp/m/
    call 2 (carry part ab + RES):         cat /tmp/m/PART_aa PART_ab > /tmp/m/smol.gguf  (md5 checked)
        python launch/convert_gguf.py convert --gguf /tmp/m/smol.gguf --out /tmp/smol --dtype float32
        python -m studies.learn_study gen --work /tmp/w
        python -m studies.learn_study run --model /tmp/smol --work /tmp/w --out $OUT/ls --resume-from RES \\
            --max-minutes 8
    calls 3-6: the run line again (with the staging lines of calls 1-2 first whenever the machine went cold)
    here:     python -m studies.learn_study report --out RES      # learn_study.json, report.md, loss_<task>.png

A call's own time counts from its start: `--max-minutes 8` leaves about 1.5 minutes for conversion and start-up
under the 10-minute limit. Defaults: 4 tasks x (5 methods x 3 LRs + extensions + 2 S-rate variants + 2 more seeds)
of 72 steps of 128 rows.
``estimate`` prints the calls the defaults need from studies/results/real_study_1xh100's measured H100 runs.
User mistakes: one ``error:`` line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from studies.config import StudyError

DEFAULT_TASKS = "arith,facts64,facts256,facts1024"
H100_REFERENCE = Path("studies/results/real_study_1xh100/real_study.json")  # relative to the checkout


def gen(args) -> None:
    from studies.tasks import ArithSpec, FactsSpec, TaskError, parse_task, write_task

    root = Path(args.work) / "tasks"
    for name in args.tasks.split(","):
        try:
            spec = parse_task(name.strip(), args.task_seed)
        except TaskError as e:
            raise StudyError(str(e)) from None
        if isinstance(spec, ArithSpec) and args.arith_train:
            lo, hi = (int(x) for x in args.digits.split("-"))
            spec = ArithSpec(
                seed=args.task_seed,
                train=args.arith_train,
                heldout=args.heldout_rows,
                test=args.test_rows,
                digits=(lo, hi),
                long_digits=(hi + 1, hi + 1),
            )
        elif isinstance(spec, FactsSpec):
            spec = FactsSpec(size=spec.size, seed=args.task_seed, heldout=args.heldout_rows, test=args.test_rows)
        meta = write_task(spec, root)
        print(f"{spec.name}: " + ", ".join(f"{k} {v['rows']}" for k, v in meta["files"].items()))


def run(args, argv: list[str], started: float) -> None:
    from studies.learn import LearnConfig, run_learn

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    missing = [t for t in tasks if not (Path(args.work) / "tasks" / t / "train.jsonl").is_file()]
    if missing:
        raise StudyError(f"no generated task {missing[0]} in {args.work}/tasks; run `gen --work {args.work}` first")
    cfg = LearnConfig(
        model=args.model,
        work=args.work,
        out=args.out,
        tasks=tasks,
        methods=args.methods.split(","),
        ratio_methods=[m for m in args.ratio_methods.split(",") if m],
        lrs=args.lrs,
        steps=args.steps,
        batch_size=args.batch_size,
        seeds=args.seeds,
        max_minutes=args.max_minutes,
        eval_reserve_minutes=args.eval_reserve_minutes,
        min_study_minutes=args.min_study_minutes,
        resume_from=args.resume_from,
        extend=args.extend,
        workers=args.workers,
        device=args.device,
        checkpoints=args.checkpoints,
    )
    run_learn(cfg, argv, started)


def report(args) -> None:
    from studies.learn_report import collect, render

    out = Path(args.out)
    doc = collect(out)
    if not doc["tasks"]:
        raise StudyError(f"no study results under {out}/<task>/seed<k>/; run `run` first")
    (out / "learn_study.json").write_text(json.dumps(doc, indent=1) + "\n")
    for p in render(doc, out):
        print(f"wrote {p}")


def estimate(args) -> None:
    """GPU calls for the defaults, from the H100 runs of real_study (same model, 3 workers sharing the GPU)."""
    path = Path(args.reference)
    ref = json.loads((path if path.is_absolute() or path.exists() else Path(__file__).parents[1] / path).read_text())
    runs = [r for m in ref["methods"].values() for r in m["sweep"]]
    step_s = sorted(r["step_ms"] for r in runs)[len(runs) // 2] / 1e3  # median, 3 workers sharing
    extra_s = sorted(r["wall_seconds"] - r["train_seconds"] for r in runs)[len(runs) // 2]  # build + checkpoint evals
    workers = runs[0]["workers"]
    n_main, n_ratio, n_tasks = (
        len(args.methods.split(",")),
        len(args.ratio_methods.split(",")),
        len(args.tasks.split(",")),
    )
    per_task = n_main * (3 + 1) + n_ratio + (args.seeds - 1) * (n_main + n_ratio)  # 3 LRs + about 1 extension
    worker_s = n_tasks * per_task * (args.steps * step_s + extra_s)
    usable_s = 60 * (args.max_minutes - 1.5)  # less the model load, worker start and base evals of each call
    calls = math.ceil(worker_s / workers / usable_s) + 1  # + the call that only stages half of the model
    doc = {
        "reference": str(args.reference),
        "reference_device": ref["device"],
        "median_step_s_with_workers": step_s,
        "median_run_overhead_s": extra_s,
        "workers": workers,
        "runs": n_tasks * per_task,
        "steps_per_run": args.steps,
        "worker_seconds": round(worker_s),
        "calls_of_max_minutes": calls,
        "max_minutes": args.max_minutes,
    }
    text = json.dumps(doc, indent=1)
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("gen", help="write the generated tasks under WORK/tasks")
    g.add_argument("--work", required=True, help="working directory (the tasks go to WORK/tasks/<task>/)")
    g.add_argument("--tasks", default=DEFAULT_TASKS, help="comma list of arith and facts<N>")
    g.add_argument("--task-seed", type=int, default=0, help="seed of the generated rows")
    g.add_argument("--arith-train", type=int, default=0, help="arith training rows (0: the task's default, 8192)")
    g.add_argument("--digits", default="1-3", help="arith operand lengths trained, LO-HI (the longer split: HI+1)")
    g.add_argument(
        "--heldout-rows",
        type=int,
        default=256,
        help="LR-selection rows per task (facts: at most half the unasked questions)",
    )
    g.add_argument("--test-rows", type=int, default=256, help="rows per test split")
    r = sub.add_parser("run", help="train and score what is not recorded yet, within --max-minutes")
    r.add_argument("--model", required=True, help="HF checkpoint directory with its tokenizer")
    r.add_argument("--work", required=True, help="the directory `gen` wrote to")
    r.add_argument("--out", required=True, help="results: OUT/<task>/seed<k>/ study directories")
    r.add_argument("--resume-from", help="an earlier --out (e.g. carried back) whose records are copied in first")
    r.add_argument("--tasks", default=DEFAULT_TASKS, help="comma list, worked through in this order")
    r.add_argument("--methods", default="frod,peftfrod,lora16,lora64,full", help="methods with LR sweeps")
    r.add_argument(
        "--ratio-methods",
        default="frod_ratio3,frod_ratio30",
        help="FRoD S-rate variants run at frod's chosen σ LR ('' for none)",
    )
    r.add_argument("--lrs", action="append", default=[], metavar="METHOD=LR,LR,LR", help="a method's LR grid")
    r.add_argument("--steps", type=int, default=72, help="optimizer steps of every run of a task")
    r.add_argument("--batch-size", type=int, default=128, help="rows per step")
    r.add_argument("--seeds", type=int, default=3, help="seeds of every chosen setting (seed 0 is the sweep's)")
    r.add_argument("--extend", type=int, default=2, help="LRs a sweep may add past the end it chose")
    r.add_argument("--max-minutes", type=float, default=8.5, help="this command's time, from its start")
    r.add_argument("--eval-reserve-minutes", type=float, default=1.5, help="kept for the test evaluations")
    r.add_argument("--min-study-minutes", type=float, default=2.5, help="no task's study starts with less left")
    r.add_argument("--workers", type=int, default=0, help="runs sharing the device (0: 3 on CUDA, 1 on CPU)")
    r.add_argument("--checkpoints", type=int, default=6, help="evaluations (and tan α) per run")
    r.add_argument("--device", default="auto", help="auto, cuda or cpu")
    o = sub.add_parser("report", help="learn_study.json, report.md and loss plots from OUT")
    o.add_argument("--out", required=True, help="the run's --out (or a carried-back copy)")
    e = sub.add_parser("estimate", help="GPU calls the study needs, from measured H100 runs of the same model")
    e.add_argument("--reference", default=str(H100_REFERENCE), help="a real_study.json measured on the GPU")
    e.add_argument("--tasks", default=DEFAULT_TASKS, help="as for run")
    e.add_argument("--methods", default="frod,peftfrod,lora16,lora64,full", help="as for run")
    e.add_argument("--ratio-methods", default="frod_ratio3,frod_ratio30", help="as for run")
    e.add_argument("--steps", type=int, default=72, help="as for run")
    e.add_argument("--seeds", type=int, default=3, help="as for run")
    e.add_argument("--max-minutes", type=float, default=8.5, help="as for run")
    e.add_argument("--json-out", help="also write the estimate to this JSON file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    started = time.time()
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse(argv)
        if args.cmd == "gen":
            gen(args)
        elif args.cmd == "run":
            run(args, [Path(__file__).name, *argv], started)
        elif args.cmd == "report":
            report(args)
        else:
            estimate(args)
    except StudyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
