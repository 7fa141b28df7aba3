"""The one training loop of the study: every method runs exactly this code on the same batches.

Per step: forward the decoder, the LM head only at the positions whose next token is scored (a generic
speed-up for every method: no ``(B, T, vocab)`` logits), cross-entropy in fp32; the objective is the mean
over the scored tokens (the project's loss mask), and two diagnostics come from the same numbers: the mean
over the answer+EOS tokens ("response") and over the answer-word tokens only. Gradient clipping, AdamW,
warmup + decay (``frod_ds.train.schedule.lr_lambda``). Per-step values stay on the device until the run ends, so
the loop never waits for the GPU.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from frod_ds.train.schedule import lr_lambda
from studies.data import Batch
from studies.models import decoder_and_head

__all__ = ["autocast", "fp32_only", "sparse_mm_autocast_ok", "token_nll", "batch_losses", "RunLog", "train_run"]

_FP32 = False  # set by fp32_only(): every autocast() of this process is fp32 inside it


def autocast(device: torch.device):
    """bf16 autocast on CUDA; fp32 on CPU and inside ``fp32_only()``."""
    if device.type == "cuda" and not _FP32:
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


@contextlib.contextmanager
def fp32_only():
    """Training and evaluation in fp32 inside (a method whose kernels fail under bf16 autocast)."""
    global _FP32
    before, _FP32 = _FP32, True
    try:
        yield
    finally:
        _FP32 = before


def sparse_mm_autocast_ok(device: torch.device) -> bool:
    """Whether ``torch.sparse.mm`` of a COO matrix (stock PEFT FRoD's S) runs forward and backward under this
    device's bf16 autocast: autocast casts it to bf16, which some CUDA builds do not implement."""
    if device.type != "cuda":
        return True
    try:
        values = torch.ones(2, device=device, requires_grad=True)
        S = torch.sparse_coo_tensor(torch.tensor([[0, 1], [1, 0]], device=device), values, (2, 2)).coalesce()
        with autocast(device):
            out = torch.sparse.mm(S, torch.randn(2, 3, device=device)).t()  # as PEFT's _sparse_activation_mm
        out.float().sum().backward()
        torch.cuda.synchronize(device)
        return True
    except RuntimeError:
        return False


def token_nll(model: nn.Module, batch: Batch) -> torch.Tensor:
    """``-log p(target | prefix)`` (N,) at the batch's scored positions, in fp32.

    The batch is right-padded, so under the causal mask a real token never sees a pad token: no padding mask
    is passed (the same numbers at every scored position, without building a (B, 1, T, T) mask and the host
    sync that checks it each step; SDPA takes its causal kernel). Positions count from 0 in every row.
    """
    decoder, head = decoder_and_head(model)
    hidden = decoder(input_ids=batch.input_ids, use_cache=False).last_hidden_state  # (B, T, H)
    h = hidden.flatten(0, 1).index_select(0, batch.pos)  # (N, H)
    return F.cross_entropy(head(h).float(), batch.target, reduction="none")  # (N,)


def batch_losses(model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(objective, response loss, answer-word loss) of one batch: means of token NLLs over their masks."""
    nll = token_nll(model, batch)  # (N,)
    resp, word = batch.response.float(), batch.answer_word.float()
    return nll.mean(), (nll * resp).sum() / resp.sum(), (nll * word).sum() / word.sum()


@dataclass
class RunLog:
    steps: int
    loss: list[float] = field(default_factory=list)  # the objective, per step
    response_loss: list[float] = field(default_factory=list)
    answer_loss: list[float] = field(default_factory=list)
    grad_norm: list[float] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)
    checkpoints: list[dict] = field(default_factory=list)
    validation: list[dict] = field(default_factory=list)  # {"step", ...} of the light validation evaluations
    train_seconds: float = 0.0
    tokens: int = 0  # padded-away tokens excluded
    scored_tokens: int = 0
    answer_tokens: int = 0
    data_order_sha256: str = ""
    completed: bool = False
    peak_mem_gb: float | None = None

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_run(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Sequence[Batch],
    cfg,
    device: torch.device,
    checkpoint_steps: set[int],
    on_checkpoint: Callable[[int], dict],
    deadline: float,
    validation_steps: set[int] = frozenset(),
    on_validation: Callable[[int], dict] | None = None,
) -> RunLog:
    """Train ``model`` on ``batches`` (one per step); ``on_checkpoint(step)`` after the listed steps, and the lighter
    ``on_validation(step)`` after ``validation_steps`` that are no checkpoint. Evaluation time is not training time.

    Stops early (``completed`` False) once ``time.time()`` passes ``deadline``.
    """
    steps = len(batches)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(cfg.schedule, int(round(cfg.warmup_ratio * steps)), steps)
    )
    trainable = [p for p in model.parameters() if p.requires_grad]
    values = torch.zeros(steps, 4, device=device)  # (steps, [objective, response, answer word, grad norm])
    log, order = RunLog(steps), hashlib.sha256()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model.train()
    _sync(device)
    t0, eval_seconds, done = time.perf_counter(), 0.0, 0
    for step, batch in enumerate(batches):
        log.lr.append(optimizer.param_groups[0]["lr"])
        with autocast(device):
            loss, resp, word = batch_losses(model, batch)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(trainable, cfg.max_grad_norm)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        values[step] = torch.stack([loss.detach(), resp.detach(), word.detach(), gnorm.detach().float()])
        log.tokens += batch.n_tokens
        log.scored_tokens += batch.n_scored
        log.answer_tokens += batch.n_answer
        order.update(batch.digest.encode())
        done = step + 1
        if done in checkpoint_steps or (on_validation is not None and done in validation_steps):
            _sync(device)
            e0 = time.perf_counter()
            if done in checkpoint_steps:
                log.checkpoints.append({"step": done, **on_checkpoint(done)})
            else:
                log.validation.append({"step": done, **on_validation(done)})
            model.train()
            eval_seconds += time.perf_counter() - e0
        if time.time() > deadline:
            break
    _sync(device)
    log.train_seconds = time.perf_counter() - t0 - eval_seconds
    rows = values[:done].cpu().tolist()
    log.loss, log.response_loss, log.answer_loss, log.grad_norm = (list(c) for c in zip(*rows)) if rows else ([],) * 4
    log.data_order_sha256 = order.hexdigest()
    log.completed = done == steps
    log.steps = done
    if device.type == "cuda":
        log.peak_mem_gb = torch.cuda.max_memory_allocated(device) / 2**30
    return log
