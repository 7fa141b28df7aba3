"""An evaluation run: validate → read rows → load the model → score this rank's batches in every mode →
gather on rank 0 → write ``results.json``, ``results.md`` and ``predictions.jsonl``.

Orchestration only: scoring is `frod_ds.eval.predict`, accuracy and the table `frod_ds.eval.accuracy`,
collectives `frod_ds.runtime.distributed`; ``frod eval`` parses flags into an `EvalConfig` and calls `run`.
Ranks take whole batches of a plan that depends only on the rows and the batch size (`plan_batches`), so any
number of ranks gives the same numbers; the model is unpartitioned on each rank (no ``synced_gpus``).
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from frod_ds.eval.accuracy import markdown_table, summarize
from frod_ds.eval.model_load import check_token_ids, load_model, resolve_dtype
from frod_ds.eval.predict import (
    LLM_ADAPTERS_MAX_NEW_TOKENS,
    LLM_ADAPTERS_NUM_BEAMS,
    EvalError,
    llm_adapters_row_problem,
    plan_batches,
    score_generate_rows,
    score_llm_adapters_rows,
    score_loglik_rows,
)
from frod_ds.formats.building import building_dir
from frod_ds.formats.file_digests import DATA_MANIFEST, FileDigests
from frod_ds.formats.folders import wrong_folder
from frod_ds.formats.lease import holding
from frod_ds.formats.ownership import check_replaceable, record_files, restamp
from frod_ds.prep.build_records import FORMAT as BUILD_FORMAT
from frod_ds.runtime import distributed as dist
from frod_ds.runtime.atomic import TMP, atomic_write_text, disk_advice, tmp_problem
from frod_ds.runtime.errors import note
from frod_ds.runtime.paths import dir_problem, file_problem
from frod_ds.runtime.rank_agreement import check_ranks_agree
from frod_ds.runtime.strict_json import loads

__all__ = ["MODES", "EvalConfig", "parse_modes", "load_task_rows", "check_built", "run"]

# loglik: argmax of summed log-probs; generate: greedy, earliest answer string; llm-adapters: LLM-Adapters' protocol.
MODES = ("loglik", "generate", "llm-adapters")

Rows = dict[str, list[dict[str, Any]]]  # {task: rows in file order}


def parse_modes(spec: str) -> tuple[str, ...]:
    """``"loglik,llm-adapters"`` → ``("loglik", "llm-adapters")``, in the order given; EvalError for an
    unknown, repeated or empty entry."""
    modes = tuple(m.strip() for m in spec.split(","))
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise EvalError(f"unknown --mode {unknown[0]!r}; pass one or a comma list of {', '.join(MODES)}")
    if len(set(modes)) < len(modes):
        raise EvalError(f"--mode {spec!r} names a mode twice")
    return modes


INPUT_FLAGS = ("data", "checkpoint", "base_model", "factor_store", "model", "tokenizer")  # folders eval reads


@dataclass(frozen=True)
class EvalConfig:
    """Everything a run needs; the fields are ``frod eval``'s flags (``mode`` the comma list as given)."""

    data: str
    output: str
    tasks: str = "all"
    mode: str = "loglik"
    checkpoint: str | None = None
    base_model: str | None = None
    factor_store: str | None = None
    model: str | None = None
    tokenizer: str | None = None
    max_new_tokens: int = 16
    batch_size: int = 8
    limit: int | None = None
    dtype: str = "auto"

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> EvalConfig:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    @property
    def modes(self) -> tuple[str, ...]:
        return parse_modes(self.mode)

    def _unwritable(self) -> list[str]:
        """Why the results could not be written into ``output`` as it is: a folder or file of it read-only or
        immutable (``chattr +i``), or something else than a killed write's leftover at a temporary name."""
        out = Path(self.output)
        stuck = [p for p in (out, *(out / f for f in LEGACY_FILES)) if p.exists() and not os.access(p, os.W_OK)]
        said = [
            f"--output {self.output}: {p} cannot be written (read-only or immutable); make it writable or choose "
            "another --output"
            for p in stuck
        ]
        return said + [p for p in (tmp_problem(out / (f + TMP), out / f) for f in LEGACY_FILES) if p]

    def validate(self) -> None:
        """Raise EvalError listing every problem with the flags."""
        problems = []
        if bool(self.checkpoint) == bool(self.model):
            problems.append("pass exactly one of --checkpoint (FRoD adapter) or --model (plain HF model)")
        if self.model and (self.base_model or self.factor_store):
            problems.append("--base-model/--factor-store apply to --checkpoint only")
        if self.checkpoint and self.tokenizer:
            problems.append("--tokenizer applies to --model only (an adapter checkpoint brings its tokenizer)")
        for flag, value in (
            ("--batch-size", self.batch_size),
            ("--max-new-tokens", self.max_new_tokens),
            ("--limit", self.limit),
        ):
            if value is not None and value < 1:
                problems.append(f"{flag} must be >= 1, got {value}")
        try:
            self.modes
        except EvalError as exc:
            problems.append(str(exc))
        if self.checkpoint and Path(self.checkpoint).is_file():  # named before the data is read
            from frod_ds.model.adapter import not_an_adapter

            problems.append(not_an_adapter(self.checkpoint, "--checkpoint"))
        if self.model and Path(self.model).is_file():
            problems.append(f"--model {self.model} is a file, not a directory; pass the checkpoint directory")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            problems.append(f"--dtype must be auto, float32 or bfloat16, got {self.dtype!r}")
        if Path(self.output).exists() and not Path(self.output).is_dir():
            problems.append(f"--output {self.output} exists and is not a directory")
        else:  # results replace an earlier eval's (nothing else in it), or fill a new or empty one, never an input
            inputs = {f"--{k.replace('_', '-')}": getattr(self, k) for k in INPUT_FLAGS}
            try:
                check_replaceable(
                    Path(self.output), RESULTS_KIND, inputs, what="--output", error=EvalError, legacy=_is_legacy_results
                )
            except EvalError as exc:
                problems.append(str(exc))
            if not problems:  # what would stop the write, found before the scoring, not after it
                problems += self._unwritable()[:1]
        if problems:
            raise EvalError("; ".join(problems))


