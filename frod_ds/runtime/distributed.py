"""Every ``torch.distributed`` call of the project, as small named helpers.

Ranks come from the launcher's environment (``frod_ds.runtime.launch_env``); with no launcher the program is one
process and every helper is the identity or a no-op, so library code calls them unconditionally. No
process-wide state outlives :func:`destroy`, so a caller can run an entry point again. A ``FrodError`` every rank
knows is a ``CollectiveError`` (``agree_on_error``, ``on_all``, ``on_main``), printed once by rank 0. NCCL when
CUDA is available, gloo otherwise; collective tensors live on ``local_device()``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from frod_ds._moved import forward_names
from frod_ds.runtime import deepspeed_state, rendezvous
from frod_ds.runtime.errors import FrodError
from frod_ds.runtime.launch_env import ProcessGroupSpec, process_group_spec

__all__ = [
    "COLLECTIVE_TIMEOUT_ENV",
    "CollectiveError",
    "collective_timeout_minutes",
    "init_distributed",
    "init_deepspeed",
    "backend",
    "default_backend",
    "destroy",
    "is_initialized",
    "get_rank",
    "get_world_size",
    "get_local_rank",
    "is_main",
    "local_device",
    "barrier",
    "all_reduce_sum",
    "all_gather_object",
    "all_gather_into",
    "peer_buffers",
    "broadcast",
    "broadcast_object",
    "gather_rows",
    "scatter_rows",
    "agree_on_error",
    "on_all",
    "on_main",
    "held_on_main",
    "print0",
]

T = TypeVar("T")


# The local rank of the group this process joined; put back to 0 by ``destroy``.
_local_rank: int = 0
COLLECTIVE_TIMEOUT_ENV = "FROD_COLLECTIVE_TIMEOUT_MIN"
DEFAULT_COLLECTIVE_TIMEOUT_MIN = 60.0


def collective_timeout_minutes() -> float:
    """How long a rank waits in one collective for the others (``FROD_COLLECTIVE_TIMEOUT_MIN``, default 60): a rank
    reading a large shard from a slow file system keeps the others waiting for minutes, a stuck one (a hung node)
    forever but for this bound. ``FrodError`` (one line) for a value that is no positive number of minutes."""
    raw = os.environ.get(COLLECTIVE_TIMEOUT_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_COLLECTIVE_TIMEOUT_MIN
    try:
        minutes = float(raw)
    except ValueError:
        minutes = float("nan")
    if not 0 < minutes < 10**6:
        raise FrodError(
            f"{COLLECTIVE_TIMEOUT_ENV}={raw!r} is no number of minutes (> 0): set how long a rank waits for the others "
            f"in one collective (default {DEFAULT_COLLECTIVE_TIMEOUT_MIN:g}), or unset it"
        )
    return minutes


def init_distributed(backend: str | None = None, timeout_minutes: float | None = None) -> None:
    """Join the process group the launcher describes; a single process when no launcher env is set.

    ``backend``: ``"nccl"`` or ``"gloo"``; default NCCL if CUDA is available, else gloo. With NCCL the
    current CUDA device is set to the local rank. ``timeout_minutes`` bounds every collective wait (default
    :func:`collective_timeout_minutes`). The environment is
    only read (``frod_ds.runtime.launch_env.process_group_spec``); :func:`destroy` leaves the group.
    """
    if dist.is_initialized():
        return
    spec = process_group_spec()
    if spec is None:
        return
    _join(spec, backend, timeout_minutes)


def default_backend() -> str:
    """The process-group backend a run gets unless told otherwise: NCCL where CUDA is available, else gloo."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def backend() -> str:
    """The backend of this process's group, or :func:`default_backend` before it joins one."""
    return dist.get_backend() if dist.is_initialized() else default_backend()


