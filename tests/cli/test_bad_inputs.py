"""Bad inputs and faults across the CLIs: each case asserts the exit code, the one ``error:`` line, and that
nothing partial or foreign was touched. The CLIs' ``main`` functions run in-process (one rank, CPU) where the
failure comes before the DeepSpeed engine is built; runs that build an engine (DeepSpeed keeps its process
group across calls, so only one per process) are one-process subprocesses. One tiny model, factor store and
trained adapter are shared by the whole module."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from launch import demo as demo_cli
from launch import eval as eval_cli
from launch import export as export_cli
from launch import train as train_cli
from tests.support.helpers_ckpt import hjd_in_process
from tests.support.train_env import CPU_ZERO2, REPO, build_env, run_train

MAX_STEPS = 2


def tree(path: Path) -> dict[str, str]:
    """Every file under ``path`` (relative name → sha256 of its bytes): proof that nothing changed."""
    if not path.exists():
        return {}
    if path.is_file():
        return {".": hashlib.sha256(path.read_bytes()).hexdigest()}
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def one_error(capsys, code: int, expected_code: int = 2) -> str:
    """The single ``error:`` line of the call that returned ``code``; no traceback."""
    err = capsys.readouterr().err
    assert code == expected_code, err[-3000:]
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(lines) == 1, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return build_env(tmp_path_factory.mktemp("bad_inputs"))


def train(env, out: Path, *extra: str, config: Path = CPU_ZERO2) -> int:
    """In-process: only for runs that fail before the engine is built."""
    overrides = env.overrides(out, **{"train.max_steps": MAX_STEPS, "train.save_every": 0})
    return train_cli.main(["--config", str(config), *overrides, *extra])


def train_proc(env, out: Path, *extra: str):
    overrides = env.overrides(out, **{"train.max_steps": MAX_STEPS, "train.save_every": 0})
    return run_train(CPU_ZERO2, [*overrides, *extra], nproc=0)


def proc_error(proc) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def trained(env):
    out = env.root / "run"
    proc = train_proc(env, out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "adapter-final" / ".frod-ds-output").is_file()
    return out


@pytest.fixture(scope="module")
def nan_adapter(env, trained):
    """A copy of the trained adapter with one σ entry NaN (as a diverged run would leave)."""
    out = env.root / "nan-adapter"
    shutil.copytree(trained / "adapter-final", out)
    tensors = load_file(str(out / "adapter.safetensors"))
    key = next(k for k in tensors if k.endswith("sigma"))
    tensors[key][0] = float("nan")
    save_file(tensors, str(out / "adapter.safetensors"))
    # as an adapter of format 2 (no weights checksum) would hold it; format 3 refuses any changed byte first
    config = json.loads((out / "adapter_config.json").read_text())
    config.pop("weights_crc32")
    (out / "adapter_config.json").write_text(json.dumps({**config, "version": 2}))
    return out


# -- recipe and configs ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override,needle",
    [
        ("train.lr_sigma=.nan", "train.lr_sigma must be a finite number"),
        ("train.lr_s=.inf", "train.lr_s must be a finite number"),
        ("train.warmup_ratio=.nan", "train.warmup_ratio must be a finite number"),
        ("train.max_nonfinite_steps=0", "train.max_nonfinite_steps must be >= 1"),
        ("data.limit=0", "data.limit must be >= 1 (rows to use), or null for every row; got 0"),
        ("train.bogus=1", "unknown key 'train.bogus'"),
        ("model.sparsity=2", "model.sparsity"),
    ],
)
def test_bad_recipe_values_are_one_line(env, tmp_path, capsys, override, needle):
    out = tmp_path / "out"
    line = one_error(capsys, train(env, out, override))
    assert needle in line
    assert not out.exists()


def test_recipe_yaml_whose_top_level_is_not_a_mapping(env, tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("- a\n- b\n")
    out = tmp_path / "out"
    code = train_cli.main(["--config", str(CPU_ZERO2), "--recipe", str(recipe), *env.overrides(out)])
    assert "r.yaml" in one_error(capsys, code)
    assert not out.exists()


@pytest.mark.parametrize(
    "text,needle",
    [
        ("[1, 2]", "object"),
        ('{"zero_optimization": {"stage": "three"}}', "got 'three'"),
        ("{not json", "JSON"),
        (
            '{"zero_optimization": {"stage": 2}, "zero_optimization": {"stage": 3}}',
            'key "zero_optimization" is given twice',
        ),
        ('{"bf16": {"enabled": "false"}}', 'bf16.enabled is the string "false"; write false without quotes'),
        (
            '{"zero_optimization": {"stage": 2, "reduce_bucket_size": -1}}',
            "zero_optimization.reduce_bucket_size: Input",
        ),
        ('{"steps_per_print": "often"}', "steps_per_print must be a positive integer, got 'often'"),
    ],
)
def test_bad_deepspeed_config_is_one_line(env, tmp_path, capsys, text, needle):
    cfg = tmp_path / "ds.json"
    cfg.write_text(text)
    out = tmp_path / "out"
    line = one_error(capsys, train(env, out, config=cfg))
    assert needle in line
    assert not (out / "checkpoints").exists()


# -- training data ----------------------------------------------------------------------------------------


def _data(env, tmp_path: Path, rows: list[dict] | None = None, raw: bytes | None = None) -> Path:
    p = tmp_path / "train.jsonl"
    if raw is not None:
        p.write_bytes(raw)
    else:
        p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def _rows(env) -> list[dict]:
    return [json.loads(x) for x in (env.data / "train.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    "case,needle",
    [
        ("non_utf8", "line 3: not valid UTF-8"),
        ("not_json", "line 2: not valid JSON"),
        ("no_prompt", "line 1: field 'prompt'"),
        ("empty", "has no rows"),
        ("few", "fewer than one global batch"),
        ("duplicate_id", "have the same id"),
        ("huge_row", "more than any sensible prompt"),
        ("lone_surrogate", "line 3: field 'answer' holds a lone surrogate '\\udc80'"),
    ],
)
def test_bad_training_data_is_one_line_naming_the_file(env, tmp_path, capsys, case, needle):
    rows = _rows(env)
    good = "".join(json.dumps(r) + "\n" for r in rows).encode()
    lines = good.splitlines(keepends=True)
    data = {
        "non_utf8": lambda: _data(env, tmp_path, raw=b"".join(lines[:2]) + b'{"prompt": "\xff"}\n'),
        "not_json": lambda: _data(env, tmp_path, raw=lines[0] + b"{oops\n"),
        "no_prompt": lambda: _data(env, tmp_path, [{"answer": "true"}]),
        "empty": lambda: _data(env, tmp_path, raw=b"\n"),
        "few": lambda: _data(env, tmp_path, rows[:3]),
        "duplicate_id": lambda: _data(env, tmp_path, rows[:10] + [rows[4]]),
        "huge_row": lambda: _data(env, tmp_path, rows[:10] + [{**rows[0], "id": "x", "prompt": "a" * 200_000}]),
        "lone_surrogate": lambda: _data(env, tmp_path, rows[:2] + [{**rows[2], "answer": "true\udc80"}] + rows[3:]),
    }[case]()
    out = tmp_path / "out"
    line = one_error(capsys, train(env, out, f"data.train={data}"))
    assert needle in line and "train.jsonl" in line
    assert not (out / "checkpoints").exists() and not (out / "adapter-final").exists()


@pytest.mark.parametrize("setting", ["data.train", "data.eval"])
@pytest.mark.parametrize("case", ["missing", "plain_dir"])
def test_missing_data_names_the_setting_that_points_at_it(env, tmp_path, capsys, setting, case):
    """A missing file, or a directory that is no data build, named with the recipe key at fault (``data.eval``
    was refused as "training data" and sent the user to data.train)."""
    target = tmp_path / ("nope.jsonl" if case == "missing" else "plain")
    if case == "plain_dir":
        target.mkdir()
    out = tmp_path / "out"
    every = ["train.eval_every=2"] if setting == "data.eval" else []
    line = one_error(capsys, train(env, out, f"{setting}={target}", *every))
    if case == "missing":
        assert f"({setting}) {target} not found; fix {setting}" in line, line
    else:
        assert f"({setting}) {target} is a directory but not a frod data build" in line, line
    assert ("evaluation data" in line) == (setting == "data.eval"), line
    assert not out.exists() or not any(out.iterdir())


# -- data builds that would quietly shrink ----------------------------------------------------------------

LA_FIXTURE = REPO / "tests" / "fixtures" / "data_prep" / "llm_adapters"
MIRROR_FIXTURE = REPO / "tests" / "fixtures" / "data_prep" / "mirror"


def _build(capsys, source: str, out: Path, tasks: str) -> str:
    from frod_ds.prep.command import main as data_prep_main

    return one_error(capsys, data_prep_main(["build", "--source", source, "--out", str(out), "--tasks", tasks]))


@pytest.mark.parametrize("split", ["train", "test"])
def test_data_build_with_an_empty_llm_adapters_split_is_refused(tmp_path, capsys, split):
    src = tmp_path / "src"
    shutil.copytree(LA_FIXTURE / "boolq", src / "boolq")
    shutil.copytree(LA_FIXTURE / "piqa", src / "piqa")
    (src / "boolq" / f"{split}.json").write_text("[]")
    before = tree(src)
    out = tmp_path / "out"
    line = _build(capsys, f"llm-adapters:{src}", out, "boolq,piqa")
    assert f"boolq {split} split {src / 'boolq' / f'{split}.json'} has no rows" in line
    assert "leave it out of --tasks" in line
    assert tree(src) == before and sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_data_build_whose_split_loses_every_row_is_refused(tmp_path, capsys):
    src = tmp_path / "mirror"
    shutil.copytree(MIRROR_FIXTURE, src)
    (src / "piqa" / "train.json").write_text('[{"goal": "g"}, {"sol1": "a"}]')  # no row renders
    before = tree(src)
    line = _build(capsys, str(src), tmp_path / "out", "boolq,piqa")
    assert f"piqa train split {src / 'piqa' / 'train.json'}: all 2 rows were dropped (" in line
    assert "--strict" in line
    assert tree(src) == before and sorted(p.name for p in tmp_path.iterdir()) == ["mirror"]


def test_data_build_of_a_combined_file_without_a_selected_task_is_refused(tmp_path, capsys):
    combined = tmp_path / "commonsense_170k.json"
    combined.write_text((LA_FIXTURE / "boolq" / "train.json").read_text())  # BoolQ rows only
    before = tree(combined)
    line = _build(capsys, f"llm-adapters:{combined}", tmp_path / "out", "boolq,piqa")
    assert f"{combined} has no usable rows of piqa, selected by --tasks" in line
    assert tree(combined) == before and sorted(p.name for p in tmp_path.iterdir()) == ["commonsense_170k.json"]


def test_density_so_small_that_s_is_empty_is_refused(env, tmp_path, capsys):
    out = tmp_path / "out"
    line = one_error(capsys, train(env, out, "model.sparsity=1e-6"))
    assert "gives S no entries" in line
    assert not (out / "checkpoints").exists()


def test_missing_model_and_store_are_one_line(env, tmp_path, capsys):
    out = tmp_path / "out"
    assert "nowhere" in one_error(capsys, train(env, out, f"model.base={tmp_path / 'nowhere'}"))
    assert "nostore" in one_error(capsys, train(env, out, f"model.factor_store={tmp_path / 'nostore'}"))
    assert not (out / "checkpoints").exists()


def test_output_dir_that_cannot_be_written(env, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("mine")
    line = one_error(capsys, train(env, blocker / "out"))
    assert "output_dir" in line and "not writable" in line
    assert blocker.read_text() == "mine"


def test_full_disk_while_publishing_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    import errno

    from frod_ds.formats.building import building_dir
    from frod_ds.runtime.errors import FrodError

    out = tmp_path / "pub"
    with pytest.raises(FrodError, match="No space left") as e:
        with building_dir(out, "eval-results") as tmp:
            (tmp / "a").write_text("x")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert "\n" not in str(e.value)
    assert list(tmp_path.iterdir()) == []


# -- run identity, resubmission, new runs ------------------------------------------------------------------


def test_resubmitting_a_finished_run_changes_nothing(env, trained, capsys):
    run = trained  # in place (recipe.yaml records output_dir): no other test resubmits into it, so it is as written
    (run / "adapter-final" / "eval").mkdir(exist_ok=True)
    (run / "adapter-final" / "eval" / "results.json").write_text("{}")
    before = tree(run)
    proc = train_proc(env, run)
    assert proc.returncode == 0 and "finished run" in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert tree(run) == before


def test_resubmitting_a_finished_run_copied_elsewhere_changes_nothing(env, trained, tmp_path):
    """A run copied to another path (its recipe.yaml names the old output_dir): the same command there has nothing
    to do and rewrites nothing, its recipe.yaml included."""
    run = tmp_path / "copied"
    shutil.copytree(trained, run)
    shutil.rmtree(run / "adapter-final" / "eval", ignore_errors=True)  # another test's user files, if it ran first
    assert f"output_dir: {trained}" in (run / "recipe.yaml").read_text()
    before = tree(run)
    proc = train_proc(env, run)
    assert proc.returncode == 0 and "finished run" in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert tree(run) == before


def test_a_finished_runs_damaged_adapter_is_written_again_bit_for_bit(env, trained, tmp_path):
    """A finished run whose adapter-final lost its weights file: the same command writes it again from the final
    checkpoint with a note, equal bit for bit to the one it lost (it had said "left as it is" and exited 0)."""
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    shutil.rmtree(run / "adapter-final" / "eval", ignore_errors=True)  # another test's user files, if it ran first
    weights = run / "adapter-final" / "adapter.safetensors"
    before = weights.read_bytes()
    weights.unlink()
    proc = train_proc(env, run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "writing adapter-final again from the checkpoint of step" in proc.stderr, proc.stderr[-3000:]
    assert weights.read_bytes() == before


def test_a_finished_runs_edited_adapter_is_refused_naming_output_dir(env, trained, tmp_path):
    """adapter-final/adapter_config.json edited by a user after the run finished: the same command does not write
    over the edit, and its one line names the recipe's output_dir (train has no --out flag)."""
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    shutil.rmtree(run / "adapter-final" / "eval", ignore_errors=True)  # another test's user files, if it ran first
    config = run / "adapter-final" / "adapter_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "users_key": 1}))
    before = tree(run)
    proc = train_proc(env, run)
    line = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and line.startswith("error: "), proc.stderr[-3000:]
    assert f"output_dir {run / 'adapter-final'} holds files changed since" in line and "--out" not in line, line
    assert tree(run) == before


