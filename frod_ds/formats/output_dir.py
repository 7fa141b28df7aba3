"""Who owns an output folder, on disk: the ownership record every folder frod-ds writes keeps, and the writer's lease.

``.frod-ds-output`` (``OutputRecord``) names the folder's kind (``KINDS``: which command wrote it) and lists what its
writer wrote there, each entry added before the file is made: a relative path, a directory with all in it
(``checkpoints/``), or a glob of names not known ahead (``q_proj.rank*.part*.safetensors``); a record from before
lists (version 1) stands for what its kind writes (``KIND_FILES``). ``.<name>.frod-ds-lease`` (``LeaseRecord``; a name
too long for it shortened, ``sibling_names``) beside the folder names the process writing it now; its mtime is the
heartbeat. docs/formats.md#output-folders. Torch-free.
"""

from __future__ import annotations

import fnmatch
import glob
import os
import re
from dataclasses import dataclass
from pathlib import Path

from frod_ds.formats.file_digests import file_sha256
from frod_ds.formats.records import record_from_dict, record_to_json
from frod_ds.formats.sibling_names import digest_of
from frod_ds.runtime.atomic import TMP
from frod_ds.runtime.errors import FrodError
from frod_ds.runtime.paths import read_small_text
from frod_ds.runtime.strict_json import loads

__all__ = [
    "MARKER",
    "RUN_FOLDER_FILES",
    "STEP_ENGINE_FILES",
    "FORMAT",
    "VERSION",
    "LEASE",
    "LEASE_FORMAT",
    "KINDS",
    "KIND_FILES",
    "WRITERS",
    "OutputRecord",
    "LeaseRecord",
    "read_record",
    "record_text",
    "entries_of",
    "match",
    "is_lease_file",
    "stamps_of",
    "edited_since_written",
    "listed_since_written",
]

MARKER = ".frod-ds-output"
FORMAT = "frod-ds-output"
VERSION = 2  # 1: the kind only (no file list)
LEASE = ".frod-ds-lease"  # the lease of folder NAME is .NAME.frod-ds-lease beside it (shortened where too long)
LEASE_FORMAT = "frod-ds-lease"

KINDS = {  # the kind each writer records → how messages name it
    "adapter": "a trained adapter",
    "training-run": "a training run",
    "factor-store": "a factor store",
    "hf-export": "a merged Hugging Face export",
    "peft-export": "a PEFT adapter export",
    "peft-import": "an imported PEFT adapter",
    "data-build": "a frod data build",
    "eval-results": "evaluation results",
    "demo": "a demo directory",
    "gguf-conversion": "a GGUF model converted to a Hugging Face checkpoint",
}
WRITERS = {  # the command that writes each kind, as a lease names its holder
    "adapter": "an adapter writer",
    "training-run": "frod train",
    "factor-store": "frod hjd",
    "hf-export": "frod export",
    "peft-export": "frod export",
    "peft-import": "frod export --from-peft",
    "data-build": "frod data build",
    "eval-results": "frod eval",
    "demo": "frod demo",
    "gguf-conversion": "frod convert-gguf",
}
_RUN = ("recipe.yaml", "metrics.jsonl", "loss.png", "tensorboard/", "checkpoints/", "adapter-*/", "superseded-*/")
_STEP = "checkpoints/step[0-9]*/"
STEP_ENGINE_FILES = (  # what a save writes beside frod-ds's own records: DeepSpeed's files (any stage), the RNG's
    "*mp_rank_[0-9][0-9]_model_states.pt",
    "*zero_pp_rank_[0-9]*_mp_rank_[0-9][0-9]_optim_states.pt",
    "rng_rank[0-9]*.pt",
)
RUN_FOLDER_FILES = (  # what a run writes in its folders, by name: so a user's file there is never the run's
    "checkpoints/latest_complete",  # the pointer, and DeepSpeed's files beside the saves
    "checkpoints/latest",
    "checkpoints/zero_to_fp32.py",
    "checkpoints/zero_to_torch.py",
    *(_STEP + name for name in STEP_ENGINE_FILES),  # each save's
    _STEP + "COMPLETE",
    _STEP + "trainable_state.safetensors",
    _STEP + "factor_store.json",
    _STEP + "run_identity.json",
    "tensorboard/events.out.tfevents.[0-9]*.*.[0-9]*.[0-9]*",  # SummaryWriter's: time, host, pid, count
    "profile/step-[0-9][0-9][0-9][0-9][0-9][0-9].rank[0-9]*.txt",
)
_HF = ("*.safetensors", "*.json", "*.model", "*.txt", "*.jinja")  # weights, index, config, tokenizer files
KIND_FILES: dict[str, tuple[str, ...]] = {  # what each kind writes: the file list of a record from before lists
    "adapter": ("adapter.safetensors", "adapter_config.json", "recipe.yaml"),
    "training-run": (*_RUN, *RUN_FOLDER_FILES),
    "factor-store": (
        "manifest.json",
        "*.V.safetensors",
        "*.rank[0-9][0-9][0-9][0-9][0-9].part[0-9][0-9][0-9][0-9].safetensors",
    ),
    "hf-export": _HF,
    "peft-export": ("adapter_model.safetensors", "adapter_config.json", "README.md", "frod_export.json"),
    "peft-import": ("store/", "adapter/", "frod_import.json"),
    "data-build": ("train.jsonl", "manifest.json", "eval/*.jsonl"),
    "eval-results": ("results.json", "results.md", "predictions.jsonl"),
    "demo": ("demo.log", "raw/", "tokenizer/", "model/", "data/", "factors/", "eval_base/", "eval/", *_RUN),
    "gguf-conversion": _HF,
}


