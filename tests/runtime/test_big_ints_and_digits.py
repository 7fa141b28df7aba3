"""Numbers that Python's ``int`` cannot read in a user's input: an integer of more digits than it converts (4300)
in a JSON, JSONL or YAML file or an override, and Unicode digits (``'²'``, for which ``str.isdigit`` is True) in the
launcher's variables. Each is one ``error:`` line naming what is wrong, exit 2, no traceback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from frod_ds.runtime.errors import FrodError
from frod_ds.runtime.launch_env import launcher_rank_world, process_group_spec, ranks_on_this_node
from frod_ds.runtime.strict_json import HugeIntegerError, loads, parse_json
from tests.support import pace
from tests.support.leftovers import clean_env
from tests.support.model_shapes import TINY

REPO = Path(__file__).resolve().parents[2]
MIRROR = REPO / "tests" / "fixtures" / "data_prep" / "mirror"
HUGE = "9" * 5000


def frod(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "frod_ds", *args],
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=pace.scaled(60),
    )


def one_error(proc: subprocess.CompletedProcess) -> str:
    """The single ``error:`` line of a command that failed on its input."""
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert len(lines) == 1, proc.stderr[-2000:]
    assert len(lines[0]) < 1000, lines[0][:300]
    return lines[0]


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(TINY))
    return d


def test_strict_json_refuses_a_huge_integer_as_a_decode_error():
    for text, pos in ((f"[1, {HUGE}]", 4), (f'{{"a": "{HUGE}", "b": -{HUGE}}}', 5015)):
        for parse in (loads, parse_json):
            with pytest.raises(json.JSONDecodeError) as caught:
                parse(text)
            assert isinstance(caught.value, HugeIntegerError)
            assert "integer of 5000 digits" in str(caught.value) and caught.value.pos == pos
    assert loads(f'["{HUGE}", 1.{HUGE}]')[0] == HUGE  # a string and a float of that many digits are read


def test_a_huge_integer_in_a_recipe_file_is_one_line(tmp_path, model_dir):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"train:\n  max_steps: {HUGE}\n")
    line = one_error(frod("plan", "--model", str(model_dir), "--gpus", "1", "--recipe", str(recipe)))
    assert f"recipe {recipe} at line 2, column 14: an integer of more than 4300 digits" in line


@pytest.mark.parametrize("value", [HUGE, f"0x{'f' * 5000}", f"[1, {{a: {HUGE}}}]"])
def test_a_huge_integer_in_an_override_is_one_line(model_dir, value):
    line = one_error(frod("plan", "--model", str(model_dir), "--gpus", "1", f"train.max_steps={value}"))
    assert "override train.max_steps=...: an integer of more than 4300 digits" in line


@pytest.mark.parametrize("value", ["0b_", "0x_"])
def test_an_integer_yaml_cannot_read_is_not_called_huge(model_dir, value):
    """Only an integer past the digit limit is called so; another one YAML tags an integer but ``int`` cannot read
    is named for what it is."""
    import yaml

    from frod_ds.config.recipe import _UniqueKeyLoader

    line = one_error(frod("plan", "--model", str(model_dir), "--gpus", "1", f"train.seed={value}"))
    assert "4300" not in line and "not a YAML scalar" in line, line
    with pytest.raises(yaml.YAMLError, match=f"'{value}' is no integer"):
        yaml.load(f"seed: {value}\n", Loader=_UniqueKeyLoader)


def test_a_huge_integer_in_a_deepspeed_config_is_one_line(tmp_path, model_dir):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 2}})[:-1] + f', "steps_per_print": {HUGE}}}')
    line = one_error(frod("plan", "--model", str(model_dir), "--gpus", "1", "--config", str(config)))
    assert f"DeepSpeed config {config} is not valid JSON: an integer of 5000 digits" in line


def test_a_huge_integer_in_a_model_config_is_one_line(model_dir):
    (model_dir / "config.json").write_text(json.dumps(TINY)[:-1] + f', "vocab_size_x": {HUGE}}}')
    line = one_error(frod("plan", "--model", str(model_dir), "--gpus", "1"))
    assert "an integer of 5000 digits" in line


@pytest.mark.parametrize("name", ["train.jsonl", "train.json"])
def test_a_huge_integer_in_a_data_row_is_one_line(tmp_path, name):
    source = tmp_path / "mirror"
    shutil.copytree(MIRROR / "obqa", source / "obqa")
    rows = (source / "obqa" / "train.jsonl").read_text()
    (source / "obqa" / "train.jsonl").unlink()
    (source / "obqa" / name).write_text(rows + f'{{"id": "x", "answerKey": {HUGE}}}\n')
    line = one_error(frod("data", "show", "--source", str(source), "--task", "obqa", "-n", "9"))
    assert "line 4" in line and "integer of 5000 digits" in line


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"RANK": "0", "WORLD_SIZE": "²"}, "WORLD_SIZE='²'"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "¹"}, "LOCAL_RANK='¹'"),
        ({"RANK": "³", "WORLD_SIZE": "4"}, "RANK='³'"),
        ({"RANK": "0", "WORLD_SIZE": HUGE}, f"WORLD_SIZE={'9' * 20!r}... (5000 characters)"),
        ({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "²"}, "SLURM_STEP_NUM_TASKS='²'"),
    ],
)
def test_unicode_digits_in_the_launcher_ranks_are_refused(env, named):
    with pytest.raises(FrodError, match="the launcher environment is not one a launcher sets") as caught:
        launcher_rank_world(env)
    assert named in str(caught.value)


def test_unicode_digits_in_the_rendezvous_are_refused():
    torchrun = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "2⁹500"}
    with pytest.raises(FrodError, match=r"MASTER_PORT='2⁹500' is no TCP port"):
        process_group_spec(torchrun)
    with pytest.raises(FrodError, match=r"MASTER_PORT='9{40}' is no TCP port"):
        process_group_spec({**torchrun, "MASTER_PORT": "9" * 40})
    srun = {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_JOB_ID": "¹²"}
    with pytest.raises(FrodError, match=r"SLURM_JOB_ID='¹²' is no job number"):
        process_group_spec(srun)
    with pytest.raises(FrodError, match=r"SLURM_JOB_ID='9{20}'... \(5000 characters\) is no job number"):
        process_group_spec({**srun, "SLURM_JOB_ID": HUGE})
    assert process_group_spec({**srun, "SLURM_JOB_ID": "12"}).init_method == "tcp://127.0.0.1:20012"


def test_unicode_digits_in_a_ranks_per_node_count_are_passed_over():
    assert ranks_on_this_node({"LOCAL_WORLD_SIZE": "²", "WORLD_SIZE": "4"}) == 4
    assert ranks_on_this_node({"SLURM_STEP_TASKS_PER_NODE": "⁸(x2)"}) == 1
    assert ranks_on_this_node({"WORLD_SIZE": HUGE}) == 1
    assert ranks_on_this_node({"SLURM_STEP_TASKS_PER_NODE": "8(x2)"}) == 8


def test_a_command_under_unicode_launcher_digits_is_one_line(tmp_path, model_dir):
    env = clean_env(RANK="0", WORLD_SIZE="²")
    proc = subprocess.run(
        [sys.executable, "-m", "frod_ds", "hjd", "--model", str(model_dir), "--out", str(tmp_path / "out")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=pace.scaled(60),
    )
    assert "WORLD_SIZE='²'" in one_error(proc)
    assert not (tmp_path / "out").exists()
