"""The study's configuration: methods, their LR sweeps and every shared training/eval setting, validated.

Methods: ``frod`` (frod-ds' FRoD; its LR is σ's, S's is ``frod_s_ratio`` times it), ``frod_ratio<k>`` (S LR = σ LR
/ k), ``full``, ``lora<r>`` (PEFT LoRA of rank r on FRoD's targets), ``peftfrod`` (stock PEFT ``FrodConfig`` as a
PEFT user gets it: its own basis, support and λ⁰, its default ``sparse_rate``, one LR for every trainable tensor),
``peftfrod_sr<dd>`` (the same at ``sparse_rate`` 0.dd), ``peftfrod_inj`` (stock PEFT FRoD holding frod-ds'
factors, support and σ⁰, trained as ``frod``: the cross-check) and ``frod_fp32`` (``frod`` without autocast: the
cross-check's twin where stock PEFT FRoD has to train in fp32). All sweeps have the same size; a method whose
choice sits at an end of its sweep may add up to ``extend`` LRs past that end (``schedule``).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from frod_ds.core.names import DEFAULT_TARGETS

__all__ = [
    "StudyError",
    "MethodSpec",
    "method_spec",
    "DEFAULT_LRS",
    "PROTOCOLS",
    "MAIN_METHODS",
    "RATIO_METHODS",
    "ARITH_GATE",
    "StudyConfig",
    "parse_lrs",
    "TARGETS",
]

# FRoD's targets and LoRA's (the same modules for both): the library's default FRoD targets
TARGETS = DEFAULT_TARGETS

# Half-decade grids. studies/results/real_study_1xh100 (SmolLM2-135M, LLM-Adapters rows, chosen by held-out
# answer-word loss) chose FRoD σ 1e-3, LoRA r16 1e-3, r32 3e-3, full 3e-4, each inside its swept range.
# Stock PEFT FRoD trains λ and S at one LR: S moves 10x faster than frod's, so its grid sits half a decade lower.
DEFAULT_LRS: dict[str, tuple[float, ...]] = {
    "frod": (1e-3, 3e-3, 1e-2),
    "lora": (3e-4, 1e-3, 3e-3),
    "full": (3e-5, 1e-4, 3e-4),
    "peftfrod": (3e-4, 1e-3, 3e-3),
    "peftfrod_inj": (1e-3, 3e-3, 1e-2),
}
PROTOCOLS = ("loglik", "llm-adapters", "exact")
# the learnability study's (``learn``): methods with LR sweeps, and FRoD's S rate at σ/3 and σ/30 beside σ/10
MAIN_METHODS = ("frod", "peftfrod", "peftfrod_sr02", "lora16", "lora64", "full")
RATIO_METHODS = ("frod_ratio3", "frod_ratio30")
# the pilot gate (docs/learn-study.md): full fine-tuning's chosen run must reach this exact match on the unseen
# pairs. `arith` failing it is kept as the pilot's record, out of the convergence line; `arith_d12`, the last
# arithmetic variant tried, is reported either way, with its shortfall stated where it has one
ARITH_GATE = {"method": "full", "split": "arith_unseen", "min_exact": 0.90, "pilot_only": ("arith", "arith_d12")}


class StudyError(ValueError):
    """A user mistake; the message is one line naming what is wrong and what to do."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).splitlines()))


@dataclass(frozen=True)
class MethodSpec:
    name: str  # "frod", "full", "lora16", ...
    kind: str  # "frod" | "lora" | "full" | "peftfrod" (stock PEFT) | "peftfrod_inj" (PEFT on frod-ds' factors)
    rank: int | None = None  # LoRA rank
    s_per_sigma: float | None = None  # frod_ratio<k>: S LR / σ LR = 1/k (None: the study's frod_s_ratio)
    sparse_rate: float | None = None  # peftfrod_sr<dd>: PEFT's sparse_rate (None: PEFT's default)
    fp32: bool = False  # frod_fp32: trained without autocast (the cross-check's twin where PEFT FRoD needs fp32)

    def s_ratio(self, default: float) -> float:
        """S LR / σ LR of a FRoD method."""
        return default if self.s_per_sigma is None else self.s_per_sigma

    @property
    def two_rates(self) -> bool:
        """σ and S at two LRs (frod-ds' FRoD and the injected cross-check); stock PEFT FRoD has one."""
        return self.kind in ("frod", "peftfrod_inj")


