"""Does frod-ds' FRoD learn like FRoD? Generated tasks a small real model learns, every method (issue #43).

    python -m studies.learn_study gen --work W                                  # tasks from their seed (seconds)
    python -m studies.learn_study run --model M --work W --out OUT              # as much as --max-minutes allows
    python -m studies.learn_study run --model M --work W --out OUT2 --resume-from OUT   # goes on from a copy
    python -m studies.learn_study report --out OUT                              # learn_study.json, report.md, plots
    python -m studies.learn_study merge --into RES CALL/gpu0.tgz CALL/gpu1.tgz  # a call's results, then report
    python -m studies.learn_study plan                                          # units, GPU seconds, calls

Tasks (``studies/tasks.py``), methods and units (``studies/learn.py``), the plan and the GPU calls
(docs/learn-study.md; one call is ``bash studies/device_call.sh``). User mistakes: one ``error:`` line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from frod_ds.runtime.atomic import atomic_write_text
from studies.config import MAIN_METHODS, RATIO_METHODS, StudyError, parse_lrs
from studies.learn_report import summary_complete
from studies.records import StudyDir

DEFAULT_TASKS = "arith_d12,facts64,facts256,facts1024"  # arith failed the pilot gate (docs/learn-study.md)
ALL_TASKS = (
    "arith,arith_d12,arith_d12x2,facts64,facts256,facts1024,facts4096"  # gen: the plan's tasks and its fallbacks
)
RECORDS = "records.tgz"  # a results folder's study directories, packed (the folder travels to every GPU call)


def gen(args) -> None:
    from studies.tasks import ArithSpec, FactsSpec, TaskError, parse_task, write_task

    root = Path(args.work) / "tasks"
    for name in args.tasks.split(","):
        try:
            spec = parse_task(name.strip(), args.task_seed)
        except TaskError as e:
            raise StudyError(str(e)) from None
        if isinstance(spec, ArithSpec):
            spec = replace(spec, validation=args.validation_rows, test=args.test_rows)
            if args.arith_train:
                spec = replace(spec, train=args.arith_train)
            if args.digits:
                lo, hi = (int(x) for x in args.digits.split("-"))
                spec = replace(spec, digits=(lo, hi), long_digits=(hi + 1, hi + 1))
        elif isinstance(spec, FactsSpec):
            spec = replace(spec, validation=args.validation_rows, test=args.test_rows)
        try:
            meta = write_task(spec, root)
        except TaskError as e:
            raise StudyError(str(e)) from None
        print(f"{spec.name}: " + ", ".join(f"{k} {v['rows']}" for k, v in meta["files"].items()))


def run(args, argv: list[str], started: float) -> None:
    from studies.learn import LearnConfig, run_learn

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    missing = [t for t in tasks if not (Path(args.work) / "tasks" / t / "train.jsonl").is_file()]
    if missing:
        raise StudyError(f"no generated task {missing[0]} in {args.work}/tasks; run `gen --work {args.work}` first")
    for name, value, ok in (
        ("--steps", args.steps, args.steps >= 1),
        ("--seeds", args.seeds, args.seeds >= 1),
        ("--timing-steps", args.timing_steps, args.timing_steps >= 0),
        ("--timing-warmup", args.timing_warmup, args.timing_warmup >= 1),
        ("--val-points", args.val_points, args.val_points >= 0),
    ):
        if not ok:
            raise StudyError(f"{name} {value} is out of range")
    cfg = LearnConfig(
        model=args.model,
        work=args.work,
        out=args.out,
        tasks=tasks,
        methods=args.methods.split(","),
        ratio_methods=[m for m in args.ratio_methods.split(",") if m],
        cross_check=not args.no_cross_check,
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
        val_points=args.val_points,
        timing_steps=args.timing_steps,
        timing_warmup=args.timing_warmup,
        pack=args.pack,
    )
    run_learn(cfg, argv, started)


def _write_report(records: Path, into: Path) -> None:
    """``learn_study.json``, ``report.md`` and the plots in ``into``, from the study directories in ``records``."""
    from studies.learn_report import collect, render

    doc = collect(records)
    if not doc["tasks"]:
        raise StudyError(f"no study results under {records}/<task>/seed<k>/; run `run` first")
    (into / "learn_study.json").write_text(json.dumps(doc, indent=1) + "\n")
    for p in render(doc, into):
        print(f"wrote {p}")


def _unpack(tarball: Path, into: Path) -> None:
    import tarfile

    with tarfile.open(tarball, "r:gz") as tar:
        tar.extractall(into, filter="data")


def _summaries(records: Path) -> dict[Path, dict]:
    return {p.relative_to(records): json.loads(p.read_text()) for p in records.glob("*/seed*/real_study.json")}


def _warned_method(warning: str) -> str | None:
    """The method a runner warning is about (``SWEEP INCOMPLETE: lora16 has ...``), or None."""
    head, _, rest = warning.partition(": ")
    return rest.split()[0] if head.isupper() and rest else None


def combine_summaries(old: dict, new: dict) -> dict:
    """One seed's summary from two calls' (two GPUs on one task, each training some methods): per method, the
    entry that lists more of its runs, else the one of the call that swept it (a call lists the other methods'
    resumed runs without their grid), else the later; the invocations of both; complete when every method either
    call asked for is chosen for good and tested in the result (and the base evaluated where either asked)."""
    methods = dict(new["methods"])
    taken = set()

    def rank(entry: dict) -> tuple:  # more runs; then the call that swept the method (its grid); then tested
        return len({r["lr"] for r in entry["sweep"]}), bool(entry.get("grid")), "test" in entry

    for m, entry in old["methods"].items():
        if m not in methods or rank(entry) > rank(methods[m]):
            methods[m] = entry
            taken.add(m)
    seen = {json.dumps(i, sort_keys=True) for i in new["invocations"]}
    extra = [i for i in old["invocations"] if json.dumps(i, sort_keys=True) not in seen]
    warnings = [w for w in new.get("warnings", []) if _warned_method(w) not in taken]
    warnings += [w for w in old.get("warnings", []) if _warned_method(w) in taken]
    out = {
        **new,
        "methods": methods,
        "invocations": sorted(extra + new["invocations"], key=lambda i: i.get("date", "")),
        "warnings": warnings,
    }
    if "base" not in out and "base" in old:
        out["base"] = old["base"]
    asked = {m for d in (old, new) for m in d.get("config", {}).get("methods", [])}
    needs_base = any(d.get("config", {}).get("base_eval", False) for d in (old, new))
    out["complete"] = summary_complete(out, asked, needs_base)
    return out


def _unsummarised(records: Path) -> list[str]:
    """A note per seed directory whose run records its ``real_study.json`` does not list: two calls worked on one
    task, and the later one's summary is reported. Every record is kept; the next ``run`` of the task (resuming
    from these records) summarises them all."""
    notes = []
    for doc_path in sorted(records.glob("*/seed*/real_study.json")):
        doc = json.loads(doc_path.read_text())
        listed = {(m, r["lr"]) for m, d in doc["methods"].items() for r in d["sweep"]}
        kept = {(r.method, r.lr) for r in StudyDir(doc_path.parent).runs()}
        extra = sorted(f"{m} lr={lr:g}" for m, lr in kept - listed)
        if extra:
            where = doc_path.parent.relative_to(records)
            notes.append(
                f"note: {where} keeps {len(extra)} run(s) its summary does not list ({', '.join(extra)}): another "
                "call's; the report leaves them out until the next `run` of that task takes them in"
            )
    return notes


def report(args) -> None:
    """From the study directories in OUT, or (a results folder) from its records.tgz."""
    out = Path(args.out)
    if (out / RECORDS).is_file() and not any(out.glob("*/seed*")):
        with tempfile.TemporaryDirectory() as tmp:
            _unpack(out / RECORDS, Path(tmp))
            _write_report(Path(tmp), out)
    else:
        _write_report(out, out)


def merge(args) -> None:
    """A results folder's records.tgz (if any) with the carried-back tarballs (``run --pack``) over it, packed
    again; then the report there. A task's directories come whole from the call that last worked on it."""
    from studies.learn import pack

    into = Path(args.into)
    into.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        records = Path(tmp)
        if (into / RECORDS).is_file():
            _unpack(into / RECORDS, records)
        for name in args.tarballs:
            before = _summaries(records)
            _unpack(Path(name), records)
            for rel, doc in _summaries(records).items():
                if rel in before and doc != before[rel]:
                    both = combine_summaries(before[rel], doc)
                    atomic_write_text(records / rel, json.dumps(both, indent=1, allow_nan=True) + "\n")
                    print(f"combined {rel.parent}: the summaries of two calls, per method the one with more runs")
            print(f"unpacked {name}")
        for line in _unsummarised(records):
            print(line)
        pack(records, into / RECORDS)
        print(f"wrote {into / RECORDS}")
        _write_report(records, into)


