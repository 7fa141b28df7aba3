"""Frozen weights partitioned across ranks, gathered one unit (a decoder layer) at a time around its use.

FRoD trains only σ and S, so the frozen weights need no gradient reduce-scatter and no optimizer state: each rank
keeps 1/N of a unit's frozen tensors as one flat shard; a unit is gathered before its forward (the next one's
gather issued then, on a side stream) and released after; its output's gradient hook gathers it again for the
backward and prefetches the unit before. A release frees the unit's buffer, views autograd saved of it included.
On one machine's GPUs a gather copies out of every rank's mapped shards (a ``Bank``); with parameter offload the
shards are in host memory, copied in before the collective. Shared tensors (V) stay replicated
(docs/training.md#zero-3s-layer-partition).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from frod_ds.config.zero3_layout import PEER_NO_HOST
from frod_ds.runtime import distributed as dist
from frod_ds.runtime.errors import FrodError

__all__ = [
    "GATHERS",
    "Bank",
    "FrozenShards",
    "Unit",
    "attach",
    "frozen_units",
    "host_bank",
    "install",
    "not_mine",
    "open_bank",
    "shard_frozen",
    "shard_unit",
    "shards_of",
    "shared_params",
]

GATHERS = ("auto", "peer", "collective")  # how a unit is gathered: peer copies where the machine allows, or NCCL
ALIGN = 256  # bytes: each shard's offset in a bank


@dataclass
class Unit:
    """One module's frozen tensors of one dtype: their Parameters, spans in the flat buffer, this rank's shard."""

    name: str
    module: nn.Module
    params: list[nn.Parameter]
    spans: list[tuple[int, int]]
    shard: Tensor  # (numel_padded / world,)
    full: Tensor  # (numel_padded,), its storage allocated only while gathered or in flight
    live: bool = False
    ready: object = None  # the side stream's event after the gather (CUDA)
    index: int = 0
    backward: bool = False  # its output took part in this step's autograd graph
    offset: int = -1  # the shard's byte offset in the bank, -1 when it has none
    peers: list[Tensor] | None = None  # every rank's shard of this unit as mapped here (a bank), rank order
    host: bool = False  # the shard lives in host memory (parameter offload), ``full`` on the device

    @property
    def numel(self) -> int:
        return self.spans[-1][1]


@dataclass
class FrozenShards:
    """The units of a model, in forward order, and the hooks that gather and release them."""

    units: list[Unit]
    handles: list = field(default_factory=list)
    stream: object = None  # the side stream gathers run on (CUDA), None on CPU
    peak_installed: int = 0  # most units gathered or in flight at once (a test's and a bench's figure)
    bank: Bank | None = None  # the mapped buffers the shards live in (peer gathers), None for the collective
    _in_backward: bool = False

    def shard_bytes(self) -> int:
        return sum(u.shard.numel() * u.shard.element_size() for u in self.units)

    def full_bytes(self) -> int:
        return sum(u.numel * u.shard.element_size() for u in self.units)

    def gathered_bytes(self) -> int:
        """Bytes the units' gathered buffers hold now (their storages, whoever references them)."""
        return sum(u.full.untyped_storage().nbytes() for u in self.units)

    # -- gather and release ---------------------------------------------------------------------------

    def _launch(self, u: Unit) -> None:
        """Start gathering ``u`` (no-op when gathered or in flight); on CUDA on the side stream."""
        if u.live:
            return
        full = u.full
        full.untyped_storage().resize_(full.numel() * full.element_size())  # allocated on the compute stream
        if self.stream is None:
            self._fill(u)
        else:
            self.stream.wait_stream(torch.cuda.current_stream(u.full.device))  # the buffer is free to write
            with torch.cuda.stream(self.stream):
                self._fill(u)
                u.ready = torch.cuda.Event()
                u.ready.record(self.stream)
        u.live = True
        self.peak_installed = max(self.peak_installed, sum(x.live for x in self.units))

    @staticmethod
    def _fill(u: Unit) -> None:
        if u.host:  # this rank's shard copied into its slice of the buffer, then the others' gathered around it
            per, rank = u.shard.numel(), dist.get_rank()
            mine = u.full[rank * per : (rank + 1) * per]
            mine.copy_(u.shard, non_blocking=True)
            if dist.get_world_size() > 1:
                dist.all_gather_into(u.full, mine)
            return
        if u.peers is None:
            dist.all_gather_into(u.full, u.shard)
            return
        per, world, me = u.shard.numel(), len(u.peers), dist.get_rank()
        for step in range(world):  # each rank starts at its own shard, then the next ranks': links spread the load
            r = (me + step) % world
            u.full[r * per : (r + 1) * per].copy_(u.peers[r])

    def _install(self, u: Unit) -> None:
        self._launch(u)
        if u.ready is not None:
            torch.cuda.current_stream(u.full.device).wait_event(u.ready)
            u.ready = None
        for p, (a, b) in zip(u.params, u.spans):
            p.data = u.full[a:b].view(p._frozen_shape)

    def _release(self, u: Unit) -> None:
        if not u.live:
            return
        empty = u.full.new_empty(0)
        for p in u.params:
            p.data = empty
        u.full.untyped_storage().resize_(0)
        u.live, u.ready = False, None

    def release_all(self) -> None:
        for u in self.units:
            self._release(u)
            u.backward = False
        self._in_backward = False

    # -- hooks ---------------------------------------------------------------------------------------

    def _pre_forward(self, u: Unit) -> None:
        self._install(u)
        if not self._in_backward and u.index + 1 < len(self.units):
            self._launch(self.units[u.index + 1])

    def _post_forward(self, u: Unit, output) -> None:
        out = output[0] if isinstance(output, tuple | list) else output
        if self._in_backward:
            return  # a checkpoint's recompute inside the backward: the unit stays for its backward
        self._release(u)
        if isinstance(out, Tensor) and out.requires_grad:
            u.backward = True
            out.register_hook(lambda grad, u=u: self._pre_backward(u))

    def _pre_backward(self, u: Unit) -> None:
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self.release_all)
        if u.index + 1 < len(self.units):
            self._release(self.units[u.index + 1])
        self._install(u)
        before = [x for x in self.units[: u.index] if x.backward]
        if before:
            self._launch(before[-1])

    @contextlib.contextmanager
    def gathered(self, modules: Iterable[nn.Module]) -> Iterator[None]:
        """Collective: the units holding any of ``modules`` gathered for reading outside a forward, released after."""
        ids = {id(m) for m in modules}
        mine = [u for u in self.units if any(id(m) in ids for m in u.module.modules())]
        for u in mine:
            self._install(u)
        try:
            yield
        finally:
            for u in mine:
                self._release(u)

    def remove(self) -> None:
        """Gather every unit for good and drop the hooks (an export or a test reads whole weights)."""
        for h in self.handles:
            h.remove()
        self.handles.clear()
        for u in self.units:
            self._install(u)  # the Parameters keep their views of the buffer, which stays allocated