def load_task_rows(data: str, tasks_spec: str, limit: int | None, modes: tuple[str, ...] = ("loglik",)) -> Rows:
    """``{task: rows}`` from ``<data>/eval/<task>.jsonl``, checked against the data build's sha256s
    (`check_built`) and validated by ``frod data``'s reader and for `modes`.

    Every missing file is reported in one EvalError; a bad row raises DataPrepError naming file and line.
    """
    from frod_ds.prep.rows import MAX_ROW_CHARS, read_rows, repeated_id
    from frod_ds.prep.tasks import parse_tasks

    tasks = parse_tasks(tasks_spec)
    problem = dir_problem(data) or wrong_folder(data, "--data", ("data-build",), "a data build")
    if problem:
        raise EvalError(problem if problem.startswith("--data") else f"--data {problem}")
    paths = {task: Path(data) / "eval" / f"{task}.jsonl" for task in tasks}
    odd = [file_problem(p) for p in paths.values() if os.path.lexists(p) and file_problem(p)]
    if odd:  # a named pipe, a link loop, a directory: not "missing"
        raise EvalError(f"eval file {odd[0]}")
    missing = [str(path) for path in paths.values() if not path.is_file()]
    if missing and Path(data).name == "eval" and (Path(data).resolve().parent / "manifest.json").is_file():
        build = Path(data).resolve().parent  # --data is the build's own eval/ folder
        raise EvalError(f"--data {data} is a data build's eval/ folder; pass the data build itself, {build}")
    if missing:
        raise EvalError(
            f"no eval file {', '.join(missing)}; build it with frod data build or drop the task from --tasks"
        )
    check_built(Path(data), paths)
    rows = {}
    for task, path in paths.items():
        task_rows = read_rows(path)[:limit]
        if not task_rows:
            raise EvalError(f"{path} has no rows")
        other = [r["task"] for r in task_rows if r["task"] != task]
        if other:
            raise EvalError(f"{path} holds rows of task {other[0]!r}; expected only {task!r}")
        twice = repeated_id(task_rows)
        if twice:
            raise EvalError(
                f"{path} rows {twice[0]} and {twice[1]} have the same id {twice[2]!r}: it would be scored twice; "
                "deduplicate the file or build the data again with frod data build"
            )
        long = next(
            (r for r in task_rows if len(r["prompt"]) + max(map(len, r["choices"]), default=0) > MAX_ROW_CHARS), None
        )
        if long is not None:  # as training refuses it: one row past this fills the memory scoring it
            raise EvalError(
                f"{path}: row {long['id']!r} is longer than any sensible prompt ({MAX_ROW_CHARS} characters with its "
                "longest choice); remove it or build the data again with frod data build"
            )
        empty = [r["id"] for r in task_rows if not all(r["choices"])]
        if empty:
            raise EvalError(f"{path}: row {empty[0]!r} has an empty answer string in 'choices'")
        if "llm-adapters" in modes:
            problem = next(filter(None, map(llm_adapters_row_problem, task_rows)), None)
            if problem:
                raise EvalError(f"{path}: {problem}; --mode llm-adapters cannot score it")
        rows[task] = task_rows
    return rows