def _join(spec: ProcessGroupSpec, backend: str | None, timeout_minutes: float | None = None) -> None:
    global _local_rank
    if backend is None:
        backend = default_backend()
    if timeout_minutes is None:
        timeout_minutes = collective_timeout_minutes()
    kwargs: dict[str, Any] = {
        "timeout": timedelta(minutes=timeout_minutes),
        "rank": spec.rank,
        "world_size": spec.world_size,
    }
    local_rank = spec.local_rank
    if backend == "nccl":
        local_rank %= max(torch.cuda.device_count(), 1)  # srun may give each task a single visible GPU
        torch.cuda.set_device(local_rank)
        kwargs["device_id"] = torch.device("cuda", local_rank)
    if spec.init_method is None:  # one process, no launcher: an in-process store, no port
        dist.init_process_group(backend=backend, store=dist.HashStore(), **kwargs)
    else:

        def connect() -> None:  # in rendezvous.join's helper thread: the CUDA device is per thread
            if backend == "nccl":
                torch.cuda.set_device(local_rank)
            dist.init_process_group(backend=backend, init_method=spec.init_method, **kwargs)

        join_s = min(rendezvous.JOIN_S, 60 * timeout_minutes)  # torch's store gives up after the timeout too
        rendezvous.join(connect, spec.rank, spec.world_size, _address(spec.init_method), join_s)
    _local_rank = spec.local_rank


def _address(init_method: str) -> str:
    if init_method == "env://":
        return f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    return init_method.removeprefix("tcp://")


def init_deepspeed() -> None:
    """:func:`init_distributed`, then DeepSpeed's communication layer on the same group. DeepSpeed needs a
    process group even for one process: without a launcher a one-rank group on an in-process store is made
    (no port, no environment). DeepSpeed reads ``LOCAL_RANK`` from the environment wherever it builds
    parameters, so it is set for as long as the group lives; :func:`destroy` puts back what was there. A
    ``DS_ACCELERATOR`` DeepSpeed cannot use is a ``FrodError`` before anything starts
    (``deepspeed_state.check_accelerator``)."""
    deepspeed_state.check_accelerator()
    import deepspeed

    if not dist.is_initialized():
        spec = process_group_spec() or ProcessGroupSpec(rank=0, world_size=1, local_rank=0, init_method=None)
        _join(spec, None)
    deepspeed_state.set_env(LOCAL_RANK=str(_local_rank))
    deepspeed_state.skip_shm_comm_op(
        deepspeed
    )  # so no launch builds an op here (the CUDA accelerator has none to build)
    deepspeed_state.quiet_nvtx(deepspeed)
    deepspeed.init_distributed(dist_backend=default_backend())


def destroy() -> None:
    """Leave the process group and undo everything :func:`init_distributed` / :func:`init_deepspeed` set up in
    this process: DeepSpeed's handle on the group and the switches set for it (``deepspeed_state.undo``). Safe to
    call when nothing was initialised; entry points call it on every exit (``frod_ds.runtime.entry.run``)."""
    global _local_rank
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    comm = sys.modules.get("deepspeed.comm.comm")
    if comm is not None and getattr(comm, "cdb", None) is not None:
        comm.cdb = None  # DeepSpeed's backend object: a later init in this process builds it on the new group
    deepspeed_state.undo()
    _local_rank = 0


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def get_local_rank() -> int:
    return _local_rank if is_initialized() else 0


def is_main() -> bool:
    return get_rank() == 0


def local_device() -> torch.device:
    """This rank's compute device: ``cuda:LOCAL_RANK`` when CUDA is available and the backend is not
    gloo, else the CPU."""
    if torch.cuda.is_available() and (not is_initialized() or dist.get_backend() == "nccl"):
        return torch.device("cuda", get_local_rank() % max(torch.cuda.device_count(), 1))
    return torch.device("cpu")


def barrier() -> None:
    if is_initialized():
        dist.barrier()