@dataclass
class OutputRecord:
    """``.frod-ds-output``: the kind of output and what its writer wrote (``files``; None before version 2)."""

    format: str
    kind: str | None = None
    version: int = 1
    files: list[str] | None = None
    # a write-once output's files as published: {path: [size, mtime_ns, sha256]} (None: a folder written in place)
    written: dict[str, list] | None = None
    # True: ``written`` stamps every file under the folder that no nested record stamps (a finished demo): any other
    # file there is not the writer's (formats.tree_stamps)
    tree: bool | None = None
    # folders under it (``dir/``) whose every file ``written`` stamps: a demo's stage outputs as each is published
    sealed: list[str] | None = None
    # with ``tree`` or ``sealed``: the folders there that held nothing when stamped (None: stamped before this was kept)
    empty_dirs: list[str] | None = None
    # with ``tree`` or ``sealed``: the outputs nested in it (``dir/``, records of their own) that are the writer's
    nested: list[str] | None = None


@dataclass
class LeaseRecord:
    """The lease file: which process writes a folder now. ``pid_start`` (clock ticks after boot) and ``boot_id``
    tell a live holder from a reused pid or a rebooted host; ``slurm_*`` tell a requeued job from another job."""

    format: str
    kind: str
    host: str
    pid: int
    started: float  # time.time() when the lease was taken
    token: str  # random: identifies this lease (and the children allowed to write under it)
    command: str | None = None
    boot_id: str | None = None
    pid_start: int | None = None
    slurm_job: str | None = None
    slurm_restart: int | None = None
    slurm_step: str | None = None


class OutputRecordError(FrodError):
    """An ownership record that cannot be read."""


def read_record(folder: Path) -> OutputRecord | None:
    """The record of ``folder``; None without one; a record of no kind when it is unreadable (never trusted)."""

    path = Path(folder) / MARKER
    try:
        data = loads(read_small_text(path, OutputRecordError, "ownership record", "not a record frod-ds wrote"))
        return record_from_dict(OutputRecord, data, str(path), OutputRecordError)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return OutputRecord(format=FORMAT) if path.exists() else None


def record_text(record: OutputRecord) -> str:
    return record_to_json(record)


# A factor store's record names its categories' part files by pattern before they are written (factor_store.file_globs)
_STORE_PARTS = re.compile(r"[A-Za-z0-9_]+\.rank\[0-9\]\*\.part\[0-9\]\*\.safetensors")


def _own_pattern(kind: str | None, entry: str) -> bool:
    """Whether record entry ``entry`` names files by a pattern its kind's writer uses (or none at all): a pattern
    no writer records (``*``, edited into the record) would claim a user's files for ``--overwrite`` to delete."""
    if not any(c in entry for c in "*?["):
        return True
    return entry in KIND_FILES.get(kind or "", ()) or (kind == "factor-store" and bool(_STORE_PARTS.fullmatch(entry)))


def entries_of(record: OutputRecord | None, legacy_kind: str | None = None) -> tuple[str, ...] | None:
    """What ``record`` says its writer wrote: its list, or for a record from before lists (or a folder recognised
    without one, ``legacy_kind``) what that kind writes; None when nothing is known to be ours, or when the list
    holds a pattern no frod-ds writer records (the record was edited: none of it is trusted)."""
    if record is not None and record.files is not None:
        if not all(_own_pattern(record.kind, e) for e in record.files):
            return None
        return tuple(record.files)
    kind = record.kind if record is not None else legacy_kind
    return KIND_FILES.get(kind) if kind else None


def _parts(entry: str) -> tuple[list[str], bool]:
    whole = entry.endswith("/")
    return [p for p in entry.rstrip("/").split("/") if p], whole


def _temporaries(name: str, is_dir: bool) -> tuple[str, ...]:
    """The names a writer gives a file or folder ``name`` while it writes it (all beside it) that may be an entry
    of kind ``is_dir``: ``name.frod-tmp`` (an atomic file write, ``runtime.atomic.TMP``: a file, never a folder),
    ``.name.tmp-HOST-PID-*`` (a folder being built), ``.name.old-HOST-PID-*`` (one being replaced), the lease;
    those of a name too long for them, shortened by its digest (``sibling_names.fitted_name``)."""
    shortened = () if glob.has_magic(name) else (f".*~{digest_of('.' + name)}*",)
    file_tmp = () if is_dir else (name + TMP,)
    return (*file_tmp, f".{name}.tmp-*", f".{name}.old-*", f".{name}{LEASE}*", *shortened)


