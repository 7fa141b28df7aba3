"""Frozen weights partitioned across 2 CPU ranks (``frod_ds.model.frozen_shards``) train exactly what the whole model
trains: two steps' losses and σ/S gradients bitwise equal to the unpartitioned model's, with and without gradient
checkpointing; at most two units gathered at once; every unit released after a step; each rank holds half, and the
bytes the run holds mid-step are the whole model's less half the partitioned weights."""

from __future__ import annotations

import json

import pytest

from tests.support import ranks
from tests.support.helpers_ckpt import REPO
from tests.support.leftovers import clean_env

PROBE = REPO / "tests" / "support" / "frozen_shards_probe.py"


@pytest.mark.slow
@pytest.mark.parametrize(
    "gc,peer,host",
    [(False, False, False), (True, False, False), (False, True, False), (True, False, True)],
    ids=["no-gc", "gc", "peer-copies", "host-shards-gc"],
)
def test_partitioned_frozen_weights_train_what_the_whole_model_trains(tmp_path, gc, peer, host):
    flags = [*(["--gc"] if gc else []), *(["--peer"] if peer else []), *(["--host"] if host else [])]
    run = ranks.run(2, [str(PROBE), str(tmp_path), *flags], clean_env(), REPO, 110)
    assert run.returncode == 0, run.stdout + run.stderr
    docs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for d in docs:
        assert all(d["peers"]) if peer else not any(d["peers"])
        if peer:  # without peer memory (CPU ranks): auto gathers by the collective, peer says what to use
            assert not d["auto_bank"]
            assert "needs CUDA GPUs" in d["peer_error"] and "zero3_gather=collective" in d["peer_error"]
        assert all(d["host"]) if host else not any(d["host"])
        if host:  # host shards are read by the collective alone
            assert "offloaded to host memory" in d["peer_error"] and "zero3_gather=auto" in d["peer_error"]
        assert d["losses"] == d["ref_losses"]
        assert d["max_grad_diff"] == 0.0 and d["grad_norm"] > 0
        assert d["released_after_step"] and d["whole_again"]
        assert 1 <= d["peak_installed"] <= 2, d["peak_installed"]
        assert d["units"] == 5  # embedding, 3 decoder layers, head
        # everything frozen but the shared V of each category is partitioned, half per rank (up to padding)
        assert d["sharded_numel"] < d["frozen_numel"]
        assert d["shard_bytes"] * 2 - d["full_bytes"] < 4 * 2 * d["units"]
        # partitioned for real, counted by the storages the run holds at the end of its forward (activations,
        # saved views of weights, shards, gathered buffers), not by the partitioning's own figures: at most the
        # whole model's bytes less half the partitioned weights, plus the two largest units in flight
        # (with host shards, none of the partitioned weights but the units in flight: the shards are in host memory)
        due = d["ref_live_bytes"] - d["full_bytes"] / (1 if host else 2) + sum(sorted(d["unit_bytes"])[-2:])
        assert d["live_bytes"] <= due, (d["live_bytes"], due, d["ref_live_bytes"], d["full_bytes"])
    assert docs[0]["losses"] != docs[1]["losses"]  # each rank its own batch: the test sees two different steps


def test_host_shards_on_one_rank_are_copied_in_around_each_use():
    """Parameter offload on one GPU: nothing to partition, but the frozen weights stay in host memory and each unit
    is copied in around its use, so the device holds at most two units; the losses and gradients are the whole
    model's, bitwise (in-process, one rank, no process group)."""
    import copy

    import torch

    from frod_ds.model.frozen_shards import shard_frozen
    from tests.support.frozen_shards_probe import _model, _steps

    whole = _model(gc=False)
    parted = copy.deepcopy(whole)
    shards = shard_frozen(parted, torch.device("cpu"), host=True)
    assert len(shards.units) == 5 and all(u.host for u in shards.units)
    assert all(p.numel() == 0 for u in shards.units for p in u.params)  # nothing resident between uses
    ref_losses, ref_grads, _ = _steps(whole, 0)
    losses, grads, _ = _steps(parted, 0, shards=shards)
    assert losses == ref_losses
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    assert 1 <= shards.peak_installed <= 2
    shards.remove()
