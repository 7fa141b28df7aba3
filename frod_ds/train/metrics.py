"""What a run records of its steps: metrics.jsonl rows, TensorBoard scalars, loss.png, and each step's peak memory.

The keys of a row are listed in docs/training.md (Outputs and resume); rank 0 writes them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from frod_ds.runtime.atomic import atomic_write_text, open_tmp, replacing
from frod_ds.runtime.errors import FrodError, note
from frod_ds.runtime.paths import replaceable_own
from frod_ds.runtime.strict_json import loads

__all__ = ["METRICS", "MetricsLog", "drop_rows_after", "plot_loss", "peak_mem_gb", "reset_peak_mem"]

METRICS = "metrics.jsonl"


class MetricsLog:
    """Rank 0's log of a run in ``out``: one JSON row per logged step appended to ``metrics.jsonl``, its numbers also
    to ``out/tensorboard`` as ``train/<key>`` when ``tensorboard`` (checked importable before the run starts)."""

    def __init__(self, out: Path, tensorboard: bool) -> None:
        self.path = out / METRICS
        self.writer: Any = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(out / "tensorboard"))

    def write(self, row: dict[str, Any]) -> None:
        try:
            f = open(self.path, "a")
        except FileNotFoundError:
            if self.path.parent.is_dir():
                raise
            raise FrodError(
                f"the run's output_dir {self.path.parent} is gone (moved or deleted while training); the run stopped "
                f"at step {row.get('step')}: resume it where its folder is now (output_dir=<that folder>)"
            ) from None
        with f:
            f.write(json.dumps(row) + "\n")
        if self.writer is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.writer.add_scalar(f"train/{k}", v, row["step"])

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _row_step(line: str) -> int | None:
    """The ``step`` of a metrics row, None when ``line`` is not one."""
    try:
        row = loads(line)
    except json.JSONDecodeError:
        return None
    step = row.get("step") if isinstance(row, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def _parses(line: str) -> bool:
    try:
        loads(line)
    except json.JSONDecodeError:
        return False
    return True


def drop_rows_after(path: Path, step: int, log_every: int = 1, finished: bool = False) -> None:
    """Keep only the rows of ``path`` up to ``step``, the step a run continues from: the steps after it are
    replayed (all of them when a run killed before its first sealed checkpoint starts over), none logged twice.
    A log that lost the rows up to ``step`` gets a ``note:``. A last line a kill cut short (no newline, not JSON) is
    dropped with a ``note:``; any other line that is not a row, and for a ``finished`` run (nothing replayed) a row
    past ``step``, is a ``FrodError`` naming it (the file is left as it is)."""
    gone = f"the rows of steps 1-{step} are gone (deleted since?): the log and loss.png start after step {step}"
    if not path.is_file():
        if step >= log_every:
            note(f"{path} is missing; {gone}")
        return
    text = path.read_text(errors="replace")
    lines = text.splitlines()
    # a kill mid-write leaves a row's prefix: no newline (a row and its newline go in one write) and never valid JSON
    # (a run killed writing the row of the step it sealed last, too); any other line is refused below
    torn = not text.endswith("\n") and bool(lines) and not _parses(lines[-1])
    if torn:
        note(f"{path}: its last line was cut short (a killed run); dropped, the {len(lines) - 1} complete rows kept")
        lines = lines[:-1]
    kept = []
    for n, line in enumerate(lines, start=1):
        at = _row_step(line)
        if at is None and line.strip():
            raise FrodError(
                f"{path} line {n} is not a metrics row ({line[:60]!r}); it was edited after the run wrote it: "
                "restore or delete that line, or pass train.new_run=true"
            )
        if at is not None and at > step and finished:
            raise FrodError(
                f"{path} line {n} is a row of step {at}, past step {step} where the finished run ended: the run did "
                "not write it; delete that line, or pass train.new_run=true"
            )
        if at is not None and at <= step:
            kept.append(line)
    if step >= log_every and not kept:
        note(f"{path} holds no row up to step {step}; {gone}")
    kept_text = "".join(line + "\n" for line in kept)
    if kept_text != text and (torn or not finished):  # else a finished run's log is left as it is (blank lines too)
        atomic_write_text(path, kept_text)


def peak_mem_gb() -> float:
    """GPU: the most memory allocated since the last ``reset_peak_mem`` (one training step's peak, the figure
    ``frod plan`` predicts); CPU: the process's max RSS so far."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB → GiB (Linux)


def reset_peak_mem() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


PLOT_MARK = ("Software", "frod-ds loss plot")  # a PNG text chunk: the plot a run wrote, which a later run replaces


def _plot_is_ours(png: Path) -> bool:
    """Whether ``png`` is absent or the loss plot a run wrote (its text chunk, ahead of the image data)."""
    mark = b"%s\x00%s" % tuple(v.encode() for v in PLOT_MARK)
    return replaceable_own(png, lambda head: head.startswith(b"\x89PNG") and mark in head)


def plot_loss(metrics_path: Path, png: Path) -> None:
    """Loss (and eval loss) against step, from metrics.jsonl; a file at ``png`` that is not a run's plot is left
    as it is (a note says so)."""
    if not _plot_is_ours(png):
        note(f"{png} is not a loss plot a run wrote: left as it is, the plot not written")
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="train loss")
    ev = [r for r in rows if "eval_loss" in r]
    if ev:
        ax.plot([r["step"] for r in ev], [r["eval_loss"] for r in ev], "o-", label="eval loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:  # through the project's temporary (``runtime.atomic.TMP``): a link or pipe there is refused, not written to
        with replacing(png) as tmp:
            with open(open_tmp(tmp), "wb") as f:
                fig.savefig(f, format="png", metadata=dict([PLOT_MARK]))
            os.replace(tmp, png)
    finally:
        plt.close(fig)