def match(entries: tuple[str, ...], rel: str, is_dir: bool) -> str | None:
    """How ``entries`` cover path ``rel`` (relative, ``/``-separated): ``"own"`` (written by the writer: listed,
    inside a listed directory, or a temporary of a listed name), ``"parent"`` (a directory holding listed paths,
    ours only while it holds nothing else) or None (not the writer's)."""
    parts = rel.split("/")
    verdict = None
    for entry in (*entries, MARKER):
        want, whole = _parts(entry)
        n = min(len(parts), len(want))
        if not all(fnmatch.fnmatchcase(p, w) for p, w in zip(parts[: n - 1], want[: n - 1])):
            continue
        last, wanted = parts[n - 1], want[n - 1]
        if len(parts) > len(want):  # inside a listed directory
            if whole and fnmatch.fnmatchcase(last, wanted):
                return "own"
        elif len(parts) == len(want):
            if (fnmatch.fnmatchcase(last, wanted) and whole == is_dir) or any(
                fnmatch.fnmatchcase(last, t) for t in _temporaries(wanted, is_dir)
            ):
                return "own"
        elif is_dir and fnmatch.fnmatchcase(last, wanted):
            verdict = "parent"
    return verdict


def is_lease_file(name: str) -> bool:
    """Whether ``name`` is a lease (``.NAME.frod-ds-lease``), not one of its temporaries."""
    return name.startswith(".") and name.endswith(LEASE) and len(name) > len(LEASE) + 1


def is_marked(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink() and (path / MARKER).is_file()


def listed_dir(path: Path) -> bool:
    """``path`` is a folder with a record of its own (a nested output: its record says what in it is ours)."""
    return os.path.isdir(path) and not os.path.islink(path) and os.path.isfile(os.path.join(path, MARKER))


def stamps_of(folder: Path, entries: list[str]) -> dict[str, list]:
    """``OutputRecord.written`` of a finished write-once output: each listed file's size, mtime and sha256."""
    out = {}
    for rel in entries:
        path = Path(folder) / rel
        if not rel.endswith("/") and path.is_file() and not path.is_symlink():
            st = path.stat()
            out[rel] = [st.st_size, st.st_mtime_ns, file_sha256(path)]
    return out


# the kinds only ever published whole (formats.building), each file stamped: a record of one without stamps is an
# older frod-ds's, whose record was written after every file it lists
PUBLISHED_WHOLE = (
    "adapter",
    "hf-export",
    "peft-export",
    "peft-import",
    "data-build",
    "eval-results",
    "gguf-conversion",
)


def edited_since_written(folder: Path, record: OutputRecord | None) -> list[str]:
    """The files of ``record.written`` still in ``folder`` with other bytes than published (a user's edit: the
    writer replaces its folder whole), or replaced by anything but a file (a link, even to the same bytes, a named
    pipe, a folder: the writer stamps files only). Size and mtime unchanged mean untouched; a copy's new mtime is
    hashed. A published-whole output's record without stamps: its listed files changed after the record."""
    if record is not None and record.written is None and record.kind in PUBLISHED_WHOLE:
        return _changed_after_record(Path(folder), record)
    out = []
    for rel, (size, mtime_ns, sha) in sorted(((record.written if record else None) or {}).items()):
        path = Path(folder) / rel
        if not os.path.lexists(path):
            continue
        if path.is_symlink() or not path.is_file():  # a link, pipe or folder there now
            out.append(rel)
            continue
        st = path.stat()
        if st.st_size != size or (st.st_mtime_ns != mtime_ns and file_sha256(path) != sha):
            out.append(rel)
    return out


def listed_since_written(folder: Path, record: OutputRecord | None) -> list[str]:
    """Files in ``folder`` that the list of a write-once output names but that were not there when it was
    published (every file of a published output is stamped): the list was edited since, and they are not ours."""
    written = (record.written if record else None) or {}
    if not written or (record.sealed and not record.tree):  # only its sealed folders stamped (formats.tree_stamps)
        return []
    out = []
    for rel in record.files or []:
        path = Path(folder) / rel
        if rel not in written and not rel.endswith("/") and path.is_file() and not path.is_symlink():
            out.append(rel)
    return sorted(out)


def _changed_after_record(folder: Path, record: OutputRecord) -> list[str]:
    """The files ``record`` lists in ``folder`` modified after the record (a nested output, listed ``sub/``, has its
    own record to say)."""
    since = (folder / MARKER).stat().st_mtime_ns
    out = []
    for rel in record.files or []:
        path = Path(folder) / rel
        if not rel.endswith("/") and path.is_file() and not path.is_symlink() and path.stat().st_mtime_ns > since:
            out.append(rel)
    return sorted(out)
