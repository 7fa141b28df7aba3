"""A run's ``output_dir``: who may write there, a new run moving an old one aside, its record, cleanup on failure.

Training writes only into a directory that is absent, empty, or a run frod-ds training wrote (``check_run_dir``);
the same command on its own run resumes. Rank 0 holds the lease on ``output_dir`` for the run's whole life, so a
second run (``train.new_run=true`` included) is refused while one is alive, and records each file and folder
before it is made. A failed fresh run leaves nothing it created (``writing_run``).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import yaml

from frod_ds.config.recipe import Recipe, recipe_to_dict
from frod_ds.formats.lease import holding
from frod_ds.formats.output_dir import RUN_FOLDER_FILES, entries_of, match, read_record
from frod_ds.formats.ownership import check_replaceable, delete_owned, marker_kind, record_files
from frod_ds.runtime import distributed as dist
from frod_ds.runtime.atomic import TMP, atomic_write_text, tmp_problem
from frod_ds.runtime.errors import FrodError
from frod_ds.runtime.paths import unmovable
from frod_ds.train.checkpoints import check_root_files, sealed_checkpoints

__all__ = [
    "RUN_KIND",
    "RUN_HOSTS",
    "PREVIOUS_RUN",
    "RUN_FILES",
    "RUN_RECORD",
    "check_run_dir",
    "check_writable",
    "run_inputs",
    "recipe_yaml",
    "open_run_dir",
    "record_adapter",
    "removed_if_failed",
    "writing_run",
]

RUN_KIND = "training-run"  # the marker's kind (frod_ds.runtime.atomic) of an output_dir training wrote
RUN_HOSTS = (RUN_KIND, "demo")  # what training writes into: its own runs, and the directory of `frod demo`
PREVIOUS_RUN = ("checkpoints", "metrics.jsonl", "loss.png", "recipe.yaml", "tensorboard", "profile")  # and adapter-*/
# recorded as a run opens
RUN_FILES = ("recipe.yaml", "metrics.jsonl", "loss.png", "tensorboard/", "checkpoints/", "profile/")
# its record: the folders by the names written in them, so a user's file there is never deleted with the run
RUN_RECORD = (*(e for e in RUN_FILES if not e.endswith("/")), *RUN_FOLDER_FILES)


def _is_legacy_run(out: Path) -> bool:
    """A run written before training marked its output_dir: sealed checkpoints, or an adapter it wrote."""
    if (out / "checkpoints").is_dir() and sealed_checkpoints(out / "checkpoints"):
        return True
    return any(p.name.startswith("adapter-") and marker_kind(p) == "adapter" for p in out.iterdir() if p.is_dir())


def run_inputs(recipe: Recipe) -> dict[str, str | None]:
    """The folders a run reads (recipe key → path): its ``output_dir`` must be none of them, nor inside one."""
    m, data = recipe.model, recipe.data.train
    reads = {"model.base": m.base, "model.factor_store": m.factor_store, "model.tokenizer": m.tokenizer}
    return reads | {"model.init_adapter": m.init_adapter, "data.train": data if data and Path(data).is_dir() else None}


def check_run_dir(out: Path, inputs: dict[str, Path | str | None] | None = None) -> None:
    """``FrodError`` unless training may write into ``output_dir`` ``out``: absent, empty, or a run frod-ds
    training wrote (its marker, or an older run's checkpoints/adapters), and apart from ``inputs`` (``run_inputs``).
    Other commands' outputs beside the adapters (evals, exports) are not this check's business: training deletes
    nothing."""
    check_replaceable(out, RUN_HOSTS, inputs, what="output_dir", legacy=_is_legacy_run, foreign=False)
    for entry in RUN_FILES:  # what the run writes there: of the kind it writes, or absent
        path = out / entry.rstrip("/")
        folder = entry.endswith("/")
        right_kind = path.is_dir() if folder else path.is_file()  # a named pipe is neither: opening it blocks
        if os.path.lexists(path) and (path.is_symlink() or not right_kind):
            if path.is_symlink() or path.is_dir():
                it = "a symbolic link" if path.is_symlink() else "a folder"
            else:
                it = "not a folder" if folder else "not a regular file"
            raise FrodError(
                f"output_dir {out}: {path} is {it}, where the run keeps its {entry.rstrip('/')}; move it away (or "
                "choose another output_dir)"
            )
        problem = None if folder else tmp_problem(path.with_name(path.name + TMP), path)
        if problem:  # the file's temporary: checked before the run rather than found after it (``replacing``)
            raise FrodError(f"output_dir {out}: {problem}")
    check_root_files(out / "checkpoints")  # a link there is refused above; no folder yet: nothing to check


def check_no_unresumable_run(out: Path) -> None:
    """``FrodError`` when ``out`` holds a run's adapters but no checkpoint to resume it from or check it against
    (``checkpoints/`` deleted to save space): a new run there would replace them without a word."""
    gone = out.is_dir() and not (out / "checkpoints").exists()  # unsealed checkpoints restart the run at step 0
    adapters = sorted(p.name for p in out.glob("adapter-*") if p.is_dir()) if gone else []
    if adapters:
        raise FrodError(
            f"output_dir {out} holds a run's {', '.join(adapters[:3])}{' …' if len(adapters) > 3 else ''} but no "
            "checkpoint to resume it from (checkpoints/ is gone), and a new run there would replace them: choose "
            "another output_dir, or pass train.new_run=true to move that run aside"
        )


def check_writable(out: Path) -> None:
    """``output_dir`` must be a directory this process can write to, or creatable: checked on it or its nearest
    existing parent, without creating anything (a run that fails later leaves no empty ``output_dir``)."""
    where = out
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        if not where.is_dir():
            raise NotADirectoryError(20, "not a directory")
        with tempfile.TemporaryFile(dir=where):
            pass
    except OSError as e:
        raise FrodError(
            f"output_dir {out} is not writable ({where}: {e.strerror or e}); choose another output_dir"
        ) from None


def recipe_yaml(recipe: Recipe) -> str:
    """The recipe as the run records it (``recipe.yaml`` beside the run and in every adapter)."""
    return yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False)


def _same_recipe(path: Path, recipe: Recipe) -> bool:
    """Whether ``path`` records ``recipe`` already, ``output_dir`` aside (a run copied or moved elsewhere)."""
    try:
        recorded = yaml.safe_load(path.read_text())
    except (OSError, ValueError, yaml.YAMLError, RecursionError):  # ValueError: bad UTF-8, a huge int
        return False
    now = recipe_to_dict(recipe)
    return isinstance(recorded, dict) and {**recorded, "output_dir": None} == {**now, "output_dir": None}


def _supersede_previous_run(out: Path) -> None:
    """``train.new_run``: move a previous run's files in ``out`` (those its record lists) into
    ``out/superseded-<time>/``; nothing is deleted, adapters included."""
    if not out.is_dir():
        return
    entries = entries_of(read_record(out), RUN_KIND) or ()
    old = [
        p
        for p in out.iterdir()
        if (p.name in PREVIOUS_RUN or (p.name.startswith("adapter-") and p.is_dir()))
        and match(entries, p.name, p.is_dir() and not p.is_symlink()) in ("own", "parent")  # parent: a folder it fills
    ]
    if not old:
        return
    stuck = unmovable(old, out)
    if stuck is not None:
        raise FrodError(
            f"train.new_run: {stuck} is a mount point (or on another file system), which cannot be moved aside "
            f"into {out}/superseded-*; move it out of output_dir or choose another output_dir (nothing was moved)"
        )
    stamp = time.strftime("superseded-%Y%m%d-%H%M%S")
    for n in range(1000):  # a name nothing holds yet: an earlier run's of the same second, or the user's
        dest = out / (stamp if n == 0 else f"{stamp}-{n}")
        try:
            dest.mkdir()  # exclusive: what holds the name (a folder, a file, a link) is never the run's to fill
        except FileExistsError:
            continue
        record_files(out, [dest.name + "/"], RUN_KIND)  # made by this run: a kill after it leaves it empty
        break
    else:
        raise FrodError(f"train.new_run: {out} holds {stamp} and 999 more names like it; move them away")
    for p in old:
        os.rename(p, dest / p.name)
    print(f"note: train.new_run: the previous run in {out} moved to {dest}", flush=True)


def open_run_dir(recipe: Recipe) -> None:
    """Rank 0, once every input is checked: a previous run moved aside (``train.new_run``), ``output_dir`` made
    and its record listing what a run writes there, ``recipe.yaml`` written."""
    out = Path(recipe.output_dir)
    if recipe.train.new_run:
        _supersede_previous_run(out)
    out.mkdir(parents=True, exist_ok=True)
    record_files(out, RUN_RECORD, RUN_KIND)
    path = out / "recipe.yaml"
    if not _same_recipe(path, recipe):  # a rerun with nothing new (the run moved, at most) leaves it be
        atomic_write_text(path, recipe_yaml(recipe))


def record_adapter(out: Path, name: str) -> None:
    """Rank 0: the adapter ``out/name`` is entered in the run's record before it is written."""
    record_files(out, [name + "/"], RUN_KIND)


@contextlib.contextmanager
def removed_if_failed(out: Path) -> Iterator[None]:
    """Run the block; if it raises and ``out`` did not exist before it and holds no sealed checkpoint or adapter
    (what a rerun would resume or keep), rank 0 deletes what the run's record lists (and ``out`` once empty): a
    failed run leaves nothing it created behind, and never deletes what it did not write."""
    created = not os.path.lexists(out)
    try:
        yield
    except BaseException:
        if (
            created
            and dist.is_main()
            and out.is_dir()
            and not out.is_symlink()
            and not sealed_checkpoints(out / "checkpoints")
            and not any(out.glob("adapter-*"))
        ):
            delete_owned(out)  # an unsealed checkpoint is nothing a rerun would resume
        raise


@contextlib.contextmanager
def writing_run(out: Path) -> Iterator[None]:
    """Collective: the life of a run's writer. Rank 0 holds the lease on ``output_dir`` (another live run there is
    refused at once, naming it); a failed fresh run leaves nothing it created (``removed_if_failed``)."""
    with dist.held_on_main(lambda: holding(out, RUN_KIND, "output_dir")), removed_if_failed(out):
        yield
