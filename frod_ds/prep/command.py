"""``frod data``: build Commonsense170K, inspect a build, show rendered examples (docs/data.md).

Errors print ``error: <one line>`` to stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from frod_ds.formats.file_digests import format_problem
from frod_ds.formats.folders import wrong_folder
from frod_ds.prep import llm_adapters, sources, tokens
from frod_ds.prep import rows as prep_rows
from frod_ds.prep.build_records import FORMAT, BuildOptions
from frod_ds.prep.dataset import DEFAULT_CUTOFF, KIND, build, resolved_template, template_problems
from frod_ds.prep.tasks import (
    DEFAULT_WINOGRANDE_SIZE,
    LLM_ADAPTERS_ROWS,
    TASKS,
    WINOGRANDE_SIZES,
    DataPrepError,
    parse_tasks,
)
from frod_ds.prep.templates import RowError, render, row_id
from frod_ds.runtime.cli_parser import Parser, input_dir, input_path, output_dir, seed_int
from frod_ds.runtime.paths import dir_problem
from frod_ds.runtime.strict_json import loads

EXAMPLES = """examples:
  frod data build --source hub --out data/cs170k
  frod data build --source llm-adapters:LLM-Adapters/dataset --out data/la --tasks boolq,obqa,arc_easy,arc_challenge
  frod data build --source llm-adapters:ft-training_set/commonsense_170k.json --out data/la170k \\
      --template llm-adapters
  frod data build --source /data/mirror --out data/cs170k --tasks boolq,piqa --strict
  frod data build --source hub --out data/cs170k --tokenizer meta-llama/Llama-2-7b-hf --cutoff 256
  frod data stats --out data/cs170k [--tokenizer DIR]
  frod data show --source /data/mirror --task piqa -n 3
  frod data show --out data/cs170k --task arc_easy --split eval --repr
