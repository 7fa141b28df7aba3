"""What the project publishes is readable as the umask says, whatever made each file: safetensors' ``save_file``
creates its file 0600, so an adapter, a PEFT export or a checkpoint's trainable state was private to its owner in a
team's group-shared folder."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch


@pytest.fixture(params=[0o022, 0o002, 0o077])
def mask(request):
    before = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(before)


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_a_published_folder_and_a_trainable_state_follow_the_umask(tmp_path, mask):
    """building_dir publishes every writer's folder (adapters, PEFT exports, GGUF conversions): a file written
    0600 inside it, as save_file writes, is published at the umask's mode; so is a checkpoint's trainable state."""
    from safetensors.torch import save_file

    from frod_ds.formats.building import building_dir
    from frod_ds.train.trainable_state import FORMAT, TrainableState, write_state

    out = tmp_path / "adapter"
    with building_dir(out, "adapter") as tmp:
        save_file({"x": torch.ones(2)}, str(tmp / "adapter.safetensors"))
        (tmp / "sub").mkdir()
        save_file({"y": torch.ones(1)}, str(tmp / "sub" / "more.safetensors"))
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) >= 3  # the two tensors files and the folder's record
    assert {str(p): _mode(p) for p in files} == {str(p): 0o666 & ~mask for p in files}
    meta = TrainableState(FORMAT, 3, 3, 1, 1, 1, 2, [1e-3], {}, 3, 0)
    state = tmp_path / "trainable_state.safetensors"
    write_state(state, {"x": torch.ones(2)}, meta)
    assert _mode(state) == 0o666 & ~mask