def all_reduce_sum(t: Tensor) -> Tensor:
    """In-place sum over ranks; returns ``t``."""
    if is_initialized():
        buf = t if t.is_contiguous() else t.contiguous()
        dist.all_reduce(buf, op=dist.ReduceOp.SUM)
        if buf is not t:
            t.copy_(buf)
    return t


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable, small), in rank order, on every rank."""
    if not is_initialized():
        return [obj]
    out: list[Any] = [None] * get_world_size()
    dist.all_gather_object(out, obj)
    return out


def all_gather_into(out: Tensor, t: Tensor) -> Tensor:
    """Every rank's ``t`` concatenated along dim 0 into ``out`` (``world`` times ``t``'s rows); ``out``."""
    if not is_initialized():
        return out.copy_(t)
    dist.all_gather_into_tensor(out, t)
    return out


def peer_buffers(nbytes: int, device: torch.device) -> list[Tensor]:
    """Collective: a byte buffer on ``device`` each rank allocates (symmetric memory) and every rank's, this
    one's included, mapped here in rank order. A copy out of a peer's runs on the copy engines over NVLink: no
    SMs, no kernel on the peer, no meeting point. Needs CUDA GPUs of one machine; raises ``FrodError`` naming
    what is missing otherwise, on every rank."""
    from torch.distributed import _symmetric_memory as symm

    hosts = all_gather_object(socket.gethostname())
    error = None
    if device.type != "cuda" or not is_initialized():
        error = "peer memory needs CUDA GPUs under torch.distributed"
    elif len(set(hosts)) > 1:
        error = f"peer memory needs every rank on one machine; the ranks run on {len(set(hosts))}"
    agree_on_error(error)
    group = dist.group.WORLD.group_name
    views: list[Tensor] = []

    def failed(e: Exception) -> str:
        return f"peer memory could not be mapped on this machine ({type(e).__name__}: {str(e).splitlines()[0]})"

    try:  # each rank allocates, and all agree, before the collective rendezvous a failed rank would never join
        if not hasattr(symm.enable_symm_mem_for_group, "__deprecated__"):  # torch versions that still need it
            symm.enable_symm_mem_for_group(group)
        buf = symm.empty(nbytes, dtype=torch.uint8, device=device)
    except (RuntimeError, AttributeError) as e:
        error = failed(e)
    agree_on_error(error)
    try:
        handle = symm.rendezvous(buf, group)
        views = [handle.get_buffer(r, (nbytes,), torch.uint8) for r in range(get_world_size())]
        views[get_rank()] = buf
    except (RuntimeError, AttributeError) as e:
        error = failed(e)
    agree_on_error(error)
    return views


def broadcast(t: Tensor, src: int = 0) -> Tensor:
    """In-place broadcast from ``src``; other ranks pass a tensor of the same shape/dtype/device.

    Any memory layout: LAPACK results (``linalg.qr``/``eigh``) are column-major, and a collective on a
    non-contiguous tensor would ship its storage order (gloo silently, NCCL refuses).
    """
    if is_initialized():
        buf = t if t.is_contiguous() else t.contiguous()
        dist.broadcast(buf, src=src)
        if buf is not t:
            t.copy_(buf)
    return t


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """``src``'s ``obj`` (picklable, small) on every rank."""
    if not is_initialized():
        return obj
    box = [obj if get_rank() == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def gather_rows(t: Tensor, dst: int = 0) -> list[Tensor] | None:
    """Gather tensors that differ only in their first dimension (``(r_p, *rest)``) onto ``dst``.

    Returns the list in rank order on ``dst`` and ``None`` elsewhere. Rows are zero-padded to the
    longest for the collective and trimmed afterwards; a rank may contribute ``r_p = 0`` rows.
    """
    if not is_initialized():
        return [t]
    rows = [int(r) for r in all_gather_object(int(t.shape[0]))]
    pad = t.new_zeros((max(rows), *t.shape[1:]))
    pad[: t.shape[0]] = t
    bufs = [torch.empty_like(pad) for _ in rows] if get_rank() == dst else None
    dist.gather(pad, gather_list=bufs, dst=dst)
    del pad
    return [b[:r] for b, r in zip(bufs, rows)] if bufs is not None else None


def scatter_rows(parts: list[Tensor] | None, like: Tensor, src: int = 0) -> Tensor:
    """Inverse of :func:`gather_rows`: rank ``p`` receives ``parts[p]`` (``(r_p, *rest)``) from ``src``.

    ``like`` gives dtype and device on every rank; ``parts`` is only read on ``src``.
    """
    if not is_initialized():
        assert parts is not None and len(parts) == 1, "one process: pass exactly one part"
        return parts[0]
    meta = None
    if get_rank() == src:
        assert parts is not None and len(parts) == get_world_size(), "one part per rank"
        meta = [tuple(p.shape) for p in parts]
    shapes = broadcast_object(meta, src=src)
    longest = max(s[0] for s in shapes)
    rest = shapes[0][1:]
    buf = torch.empty((longest, *rest), dtype=like.dtype, device=like.device)
    send = None
    if get_rank() == src:
        send = []
        for p in parts:  # type: ignore[union-attr]
            padded = p.new_zeros((longest, *rest))
            padded[: p.shape[0]] = p
            send.append(padded)
    dist.scatter(buf, scatter_list=send, src=src)
    del send
    return buf[: shapes[get_rank()][0]]


class CollectiveError(FrodError):
    """A user error that every rank raised together (the ranks agreed on it): report it once, on rank 0."""


def agree_on_error(error: str | None, src: int | None = None) -> None:
    """Collective: if any rank passes an error message, raise the first as ``CollectiveError`` on all.
    With ``src``, only that rank's ``error`` counts (it alone checked)."""
    if src is not None:
        errors = [broadcast_object(error, src=src)]
    else:
        errors = all_gather_object(error)
    errors = [e for e in errors if e]
    if errors:
        raise CollectiveError(errors[0])


def on_all(fn: Callable[[], T]) -> T:
    """Run ``fn`` on every rank; a ``FrodError`` on any rank becomes a ``CollectiveError`` on all. Any other
    exception is a bug and propagates on the rank where it happened."""
    result, error = None, None
    try:
        result = fn()
    except FrodError as e:
        error = str(e)
    agree_on_error(error)
    return result  # type: ignore[return-value]


def on_main(fn: Callable[[], T]) -> T:
    """Run ``fn`` on rank 0 and broadcast its (picklable) result; a ``FrodError`` there becomes a
    ``CollectiveError`` on every rank. Any other exception is a bug and propagates on rank 0."""
    result, error = None, None
    if is_main():
        try:
            result = fn()
        except FrodError as e:
            error = str(e)
    result, error = broadcast_object((result, error))
    if error:
        raise CollectiveError(error)
    return result  # type: ignore[return-value]


@contextlib.contextmanager
def held_on_main(enter: Callable[[], contextlib.AbstractContextManager[Any]]) -> Iterator[None]:
    """Collective: hold ``enter()`` on rank 0 only for the block (the writer's lease on its output: one process
    writes for all ranks); a ``FrodError`` entering it is a ``CollectiveError`` on every rank before any goes on."""
    with contextlib.ExitStack() as stack:
        error = None
        if is_main():
            try:
                stack.enter_context(enter())
            except FrodError as e:
                error = str(e)
        agree_on_error(error, src=0)
        yield


def print0(*args: Any, **kwargs: Any) -> None:
    """``print`` on rank 0 only, flushed."""
    if is_main():
        print(*args, flush=True, **kwargs)


# Names that moved (check_shared_dir to shared_dir in 0.2.0, the DeepSpeed switches to deepspeed_state): importing
# them from here warns (frod_ds._moved).
__getattr__ = forward_names(
    __name__,
    {
        "check_shared_dir": "frod_ds.runtime.shared_dir",
        **dict.fromkeys(
            ("accelerator_problem", "check_accelerator", "restore_functional_linear", "NVTX_ENV", "SHM_COMM_OP"),
            "frod_ds.runtime.deepspeed_state",
        ),
    },
)
