"""Build Commonsense170K in the paper's or LLM-Adapters' templates: read, render, validate, shuffle, write.

A build is ``OUT/train.jsonl`` (the selected tasks' training splits, rendered and shuffled),
``OUT/eval/<task>.jsonl`` (each task's evaluation split) and ``OUT/manifest.json`` (sources, counts, drops per
reason, seed, sha256s), made in a temporary sibling directory and renamed to OUT at the end: a failed build
leaves nothing in OUT, and the same inputs and seed give byte-identical files (docs/data.md).
"""

from __future__ import annotations

import json
import random
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

from frod_ds.formats.building import building_dir
from frod_ds.formats.lease import holding
from frod_ds.formats.ownership import check_out
from frod_ds.prep import llm_adapters, sources, tokens
from frod_ds.prep import rows as prep_rows
from frod_ds.prep.build_records import BuildOptions, SplitResult, make_manifest
from frod_ds.prep.row_checks import count_repeats, count_test_in_training, drop_rows_training_refuses
from frod_ds.prep.tasks import TASKS, DataPrepError, check_winogrande_size
from frod_ds.prep.templates import RowError, blank_field, render, row_id

KIND = "data-build"  # the ownership record's kind (frod_ds.formats.output_dir): --overwrite replaces only a build
DEFAULT_CUTOFF = 256  # tokens; LLM-Adapters' cutoff_len for Commonsense170K


def log(message: str) -> None:
    """Progress and diagnostics go to stderr; stdout carries the build report."""
    print(message, file=sys.stderr, flush=True)


def validate_options(options: BuildOptions) -> None:
    """Collect every problem with the options into one error."""
    problems = []
    if not options.tasks:
        problems.append("no tasks selected")
    problems += [f"unknown task {t!r}" for t in options.tasks if t not in TASKS]
    try:
        check_winogrande_size(options.winogrande_size)
    except DataPrepError as exc:
        problems.append(str(exc))
    if options.cutoff is not None and options.tokenizer is None:
        problems.append("--cutoff needs --tokenizer")
    if options.cutoff is not None and options.cutoff <= 0:
        problems.append(f"--cutoff must be positive, got {options.cutoff}")
    if options.keep_duplicates and options.strict:
        problems.append("--keep-duplicates keeps repeated training rows, --strict refuses them: pass one of them")
    problems += template_problems(options)
    out = options.out
    if out.exists() and not out.is_dir():
        problems.append(f"--out {out} exists and is not a directory")
    else:
        try:  # --overwrite deletes OUT: only ever an earlier build, never a mistyped directory or the source
            check_out(out, KIND, {"--source": options.source}, options.overwrite, error=DataPrepError, empty_ok=True)
        except DataPrepError as exc:
            problems.append(str(exc))
    if problems:
        raise DataPrepError("; ".join(problems))


def resolved_template(options: BuildOptions) -> str:
    """The template a build uses: `options.template`, or by default llm-adapters for an llm-adapters source."""
    if options.template is not None:
        return options.template
    return "llm-adapters" if sources.llm_adapters_path(options.source) is not None else "paper"


def template_problems(options: BuildOptions) -> list[str]:
    """What is wrong with the template for this source (and, for a combined file, with --tasks)."""
    template, path = resolved_template(options), sources.llm_adapters_path(options.source)
    if template not in llm_adapters.TEMPLATES:
        return [f"unknown template {template!r}; choose one of {', '.join(llm_adapters.TEMPLATES)}"]
    if path is None:
        if template != "paper":
            return [
                f"--template {template} needs --source llm-adapters:PATH "
                "(hub and mirror rows have no LLM-Adapters instruction)"
            ]
        return []
    if options.source == sources.LLM_ADAPTERS:
        return [
            "--source llm-adapters:PATH needs a PATH (commonsense_170k.json or a folder of <task>/{train,test}.json)"
        ]
    if not path.is_file():
        return []
    problems = []
    for family in llm_adapters.FAMILIES.values():
        chosen = [task for task in family.tasks if task in options.tasks]
        if chosen and len(chosen) < len(family.tasks):
            problems.append(
                f"{path.name} cannot tell {', '.join(family.tasks)} apart (one instruction family, '{family.key}'): "
                f"select all of them or none in --tasks, or use a folder of per-task files"
            )
        elif chosen and len(family.tasks) > 1 and template == "paper":
            problems.append(
                f"--template paper cannot render {path.name}'s '{family.key}' rows: {', '.join(family.tasks)} share "
                "that instruction and SIQA's paper template differs from OBQA's and ARC's; use a folder of per-task "
                f"files, --template llm-adapters, or --tasks without {','.join(family.tasks)}"
            )
    return problems


