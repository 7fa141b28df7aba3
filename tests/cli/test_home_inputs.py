"""An input path written with a leading ``~`` that no shell expanded (quoted, from a script or a launcher's argument
list, in a recipe) means what the shell would have made of it, for every command's inputs; an output so written is
refused in one line instead (tests/formats: ``literal_home``). A ``--factor-store`` that is not there is named as
the flag's, not as the adapter's."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from frod_ds.cli.main import main
from frod_ds.config.recipe import load_recipe
from tests.support.leftovers import REPO
from tests.support.train_env import CPU_ZERO2, build_env, run_train


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return build_env(tmp_path_factory.mktemp("home-inputs"))


@pytest.fixture
def home(env, tmp_path, monkeypatch) -> Path:
    """$HOME holding copies of the set-up's raw mirror, data build, model and store."""
    home = tmp_path / "home"
    for name in ("raw", "data", "model", "factors"):
        shutil.copytree(env.root / name, home / name)
    shutil.copy(REPO / "ds_configs" / "zero2.json", home / "ds.json")
    (home / "r.yaml").write_text(
        "model:\n  base: ~/model\n  factor_store: ~/factors\n  tokenizer: ~/model\ndata:\n  train: ~/data\n"
    )
    monkeypatch.setenv("HOME", str(home))
    return home


def test_data_commands_read_their_inputs_under_home(home, capsys):
    assert main(["data", "stats", "--out", "~/data"]) == 0
    assert "train rows:" in capsys.readouterr().out
    assert main(["data", "show", "--source", "~/raw", "--task", "piqa", "-n", "1"]) == 0
    assert main(["data", "show", "--out", "~/data", "--task", "piqa", "-n", "1"]) == 0


def test_hjd_verify_plan_and_a_recipe_read_theirs(home, capsys):
    assert main(["hjd", "--model", "~/model", "--verify", "~/factors"]) == 0
    assert f"verify {home / 'factors'}: OK" in capsys.readouterr().out
    args = ["plan", "--model", "~/model", "--gpus", "1", "--recipe", "~/r.yaml", "--config", "~/ds.json"]
    assert main(args) == 0, capsys.readouterr().err
    recipe = load_recipe("~/r.yaml")
    assert (recipe.model.base, recipe.model.factor_store) == (str(home / "model"), str(home / "factors"))
    assert recipe.data.train == str(home / "data")


def test_a_factor_store_flag_that_is_not_there_is_the_flags(env, tmp_path, capsys):
    """The adapter named a store that is there; ``--factor-store`` a path that is not: the line names the flag."""
    from frod_ds.model.adapter import adapter_sources
    from frod_ds.runtime.errors import AdapterError

    run = tmp_path / "run"
    trained = run_train(CPU_ZERO2, env.overrides(run, **{"train.max_steps": "1"}), nproc=1)
    assert trained.returncode == 0, trained.stderr[-3000:]
    with pytest.raises(AdapterError) as e:
        adapter_sources(run / "adapter-final", factor_store=str(tmp_path / "nowhere"))
    assert str(e.value) == (
        f"--factor-store {tmp_path / 'nowhere'} does not exist; pass the directory written by frod hjd for this base "
        "model"
    )