def attach(model: nn.Module, shards: FrozenShards) -> None:
    """Record ``shards`` on ``model`` (a plain attribute: it goes with the model into the engine)."""
    object.__setattr__(model, "frod_frozen_shards", shards)


def shards_of(model: nn.Module) -> FrozenShards | None:
    """The ``FrozenShards`` partitioning ``model``'s frozen weights, None when they are whole."""
    return getattr(model, "frod_frozen_shards", None)


def frozen_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The units a causal LM is partitioned by: its input embedding, each decoder layer, its output head."""
    layers = [(n, m) for n, m in model.named_modules() if type(m).__name__.endswith("DecoderLayer")]
    assert layers, f"no decoder layers in {type(model).__name__}"
    units = []
    emb = model.get_input_embeddings()
    head = model.get_output_embeddings()
    names = {id(m): n for n, m in model.named_modules()}
    if emb is not None:
        units.append((names[id(emb)], emb))
    units += layers
    if head is not None and head is not emb:
        units.append((names[id(head)], head))
    return units


def _frozen_params(module: nn.Module, shared: set[int]) -> Iterable[nn.Parameter]:
    for p in module.parameters():
        if not p.requires_grad and id(p) not in shared and p.numel() > 0:
            yield p


def shared_params(units: list[tuple[str, nn.Module]]) -> set[int]:
    """Ids of the Parameters more than one unit holds (FRoD's V): those stay replicated."""
    seen: dict[int, int] = {}
    for _, m in units:
        for p in m.parameters():
            seen[id(p)] = seen.get(id(p), 0) + 1
    return {k for k, v in seen.items() if v > 1}


def _layout(module: nn.Module, shared: set[int], world: int) -> list[tuple[torch.dtype, list, list, int]]:
    """``module``'s frozen tensors by dtype: (dtype, Parameters, their spans in the flat unit, numel per rank)."""
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for p in _frozen_params(module, shared):
        by_dtype.setdefault(p.dtype, []).append(p)
    out = []
    for dtype, params in by_dtype.items():
        spans, a = [], 0
        for p in params:
            spans.append((a, a + p.numel()))
            a += p.numel()
        out.append((dtype, params, spans, -(-a // world)))
    return out


@dataclass
class Bank:
    """This rank's shards of every unit in one byte buffer, laid out before any is read, and every rank's buffer as
    mapped here (``views``, rank order): a unit's gather copies its slice out of each."""

    views: list[Tensor]
    used: int = 0

    def take(self, numel: int, dtype: torch.dtype) -> tuple[Tensor, int]:
        """The next ``numel`` elements of this rank's buffer as a ``dtype`` tensor, and their byte offset."""
        a, nbytes = self.used, numel * dtype.itemsize
        assert a + nbytes <= self.views[0].numel(), "bank laid out smaller than its shards"
        self.used = -(-(a + nbytes) // ALIGN) * ALIGN
        return self.views[dist.get_rank()][a : a + nbytes].view(dtype), a


def open_bank(
    units: list[tuple[str, nn.Module]], shared: set[int], device: torch.device, gather: str = "auto"
) -> Bank | None:
    """Collective: the bank ``units``' shards go in when ``gather`` is peer (an error where the machine cannot map
    peers' memory) or auto (where it can: CUDA GPUs of one machine), None for the collective gather or one rank.
    Reads only shapes and dtypes: ``units`` may still be on the meta device."""
    if gather not in GATHERS:
        raise FrodError(f"the frozen weights' gather must be one of {', '.join(GATHERS)}, got {gather!r}")
    world = dist.get_world_size()
    if world == 1 or gather == "collective" or (gather == "auto" and device.type != "cuda"):
        return None
    per_unit = [n * dt.itemsize for _, m in units for dt, _, _, n in _layout(m, shared, world)]
    nbytes = sum(-(-b // ALIGN) * ALIGN for b in per_unit)
    try:
        return Bank(dist.peer_buffers(max(nbytes, ALIGN), device))
    except FrodError as e:
        if gather == "peer":
            raise FrodError(f"{e}; use the collective gather (train.zero3_gather=collective)") from e
        dist.print0(f"frozen weights: gathered by NCCL ({e})")
        return None


def host_bank(
    units: list[tuple[str, nn.Module]], shared: set[int], device: torch.device, gather: str, host: bool
) -> Bank | None:
    """``open_bank``'s answer, or None for shards in host memory, which only the collective gathers (an error for
    ``gather`` peer)."""
    if not host:
        return open_bank(units, shared, device, gather)
    if gather == "peer":  # frod train and frod plan refuse it first (zero3_layout.check_gather)
        raise FrodError(PEER_NO_HOST)
    dist.print0("frozen weights: shards in host memory (offload_param), copied in and gathered by the collective")
    return None


@torch.no_grad()
def not_mine(module: nn.Module, shared: set[int]) -> set[int]:
    """Ids of ``module``'s frozen Parameters that lie wholly outside this rank's span of the flat unit (its shapes
    suffice: call it on the skeleton): a build need not read them, the ranks whose spans hold them do."""
    world, rank = dist.get_world_size(), dist.get_rank()
    out: set[int] = set()
    for _, params, spans, per_rank in _layout(module, shared, world) if world > 1 else ():
        lo, hi = rank * per_rank, (rank + 1) * per_rank
        out |= {id(p) for p, (s, e) in zip(params, spans) if not (s < hi and e > lo)}
    return out


def shard_unit(
    name: str,
    module: nn.Module,
    shared: set[int],
    device: torch.device,
    bank: Bank | None = None,
    host: bool = False,
) -> list[Unit]:
    """This rank's 1/N of ``module``'s frozen tensors, one flat shard per dtype on ``device`` (in ``bank`` when
    given; in pinned host memory with ``host``, gathered onto ``device``); the Parameters are left empty (their
    values live in the shards until a gather). Reads the values from wherever they are now. On one rank without
    ``host`` the tensors move to ``device`` whole and no unit is made."""
    assert not (host and bank is not None), "host shards are gathered by the collective, not out of a bank"
    world, rank = dist.get_world_size(), dist.get_rank()
    if world == 1 and not host:  # nothing to partition: the unit stays whole on the device, never gathered
        for p in _frozen_params(module, shared):
            p.data = p.data.to(device)
        return []
    made = []
    for dtype, params, spans, per_rank in _layout(module, shared, world):
        lo, hi = rank * per_rank, (rank + 1) * per_rank
        if host:
            shard, offset = torch.zeros(per_rank, dtype=dtype, pin_memory=device.type == "cuda"), -1
        elif bank is None:
            shard, offset = torch.zeros(per_rank, dtype=dtype, device=device), -1
        else:
            shard, offset = bank.take(per_rank, dtype)
            shard.zero_()
        for p, (s, e) in zip(params, spans):  # the part of each tensor inside this rank's span
            if s < hi and e > lo:
                flat = p.detach().reshape(-1)
                shard[max(s, lo) - lo : min(e, hi) - lo] = flat[max(s, lo) - s : min(e, hi) - s].to(shard.device)
            p._frozen_shape = tuple(p.shape)
        full = torch.empty(per_rank * world, dtype=dtype, device=device)
        full.untyped_storage().resize_(0)
        for p in params:
            p.data = full.new_empty(0)
        name_ = f"{name}:{dtype}".removesuffix(":torch.bfloat16")
        made.append(Unit(name_, module, params, spans, shard, full, offset=offset, host=host))
    return made


def install(units: list[Unit], device: torch.device, bank: Bank | None = None) -> FrozenShards:
    """Collective: the hooks that gather each of ``units`` (in forward order) around its module's forward and
    backward; with ``bank`` (the one their shards were cut into), gathers copy out of every rank's bank."""
    for i, u in enumerate(units):
        u.index = i
        if bank is not None:
            nbytes = u.shard.numel() * u.shard.element_size()
            u.peers = [v[u.offset : u.offset + nbytes].view(u.shard.dtype) for v in bank.views]
    if bank is not None:  # every rank's shards written before any rank reads them
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    fs = FrozenShards(units, stream=stream, bank=bank)
    by_module: dict[int, list[Unit]] = {}
    for u in units:
        by_module.setdefault(id(u.module), []).append(u)
    for group in by_module.values():
        module = group[0].module
        fs.handles.append(module.register_forward_pre_hook(_each(group, fs._pre_forward)))
        fs.handles.append(module.register_forward_hook(_each(group, fs._post_forward, with_output=True)))
    return fs


def shard_frozen(
    model: nn.Module,
    device: torch.device,
    units: list[tuple[str, nn.Module]] | None = None,
    gather: str = "auto",
    host: bool = False,
) -> FrozenShards:
    """Partition ``model``'s frozen weights by unit across the ranks (each keeps 1/N on ``device``, or in host
    memory with ``host``) and install the hooks that gather each unit around its forward and its backward
    (``gather``: ``open_bank``). The model's other tensors are left as they are (move them to ``device`` as usual).
    Units run in the order given (forward order)."""
    units = frozen_units(model) if units is None else units
    shared = shared_params(units)
    bank = host_bank(units, shared, device, gather, host)
    made = [u for name, module in units for u in shard_unit(name, module, shared, device, bank, host)]
    return install(made, device, bank)


def _each(group: list[Unit], fn, with_output: bool = False):
    """A module hook calling ``fn`` per unit of ``group``; it returns None (a hook's value would replace the
    module's inputs or output)."""

    def hook(module, args, output=None) -> None:
        for u in group:
            fn(u, output) if with_output else fn(u)

    return hook