def method_spec(name: str) -> MethodSpec:
    """``frod`` | ``full`` | ``peftfrod`` | ``peftfrod_sr<dd>`` | ``peftfrod_inj`` | ``lora<r>`` | ``frod_ratio<k>``
    → its spec; StudyError otherwise."""
    if name in ("frod", "full", "peftfrod", "peftfrod_inj"):
        return MethodSpec(name, name)
    if name == "frod_fp32":
        return MethodSpec(name, "frod", fp32=True)
    m = re.fullmatch(r"lora(\d+)", name)
    if m and int(m.group(1)) > 0:
        return MethodSpec(name, "lora", int(m.group(1)))
    m = re.fullmatch(r"frod_ratio(\d+)", name)
    if m and int(m.group(1)) > 0:
        return MethodSpec(name, "frod", s_per_sigma=1 / int(m.group(1)))
    m = re.fullmatch(r"peftfrod_sr(\d+)", name)
    if m and int(m.group(1)) > 0:
        return MethodSpec(name, "peftfrod", sparse_rate=float(f"0.{m.group(1)}"))
    raise StudyError(
        f"unknown method {name!r}; use frod, full, lora<r> (e.g. lora16), frod_ratio<k> (e.g. frod_ratio30: "
        "S LR = σ LR / 30), peftfrod (stock PEFT FRoD), peftfrod_sr<dd> (its sparse_rate 0.dd, e.g. peftfrod_sr02) "
        "peftfrod_inj (stock PEFT FRoD on frod-ds' factors) or frod_fp32 (frod without autocast)"
    )


def parse_lrs(items: list[str], methods: list[str]) -> dict[str, tuple[float, ...]]:
    """``["frod=3e-4,1e-3,3e-3", ...]`` over the defaults → ``{method: lrs}`` (ascending); StudyError on bad input."""
    lrs = {m: DEFAULT_LRS[method_spec(m).kind] for m in methods}
    for item in items:
        name, sep, values = item.partition("=")
        if not sep or name not in lrs:
            raise StudyError(f"--lrs {item!r}: expected METHOD=LR,LR,... with METHOD one of {', '.join(methods)}")
        try:
            parsed = tuple(float(v) for v in values.split(","))
        except ValueError:
            raise StudyError(f"--lrs {item!r}: learning rates must be numbers, e.g. {name}=1e-4,3e-4,1e-3") from None
        if not all(math.isfinite(v) and v > 0 for v in parsed) or len(set(parsed)) != len(parsed):
            raise StudyError(f"--lrs {item!r}: learning rates must be distinct positive numbers")
        lrs[name] = parsed
    return {m: tuple(sorted(v)) for m, v in lrs.items()}