def test_a_run_without_its_checkpoints_is_not_replaced_by_a_new_one(env, trained, tmp_path, capsys):
    """checkpoints/ deleted (to save space), adapter-final kept: nothing to resume or check the run against, so a
    rerun (here with another max_steps) is refused instead of training anew over its adapters."""
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    shutil.rmtree(run / "checkpoints")
    before = tree(run)
    line = one_error(capsys, train(env, run, "train.max_steps=9"))
    assert f"output_dir {run} holds a run's adapter-final" in line and "checkpoints/ is gone" in line, line
    assert "train.new_run=true" in line and tree(run) == before


def test_resubmitting_with_another_micro_batch_split_is_the_same_run(env, trained, tmp_path, capsys):
    run = tmp_path / "run"  # a copy: resubmitting rewrites recipe.yaml, which later tests compare
    shutil.copytree(trained, run)
    before = tree(run)
    proc = train_proc(env, run, "train.micro_batch_size=2", "train.grad_accum=4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    after = tree(run)
    assert after.pop("recipe.yaml") and before.pop("recipe.yaml"), "recipe.yaml records the latest command"
    assert after == before


@pytest.mark.parametrize(
    "override,needle",
    [
        ("train.lr_sigma=0.5", "train.lr_sigma: 0.01 there, 0.5 now"),
        ("train.seed=7", "train.seed"),
        ("train.micro_batch_size=8", "global_batch: 8 there, 16 now"),
        ("model.sparsity=0.2", "model.sparsity"),
        ("model.targets=[q_proj]", "model.targets now gives ['q_proj']"),
        ("train.max_steps=9", "its LR schedule: to train on, start from model.init_adapter="),
    ],
)
def test_rerunning_into_another_runs_output_dir_is_refused(env, trained, capsys, override, needle):
    before = tree(trained)
    line = one_error(capsys, train(env, trained, override))
    assert needle in line and "train.new_run=true" in line
    if needle.startswith("global_batch"):  # only the global batch differs: the advice is how to keep it
        assert "holds a run of global batch 8" in line and "micro_batch_size × train.grad_accum × ranks = 8" in line
    elif needle.startswith("model.targets"):  # the targets changed, not the factor store
        assert "holds a run that trains [" in line and "resume it with its targets" in line
    else:
        assert "holds another run" in line
    assert tree(trained) == before


def test_rerunning_with_other_data_is_refused(env, trained, tmp_path, capsys):
    rows = _rows(env)
    data = _data(env, tmp_path, rows[::-1])
    before = tree(trained)
    line = one_error(capsys, train(env, trained, f"data.train={data}"))
    assert "data.train content" in line
    assert tree(trained) == before


def test_new_run_moves_the_previous_run_aside(env, trained, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    before = tree(out)
    before.pop(".frod-ds-output")  # the directory's marker stays: it is still a training run
    proc = train_proc(env, out, "train.lr_sigma=0.02", "train.new_run=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (old,) = [p for p in out.iterdir() if p.name.startswith("superseded-")]
    assert tree(old) == before, "the previous run is kept, byte for byte"
    assert (out / "adapter-final").is_dir()


def test_corrupt_run_identity_record_is_one_line(env, trained, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    tag = (out / "checkpoints" / "latest_complete").read_text().strip()
    (out / "checkpoints" / tag / "run_identity.json").write_text("{trunc")
    before = tree(out)
    line = one_error(capsys, train(env, out))
    assert "corrupt" in line and "run_identity.json" in line
    assert tree(out) == before


# -- damaged checkpoints: fall back to the newest complete one, or say what to do ----------------------------


@pytest.fixture(scope="module")
def saved_each_step(env):
    """A finished 3-step run with a sealed checkpoint after every step; and its command for another output_dir."""

    def overrides(out: Path) -> list[str]:
        return env.overrides(out, **{"train.max_steps": 3, "train.save_every": 1, "train.keep_checkpoints": 3})

    out = env.root / "each-step"
    proc = run_train(CPU_ZERO2, overrides(out), nproc=0)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in (out / "checkpoints").glob("step*")) == [f"step{s:08d}" for s in (1, 2, 3)]
    return out, overrides


def _unfinished(run: Path, dest: Path, drop: tuple[str, ...] = ()) -> Path:
    """A copy of ``run`` as if it had been stopped after its last checkpoint (no adapter-final), minus ``drop``."""
    shutil.copytree(run, dest)
    shutil.rmtree(dest / "adapter-final")
    for tag in drop:
        shutil.rmtree(dest / "checkpoints" / tag)
    return dest


def _notes(proc) -> list[str]:
    return [x for x in proc.stderr.splitlines() if x.startswith("note:")]


def _optim_shard(ckpt: Path) -> Path:
    return next(ckpt.glob("*optim_states.pt"))


def test_truncated_newest_checkpoint_falls_back_to_the_previous_one(saved_each_step, tmp_path):
    """Same step, same losses, same adapter as a run resumed from that checkpoint directly; the skipped checkpoint
    is set aside byte for byte, the one resumed from is left as it was."""
    run, overrides = saved_each_step
    out = _unfinished(run, tmp_path / "fallback")
    shard = _optim_shard(out / "checkpoints" / "step00000003")
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    skipped, resumed = tree(out / "checkpoints" / "step00000003"), tree(out / "checkpoints" / "step00000002")
    proc = run_train(CPU_ZERO2, overrides(out), nproc=0)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = _notes(proc)
    assert f"checkpoint {out / 'checkpoints' / 'step00000003'} skipped ({shard.name} is truncated (" in line
    assert "resuming from the newest complete one, step00000002" in line and "skipped-step00000003" in line
    assert "resumed from step00000002: step 2/3" in proc.stdout
    assert tree(out / "checkpoints" / "skipped-step00000003") == skipped, "the skipped checkpoint kept as it was"
    assert tree(out / "checkpoints" / "step00000002") == resumed

    direct = _unfinished(run, tmp_path / "direct", drop=("step00000003",))
    proc = run_train(CPU_ZERO2, overrides(direct), nproc=0)
    assert proc.returncode == 0 and not _notes(proc), proc.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["loss"] for r in rows] == [
        json.loads(x)["loss"] for x in (direct / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["loss"] for r in rows] == [
        json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()
    ]
    a, b = (load_file(str(d / "adapter-final" / "adapter.safetensors")) for d in (out, direct))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_newest_checkpoint_with_a_changed_byte_falls_back(saved_each_step, tmp_path):
    run, overrides = saved_each_step
    out = _unfinished(run, tmp_path / "flipped")
    state = out / "checkpoints" / "step00000003" / "trainable_state.safetensors"
    data = bytearray(state.read_bytes())
    data[-5] ^= 0x01
    state.write_bytes(bytes(data))
    before = tree(out / "checkpoints" / "step00000002")
    proc = run_train(CPU_ZERO2, overrides(out), nproc=0)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = _notes(proc)
    assert "step00000003 skipped (trainable_state.safetensors is corrupt (its sha256 differs" in line
    assert tree(out / "checkpoints" / "step00000002") == before
    assert (out / "adapter-final").is_dir()


@pytest.mark.parametrize("unsealed", [("step00000003",), ("step00000001", "step00000002", "step00000003")])
def test_a_checkpoint_without_its_seal_is_named_in_a_note_and_not_resumed(saved_each_step, tmp_path, unsealed):
    """A save that never finished (no COMPLETE): the run resumes from the newest sealed checkpoint, or starts at
    step 0 when there is none, saying so; either way it ends with the uninterrupted run's losses and adapter."""
    run, overrides = saved_each_step
    out = _unfinished(run, tmp_path / "unsealed")
    for tag in unsealed:
        (out / "checkpoints" / tag / "COMPLETE").unlink()
    proc = run_train(CPU_ZERO2, overrides(out), nproc=0)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = _notes(proc)
    assert line.startswith(f"note: {', '.join(unsealed)} in {out / 'checkpoints'}: no COMPLETE seal"), line
    if len(unsealed) == 1:
        assert "resuming from step00000002" in line and "resumed from step00000002: step 2/3" in proc.stdout
    else:
        assert "starting at step 0" in line and "resumed from" not in proc.stdout
    assert [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [
        json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()
    ]
    a, b = (load_file(str(d / "adapter-final" / "adapter.safetensors")) for d in (out, run))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert all((out / "checkpoints" / t / "COMPLETE").is_file() for t in unsealed), "each step saved again, sealed"


@pytest.mark.parametrize("damage", ["truncated", "missing", "seal"])
def test_no_resumable_checkpoint_is_one_line_and_touches_nothing(env, trained, tmp_path, capsys, damage):
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    shutil.rmtree(out / "adapter-final")
    ckpt = out / "checkpoints" / (out / "checkpoints" / "latest_complete").read_text().strip()
    shard = _optim_shard(ckpt)
    if damage == "truncated":
        shard.write_bytes(shard.read_bytes()[:100])
    elif damage == "missing":
        shard.unlink()
    else:
        (ckpt / "COMPLETE").write_text('{"format": ')
    before = tree(out)
    line = one_error(capsys, train(env, out))
    why = {
        "truncated": f"{shard.name} is truncated (100 of",
        "missing": f"{shard.name} is missing",
        "seal": "its COMPLETE record is corrupt",
    }[damage]
    assert f"no checkpoint in {out / 'checkpoints'} can be resumed" in line and why in line
    assert "train.new_run=true" in line and f"remove {out / 'checkpoints'}" in line
    assert tree(out) == before


# -- non-finite values ------------------------------------------------------------------------------------


def test_a_weight_that_overflows_stops_training_without_an_adapter(env, tmp_path, capsys):
    """A finite base weight so large that the logits overflow (no entry check can call it damaged): three
    non-finite steps stop the run, naming the setting that allows more, and no adapter is written."""
    model = tmp_path / "model"
    shutil.copytree(env.model, model)
    for shard in model.glob("*.safetensors"):
        tensors = load_file(str(shard))
        if "model.norm.weight" in tensors:  # not a targeted weight, but the store records the others' fingerprint
            tensors["model.norm.weight"][:] = 3e38
            save_file(tensors, str(shard), metadata={"format": "pt"})
    store = tmp_path / "store"
    assert hjd_in_process(["--model", str(model), "--out", str(store), "--device", "cpu"]).returncode == 0
    out = tmp_path / "out"
    line = proc_error(train_proc(env, out, f"model.base={model}", f"model.factor_store={store}", "train.max_steps=6"))
    assert "consecutive steps with a non-finite loss" in line and "train.max_nonfinite_steps" in line
    assert not (out / "adapter-final").exists()


def test_export_refuses_a_non_finite_adapter(nan_adapter, tmp_path, capsys):
    out = tmp_path / "merged"
    line = one_error(capsys, export_cli.main(["--checkpoint", str(nan_adapter), "--out", str(out)]))
    assert "non-finite" in line
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_eval_refuses_a_non_finite_adapter(env, nan_adapter, tmp_path, capsys):
    out = tmp_path / "eval"
    line = one_error(
        capsys,
        eval_cli.main(
            ["--checkpoint", str(nan_adapter), "--data", str(env.data), "--tasks", "boolq", "--output", str(out)]
        ),
    )
    assert "non-finite" in line
    assert not out.exists()


def test_eval_refuses_a_base_whose_tokenizer_is_not_the_adapters(env, trained, tmp_path, capsys):
    """--base-model a copy of the base whose tokenizer files were replaced by another tokenizer (trained on other
    text, no larger): the adapter records its tokenizer's digest, so the scores of other ids are refused."""
    import json

    from frod_ds.testing.toy import train_sentencepiece_tokenizer

    base = tmp_path / "base"
    shutil.copytree(env.model, base)
    texts = [
        " ".join(json.loads(x)["prompt"].split()[::-1]) for x in (env.data / "train.jsonl").read_text().splitlines()
    ]
    other = train_sentencepiece_tokenizer(tmp_path / "other", texts, vocab_size=300)
    for f in other.iterdir():
        shutil.copy(f, base / f.name)
    out = tmp_path / "eval"
    argv = ["--checkpoint", str(trained / "adapter-final"), "--base-model", str(base), "--data", str(env.data)]
    line = one_error(capsys, eval_cli.main([*argv, "--tasks", "boolq", "--output", str(out)]))
    assert f"the tokenizer in {base} is not the one adapter" in line and "trained with" in line, line
    assert not out.exists()


@pytest.mark.parametrize("inside", ["store", "model", "data"])
def test_training_into_an_input_is_refused(env, tmp_path, capsys, inside):
    """output_dir inside the factor store, the base model or the data build the run reads: refused before anything
    is written there (the run wrote its files into the store, the model folder)."""
    src = {"store": env.store, "model": env.model, "data": env.data}[inside]
    copy = tmp_path / inside
    shutil.copytree(src, copy)
    before = sorted(p.relative_to(copy).as_posix() for p in copy.rglob("*"))
    key = {"store": "model.factor_store", "model": "model.base", "data": "data.train"}[inside]
    line = one_error(capsys, train(env, copy / "run", f"{key}={copy}"))
    assert f"output_dir {copy / 'run'} (not there yet) is inside {key} {copy}, an input of this command" in line, line
    assert sorted(p.relative_to(copy).as_posix() for p in copy.rglob("*")) == before


@pytest.mark.parametrize("flag", ["--data", "--checkpoint"])
def test_eval_into_an_input_is_refused(env, trained, tmp_path, capsys, flag):
    """--output inside the data build or the adapter it scores: refused before anything is written there."""
    data, adapter = tmp_path / "data", tmp_path / "adapter"
    shutil.copytree(env.data, data)
    shutil.copytree(trained / "adapter-final", adapter)
    out = (data if flag == "--data" else adapter) / "results"
    argv = ["--checkpoint", str(adapter), "--data", str(data), "--tasks", "boolq", "--limit", "2", "--output", str(out)]
    line = one_error(capsys, eval_cli.main(argv))
    assert f"--output {out} (not there yet) is inside {flag}" in line and "an input of this command" in line, line
    assert not out.exists()


@pytest.mark.parametrize("fmt", ["hf", "peft"])
def test_export_into_its_base_model_is_refused_as_its_input(env, trained, tmp_path, capsys, fmt):
    """``--out`` the very folder ``--base-model`` names (with ``--overwrite``): named as the command's input, not as
    a folder frod-ds did not write; nothing in it changes."""
    base = tmp_path / "base"
    shutil.copytree(env.model, base)
    before = {p.name: p.read_bytes() for p in base.iterdir() if p.is_file()}
    argv = ["--checkpoint", str(trained / "adapter-final"), "--base-model", str(base), "--out", str(base)]
    line = one_error(capsys, export_cli.main([*argv, "--overwrite", "--format", fmt]))
    assert f"--out {base} (files not written by frod-ds) is --base-model {base}, an input of this command" in line
    assert {p.name: p.read_bytes() for p in base.iterdir() if p.is_file()} == before


def test_export_refuses_a_base_with_a_non_finite_weight_as_train_and_eval_do(env, trained, tmp_path, capsys):
    """A NaN in an untargeted base weight (its store built from that base): training and eval refuse the base as
    damaged; export wrote the NaN into the merged checkpoint without a word. Now it names the tensor, and no
    --out is left."""
    base = tmp_path / "base"
    shutil.copytree(env.model, base)
    name = "model.layers.0.mlp.down_proj.weight"
    shard = next(p for p in base.glob("*.safetensors") if name in load_file(str(p)))
    tensors = load_file(str(shard))
    tensors[name][0, 0] = float("nan")
    save_file(tensors, str(shard), metadata={"format": "pt"})
    store = tmp_path / "store"
    assert hjd_in_process(["--model", str(base), "--out", str(store), "--device", "cpu"]).returncode == 0
    out = tmp_path / "merged"
    argv = ["--checkpoint", str(trained / "adapter-final"), "--base-model", str(base), "--factor-store", str(store)]
    line = one_error(capsys, export_cli.main([*argv, "--out", str(out)]))
    assert f"{name} holds 1 non-finite value(s) (NaN/inf) in the base checkpoint {base}" in line, line
    assert not out.exists() and not list(tmp_path.glob(".merged*"))


# -- damaged inputs of eval and export --------------------------------------------------------------------


def test_corrupt_adapter_config_is_called_corrupt(env, trained, tmp_path, capsys):
    adapter = tmp_path / "adapter"
    shutil.copytree(trained / "adapter-final", adapter)
    (adapter / "adapter_config.json").write_text('{"format": "frod')
    line = one_error(capsys, export_cli.main(["--checkpoint", str(adapter), "--out", str(tmp_path / "m")]))
    assert "corrupt" in line and "missing" not in line
    line = one_error(
        capsys,
        eval_cli.main(
            ["--checkpoint", str(adapter), "--data", str(env.data), "--tasks", "boolq", "--output", str(tmp_path / "e")]
        ),
    )
    assert "corrupt" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]


def test_truncated_checkpoint_shard_given_to_eval(env, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(env.model, model)
    shard = sorted(model.glob("*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    out = tmp_path / "eval"
    line = one_error(
        capsys,
        eval_cli.main(["--model", str(model), "--data", str(env.data), "--tasks", "boolq", "--output", str(out)]),
    )
    assert shard.name in line
    assert not out.exists()


def test_eval_of_a_missing_checkpoint(env, tmp_path, capsys):
    line = one_error(
        capsys,
        eval_cli.main(
            [
                "--checkpoint",
                str(tmp_path / "nope"),
                "--data",
                str(env.data),
                "--tasks",
                "boolq",
                "--output",
                str(tmp_path / "e"),
            ]
        ),
    )
    assert "nope" in line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "flag, folder, kind",
    [
        ("--model", "store", "a factor store"),
        ("--model", "data", "a frod data build"),
        ("--model", "peft", "a PEFT adapter"),
        ("--checkpoint", "store", "a factor store"),
        ("--checkpoint", "model", "a Hugging Face model checkpoint"),
        ("--checkpoint", "peft", "a PEFT adapter"),
    ],
)
def test_eval_names_a_folder_of_the_wrong_kind(env, tmp_path, capsys, flag, folder, kind):
    """A factor store, a data build or a PEFT adapter given as --model or --checkpoint: one line saying what the
    folder is (transformers and peft used to stop with a traceback), nothing written."""
    peft = tmp_path / "peft"  # the layout PEFT's save_pretrained writes
    peft.mkdir()
    (peft / "adapter_config.json").write_text(json.dumps({"peft_type": "FROD", "base_model_name_or_path": "m"}))
    save_file({"x": torch.zeros(1)}, str(peft / "adapter_model.safetensors"))
    where = peft if folder == "peft" else getattr(env, folder)
    out = tmp_path / "eval"
    argv = [flag, str(where), "--data", str(env.data), "--tasks", "boolq", "--output", str(out)]
    line = one_error(capsys, eval_cli.main(argv))
    assert line.startswith(f"error: {flag} {where} is {kind}"), line
    assert not out.exists()


# -- never replace what frod-ds did not write ------------------------------------------------------------


def test_export_overwrite_refuses_a_directory_it_did_not_write(trained, tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    line = one_error(
        capsys, export_cli.main(["--checkpoint", str(trained / "adapter-final"), "--out", str(mine), "--overwrite"])
    )
    assert "not written by frod-ds" in line
    assert tree(mine) == {"thesis.tex": hashlib.sha256(b"years of work").hexdigest()}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]


def test_export_overwrite_refuses_the_working_directory(trained, tmp_path, capsys, monkeypatch):
    work = tmp_path / "work"
    (work / "sub").mkdir(parents=True)
    (work / ".frod-ds-output").write_text("{}")  # even a marked directory, if the user stands in it
    monkeypatch.chdir(work / "sub")
    line = one_error(
        capsys, export_cli.main(["--checkpoint", str(trained / "adapter-final"), "--out", str(work), "--overwrite"])
    )
    assert "contains" in line
    assert (work / "sub").is_dir()


def test_export_overwrite_replaces_its_own_export(trained, tmp_path, capsys):
    out = tmp_path / "merged"
    args = ["--checkpoint", str(trained / "adapter-final"), "--out", str(out)]
    assert export_cli.main(args) == 0
    line = one_error(capsys, export_cli.main(args))
    assert "--overwrite" in line
    assert export_cli.main([*args, "--overwrite"]) == 0
    assert (out / ".frod-ds-output").is_file() and (out / "frod_export.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged"]


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--dtype", "int8"], "--dtype"),
        (["--shard-gb", "0"], "--shard-gb"),
    ],
)
def test_bad_export_options(trained, tmp_path, capsys, argv, needle):
    out = tmp_path / "m"
    line = one_error(
        capsys, export_cli.main(["--checkpoint", str(trained / "adapter-final"), "--out", str(out), *argv])
    )
    assert needle in line
    assert not out.exists()


def test_demo_never_deletes_the_repository(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    head = (REPO / ".git").exists()
    line = one_error(capsys, demo_cli.main(["--out", "."]))
    assert "refusing" in line
    assert (REPO / ".git").exists() == head and (REPO / "frod_ds" / "train" / "trainer.py").is_file()


def test_demo_refuses_a_directory_it_did_not_write(tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    line = one_error(capsys, demo_cli.main(["--out", str(mine)]))
    assert "not written by frod-ds" in line
    assert (mine / "notes.txt").read_text() == "keep"


def test_demo_refuses_a_parent_of_the_working_directory(tmp_path, capsys, monkeypatch):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / ".frod-ds-output").write_text("{}")
    monkeypatch.chdir(tmp_path / "a" / "b")
    line = one_error(capsys, demo_cli.main(["--out", str(tmp_path / "a")]))
    assert "contains" in line
    assert (tmp_path / "a" / "b").is_dir()


def test_adapter_publish_refuses_to_replace_an_unmarked_directory(tmp_path):
    from frod_ds.formats.adapter_dir import AdapterConfig
    from frod_ds.model.adapter import write_adapter
    from frod_ds.runtime.errors import FrodError

    out = tmp_path / "adapter-final"
    out.mkdir()
    (out / "eval").mkdir()
    (out / "eval" / "results.json").write_text("{}")
    config = AdapterConfig(base_model="b", factor_store="s", targets=["q_proj"], sparsity=0.1, seed=0, dtype="float32")
    with pytest.raises(FrodError, match="not written by frod-ds"):
        write_adapter(out, {"x": torch.zeros(1)}, config)
    assert (out / "eval" / "results.json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter-final"]


def test_adapter_write_refuses_non_finite_tensors(tmp_path):
    from frod_ds.formats.adapter_dir import AdapterConfig
    from frod_ds.model.adapter import write_adapter
    from frod_ds.runtime.errors import FrodError

    config = AdapterConfig(base_model="b", factor_store="s", targets=["q_proj"], sparsity=0.1, seed=0, dtype="float32")
    with pytest.raises(FrodError, match="non-finite"):
        write_adapter(tmp_path / "a", {"x": torch.tensor([1.0, float("inf")])}, config)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "argv",
    [
        ["hjd", "--model", "~frod-no-such-user/m", "--out", "{tmp}/store"],
        ["plan", "--model", "~frod-no-such-user/m", "--gpus", "1"],
        ["convert-gguf", "convert", "--gguf", "~frod-no-such-user/g.gguf", "--out", "{tmp}/g"],
        ["demo", "--out", "~frod-no-such-user/demo"],
    ],
)
def test_a_home_of_no_such_user_is_one_line(tmp_path, capsys, monkeypatch, argv):
    """``~user/...`` of a user this node does not have (quoted, or from a script: no shell expanded it): pathlib
    cannot expand it; the path is taken as written and refused in one line, never a RuntimeError's traceback, and
    no folder named ``~...`` is made in the working directory."""
    from frod_ds.cli.main import main

    monkeypatch.chdir(tmp_path)
    assert main([a.replace("{tmp}", str(tmp_path)) for a in argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("error: ") and "~frod-no-such-user" in err[-1], err
    assert not any(p.name.startswith("~") for p in tmp_path.iterdir())
