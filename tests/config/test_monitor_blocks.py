"""DeepSpeed's monitor blocks (``tensorboard``, ``wandb``, ``comet``, ``csv_monitor``): an enabled one whose logging
package is not installed is refused in one line naming the block, the package and the way on, instead of
DeepSpeed's ``ModuleNotFoundError`` in the middle of ``deepspeed.initialize``; a disabled one, ``csv_monitor`` and a
block whose package is installed pass."""

from __future__ import annotations

import importlib.util
import json

import pytest

from frod_ds.config.ds_config import (
    DSConfigError,
    check_ds_config,
    ds_config_problems,
    monitor_problems,
    resolve_ds_config,
)
from frod_ds.config.recipe import load_recipe
from tests.support.train_env import CPU_ZERO3, build_env, train_in_process

PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "comet": "comet_ml"}
RECIPE = ["model.base=m", "model.factor_store=f", "data.train=t.jsonl", "model.dtype=float32"]


def _zero3(**blocks) -> dict:
    return {**json.loads(CPU_ZERO3.read_text()), **blocks}


def _missing(module: str) -> None:
    if importlib.util.find_spec(module) is not None:
        pytest.skip(f"{module} is installed here")


@pytest.mark.parametrize("block", sorted(PACKAGES))
def test_an_enabled_monitor_without_its_package_is_refused(block, capsys):
    """By training; `frod plan --config` only says so: the machine that trains may have the package."""
    module = PACKAGES[block]
    _missing(module)
    cfg = _zero3(**{block: {"enabled": True}})
    problems = [p for p in monitor_problems(cfg) if block in p]
    assert len(problems) == 1, monitor_problems(cfg)
    assert f'the "{block}" block is enabled, but DeepSpeed logs through the `{module}` package' in problems[0]
    assert "not installed: pip install" in problems[0] and "remove the block" in problems[0]
    assert "train.tensorboard=true" in problems[0]
    with pytest.raises(DSConfigError, match=f'"{block}" block is enabled') as err:
        resolve_ds_config(cfg, load_recipe(None, RECIPE, paths=False), 1)
    assert "\n" not in str(err.value)
    assert ds_config_problems(cfg) == []
    check_ds_config(cfg, "ds.json")
    said = capsys.readouterr().err
    assert f'note: DeepSpeed config ds.json: the "{block}" block is enabled' in said and "frod train refuses" in said


@pytest.mark.parametrize(
    "blocks",
    [
        {"tensorboard": {"enabled": False, "output_path": "tb"}},
        {"wandb": {"project": "p"}},  # enabled defaults to false
        {"csv_monitor": {"enabled": True, "output_path": "csv"}},  # needs no package
    ],
)
def test_disabled_monitors_and_csv_monitor_pass(blocks):
    assert ds_config_problems(_zero3(**blocks)) == [] and monitor_problems(_zero3(**blocks)) == []


def test_an_enabled_monitor_whose_package_is_installed_passes(tmp_path, monkeypatch):
    _missing("wandb")
    (tmp_path / "wandb").mkdir()
    (tmp_path / "wandb" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert monitor_problems(_zero3(wandb={"enabled": True})) == []


def test_frod_train_refuses_a_tensorboard_block_without_tensorboard(tmp_path):
    _missing("tensorboard")
    env = build_env(tmp_path / "env")
    config = tmp_path / "ds.json"
    config.write_text(json.dumps(_zero3(tensorboard={"enabled": True, "output_path": str(tmp_path / "tb")})))
    out = tmp_path / "run"
    res = train_in_process(config, env.overrides(out, **{"train.max_steps": 1}))
    assert res.returncode == 2, res.stderr[-3000:]
    assert "Traceback" not in res.stderr and "ModuleNotFoundError" not in res.stderr
    lines = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and 'the "tensorboard" block is enabled' in lines[0], res.stderr[-3000:]
    assert not out.exists() and not (tmp_path / "tb").exists()