def convert_split(
    task: str, split: str, data: sources.SplitData, strict: bool
) -> tuple[list[dict[str, Any]], Counter[str]]:
    """Render every row of one split; drop (or, if `strict`, reject) rows that do not fit the schema."""
    rows: list[dict[str, Any]] = []
    dropped: Counter[str] = Counter()
    for index, raw in enumerate(data.rows):
        try:
            example = render(task, raw)
            rid = row_id(task, split, index, raw)
            blank = blank_field(task, raw) if strict else None
            if blank is not None:
                raise RowError(f"blank field '{blank}'", "only whitespace: the prompt asks nothing")
        except RowError as err:
            if strict:
                raise DataPrepError(f"{task}: {data.origin} row index {index}: {err} (--strict)") from None
            dropped[err.reason] += 1
            continue
        rows.append(
            {
                "task": task,
                "id": rid,
                "prompt": example.prompt,
                "answer": example.answer,
                "choices": list(example.choices),
                "label": example.label,
            }
        )
    return rows, dropped


def _families(converted: llm_adapters.Converted) -> dict[str, Any]:
    """Per family found in a file: its tasks, rows read and rows kept (manifest ``families``)."""
    return {
        key: {
            "tasks": list(llm_adapters.FAMILIES[key].tasks) if key in llm_adapters.FAMILIES else [],
            "read": n,
            "kept": converted.kept_families[key],
        }
        for key, n in sorted(converted.families.items())
    }


def load_llm_adapters_splits(options: BuildOptions, path: Path) -> list[SplitResult]:
    """Per-task folders: train and test split of each selected task. Combined file: one train result."""
    template = resolved_template(options)
    sources.check_llm_adapters_source(path, list(options.tasks))
    results = []
    if path.is_file():
        data = sources.load_llm_adapters_file(path, path)
        conv = llm_adapters.convert(
            data.rows,
            task=None,
            role="train",
            template=template,
            origin=data.origin,
            strict=options.strict,
            selected=frozenset(options.tasks),
            id_prefix=path.stem,
        )
        log(f"{path.name}: {len(conv.rows)} of {len(data.rows)} rows rendered")
        results.append(
            SplitResult(
                path.name,
                "train",
                "train",
                conv.rows,
                len(data.rows),
                conv.dropped,
                data.provenance,
                _families(conv),
                conv.not_selected,
                data.origin,
            )
        )
        return results
    for task in options.tasks:
        for role in ("train", "eval"):
            if not sources.has_llm_adapters_split(path, task, role):  # check_llm_adapters_source: test.json is there
                log(
                    f"note: {path / sources.LLM_ADAPTERS_FOLDERS[task]} has no train.json; {task} adds its test "
                    "split only, no training rows"
                )
                continue
            data = sources.load_llm_adapters_split(path, task, role)
            split = sources.LLM_ADAPTERS_SPLITS[role]
            conv = llm_adapters.convert(
                data.rows,
                task=task,
                role=role,
                template=template,
                origin=data.origin,
                strict=options.strict,
                split=split,
            )
            log(f"{task} {split}: {len(conv.rows)} of {len(data.rows)} rows rendered ({data.origin})")
            results.append(
                SplitResult(
                    task,
                    role,
                    split,
                    conv.rows,
                    len(data.rows),
                    conv.dropped,
                    data.provenance,
                    _families(conv),
                    origin=data.origin,
                )
            )
    return results


def load_splits(options: BuildOptions) -> list[SplitResult]:
    """Read and render the train and eval split of every selected task, in canonical task order."""
    path = sources.llm_adapters_path(options.source)
    if path is not None:
        return load_llm_adapters_splits(options, path)
    if options.source != sources.HUB:
        sources.check_local_tasks(Path(options.source), list(options.tasks))
    results = []
    for task in TASKS:
        if task not in options.tasks:
            continue
        for role, split in (("train", "train"), ("eval", TASKS[task].eval_split)):
            data = sources.load_split(options.source, task, split, options.winogrande_size)
            rows, dropped = convert_split(task, split, data, options.strict)
            log(f"{task} {split}: {len(rows)} of {len(data.rows)} rows rendered ({data.origin})")
            results.append(
                SplitResult(task, role, split, rows, len(data.rows), dropped, data.provenance, origin=data.origin)
            )
    return results


