"""The study's output directory as typed records, so a study can go on over several commands.

    OUT/study.json         StudyIdentity: what determines every result (written once; a resume must match it)
    OUT/base.json          BaseRecord: the base model's step-0 metrics, test results and FRoD's init check
    OUT/invocations.json   InvocationsRecord: one entry per command that worked on the study
    OUT/records/<run>.json RunRecord: one finished (method, LR) run: curves, held-out metrics, test results
    OUT/real_study.json    the combined report (``runner``), rebuilt from the records after every event

Each record is written atomically (tmp + fsync + rename), so a command cut off at any moment leaves every
finished run readable. No weights are stored: a run's test results are taken in the command that trains it
(see ``runner``), which keeps the directory small enough to carry between machines as a tarball.

Identity: the sha256 of the training and test files, a sampled fingerprint of the model's weights plus the
sha256 of its small files (config, tokenizer), the device type (CUDA runs use bf16 autocast, CPU runs fp32)
and every setting that changes a run's numbers or the selection. Left out: the methods and LR sweeps (a
later command may add runs), the time budget, the worker count, the extension limit, the output paths.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from frod_ds.formats.records import changed_keys, parse_json, record_from_dict, record_to_json
from frod_ds.formats.run_identity import file_sha256
from frod_ds.runtime.atomic import atomic_write_text
from studies.config import StudyConfig, StudyError

__all__ = [
    "IDENTITY_NAME",
    "BASE_NAME",
    "INVOCATIONS_NAME",
    "RUNS_DIR",
    "STUDY_FORMAT",
    "IDENTITY_SETTINGS",
    "StudyIdentity",
    "RunRecord",
    "BaseRecord",
    "Invocation",
    "InvocationsRecord",
    "StudyDir",
    "study_identity",
    "run_file_name",
]

STUDY_FORMAT = 1
IDENTITY_NAME = "study.json"
BASE_NAME = "base.json"
INVOCATIONS_NAME = "invocations.json"
RUNS_DIR = "records"  # not "runs/": the repository ignores every runs/ folder, and records get committed

# StudyConfig fields that change a run's numbers or which run is chosen (everything else is bookkeeping).
IDENTITY_SETTINGS = (
    "batch_size",
    "cutoff",
    "epochs",
    "schedule",
    "warmup_ratio",
    "max_grad_norm",
    "betas",
    "weight_decay",
    "train_on_inputs",
    "seed",
    "heldout",
    "train_limit",
    "eval_limit",
    "curve_limit",
    "checkpoints",
    "eval_batch",
    "gen_batch",
    "protocols",
    "gen_impl",
    "num_beams",
    "max_new_tokens",
    "select_by",
    "frod_sparsity",
    "frod_s_ratio",
    "frod_pi",
    "lora_alpha_ratio",
    "lora_dropout",
)

OPTIONAL_SETTINGS = {
    "exact_max_new_tokens": lambda cfg: "exact" in cfg.protocols,
    "val_every": lambda cfg: cfg.val_every > 0,
    "peft_frod_fp32": lambda cfg: cfg.peft_frod_fp32,
}


@dataclass
class StudyIdentity:
    format: int
    model: dict[str, str]  # "weights" → sampled fingerprint; "<file>" → sha256 of each small file
    data: dict[str, str]  # "train" / "eval/<task>.jsonl" → sha256
    device_type: str  # "cuda" (bf16 autocast) or "cpu" (fp32)
    settings: dict[str, Any] = field(default_factory=dict)

    def differences(self, other: StudyIdentity) -> list[str]:
        """What differs between the recorded study (``self``) and the one asked for now (``other``)."""
        out = []
        for name, a, b in (("model", self.model, other.model), ("data", self.data, other.data)):
            if a != b:
                out.append(f"{name} content ({', '.join(changed_keys(a, b))})")
        if self.device_type != other.device_type:
            out.append(f"device: {self.device_type} there, {other.device_type} now")
        out += [
            f"{k}: {self.settings.get(k)!r} there, {other.settings.get(k)!r} now"
            for k in changed_keys(self.settings, other.settings)
        ]
        return out


@dataclass
class RunRecord:
    """One finished (method, LR) run; ``test`` is filled in once the run has been scored on the test sets."""

    method: str
    lr: float
    lr_s: float | None
    trainable_params: int
    steps: int
    train_seconds: float
    step_ms: float
    wall_seconds: float
    workers: int  # runs that shared the device while it trained (step_ms is a speed comparison only at 1)
    tokens: int
    scored_tokens: int
    answer_tokens: int
    data_order_sha256: str
    peak_mem_gb: float | None
    heldout: dict[str, float]  # accuracy, loss, response_loss, answer_loss at the last step
    checkpoints: list[dict[str, Any]]  # step, held-out metrics, test-slice accuracy
    log: dict[str, list[float]]  # per step: loss, response_loss, answer_loss, grad_norm, lr
    invocation: int  # index into invocations.json of the command that trained it
    test: dict[str, Any] | None = None  # protocol → summary (average, tasks, correct_bits, seconds, ...)
    validation: list[dict[str, Any]] | None = None  # --val-every: {step, loss, response_loss, answer_loss}


@dataclass
class BaseRecord:
    step0: dict[str, Any] | None = None  # held-out and test-slice metrics of the base model (step 0 of the curves)
    test: dict[str, Any] | None = None  # protocol → summary (llm-adapters on the curve slice only)
    frod_init: dict[str, Any] | None = None  # max |logit - base| at FRoD's init, HJD seconds


@dataclass
class Invocation:
    command: str
    date: str
    device: str
    versions: dict[str, Any]
    workers: int
    max_minutes: float
    wall_seconds: float | None = None
    warnings: list[str] = field(default_factory=list)


@dataclass
class InvocationsRecord:
    invocations: list[Invocation] = field(default_factory=list)


def run_file_name(method: str, lr: float) -> str:
    """``frod_lr0.003.json``: the method and the LR as Python prints it (exact: JSON keeps the same float)."""
    return f"{method}_lr{lr!r}.json"


def _file_sha256s(paths: list[Path], root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): file_sha256(p) for p in sorted(paths)}


def study_identity(cfg: StudyConfig, device_type: str) -> StudyIdentity:
    """The identity of the study ``cfg`` asks for (reads the data files and samples the model's weights)."""
    from frod_ds.io.fingerprint import weights_fingerprint
    from frod_ds.io.hf_checkpoint import HFCheckpoint

    model_dir = Path(cfg.model)
    # config, generation config, tokenizer files; not dotfiles or the conversion record (it holds the
    # conversion's date and timing: a reconverted identical model must resume the study)
    from frod_ds.interop.gguf import MARKER

    small = [
        p
        for p in model_dir.iterdir()
        if p.is_file()
        and not p.name.startswith(".")
        and p.name != MARKER
        and p.suffix in (".json", ".jinja", ".txt", ".model")
    ]
    ckpt = HFCheckpoint(model_dir)
    model = {"weights": weights_fingerprint(ckpt, ckpt.keys()), **_file_sha256s(small, model_dir)}
    data = {
        "train": file_sha256(cfg.train_path),
        **_file_sha256s(list(cfg.eval_path.glob("*.jsonl")), cfg.eval_path.parent),
    }
    if cfg.heldout_file is not None:
        data["heldout"] = file_sha256(Path(cfg.heldout_file))
    settings = {
        k: (list(v) if isinstance(v, tuple) else v)
        for k, v in dataclasses.asdict(cfg).items()
        if k in IDENTITY_SETTINGS
    }
    # settings added later enter the identity only where used, so studies recorded before them still resume
    settings.update({k: getattr(cfg, k) for k, used in OPTIONAL_SETTINGS.items() if used(cfg)})
    return StudyIdentity(format=STUDY_FORMAT, model=model, data=data, device_type=device_type, settings=settings)


def _read(cls, path: Path):
    return record_from_dict(cls, parse_json(path.read_text(), path, StudyError), str(path), StudyError)


class StudyDir:
    """A study's output directory: its identity, base record, invocations and run records."""

    def __init__(self, path: Path):
        self.path = Path(path)

    @property
    def runs_dir(self) -> Path:
        return self.path / RUNS_DIR

    def exists(self) -> bool:
        return (self.path / IDENTITY_NAME).is_file()

    def identity(self) -> StudyIdentity:
        return _read(StudyIdentity, self.path / IDENTITY_NAME)

    def check_identity(self, wanted: StudyIdentity, what: str) -> None:
        """StudyError (one line) unless the recorded identity equals ``wanted``."""
        diff = self.identity().differences(wanted)
        if diff:
            shown = "; ".join(diff[:4]) + (f"; and {len(diff) - 4} more" if len(diff) > 4 else "")
            raise StudyError(
                f"{what} {self.path} holds a study with another configuration ({shown}); "
                "use its settings, or choose a new --out"
            )

    def create(self, identity: StudyIdentity) -> None:
        self.runs_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.path / IDENTITY_NAME, record_to_json(identity))

    # -- records -----------------------------------------------------------------------------------------

    def base(self) -> BaseRecord:
        path = self.path / BASE_NAME
        return _read(BaseRecord, path) if path.is_file() else BaseRecord()

    def write_base(self, record: BaseRecord) -> None:
        atomic_write_text(self.path / BASE_NAME, record_to_json(record))

    def invocations(self) -> InvocationsRecord:
        path = self.path / INVOCATIONS_NAME
        return _read(InvocationsRecord, path) if path.is_file() else InvocationsRecord()

    def write_invocations(self, record: InvocationsRecord) -> None:
        atomic_write_text(self.path / INVOCATIONS_NAME, record_to_json(record))

    def runs(self) -> list[RunRecord]:
        out = []
        for path in sorted(self.runs_dir.glob("*.json")) if self.runs_dir.is_dir() else []:
            record = _read(RunRecord, path)
            if path.name != run_file_name(record.method, record.lr):
                raise StudyError(
                    f"{path} holds the run {record.method} lr={record.lr!r}, not the one its name says; "
                    "it was renamed or edited by hand"
                )
            out.append(record)
        return out

    def write_run(self, record: RunRecord) -> None:
        atomic_write_text(self.runs_dir / run_file_name(record.method, record.lr), record_to_json(record))

    # -- carrying a study over -----------------------------------------------------------------------------

    def copy_records_from(self, src: StudyDir) -> list[str]:
        """Copy ``src``'s records that this directory lacks (identity checked by the caller); the names copied."""
        copied = []
        for name in (IDENTITY_NAME, BASE_NAME, INVOCATIONS_NAME, "real_study.log"):
            if (src.path / name).is_file() and not (self.path / name).exists():
                shutil.copyfile(src.path / name, self.path / name)
                copied.append(name)
        self.runs_dir.mkdir(parents=True, exist_ok=True)
        for path in sorted(src.runs_dir.glob("*.json")) if src.runs_dir.is_dir() else []:
            if re.fullmatch(r"[\w.+-]+\.json", path.name) and not (self.runs_dir / path.name).exists():
                shutil.copyfile(path, self.runs_dir / path.name)
                copied.append(f"{RUNS_DIR}/{path.name}")
        return copied