def check_built(data: Path, paths: dict[str, Path]) -> None:
    """``EvalError`` unless each task file in ``paths`` is the one the data build wrote (its sha256 in
    ``data/manifest.json``); a ``note:`` when ``data`` is no data build (no manifest: nothing to check against)."""
    built = FileDigests.read(
        data / DATA_MANIFEST, EvalError, "build the data again with frod data build", format=BUILD_FORMAT
    )
    if built is None:
        note(f"{data} has no {DATA_MANIFEST} (not a frod data build): its eval files are scored unchecked")
        return
    for task, path in paths.items():
        name = f"eval/{task}.jsonl"
        if name not in built.files:
            raise EvalError(
                f"{path} is not a file of the data build in {data} (its {DATA_MANIFEST} lists no {name}); "
                f"build {task} with frod data build, or leave it out of --tasks"
            )
        if built.changed(data, name):
            raise EvalError(
                f"{path} was changed after frod data build wrote it (its sha256 is not the one {data}/"
                f"{DATA_MANIFEST} records): scores of edited test rows are not the task's; build the data again"
            )


def score_batch(
    mode: str, model: torch.nn.Module, tokenizer: Any, rows: list[dict[str, Any]], pad_id: int, config: EvalConfig
) -> list[dict[str, Any]]:
    """Prediction records of one batch of rows in one mode."""
    if mode == "loglik":
        return score_loglik_rows(model, tokenizer, rows, pad_id)
    if mode == "generate":
        return score_generate_rows(model, tokenizer, rows, pad_id, config.max_new_tokens)
    assert mode == "llm-adapters", f"unknown mode {mode!r}"
    return score_llm_adapters_rows(model, tokenizer, rows, pad_id)


def evaluate_shard(model: torch.nn.Module, tokenizer: Any, rows: Rows, config: EvalConfig) -> list[dict[str, Any]]:
    """Prediction records of this rank's batches (batches strided over ranks) in every mode, each with
    its ``mode`` and its row's ``index`` in the task file."""
    rank, world = dist.get_rank(), dist.get_world_size()
    pad_id = next(i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if i is not None)
    records = []
    for mode in config.modes:
        for task, task_rows in rows.items():
            batches = plan_batches(task_rows, config.batch_size)[rank::world]
            desc = f"{mode} {task}" + (f" (rank 0 of {world})" if world > 1 else "")
            with tqdm(
                total=sum(map(len, batches)), desc=desc, unit="row", disable=not dist.is_main(), dynamic_ncols=True
            ) as bar:
                for batch in batches:
                    scored = score_batch(mode, model, tokenizer, [task_rows[i] for i in batch], pad_id, config)
                    records += [{"mode": mode, "index": i, **record} for i, record in zip(batch, scored)]
                    bar.update(len(batch))
    return records


RESULTS_KIND = "eval-results"


LEGACY_FILES = ("results.json", "results.md", "predictions.jsonl")  # what every eval has written