@dataclass
class StudyConfig:
    model: str
    data: str | None
    out: str
    train: str | None = None  # defaults to <data>/train.jsonl
    eval_dir: str | None = None  # defaults to <data>/eval
    heldout_file: str | None = None  # LR-selection rows; None: ``heldout`` rows split off the training rows
    methods: list[str] = field(default_factory=lambda: ["frod", "lora16", "lora32", "full"])
    lrs: dict[str, tuple[float, ...]] = field(default_factory=dict)
    batch_size: int = 64
    cutoff: int = 256
    epochs: float = 1.0
    schedule: str = "cosine"
    warmup_ratio: float = 0.1
    max_grad_norm: float = 1.0
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    train_on_inputs: bool = False
    seed: int = 0
    heldout: int = 512
    train_limit: int | None = None
    eval_limit: int | None = None  # per task, final evals (None: whole test sets)
    curve_limit: int = 128  # per task, the test slice of the accuracy-vs-step curve
    checkpoints: int = 4  # evaluations per run (evenly spaced, the last at the final step)
    val_every: int = 0  # validation losses every this many steps too (0: at the checkpoints only)
    eval_batch: int = 64
    gen_batch: int = 128
    protocols: tuple[str, ...] = ("loglik", "llm-adapters")
    gen_impl: str = "auto"
    num_beams: int = 4
    max_new_tokens: int = 32
    exact_max_new_tokens: int = 16  # greedy tokens of the exact-match protocol (answer + EOS must fit)
    select_by: str = "accuracy"
    smooth_frac: float = 0.05
    base_eval: bool = True
    plots: bool = True  # the study's own plots beside its records (``learn`` draws its own from every seed)
    max_minutes: float = 8.5
    workers: int = 0  # runs at a time sharing the device; 0: 3 on CUDA, 1 on CPU
    eval_reserve_minutes: float = 2.0  # kept free for the final evaluations when deciding to start a round
    device: str = "auto"
    frod_sparsity: float = 0.02
    frod_s_ratio: float = 0.1
    frod_pi: float = 1e-3
    peft_frod_fp32: bool = False  # stock PEFT FRoD kinds without autocast (its sparse matmul fails under bf16)
    lora_alpha_ratio: float = 2.0
    lora_dropout: float = 0.0
    resume_from: str | None = None  # a study directory whose records are copied into ``out`` first
    extend: int = 1  # LRs a method may add past an end of its sweep when its choice sits there

    @property
    def train_path(self) -> Path:
        return Path(self.train) if self.train else Path(self.data or ".") / "train.jsonl"

    @property
    def eval_path(self) -> Path:
        return Path(self.eval_dir) if self.eval_dir else Path(self.data or ".") / "eval"

    def validate(self) -> None:
        """Every problem that can be seen before anything is loaded, in one StudyError."""
        problems = []
        if not (Path(self.model) / "config.json").is_file():
            problems.append(f"--model {self.model} is not a Hugging Face checkpoint directory (no config.json)")
        if self.data is None and (self.train is None or self.eval_dir is None):
            problems.append("pass --data DIR (with train.jsonl and eval/) or both --train FILE and --eval-dir DIR")
        elif not self.train_path.is_file():
            problems.append(f"training rows {self.train_path} not found; build them with `python -m data_prep build`")
        elif not self.eval_path.is_dir() or not any(self.eval_path.glob("*.jsonl")):
            problems.append(f"test rows {self.eval_path}/<task>.jsonl not found")
        out = Path(self.out)
        if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / "study.json").is_file())):
            problems.append(
                f"--out {out} exists and is neither empty nor a study directory (no study.json); choose a new one"
            )
        if self.resume_from is not None and not (Path(self.resume_from) / "study.json").is_file():
            problems.append(
                f"--resume-from {self.resume_from} is not a study directory (no study.json); give the "
                "--out of an earlier run (unpacked)"
            )
        # the methods trained now; ``lrs`` may also name methods recorded earlier (their grids, for the report)
        sizes = {m: len(v) for m, v in self.lrs.items() if m in self.methods}
        if len(set(sizes.values())) > 1:
            problems.append(f"LR sweeps must have equal sizes, got {sizes}; adjust --lrs")
        for name, value, ok in (
            ("--batch-size", self.batch_size, self.batch_size >= 1),
            ("--cutoff", self.cutoff, self.cutoff >= 8),
            ("--epochs", self.epochs, self.epochs > 0),
            ("--warmup-ratio", self.warmup_ratio, 0 <= self.warmup_ratio < 1),
            ("--heldout", self.heldout, self.heldout >= 1),
            ("--checkpoints", self.checkpoints, self.checkpoints >= 1),
            ("--val-every", self.val_every, self.val_every >= 0),
            ("--curve-limit", self.curve_limit, self.curve_limit >= 1),
            ("--workers", self.workers, self.workers >= 0),
            ("--extend", self.extend, self.extend >= 0),
            ("--eval-batch", self.eval_batch, self.eval_batch >= 1),
            ("--gen-batch", self.gen_batch, self.gen_batch >= 1),
            ("--max-minutes", self.max_minutes, self.max_minutes > 0),
            ("--eval-reserve-minutes", self.eval_reserve_minutes, 0 <= self.eval_reserve_minutes < self.max_minutes),
            ("--frod-sparsity", self.frod_sparsity, 0 < self.frod_sparsity < 1),
            ("--smooth-frac", self.smooth_frac, 0 <= self.smooth_frac < 1),
            ("--train-limit", self.train_limit, self.train_limit is None or self.train_limit >= 1),
            ("--eval-limit", self.eval_limit, self.eval_limit is None or self.eval_limit >= 1),
        ):
            if not ok:
                problems.append(f"{name} {value} is out of range")
        if self.schedule not in ("cosine", "linear", "constant"):
            problems.append(f"--schedule {self.schedule!r}: use cosine, linear or constant")
        if self.select_by not in ("accuracy", "answer_loss"):
            problems.append(f"--select-by {self.select_by!r}: use accuracy or answer_loss")
        # the llm-adapters protocol is the library's scorer, with LLM-Adapters' own beams and new tokens
        from frod_ds.eval.predict import LLM_ADAPTERS_MAX_NEW_TOKENS, LLM_ADAPTERS_NUM_BEAMS

        if self.gen_impl not in ("auto", "project"):
            problems.append(
                f"--gen-impl {self.gen_impl!r}: the study scores with the library's "
                "frod_ds.eval.predict.score_llm_adapters_rows only; use auto or project"
            )
        for name, value, protocol in (
            ("--num-beams", self.num_beams, LLM_ADAPTERS_NUM_BEAMS),
            ("--max-new-tokens", self.max_new_tokens, LLM_ADAPTERS_MAX_NEW_TOKENS),
        ):
            if value != protocol:
                problems.append(
                    f"{name} {value}: LLM-Adapters' protocol (frod_ds.eval.predict) uses {protocol}; leave {name} out"
                )
        bad = [p for p in self.protocols if p not in PROTOCOLS]
        if bad or not self.protocols:
            problems.append(f"--protocols {','.join(self.protocols)!r}: use some of {', '.join(PROTOCOLS)}")
        if self.heldout_file is not None and not Path(self.heldout_file).is_file():
            problems.append(f"--heldout-file {self.heldout_file} not found")
        if self.device not in ("auto", "cpu", "cuda"):
            problems.append(f"--device {self.device!r}: use auto, cpu or cuda")
        if problems:
            raise StudyError("; ".join(problems))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["lrs"] = {m: list(v) for m, v in self.lrs.items()}
        d["lr_s_per_frod_sigma_lr"] = self.frod_s_ratio
        d["lora_alpha"] = {
            m: self.lora_alpha_ratio * method_spec(m).rank for m in self.methods if method_spec(m).kind == "lora"
        }
        d["targets"] = list(TARGETS)
        return d
