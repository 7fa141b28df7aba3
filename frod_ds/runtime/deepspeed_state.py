"""The process-wide switches frod-ds sets for DeepSpeed, and their undoing (:func:`undo`): a ``DS_ACCELERATOR``
checked before DeepSpeed reads it (an empty one unset), ``LOCAL_RANK`` while a group lives, DeepSpeed's
shared-memory op kept from building, its NVTX ranges off, and PyTorch's ``linear`` that ``zero.Init`` replaces.
No ``torch.distributed`` here (``frod_ds.runtime.distributed`` joins the group and calls these)."""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import os
import sys
from pathlib import Path

import torch

from frod_ds.runtime.errors import FrodError

__all__ = [
    "ACCELERATOR_ENV",
    "NVTX_ENV",
    "SHM_COMM_OP",
    "accelerator_problem",
    "check_accelerator",
    "quiet_nvtx",
    "restore_functional_linear",
    "set_env",
    "skip_shm_comm_op",
    "undo",
]

# Process-wide state this module creates, undone by ``undo``: the environment variables set for DeepSpeed
# (name -> the value they replaced, None when unset).
_saved_env: dict[str, str | None] = {}
# Entries of ``deepspeed.ops.__compatible_ops__`` turned off by ``skip_shm_comm_op`` (name -> the value they had).
_saved_ops: dict[str, bool] = {}
# ``deepspeed.utils.nvtx.enable_nvtx`` as it was before ``quiet_nvtx`` turned it off (None: not turned off).
_saved_nvtx: bool | None = None
NVTX_ENV = "FROD_DS_NVTX"  # "1": keep DeepSpeed's NVTX ranges (for a profiler such as Nsight Systems)
SHM_COMM_OP = "deepspeed_shm_comm"  # DeepSpeed's ShareMemCommBuilder.NAME


ACCELERATOR_ENV = "DS_ACCELERATOR"  # DeepSpeed's choice of device kind, read when deepspeed is first imported
_ACCELERATOR_FIX = "unset it (DeepSpeed then finds the device itself) or set DS_ACCELERATOR=cpu"


def _supported_accelerators() -> list[str] | None:
    """DeepSpeed's ``SUPPORTED_ACCELERATOR_LIST``, read from its source when deepspeed is not imported yet (its
    import resolves ``DS_ACCELERATOR`` and raises on a bad one); None when it cannot be read."""
    loaded = sys.modules.get("deepspeed.accelerator.real_accelerator")
    if loaded is not None:
        return list(loaded.SUPPORTED_ACCELERATOR_LIST)
    spec = importlib.util.find_spec("deepspeed")  # a top-level package: found, not imported
    for root in (spec.submodule_search_locations or []) if spec else []:
        try:
            tree = ast.parse((Path(root) / "accelerator" / "real_accelerator.py").read_text())
        except (OSError, SyntaxError, ValueError):
            return None
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(
                getattr(t, "id", "") == "SUPPORTED_ACCELERATOR_LIST" for t in node.targets
            ):
                with contextlib.suppress(ValueError):
                    return [str(name) for name in ast.literal_eval(node.value)]
    return None


def accelerator_problem(device: bool = True) -> str | None:
    """Why DeepSpeed cannot run on the ``DS_ACCELERATOR`` set (a name it does not know; with ``device``, the
    command runs on it: ``cuda`` without a visible GPU), or None: unset or empty (taken as unset), or usable as far
    as can be told before importing it."""
    value = os.environ.get(ACCELERATOR_ENV)
    if not value:
        return None
    supported = _supported_accelerators()
    if supported is not None and value not in supported:
        return (
            f"{ACCELERATOR_ENV}={value!r} names no accelerator DeepSpeed knows ({', '.join(supported)}); "
            f"{_ACCELERATOR_FIX}"
        )
    if device and value == "cuda" and not torch.cuda.is_available():
        return (
            f"{ACCELERATOR_ENV}=cuda but this process sees no CUDA GPU (none installed, CUDA_VISIBLE_DEVICES empty or "
            f"the driver not loaded); {_ACCELERATOR_FIX}"
        )
    return None