def _is_legacy_results(path: Path) -> bool:
    """Results of an eval run before outputs held records: an unmarked directory holding all three files eval
    writes, its ``results.json`` eval's (a ``mode`` and a ``config``), and (``check_replaceable`` makes sure)
    nothing else. A folder merely holding some ``results.json`` is the user's."""
    if not all((path / name).is_file() for name in LEGACY_FILES):
        return False
    try:
        doc = loads((path / "results.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and isinstance(doc.get("mode"), str) and isinstance(doc.get("config"), dict)


def write_outputs(output: Path, files: dict[str, str]) -> None:
    """A new (or empty) `output` is built under a temporary name and renamed into place; into an earlier eval's
    results (checked by ``EvalConfig.validate``: they hold nothing else) each file is entered in the record, then
    written under a temporary name and renamed over the old one."""
    if output.is_dir() and any(output.iterdir()):
        record_files(output, list(files), RESULTS_KIND)
        for name, text in files.items():
            atomic_write_text(output / name, text)
        restamp(output, list(files))  # the record's stamps are this run's files now
        return
    with building_dir(output, RESULTS_KIND, what="--output") as tmp:
        for name, text in files.items():
            (tmp / name).write_text(text, encoding="utf-8")


def build_results(
    config: EvalConfig, tasks: list[str], records: list[dict[str, Any]]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(``results.json`` body, records in mode, task and file order) from all ranks' records.

    ``results["modes"][mode]`` is each mode's `summarize` result (per task: accuracy, n, correct and
    unmatched or accuracy_norm); the top-level ``mode``, ``tasks``, ``average``, ... repeat the first
    mode's, so readers of a single-mode run find them where they always were.
    """
    modes = config.modes
    order = {task: k for k, task in enumerate(tasks)}
    records = sorted(records, key=lambda r: (modes.index(r["mode"]), order[r["task"]], r["index"]))
    by_mode = {mode: summarize([r for r in records if r["mode"] == mode], tasks, mode) for mode in modes}
    run_config = {k: v for k, v in asdict(config).items() if k != "mode"}
    run_config.update(modes=list(modes), world_size=dist.get_world_size())
    if "generate" not in modes:
        run_config["max_new_tokens"] = None
    if "llm-adapters" in modes:
        run_config["llm_adapters"] = {
            "num_beams": LLM_ADAPTERS_NUM_BEAMS,
            "max_new_tokens": LLM_ADAPTERS_MAX_NEW_TOKENS,
        }
    results = {"mode": modes[0], **by_mode[modes[0]], "modes": by_mode, "config": run_config}
    return results, records


def report(config: EvalConfig, tasks: list[str], records: list[dict[str, Any]]) -> str:
    """Rank 0: results.json, results.md and predictions.jsonl from all ranks' records; the text to print once every
    rank knows they are written (a closed stdout is not a write of the results)."""
    results, records = build_results(config, tasks, records)
    title = f"Commonsense accuracy, {' and '.join(config.modes)}: {config.checkpoint or config.model}"
    table = markdown_table(results["modes"], title=title)
    write_outputs(
        Path(config.output),
        {
            "results.json": json.dumps(results, indent=2) + "\n",
            "results.md": table,
            "predictions.jsonl": "".join(json.dumps(r) + "\n" for r in records),
        },
    )
    return f"{table}\nwrote {config.output}/results.json, results.md, predictions.jsonl"


def _inputs(config: EvalConfig) -> tuple[dict[str, list[dict[str, Any]]], torch.nn.Module, Any]:
    """Everything a user can get wrong before scoring: flags, rows, the model; the same outcome on every rank."""
    config.validate()
    rows = load_task_rows(config.data, config.tasks, config.limit, config.modes)
    device = dist.local_device()
    model, tokenizer = load_model(config, device, resolve_dtype(config.dtype, device))
    check_token_ids(rows, tokenizer, model, config)
    return rows, model, tokenizer


def _digest(rows: list[dict[str, Any]]) -> str:
    """sha256 of a task's rows as scored (what the ranks must share to score their parts of one list)."""
    return hashlib.sha256(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()[:16]


def run(config: EvalConfig) -> None:
    """The whole run on every rank (the process group already joined); rank 0 holds the lease on ``--output``
    from the first check to the last write (a second eval there is refused at once) and writes the outputs.

    User mistakes are ``FrodError``s (``frod_ds.runtime.entry`` prints them): those up to the model load and in
    writing the outputs are agreed by every rank (one line, from rank 0); one in a row that only one rank
    scores is raised on that rank.
    """
    flags = {"--": {f.name.replace("_", "-"): getattr(config, f.name) for f in fields(config)}}
    dist.on_all(lambda: check_ranks_agree(flags, "a launcher passing one rank other flags?"))
    with dist.held_on_main(lambda: holding(config.output, RESULTS_KIND, "--output", EvalError)):
        rows, model, tokenizer = dist.on_all(lambda: _inputs(config))
        digests = {"": {f"--data rows of {task}": _digest(task_rows) for task, task_rows in rows.items()}}
        dist.on_all(lambda: check_ranks_agree(digests, "a node reading another copy of --data?"))
        records = evaluate_shard(model, tokenizer, rows, config)
        shards = dist.all_gather_object(records)
        error, said = None, ""
        if dist.is_main():
            try:
                said = report(config, list(rows), [r for shard in shards for r in shard])
            except OSError as exc:  # the scores are lost with the process: say what to change before re-running
                where = exc.filename2 or exc.filename or config.output
                fix = (
                    disk_advice(exc)
                    if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
                    else "make it writable (chattr -i / chmod u+w) or choose another --output"
                )
                error = f"cannot write results to {config.output} ({exc.strerror or exc}: {where}): {fix}, then re-run"
        dist.agree_on_error(error, src=0)
        dist.print0(said)