def check(args) -> int:
    """Every method briefly on the device (build, steps, evaluations, merge, test protocols); 1 if any fails."""
    from studies.learn import Learn, LearnConfig
    from studies.timing import check_methods

    methods = args.methods.split(",")
    cfg = LearnConfig(args.model, args.work, args.out, [args.task], device=args.device, batch_size=args.batch_size)
    learn = Learn(cfg, [], time.time())
    lrs = {m: v[len(v) // 2] for m, v in parse_lrs([], methods).items()}  # each grid's middle
    study = learn.config(args.task, 0, methods, {m: (lr,) for m, lr in lrs.items()}, 0)
    got = check_methods(study, lrs, learn.device)
    bad = {m: e for m, e in got.items() if e != "ok"}
    print(f"check: {len(got) - len(bad)} of {len(got)} methods ok" + (f"; FAILED: {bad}" if bad else ""))
    return 1 if bad else 0


def plan(args) -> None:
    """The ordered units, their estimated seconds and the calls they make (Markdown, and JSON with --json-out)."""
    from studies.learn_plan import Costs, calls, from_results, units
    from studies.tasks import task_steps

    costs = Costs(workers=args.workers)
    if args.measured and (Path(args.measured) / RECORDS).is_file():
        with tempfile.TemporaryDirectory() as tmp:
            _unpack(Path(args.measured) / RECORDS, Path(tmp))
            costs = from_results(Path(tmp), costs)
    elif args.measured and Path(args.measured).is_dir():
        costs = from_results(Path(args.measured), costs)
    methods = len(args.methods.split(","))
    per_gpu = [
        [u for t in spec.split(",") if t for u in units(t, task_steps(t, args.steps), methods, args.seeds, costs)]
        for spec in args.gpu
    ]
    grouped = calls(per_gpu, args.work_seconds)
    lines = [
        f"Costs: {json.dumps(costs.__dict__)}; {args.work_seconds:.0f} s of work per GPU and call.\n",
        "| GPU | task | unit | runs | est. s |",
        "|---|---|---|---|---|",
    ]
    for g, us in enumerate(per_gpu):
        lines += [f"| {g} | {u['task']} | {u['unit']} | {u['runs']:g} | {u['seconds']:.0f} |" for u in us]
        lines.append(f"| {g} | **total** | | | **{sum(u['seconds'] for u in us):.0f}** |")
    lines += ["", "| call | " + " | ".join(f"GPU {g}" for g in range(len(per_gpu))) + " |"]
    lines.append("|---|" + "---|" * len(per_gpu))
    lines += [f"| {i + 1} | " + " | ".join(", ".join(c) or "—" for c in call) + " |" for i, call in enumerate(grouped)]
    print("\n".join(lines))
    if args.json_out:
        doc = {"costs": costs.__dict__, "units": per_gpu, "calls": grouped, "work_seconds": args.work_seconds}
        Path(args.json_out).write_text(json.dumps(doc, indent=1) + "\n")


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("gen", help="write the generated tasks under WORK/tasks")
    g.add_argument("--work", required=True, help="working directory (the tasks go to WORK/tasks/<task>/)")
    g.add_argument("--tasks", default=ALL_TASKS, help="comma list of arith, arith_d<lo><hi> and facts<N>")
    g.add_argument("--task-seed", type=int, default=0, help="seed of the generated rows")
    g.add_argument("--arith-train", type=int, default=0, help="arith training rows (0: the task's default)")
    g.add_argument("--digits", default="", help="arith operand lengths trained, LO-HI (the longer split: HI+1)")
    g.add_argument(
        "--validation-rows",
        type=int,
        default=256,
        help="LR-selection rows per task (facts: at most half the unasked questions)",
    )
    g.add_argument("--test-rows", type=int, default=256, help="rows per test split")
    r = sub.add_parser("run", help="train and score what is not recorded yet, within --max-minutes")
    r.add_argument("--model", required=True, help="HF checkpoint directory with its tokenizer")
    r.add_argument("--work", required=True, help="the directory `gen` wrote to")
    r.add_argument("--out", required=True, help="results: OUT/<task>/seed<k>/, OUT/<task>/timing.json")
    r.add_argument("--resume-from", help="an earlier --out (e.g. carried back) whose records are copied in first")
    r.add_argument("--tasks", default=DEFAULT_TASKS, help="comma list, worked through in this order")
    r.add_argument("--methods", default=",".join(MAIN_METHODS), help="methods with LR sweeps")
    r.add_argument(
        "--ratio-methods",
        default=",".join(RATIO_METHODS),
        help="FRoD S-rate variants run at frod's chosen σ LR (--ratio-methods= for none)",
    )
    r.add_argument("--no-cross-check", action="store_true", help="no peftfrod_inj run (the cross-check)")
    r.add_argument("--lrs", action="append", default=[], metavar="METHOD=LR,LR,LR", help="a method's LR grid")
    r.add_argument("--steps", type=int, default=160, help="optimizer steps of every run of a task")
    r.add_argument("--batch-size", type=int, default=128, help="rows per step")
    r.add_argument("--seeds", type=int, default=3, help="seeds of every chosen setting (seed 0 is the sweep's)")
    r.add_argument("--extend", type=int, default=2, help="LRs a sweep may add past the end it chose")
    r.add_argument("--max-minutes", type=float, default=8.5, help="this command's time, from its start")
    r.add_argument("--eval-reserve-minutes", type=float, default=1.5, help="kept for the test evaluations")
    r.add_argument("--min-study-minutes", type=float, default=2.0, help="no unit starts with less left")
    r.add_argument("--workers", type=int, default=0, help="runs sharing the device (0: 3 on CUDA, 1 on CPU)")
    r.add_argument("--checkpoints", type=int, default=4, help="full evaluations (and tan α) per run")
    r.add_argument("--val-points", type=int, default=16, help="validation losses per run (0: the checkpoints')")
    r.add_argument("--timing-steps", type=int, default=30, help="timed steps per method alone (0: no timing)")
    r.add_argument("--timing-warmup", type=int, default=5, help="untimed steps before them")
    r.add_argument("--pack", help="rewrite this .tgz of OUT after every unit (what a GPU call carries back)")
    r.add_argument("--device", default="auto", help="auto, cuda or cpu")
    o = sub.add_parser("report", help="learn_study.json, report.md and loss plots from OUT")
    o.add_argument("--out", required=True, help="the run's --out (or a carried-back copy)")
    m = sub.add_parser("merge", help="a call's `run --pack` tarballs into a results folder's records.tgz; report")
    m.add_argument("--into", required=True, help="the results folder (e.g. studies/results/learn_study)")
    m.add_argument("tarballs", nargs="+", help="the .tgz files a call brought back")
    c = sub.add_parser("check", help="every method briefly on the device; exit 1 if any fails")
    c.add_argument("--model", required=True, help="HF checkpoint directory with its tokenizer")
    c.add_argument("--work", required=True, help="the directory `gen` wrote to")
    c.add_argument("--out", required=True, help="a scratch directory (nothing is recorded)")
    c.add_argument("--task", default="facts64", help="the task whose rows it uses")
    c.add_argument("--batch-size", type=int, default=128, help="rows per step")
    c.add_argument(
        "--methods",
        default=",".join([*MAIN_METHODS, *RATIO_METHODS, "peftfrod_inj"]),
        help="methods to check",
    )
    c.add_argument("--device", default="auto", help="auto, cuda or cpu")
    e = sub.add_parser("plan", help="the units, their estimated GPU seconds and the calls they make")
    e.add_argument("--gpu", action="append", default=[], help="one GPU's tasks in order (repeat per GPU)")
    e.add_argument("--methods", default=",".join(MAIN_METHODS), help="as for run")
    e.add_argument("--steps", type=int, default=160, help="as for run")
    e.add_argument("--seeds", type=int, default=3, help="as for run")
    e.add_argument("--workers", type=int, default=6, help="runs sharing one GPU")
    e.add_argument("--work-seconds", type=float, default=500, help="seconds of work per GPU and call")
    e.add_argument("--measured", help="a results folder whose recorded runs replace the estimated costs")
    e.add_argument("--json-out", help="also write the plan to this JSON file")
    a = p.parse_args(argv)
    if a.cmd == "plan" and not a.gpu:
        a.gpu = ["arith,facts64", "facts256,facts1024"]
    return a


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
        elif args.cmd == "merge":
            merge(args)
        elif args.cmd == "check":
            return check(args)
        else:
            plan(args)
    except StudyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