"""


def _add_source_flags(parser: argparse.ArgumentParser, required: bool) -> None:
    parser.add_argument(
        "--source",
        required=required,
        type=input_path,
        metavar="hub|DIR|llm-adapters:PATH",
        help="'hub' to load each task from the Hugging Face Hub with datasets, a local mirror "
        "directory with one subdirectory per task key holding train/validation/test split files, or "
        "llm-adapters:PATH with PATH LLM-Adapters' commonsense_170k.json (training rows only) or a folder of "
        "<task>/{train,test}.json in LLM-Adapters' layout (boolq, piqa, social_i_qa, hellaswag, winogrande, "
        "ARC-Easy, ARC-Challenge, openbookqa)",
    )
    parser.add_argument(
        "--template",
        choices=llm_adapters.TEMPLATES,
        help="prompt template: 'paper' (the FRoD paper's, answer after '\\nAnswer: ') or 'llm-adapters' "
        "(LLM-Adapters' training/scoring prompts and 'the correct answer is ...' answers, character for "
        "character; needs an llm-adapters source). Default: llm-adapters for an llm-adapters source, else paper",
    )
    parser.add_argument(
        "--winogrande-size",
        choices=WINOGRANDE_SIZES,
        default=DEFAULT_WINOGRANDE_SIZE,
        help="WinoGrande training set size, i.e. the Hub config winogrande_<size> "
        f"(default: {DEFAULT_WINOGRANDE_SIZE}, the paper's winogrande_l)",
    )


def _add_tokenizer_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tokenizer", metavar="ID|DIR", help="Hugging Face tokenizer id or directory to measure token lengths with"
    )
    parser.add_argument(
        "--cutoff",
        type=int,
        metavar="N",
        help=f"report rows whose training text is longer than N tokens (needs --tokenizer; default {DEFAULT_CUTOFF})",
    )


def make_parser() -> argparse.ArgumentParser:
    """The argparse tree: build, stats, show."""
    parser = Parser(
        allow_abbrev=False,
        prog="frod data",
        description="Commonsense170K in the paper's or LLM-Adapters' prompt templates.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{build,stats,show}")

    p = sub.add_parser("build", allow_abbrev=False, help="render the training mixture and per-task eval files into OUT")
    _add_source_flags(p, required=True)
    p.add_argument(
        "--out", type=output_dir, required=True, help="output directory (must be absent or empty unless --overwrite)"
    )
    p.add_argument("--tasks", default="all", help=f"comma list of tasks or 'all' (default); tasks: {', '.join(TASKS)}")
    p.add_argument("--seed", type=seed_int, default=42, help="seed of the training-mixture shuffle (default: 42)")
    p.add_argument(
        "--strict", action="store_true", help="fail on the first invalid source row instead of dropping and counting it"
    )
    p.add_argument(
        "--overwrite", action="store_true", help="replace an existing non-empty OUT (only once the new build succeeded)"
    )
    p.add_argument(
        "--keep-duplicates",
        action="store_true",
        help="keep training rows that repeat an earlier row of their split verbatim (default: drop and count them; "
        "test rows are always kept as published and counted; --strict refuses both)",
    )
    _add_tokenizer_flags(p)

    p = sub.add_parser(
        "stats", allow_abbrev=False, help="check a built OUT against its manifest and print counts and length stats"
    )
    p.add_argument("--out", type=input_dir, required=True, help="a directory written by 'build'")
    _add_tokenizer_flags(p)

    p = sub.add_parser(
        "show", allow_abbrev=False, help="print N rendered examples of one task, from a source or from a built OUT"
    )
    _add_source_flags(p, required=False)
    p.add_argument("--out", type=input_dir, help="read rendered rows from this built directory instead of a source")
    p.add_argument("--task", required=True, choices=list(TASKS), help="task key")
    p.add_argument(
        "--split",
        choices=("train", "eval"),
        default="train",
        help="training split or the task's eval split (default: train)",
    )
    p.add_argument("-n", type=int, default=3, help="number of examples to print (default: 3)")
    p.add_argument("--repr", action="store_true", help="print Python reprs to make spaces and newlines visible")
    return parser


# --- build ----------------------------------------------------------------------------------


def print_build_report(manifest: dict[str, Any], files: dict[str, str]) -> None:
    """Counts per task and split, drops per reason, the total against LLM-Adapters, sha256s."""
    print(f"{'task':<14} {'role':<5} {'split':<10} {'read':>7} {'kept':>7} {'dropped':>7}")
    for task, roles in manifest["counts"].items():
        for role, c in roles.items():
            print(f"{task:<14} {role:<5} {c['split']:<10} {c['read']:>7} {c['kept']:>7} {c['dropped']:>7}")
    n = manifest["train_rows"]
    print(f"train.jsonl: {n} rows; LLM-Adapters commonsense_170k has {LLM_ADAPTERS_ROWS} ({n - LLM_ADAPTERS_ROWS:+d})")
    for task, roles in manifest["dropped"].items():
        for role, reasons in roles.items():
            for reason, count in reasons.items():
                print(f"dropped: {task} {role}: {reason}: {count}")
    repeated = manifest.get("repeated", {})
    for task, roles in repeated.get("rows", {}).items():
        for role, n in roles.items():
            done = (
                repeated[role]
                if role == "eval" or repeated[role] == "kept"
                else "dropped (--keep-duplicates keeps them)"
            )
            print(f"repeated: {task} {role}: {n} row(s) repeat an earlier row verbatim: {done}")
    for task, n in manifest.get("test_rows_in_training", {}).get("rows", {}).items():
        print(f"test rows in training: {task}: {n} test row(s) appear verbatim in its training rows: kept as published")
    for task, roles in manifest["counts"].items():
        for role, c in roles.items():
            if c.get("not_selected"):
                print(f"not selected: {task} {role}: {c['not_selected']} rows of instruction families outside --tasks")
    if "template" in manifest:
        print(f"template: {manifest['template']}")
        for name, families in manifest["families"].items():
            found = ", ".join(f"{key} {f['read']} read/{f['kept']} kept" for key, f in families.items())
            print(f"families: {name}: {found}")
        for task, note in manifest["notes"].items():
            print(f"note: {task}: {note}")
    report = manifest.get("token_lengths")
    if report:
        print(f"token lengths ({report['tokenizer']}, cutoff {report['cutoff']}):")
        for task, roles in report["per_task"].items():
            for role, s in roles.items():
                print(
                    f"  {task:<14} {role:<5} max {s['max']:>5}  p95 {s['p95']:>5}  "
                    f"over cutoff {s['over_cutoff']:>6} of {s['rows']}"
                )
    for name, digest in files.items():
        print(f"sha256 {digest}  {name}")


def cmd_build(args: argparse.Namespace) -> None:
    """`build`: render the selected tasks into OUT and print the report."""
    options = BuildOptions(
        source=args.source,
        out=args.out,
        tasks=tuple(parse_tasks(args.tasks)),
        winogrande_size=args.winogrande_size,
        seed=args.seed,
        strict=args.strict,
        tokenizer=args.tokenizer,
        cutoff=args.cutoff,
        overwrite=args.overwrite,
        template=args.template,
        keep_duplicates=args.keep_duplicates,
    )
    manifest, files = build(options)
    print_build_report(manifest, files)
    print(f"wrote {args.out}")


# --- stats ----------------------------------------------------------------------------------


def load_built(out: Path) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """The manifest and rows of each file of a built OUT, after checking every sha256."""
    path = out / "manifest.json"
    missing = dir_problem(out)
    if missing:  # a build writes aside and publishes whole: a killed one leaves no --out
        raise DataPrepError(f"{missing}; pass the --out of a finished frod data build")
    problem = wrong_folder(out, "--out", (KIND,), "a frod data build")
    if problem:
        raise DataPrepError(problem)
    if not path.is_file():
        what = "its manifest.json is not a file" if path.exists() else "no manifest.json"
        raise DataPrepError(f"{out} is not a frod data build ({what}); build it with frod data build")
    try:
        manifest = loads(path.read_text(encoding="utf-8"))
        recorded = manifest["files"]
    except (ValueError, KeyError, TypeError) as exc:
        raise DataPrepError(f"{path} is not a valid manifest ({type(exc).__name__}: {exc})") from None
    problem = format_problem(manifest, path, FORMAT)
    if problem:
        raise DataPrepError(f"{problem}; build the data again with frod data build")
    if not isinstance(recorded, dict) or not all(isinstance(v, str) for v in recorded.values()):
        raise DataPrepError(
            f"{path}: files is a JSON {type(recorded).__name__}, not an object of file names to sha256s; build the "
            "data again with frod data build"
        )
    for key in ("source", "counts"):
        if manifest.get(key) is not None and not isinstance(manifest[key], dict):
            raise DataPrepError(
                f"{path}: {key} is a JSON {type(manifest[key]).__name__}, not an object; build the data again with "
                "frod data build"
            )
    rows = {}
    for name, digest in recorded.items():
        file = out / name
        if not file.is_file():
            raise DataPrepError(f"{file} is listed in the manifest but missing")
        if prep_rows.sha256_file(file) != digest:
            raise DataPrepError(f"{file} does not match its sha256 in the manifest; rebuild it")
        rows[name] = prep_rows.read_rows(file)
    return manifest, rows


def cmd_stats(args: argparse.Namespace) -> None:
    """`stats`: verify a build against its manifest; print rows and lengths per file and task."""
    if args.cutoff is not None and args.cutoff < 1:  # as build refuses it
        raise DataPrepError(f"--cutoff must be positive, got {args.cutoff}")
    manifest, files = load_built(args.out)
    tokenizer = tokens.load_tokenizer(args.tokenizer) if args.tokenizer else None
    if args.cutoff is not None and tokenizer is None:
        raise DataPrepError("--cutoff needs --tokenizer")
    cutoff = args.cutoff or DEFAULT_CUTOFF
    print(
        f"{args.out}: seed {manifest.get('seed')}, source {(manifest.get('source') or {}).get('kind')}, all sha256s "
        "match"
    )
    header = f"{'file':<26} {'task':<14} {'rows':>7} {'prompt chars mean/max':>22}"
    print(header + (f" {'tokens mean/p95/max':>20} {'>' + str(cutoff):>7}" if tokenizer is not None else ""))
    for name, rows in files.items():
        by_task: dict[str, list[dict[str, Any]]] = {}
        for row in rows:
            by_task.setdefault(row["task"], []).append(row)
        for task, task_rows in by_task.items():
            chars = [len(row["prompt"]) for row in task_rows]
            line = f"{name:<26} {task:<14} {len(task_rows):>7} {sum(chars) / len(chars):>14.0f} / {max(chars):>5}"
            if tokenizer is not None:
                texts = [prep_rows.training_text(row) for row in task_rows]
                s = tokens.summarize(tokens.token_lengths(tokenizer, texts, desc=f"tokenizing {task}"), cutoff)
                line += f" {s['mean']:>8.0f}/{s['p95']:>5}/{s['max']:>5} {s['over_cutoff']:>7}"
            print(line)
    print(f"train rows: {len(files.get('train.jsonl', []))} (LLM-Adapters commonsense_170k: {LLM_ADAPTERS_ROWS})")


# --- show -----------------------------------------------------------------------------------


def examples_from_source(source: str, task: str, role: str, winogrande_size: str, n: int) -> list[dict[str, Any]]:
    """The first `n` valid rendered rows of one split of `task`, read from `source`."""
    split = "train" if role == "train" else TASKS[task].eval_split
    if source != sources.HUB:
        sources.check_local_tasks(Path(source), [task])
    data = sources.load_split(source, task, split, winogrande_size)
    shown: list[dict[str, Any]] = []
    skipped: Counter[str] = Counter()
    for index, raw in enumerate(data.rows):
        if len(shown) == n:
            break
        try:
            ex = render(task, raw)
            shown.append(
                {
                    "task": task,
                    "id": row_id(task, split, index, raw),
                    "prompt": ex.prompt,
                    "answer": ex.answer,
                    "choices": list(ex.choices),
                    "label": ex.label,
                }
            )
        except RowError as err:
            skipped[err.reason] += 1
    for reason, count in skipped.items():
        print(f"(skipped {count} invalid row(s): {reason})", file=sys.stderr)
    return shown


def examples_from_llm_adapters(source: str, task: str, role: str, template: str | None, n: int) -> list[dict[str, Any]]:
    """The first `n` valid rendered rows of `task` from an ``llm-adapters:PATH`` source.

    From a combined file the rows shown are those of `task`'s instruction family, whose ``task`` is
    ``"siqa|obqa|arc_easy|arc_challenge"`` where the family does not tell the task.
    """
    path = sources.llm_adapters_path(source)
    family = llm_adapters.FAMILY_OF_TASK[task]
    options = BuildOptions(
        source=source, out=Path(), tasks=family.tasks if path.is_file() else (task,), template=template
    )
    problems = template_problems(options)
    if problems:
        raise DataPrepError("; ".join(problems))
    sources.check_llm_adapters_source(path, [task])
    if path.is_file():
        if role != "train":
            raise DataPrepError(
                f"{path.name} holds training rows only; show --split eval needs a folder of <task>/test.json"
            )
        data = sources.load_llm_adapters_file(path, path)
        conv = llm_adapters.convert(
            data.rows,
            task=None,
            role=role,
            template=resolved_template(options),
            origin=data.origin,
            strict=False,
            selected=frozenset(family.tasks),
            id_prefix=path.stem,
        )
    else:
        data = sources.load_llm_adapters_split(path, task, role)
        conv = llm_adapters.convert(
            data.rows,
            task=task,
            role=role,
            template=resolved_template(options),
            origin=data.origin,
            strict=False,
            split=sources.LLM_ADAPTERS_SPLITS[role],
        )
    for reason, count in conv.dropped.items():
        print(f"(skipped {count} invalid row(s): {reason})", file=sys.stderr)
    return conv.rows[:n]


def examples_from_build(out: Path, task: str, role: str, n: int) -> list[dict[str, Any]]:
    """The first `n` rows of `task` in a built OUT (mixture order for train)."""
    path = out / "train.jsonl" if role == "train" else out / "eval" / f"{task}.jsonl"
    if not path.is_file():
        raise DataPrepError(f"{path} not found; is {out} a frod data build that includes {task}?")
    rows = prep_rows.read_rows(path)
    held = sorted({row["task"] for row in rows})
    if task not in held:  # a task left out of the build: say what the build holds
        raise DataPrepError(f"{out} holds no {task} rows (its training mixture: {', '.join(held) or 'empty'})")
    return [row for row in rows if row["task"] == task][:n]


def cmd_show(args: argparse.Namespace) -> None:
    """`show`: print the training text of N rendered rows of one task."""
    if (args.source is None) == (args.out is None):
        raise DataPrepError("show needs exactly one of --source or --out")
    if args.n < 1:
        raise DataPrepError(f"-n must be at least 1, got {args.n}")
    if args.source is not None and sources.llm_adapters_path(args.source) is not None:
        rows = examples_from_llm_adapters(args.source, args.task, args.split, args.template, args.n)
    elif args.source is not None:
        if args.template not in (None, "paper"):
            raise DataPrepError(f"--template {args.template} needs --source llm-adapters:PATH")
        rows = examples_from_source(args.source, args.task, args.split, args.winogrande_size, args.n)
    else:
        rows = examples_from_build(args.out, args.task, args.split, args.n)
    if not rows:  # nothing to show is not a success
        raise DataPrepError(f"no valid {args.task} {args.split} rows in {args.source or args.out}")
    for row in rows:
        print(f"=== {row['task']} {row['id']}  label {row['label']}  choices {row['choices']}")
        text = prep_rows.training_text(row)
        print(repr(text) if args.repr else text)


COMMANDS = {"build": cmd_build, "stats": cmd_stats, "show": cmd_show}


def main(argv: Sequence[str] | None = None) -> int:
    """Parse `argv`, run the command; a user mistake becomes `error: ...` on stderr and status 2."""
    from frod_ds.runtime import entry

    args = make_parser().parse_args(argv)

    def body() -> None:
        COMMANDS[args.command](args)

    # every FrodError (DataPrepError and those of the shared writers in frod_ds.formats.ownership) and a full disk:
    # one `error:` line and exit 2, as for every other command
    return entry.run(body, init_group=False)