def check_accelerator(device: bool = True) -> None:
    """Before DeepSpeed is first imported (it resolves ``DS_ACCELERATOR`` then, once per process): a
    ``FrodError`` for a value it cannot use (:func:`accelerator_problem`), an empty one unset until
    :func:`undo` (DeepSpeed refuses ``""``), and deepspeed imported where installed, so that the ``ValueError``
    its import raises for a kind whose support is missing (``npu`` without ``torch_npu``) is one line too. For
    every command that imports DeepSpeed, itself or through transformers' ``save_pretrained``."""
    problem = accelerator_problem(device)
    if problem:
        raise FrodError(problem)
    if os.environ.get(ACCELERATOR_ENV) == "":
        _saved_env.setdefault(ACCELERATOR_ENV, "")
        del os.environ[ACCELERATOR_ENV]
    if "deepspeed" in sys.modules or importlib.util.find_spec("deepspeed") is None:
        return
    try:
        import deepspeed  # noqa: F401 - resolves the accelerator
    except ValueError as e:
        value = os.environ.get(ACCELERATOR_ENV)
        if not value:
            raise
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise FrodError(f"{ACCELERATOR_ENV}={value!r}: DeepSpeed cannot use it ({first}); {_ACCELERATOR_FIX}") from None


def skip_shm_comm_op(deepspeed) -> None:
    """Keep DeepSpeed's CPU backend from compiling its shared-memory all-reduce op at ``init_distributed``.

    Only AutoTP inference uses ``deepspeed_shm_comm``, yet DeepSpeed JIT-builds and loads it in every rank of every
    launch, waiting without a timeout on a build lock (docs/failure-policy.md#deepspeeds-jit-built-ops). Its
    ``deepspeed.ops.__compatible_ops__`` entry is set false here and put back by :func:`undo`.
    """
    ops = deepspeed.ops.__compatible_ops__  # probed once per process, then one dict that edits persist in
    if ops.get(SHM_COMM_OP):
        _saved_ops.setdefault(SHM_COMM_OP, ops[SHM_COMM_OP])
        ops[SHM_COMM_OP] = False


def quiet_nvtx(deepspeed) -> None:
    """Turn off DeepSpeed's NVTX ranges unless ``$FROD_DS_NVTX`` is 1. DeepSpeed wraps each of ZeRO-3's fetches,
    releases, hooks and partitions in an NVTX range push and pop, each with two ``torch.compiler.is_compiling``
    checks: Python that runs whether or not a profiler listens (15% of a 7B ``zero3.json`` step's Python calls,
    ``bench/results/host_calls``), on a step whose host work is what bounds it on one GPU
    (``bench/results/zero3_levers``, ablation ``nvtx-on``). The ranges only serve a
    profiler such as Nsight Systems: ``FROD_DS_NVTX=1`` keeps them. DeepSpeed itself turns them off for
    ``engine.compile()``; :func:`undo` puts back the value it had."""
    global _saved_nvtx
    nvtx = deepspeed.utils.nvtx
    if os.environ.get(NVTX_ENV) != "1" and nvtx.enable_nvtx:
        if _saved_nvtx is None:
            _saved_nvtx = nvtx.enable_nvtx
        nvtx.enable_nvtx = False


def set_env(**values: str) -> None:
    for name, value in values.items():
        if os.environ.get(name) != value:
            _saved_env.setdefault(name, os.environ.get(name))
            os.environ[name] = value


def restore_functional_linear() -> None:
    """Put ``torch.nn.functional.linear`` back where ``deepspeed.zero.Init`` replaced it process-wide (a JSON with
    ``zero_optimization.memory_efficient_linear`` true, DeepSpeed's default; the shipped ones turn it off): DeepSpeed
    keeps the original and leaves the replacement in place for the rest of the process."""
    pp = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
    original = getattr(getattr(pp, "InsertPostInitMethodToModuleSubClasses", None), "linear_bk", None)
    if original is not None and torch.nn.functional.linear is not original:
        torch.nn.functional.linear = original


def undo() -> None:
    """Put back everything this module changed in the process: the environment variables, DeepSpeed's op table
    and NVTX switch, and PyTorch's ``linear`` where ``zero.Init`` replaced it (``frod_ds.runtime.distributed.destroy``
    calls it on every exit)."""
    global _saved_nvtx
    for name, value in _saved_env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    _saved_env.clear()
    ds_ops = sys.modules.get("deepspeed.ops")
    if ds_ops is not None and _saved_ops:
        ds_ops.__compatible_ops__.update(_saved_ops)
    _saved_ops.clear()
    ds_nvtx = sys.modules.get("deepspeed.utils.nvtx")
    if ds_nvtx is not None and _saved_nvtx is not None:
        ds_nvtx.enable_nvtx = _saved_nvtx
    _saved_nvtx = None
    restore_functional_linear()