def check_no_empty_split(results: list[SplitResult], tasks: tuple[str, ...]) -> None:
    """A split the build asked for must keep at least one row: an empty source file, or one whose rows were all
    dropped, would otherwise leave a task out of the training mixture or the evaluation without a word. For a
    combined LLM-Adapters file the same holds for each selected instruction family. Raises one error naming
    every such split and its file; there is no switch to allow it (leave the task out of ``--tasks`` instead)."""
    problems = []
    for r in results:
        combined = r.task not in TASKS  # a combined file: one result, checked per selected family below
        what = r.origin if combined else f"{r.task} {r.split} split {r.origin}"
        if r.read == 0:
            problems.append(f"{what} has no rows")
        elif not r.rows and not r.not_selected:
            reasons = ", ".join(f"{k}: {v}" for k, v in sorted(r.dropped.items()))
            problems.append(f"{what}: all {r.read} rows were dropped ({reasons})")
        elif combined and r.families is not None:
            kept = {key for key, f in r.families.items() if f["kept"]}
            missing = [
                t
                for f in llm_adapters.FAMILIES.values()
                if set(f.tasks) <= set(tasks) and f.key not in kept
                for t in f.tasks
            ]
            if missing:
                problems.append(f"{what} has no usable rows of {','.join(missing)}, selected by --tasks")
    if problems:
        dropped = any("were dropped" in p for p in problems)
        raise DataPrepError(
            "; ".join(problems)
            + "; fix the source"
            + (" (--strict names the first bad row)" if dropped else "")
            + " or leave it out of --tasks"
        )


def mixture(results: list[SplitResult], seed: int) -> list[dict[str, Any]]:
    """All training rows, concatenated in canonical task order, then shuffled with `seed`."""
    rows = [row for result in results if result.role == "train" for row in result.rows]
    random.Random(seed).shuffle(rows)
    return rows


def token_report(results: list[SplitResult], tokenizer: Any, name: str, cutoff: int, template: str) -> dict[str, Any]:
    """Token-length summary (and rows over `cutoff`) per task and split, for the manifest."""
    per_task: dict[str, dict[str, Any]] = {}
    for result in results:
        texts = [prep_rows.training_text(row) for row in result.rows]
        lengths = tokens.token_lengths(tokenizer, texts, desc=f"tokenizing {result.task} {result.split}")
        per_task.setdefault(result.task, {})[result.role] = tokens.summarize(lengths, cutoff)
    return {
        "tokenizer": name,
        "cutoff": cutoff,
        "length_of": ("prompt + '\\nAnswer: ' + answer" if template == "paper" else "prompt + answer (separator '')")
        + ", with the tokenizer's special tokens and EOS",
        "per_task": per_task,
    }


def write_outputs(
    out: Path, train: list[dict[str, Any]], results: list[SplitResult], manifest: dict[str, Any]
) -> dict[str, str]:
    """Write every file into a temporary sibling of `out`, then rename it to `out`.

    Returns the sha256 of each written file, keyed by its path relative to `out`.
    """
    with building_dir(out, KIND, error=DataPrepError) as tmp:
        (tmp / "eval").mkdir()
        files = {"train.jsonl": prep_rows.write_rows(tmp / "train.jsonl", train)}
        for r in results:
            if r.role == "eval":
                files[f"eval/{r.task}.jsonl"] = prep_rows.write_rows(tmp / "eval" / f"{r.task}.jsonl", r.rows)
        manifest["files"] = files
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2, ensure_ascii=True) + "\n", encoding="ascii")
        files = {**files, "manifest.json": prep_rows.sha256_file(tmp / "manifest.json")}
    return files


def build(options: BuildOptions) -> tuple[dict[str, Any], dict[str, str]]:
    """Build OUT from the options, holding its lease throughout (a second build of OUT is refused at once);
    returns the manifest and the sha256 of every written file."""
    with holding(options.out, KIND, "--out", DataPrepError):
        validate_options(options)
        options = replace(options, tasks=tuple(task for task in TASKS if task in options.tasks))  # canonical order
        tokenizer = tokens.load_tokenizer(options.tokenizer) if options.tokenizer else None
        results = load_splits(options)
        for result in results:
            drop_rows_training_refuses(result, options.strict)
            count_repeats(result, options.strict, options.keep_duplicates)
        check_no_empty_split(results, options.tasks)
        in_training = count_test_in_training(results, options.strict)
        train = mixture(results, options.seed)
        manifest = make_manifest(options, results, len(train), resolved_template(options), in_training)
        if tokenizer is not None:
            manifest["token_lengths"] = token_report(
                results, tokenizer, options.tokenizer, options.cutoff or DEFAULT_CUTOFF, resolved_template(options)
            )
        files = write_outputs(options.out, train, results, manifest)
        return manifest, files
