"""One rank of ``tests/model/test_frozen_shards.py``: a tiny FRoD model with its frozen weights partitioned across the
ranks (``frod_ds.model.frozen_shards``) against the same model whole, two training steps' losses and σ/S gradients;
writes ``<out>/rank<r>.json``. With ``--peer`` the units are gathered by copies out of every rank's bank, mapped
here from a shared file per rank (the CPU stand-in for GPU peer memory, ``distributed.peer_buffers``); with
``--host`` the shards are kept as parameter offload keeps them (host memory, copied in before the collective).
Usage: ``python tests/support/frozen_shards_probe.py OUT [--gc] [--peer | --host]``."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch

from frod_ds.model.apply import apply_frod
from frod_ds.model.frozen_shards import frozen_units, open_bank, shard_frozen, shared_params
from frod_ds.runtime import distributed as dist
from frod_ds.runtime.errors import FrodError
from frod_ds.train.trainer import enable_gradient_checkpointing


def _model(gc: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = apply_frod(LlamaForCausalLM(cfg), sparsity=0.1, seed=0)
    g = torch.Generator().manual_seed(1)
    for p in model.parameters():
        if p.requires_grad:  # σ and S away from their initial values, so every gradient term is exercised
            p.data += 0.05 * torch.randn(p.shape, generator=g)
    if gc:
        enable_gradient_checkpointing(model)
    return model.train()


def _live_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes the distinct storages under ``tensors`` hold now: views share one storage, a freed one holds 0."""
    held: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        if st.nbytes():
            held[st.data_ptr()] = max(held.get(st.data_ptr(), 0), st.nbytes())
    return sum(held.values())


def _steps(model, rank: int, steps: int = 2, shards=None) -> tuple[list[float], list[torch.Tensor], int]:
    """Losses and σ/S gradients of ``steps`` steps, and the bytes held at the end of the first forward: the
    module's tensors, every tensor autograd saved for the backward, and the partitioning's own buffers."""
    g = torch.Generator().manual_seed(100 + rank)
    losses, grads, live = [], [], 0
    for i in range(steps):
        ids = torch.randint(0, 64, (2, 12), generator=g)
        saved: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            loss = model(input_ids=ids, labels=ids).loss
        if i == 0:
            # what the device holds: a host shard (parameter offload) is not on it
            own = (
                []
                if shards is None
                else [b for u in shards.units for b in (u.shard, u.full) if not u.host or b is u.full]
            )
            live = _live_bytes([*model.parameters(), *model.buffers(), *saved, *own])
        saved.clear()
        loss.backward()
        losses.append(float(loss))
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.requires_grad]))
        model.zero_grad(set_to_none=True)
    return losses, grads, live


def _file_banks(root: Path):
    """``peer_buffers`` over one shared file per rank under ``root``: every rank maps every rank's."""

    def peer_buffers(nbytes: int, device: torch.device) -> list[torch.Tensor]:
        rank, world = dist.get_rank(), dist.get_world_size()
        mine = torch.from_file(str(root / f"bank{rank}"), shared=True, size=nbytes, dtype=torch.uint8)
        dist.barrier()
        views = [torch.from_file(str(root / f"bank{r}"), True, nbytes, dtype=torch.uint8) for r in range(world)]
        views[rank] = mine
        return views

    return peer_buffers


def _refusals(model) -> dict:
    """What open_bank does on CPU ranks with the real peer_buffers: auto falls back, peer refuses in one line."""
    units = frozen_units(model)
    auto = open_bank(units, shared_params(units), torch.device("cpu"), "auto")
    try:
        open_bank(units, shared_params(units), torch.device("cpu"), "peer")
        peer = None
    except FrodError as e:
        peer = str(e)
    return {"auto_bank": auto is not None, "peer_error": peer}


def main() -> None:
    out, gc, peer, host = Path(sys.argv[1]), "--gc" in sys.argv, "--peer" in sys.argv, "--host" in sys.argv
    dist.init_distributed()
    rank = dist.get_rank()
    whole = _model(gc)
    parted = copy.deepcopy(whole)
    frozen_numel = sum(p.numel() for p in parted.parameters() if not p.requires_grad)
    refusals = _refusals(parted) if peer else {}
    if peer:
        dist.peer_buffers = _file_banks(out)  # this process's module: the probe exits after
    if host:  # only the collective reads host shards: peer copies are refused in one line
        try:
            shard_frozen(copy.deepcopy(whole), torch.device("cpu"), gather="peer", host=True)
            refusals = {"peer_error": None}
        except FrodError as e:
            refusals = {"peer_error": str(e)}
    gather = "peer" if peer else "auto" if host else "collective"
    shards = shard_frozen(parted, torch.device("cpu"), gather=gather, host=host)
    ref_losses, ref_grads, ref_live = _steps(whole, rank)
    losses, grads, live = _steps(parted, rank, shards=shards)
    released = all(p.numel() == 0 for u in shards.units for p in u.params)
    doc = {
        "losses": losses,
        "ref_losses": ref_losses,
        "max_grad_diff": max(float((a - b).abs().max()) for a, b in zip(grads, ref_grads)),
        "grad_norm": float(ref_grads[0].norm()),
        "released_after_step": released,
        "peak_installed": shards.peak_installed,
        "units": len(shards.units),
        "live_bytes": live,
        "ref_live_bytes": ref_live,
        "unit_bytes": [u.numel * u.shard.element_size() for u in shards.units],
        "shard_bytes": shards.shard_bytes(),
        "full_bytes": shards.full_bytes(),
        "frozen_numel": frozen_numel,
        "sharded_numel": sum(u.numel for u in shards.units),
        "peers": [u.peers is not None for u in shards.units],
        "host": [u.host for u in shards.units],
        **refusals,
    }
    shards.remove()
    doc["whole_again"] = all(
        torch.equal(a, b) for a, b in zip(whole.state_dict().values(), parted.state_dict().values())
    )
    (out / f"rank{rank}.json").write_text(json.dumps(doc))
    dist.destroy()


if __name__ == "__main__":
    main()
