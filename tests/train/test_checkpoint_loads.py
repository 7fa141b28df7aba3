"""Checkpoint and engine-state files are loaded ``weights_only`` with DeepSpeed's few classes allowed
(``frod_ds.io.torch_pickle``): a ``.pt`` file that names any other callable is never unpickled, even when the
checkpoint's seal matches it (a folder from elsewhere is sealed by whoever made it), and every file today's code
and the committed fixtures hold still loads."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.support.leftovers import REPO
from tests.support.train_env import CPU_ZERO2, train_in_process

FIXTURES = sorted((REPO / "tests" / "fixtures").glob("*/run/checkpoints/*/*.pt"))


class _Payload:
    """Unpickled by a full ``torch.load``, it runs ``os.system("touch <sentinel>")``."""

    def __init__(self, sentinel: Path) -> None:
        self.sentinel = sentinel

    def __reduce__(self):
        return os.system, (f"touch {self.sentinel}",)


def _poison(pt: Path, sentinel: Path) -> None:
    """Replace ``pt`` by a pickle whose loading runs a command, and re-seal its checkpoint to match."""
    from frod_ds.train.checkpoints import file_seal, files_to_seal, write_seal

    torch.save({"python": _Payload(sentinel)}, pt)
    ckpt = pt.parent
    write_seal(ckpt, {name: file_seal(ckpt / name) for name in files_to_seal(ckpt)})


def test_the_payload_runs_when_unpickled_in_full(tmp_path):
    """What the guard is for: the same file, loaded without it, runs its command."""
    pt, sentinel = tmp_path / "rng_rank0.pt", tmp_path / "ran"
    torch.save({"python": _Payload(sentinel)}, pt)
    torch.load(pt, weights_only=False)
    assert sentinel.exists()


def test_a_sealed_checkpoint_naming_a_foreign_callable_is_skipped_unrun(tmp_path):
    from frod_ds.io.torch_pickle import UnsafePickleError, safe_load
    from frod_ds.train.checkpoints import ResumeError, choose_checkpoint

    root = tmp_path / "checkpoints"
    shutil.copytree(REPO / "tests" / "fixtures" / "run_v1" / "run" / "checkpoints", root)
    sentinel = tmp_path / "ran"
    _poison(root / "step00000003" / "rng_rank0.pt", sentinel)
    with pytest.raises(ResumeError, match=r"rng_rank0\.pt names posix\.system, which frod-ds never writes"):
        choose_checkpoint(root)
    with pytest.raises(UnsafePickleError, match="posix.system"):
        safe_load(root / "step00000003" / "rng_rank0.pt")
    assert not sentinel.exists()


def test_resuming_a_poisoned_run_is_one_error_line_and_runs_nothing(tmp_path):
    """The committed ZeRO-2 run (``tests/fixtures/run_v1``) with its engine file swapped for a sealed payload."""
    import importlib.util

    root = tmp_path / "run_v1"
    shutil.copytree(REPO / "tests" / "fixtures" / "run_v1", root)
    spec = importlib.util.spec_from_file_location("make_run_v1", REPO / "tests" / "fixtures" / "make_run_v1.py")
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    ckpt = root / "run" / "checkpoints" / "step00000003"
    sentinel = tmp_path / "ran"
    _poison(ckpt / "zero_pp_rank_0_mp_rank_00_optim_states.pt", sentinel)
    before = sorted((p.relative_to(root), p.stat().st_mtime_ns) for p in root.rglob("*"))
    res = train_in_process(CPU_ZERO2, [f"{k}={v}" for k, v in make.run_overrides(root).items()])
    errors = [x for x in res.stderr.splitlines() if x.startswith("error:")]
    assert res.returncode == 2 and len(errors) == 1, res.stderr[-3000:]
    assert "zero_pp_rank_0_mp_rank_00_optim_states.pt names posix.system" in errors[0]
    assert not sentinel.exists()
    assert sorted((p.relative_to(root), p.stat().st_mtime_ns) for p in root.rglob("*")) == before, "nothing changed"


@pytest.mark.parametrize("pt", FIXTURES, ids=[str(p.relative_to(REPO / "tests" / "fixtures")) for p in FIXTURES])
def test_every_committed_engine_file_loads_with_the_allow_list(pt):
    from frod_ds.io.torch_pickle import safe_load, unloadable

    assert unloadable(pt) is None
    full = torch.load(pt, map_location="cpu", weights_only=False)  # trusted: the repository's own fixture
    assert _same(safe_load(pt, map_location="cpu"), full)


def _same(a, b) -> bool:
    """Equal as loaded: tensors bitwise, containers item by item, DeepSpeed's records by their fields."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if hasattr(a, "__dict__") and not isinstance(a, type):
        return type(a) is type(b) and _same(vars(a), vars(b))
    return a == b


def test_a_deepspeed_engine_loads_its_files_through_the_allow_list(tmp_path):
    """``use_safe_loads`` replaces the engine's checkpoint loader (DeepSpeed's passes ``weights_only=False``)."""
    from types import SimpleNamespace

    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    from frod_ds.io.torch_pickle import UnsafePickleError, use_safe_loads

    engine = SimpleNamespace(checkpoint_engine=TorchCheckpointEngine())
    use_safe_loads(engine)
    optim = next(p for p in FIXTURES if p.name.endswith("optim_states.pt"))
    assert type(engine.checkpoint_engine.load(str(optim), map_location="cpu")["optimizer_state_dict"]) is dict
    sentinel = tmp_path / "ran"
    torch.save({"x": _Payload(sentinel)}, tmp_path / "bad.pt")
    with pytest.raises(UnsafePickleError):
        engine.checkpoint_engine.load(str(tmp_path / "bad.pt"), map_location="cpu")
    assert not sentinel.exists()


def test_a_save_never_writes_through_what_sits_at_its_own_file_names(tmp_path):
    """Every save writes latest_complete, and DeepSpeed its ``latest`` and recovery scripts, into the checkpoints
    folder, DeepSpeed through whatever is at that path: a link there (to a file the run never wrote), a folder or a
    pipe is refused in one line naming it, before a save; regular files of those names are the run's own."""
    import os

    from frod_ds.runtime.errors import FrodError
    from frod_ds.train.checkpoints import ROOT_FILES, check_root_files

    root = tmp_path / "checkpoints"
    root.mkdir()
    for name in ROOT_FILES:
        (root / name).write_text("step00000002")
    check_root_files(root)  # the run's own
    decoy = tmp_path / "users_file"
    decoy.write_text("keep me")
    plants = {"link": lambda p: p.symlink_to(decoy), "folder": lambda p: p.mkdir(), "pipe": lambda p: os.mkfifo(p)}
    for name in ROOT_FILES:
        for plant in plants.values():
            path = root / name
            path.unlink()
            plant(path)
            with pytest.raises(FrodError, match=f"{path} is (a symbolic link to {decoy}|not a regular file)"):
                check_root_files(root)
            path.rmdir() if path.is_dir() and not path.is_symlink() else path.unlink()
            path.write_text("step00000002")
    assert decoy.read_text() == "keep me"
