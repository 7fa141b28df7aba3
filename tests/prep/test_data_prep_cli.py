"""The `python -m data_prep` command line: build report, errors as one line with status 2, stats, show."""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from frod_ds.prep.command import main, make_parser
from tests.support import pace
from tests.support.leftovers import clean_env

REPO = Path(__file__).resolve().parents[2]
MIRROR = Path(__file__).parents[1] / "fixtures" / "data_prep" / "mirror"


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err
    return lines[0]


def test_every_flag_has_help():
    parser = make_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(subparsers.choices) == {"build", "stats", "show"}
    for name, sub in subparsers.choices.items():
        for action in sub._actions:
            assert action.help, f"{name} {action.option_strings} has no help"


def test_build_prints_counts_drops_reference_and_sha256s(capsys, tmp_path):
    out = tmp_path / "cs"
    code, stdout, _ = run_cli(capsys, "build", "--source", MIRROR, "--out", out, "--tasks", "boolq,hellaswag,obqa")
    assert code == 0
    assert "train.jsonl: 7 rows; LLM-Adapters commonsense_170k has 170420 (-170413)" in stdout
    assert "dropped: boolq train: missing field 'passage': 1" in stdout
    assert "dropped: hellaswag eval: label missing: 1" in stdout
    assert any(line.split() == ["obqa", "eval", "test", "1", "1", "0"] for line in stdout.splitlines())
    printed = {line.split()[2]: line.split()[1] for line in stdout.splitlines() if line.startswith("sha256 ")}
    files = {p.relative_to(out).as_posix(): p for p in out.rglob("*") if p.is_file() and p.name != ".frod-ds-output"}
    assert set(printed) == set(files)
    for name, path in files.items():
        assert printed[name] == hashlib.sha256(path.read_bytes()).hexdigest()


def test_strict_error_is_one_line_status_2_and_out_untouched(capsys, tmp_path):
    out = tmp_path / "cs"
    code, stdout, err = run_cli(capsys, "build", "--source", MIRROR, "--out", out, "--tasks", "siqa", "--strict")
    assert code == 2
    assert error_line(err) == (
        f"error: siqa: {MIRROR / 'siqa' / 'train.jsonl'} row index 1: blank field 'question' "
        "(only whitespace: the prompt asks nothing) (--strict)"
    )
    assert not out.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["--tasks", "boolq,mmlu"],
            "error: unknown task 'mmlu'; valid tasks: boolq, piqa, siqa, hellaswag, winogrande, "
            "obqa, arc_easy, arc_challenge (or 'all')",
        ),
        (["--tasks", ","], "error: --tasks is empty"),
        (["--tasks", "boolq,,piqa"], "error: --tasks 'boolq,,piqa' has an empty name between commas"),
        (["--tasks", "all,boolq"], "error: --tasks 'all,boolq': 'all' stands alone; pass --tasks all, or a comma"),
        (["--tasks", "boolq,all"], "error: --tasks 'boolq,all': 'all' stands alone; pass --tasks all, or a comma"),
        (["--cutoff", "128"], "error: --cutoff needs --tokenizer"),
    ],
)
def test_bad_flags_are_one_line_errors(capsys, tmp_path, argv, message):
    code, _, err = run_cli(capsys, "build", "--source", MIRROR, "--out", tmp_path / "cs", *argv)
    assert code == 2
    assert error_line(err).startswith(message)
    assert not (tmp_path / "cs").exists()


def test_out_under_a_file_is_one_line_status_2(capsys, tmp_path):
    (tmp_path / "afile").write_text("x")
    code, _, err = run_cli(capsys, "build", "--source", MIRROR, "--out", tmp_path / "afile" / "d")
    assert code == 2 and str(tmp_path / "afile") in error_line(err) and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_missing_task_dir_suggests_tasks_flag(capsys, tmp_path):
    mirror = tmp_path / "mirror"
    (mirror / "piqa").mkdir(parents=True)
    code, _, err = run_cli(capsys, "build", "--source", mirror, "--out", tmp_path / "cs")
    assert code == 2
    line = error_line(err)
    assert "no directory for task(s) boolq, siqa, hellaswag, winogrande, obqa, arc_easy, arc_challenge" in line
    assert line.endswith("pass --tasks piqa to build only the tasks present")


def test_stats_verifies_sha256_and_prints_counts(capsys, tmp_path):
    out = tmp_path / "cs"
    assert run_cli(capsys, "build", "--source", MIRROR, "--out", out, "--tasks", "piqa,arc_easy")[0] == 0
    code, stdout, _ = run_cli(capsys, "stats", "--out", out)
    assert code == 0
    assert "all sha256s match" in stdout
    assert any(line.split()[:3] == ["train.jsonl", "piqa", "2"] for line in stdout.splitlines())
    assert any(line.split()[:3] == ["eval/arc_easy.jsonl", "arc_easy", "1"] for line in stdout.splitlines())
    assert "train rows: 4" in stdout
    with open(out / "eval" / "piqa.jsonl", "a") as f:
        f.write("\n")
    code, _, err = run_cli(capsys, "stats", "--out", out)
    assert code == 2 and "piqa.jsonl does not match its sha256 in the manifest" in error_line(err)
    code, _, err = run_cli(capsys, "stats", "--out", tmp_path)
    assert code == 2 and "is not a frod data build (no manifest.json)" in error_line(err)
    (tmp_path / "manifest.json").mkdir()
    code, _, err = run_cli(capsys, "stats", "--out", tmp_path)
    assert code == 2 and "is not a frod data build (its manifest.json is not a file)" in error_line(err)


def test_show_from_source_prints_training_text(capsys):
    code, stdout, err = run_cli(capsys, "show", "--source", MIRROR, "--task", "winogrande", "-n", "5")
    assert code == 0
    assert "skipped 1 invalid row(s): label missing" in err
    assert stdout == (
        "=== winogrande winogrande-train-0  label 1  choices ['Option1', 'Option2']\n"
        "Please choose the correct answer to fill in the blank to complete the given sentence: Ian volunteered to eat "
        "Dennis's menudo after already having a bowl because _ despised eating intestine.\n\n"
        "Option1: Ian\nOption2: Dennis.\nAnswer: Option2\n"
        "=== winogrande winogrande-train-1  label 0  choices ['Option1', 'Option2']\n"
        "Please choose the correct answer to fill in the blank to complete the given sentence:  Zo\u00eb gave "
        "Ren\u00e9e {the} book because _ was leaving.\n\n\nOption1: Zo\u00eb\nOption2:  Ren\u00e9e .\nAnswer: Option1\n"
    )


def test_show_from_build_with_repr(capsys, tmp_path):
    out = tmp_path / "cs"
    run_cli(capsys, "build", "--source", MIRROR, "--out", out, "--tasks", "arc_challenge")
    code, stdout, _ = run_cli(capsys, "show", "--out", out, "--task", "arc_challenge", "--split", "eval", "--repr")
    assert code == 0
    assert stdout.splitlines()[1] == repr(
        "Please choose the correct answer to the question:Which is a gas?\n"
        "Option A:\nice\nOption B:\nsteam\nOption C:\nwater\n.\nAnswer: Option B"
    )
    code, _, err = run_cli(capsys, "show", "--out", out, "--source", MIRROR, "--task", "piqa")
    assert code == 2 and error_line(err) == "error: show needs exactly one of --source or --out"
    # a task the build left out is named with what the build holds, not "no rows found" and exit 0
    code, stdout, err = run_cli(capsys, "show", "--out", out, "--task", "piqa")
    assert code == 2 and not stdout
    assert error_line(err) == f"error: {out} holds no piqa rows (its training mixture: arc_challenge)"


def test_module_entry_point_runs(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "data_prep", "show", "--source", str(MIRROR), "--task", "obqa", "-n", "1"],
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=pace.scaled(60),
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("=== obqa 7-980  label 3  choices ['Option A', 'Option B', 'Option C', 'Option D']\n")


def test_hub_source_offline_fails_with_one_line_error(tmp_path):
    env = clean_env(HF_HOME=str(tmp_path / "hf"))
    out = tmp_path / "cs"
    proc = subprocess.run(
        [sys.executable, "-m", "data_prep", "build", "--source", "hub", "--out", str(out), "--tasks", "siqa"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=pace.scaled(120),
    )
    assert proc.returncode == 2
    line = error_line(proc.stderr)
    assert line.startswith("error: cannot load siqa from the Hugging Face Hub (lighteval/siqa, split train): ")
    assert "use --source DIR" in line
    assert not out.exists()


def test_a_build_under_a_launcher_of_several_ranks_is_built_once(tmp_path):
    """``frod data build`` started on each of 2 ranks (torchrun, or srun with several tasks in a batch script): rank 0
    builds, the others leave it, the job succeeds, and the output equals a one-process build's."""
    from tests.support import ranks

    args = ["-m", "frod_ds", "data", "build", "--source", str(MIRROR), "--tasks", "boolq,obqa", "--out"]
    one = ranks.run(0, [*args, str(tmp_path / "one")], clean_env(), REPO, 60)
    assert one.returncode == 0, one.stderr[-2000:]
    two = ranks.run(2, [*args, str(tmp_path / "two")], clean_env(), REPO, 60)
    assert two.returncode == 0, two.stderr[-2000:]
    assert "error:" not in two.stderr and two.stderr.count("note: frod data runs as one process") == 1, two.stderr
    files = sorted(p.relative_to(tmp_path / "one") for p in (tmp_path / "one").rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(tmp_path / "two") for p in (tmp_path / "two").rglob("*") if p.is_file())
    jsonl = [f for f in files if f.suffix == ".jsonl"]
    assert jsonl and all((tmp_path / "one" / f).read_bytes() == (tmp_path / "two" / f).read_bytes() for f in jsonl)


def test_a_one_process_launch_script_under_several_ranks_runs_on_rank_0_only():
    """The ``launch/`` form of a one-process command (export) on 2 ranks: its help printed once, by rank 0."""
    from tests.support import ranks

    two = ranks.run(2, [str(REPO / "launch" / "export.py"), "--help"], clean_env(), REPO, 60)
    assert two.returncode == 0, two.stderr[-2000:]
    assert two.stdout.count("usage:") == 1 and two.stderr.count("note: frod export runs as one process") == 1


@pytest.mark.parametrize("env", [{"RANK": "0", "WORLD_SIZE": "0"}, {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "x"}])
def test_a_build_in_an_environment_no_launcher_sets_is_built(tmp_path, env):
    """Launcher variables no launcher sets mean nothing to a one-process command: the build runs, no traceback."""
    from tests.support import ranks

    args = ["-m", "frod_ds", "data", "build", "--source", str(MIRROR), "--tasks", "boolq", "--out", str(tmp_path / "d")]
    run = ranks.run(0, args, {**clean_env(), **env}, REPO, 60)
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert (tmp_path / "d" / "train.jsonl").is_file()


def test_rank_0_of_variables_no_launcher_set_runs_without_naming_a_launcher(tmp_path):
    """``RANK=0 WORLD_SIZE=2`` left in a shell: the command runs as one process, and no note speaks of the launcher
    that started the others (none did)."""
    from tests.support import ranks

    args = ["-m", "frod_ds", "data", "build", "--source", str(MIRROR), "--tasks", "boolq", "--out", str(tmp_path / "d")]
    run = ranks.run(0, args, {**clean_env(), "RANK": "0", "WORLD_SIZE": "2"}, REPO, 60)
    assert run.returncode == 0 and (tmp_path / "d" / "train.jsonl").is_file(), run.stderr[-2000:]
    assert "launcher" not in run.stderr, run.stderr[-2000:]


@pytest.mark.parametrize(
    "env",
    [
        {"RANK": "1", "WORLD_SIZE": "2"},
        {"RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": ""},  # set empty: no launcher's
        {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_JOB_ID": "7"},
    ],
)
@pytest.mark.parametrize("form", [["-m", "frod_ds", "data"], ["-m", "data_prep"]])
def test_rank_variables_no_launcher_set_are_refused_on_a_rank_other_than_0(tmp_path, env, form):
    """``RANK=1 WORLD_SIZE=2`` left in a shell (no torchrun, deepspeed or srun step beside them): a one-process
    command would take itself for rank 1 and do nothing with exit 0; it says so in one line and exits 2, in each
    form the command has."""
    from tests.support import ranks

    args = [*form, "build", "--source", str(MIRROR), "--tasks", "boolq", "--out", str(tmp_path / "d")]
    run = ranks.run(0, args, {**clean_env(), **env}, REPO, 60)
    assert run.returncode == 2, run.stderr[-2000:]
    (line,) = [x for x in run.stderr.splitlines() if x.startswith("error: ")]
    assert "this process is rank 1 of 2" in line and "no launcher started it" in line, line
    assert not (tmp_path / "d").exists()


def test_a_commands_module_run_as_the_program_is_the_frod_verb(tmp_path):
    """``python -m frod_ds.cli.plan`` (each command's module): the verb's rank check applies, as ``frod plan``'s."""
    from tests.support import ranks

    args = ["-m", "frod_ds.cli.plan", "--model", str(tmp_path / "m"), "--gpus", "1"]
    run = ranks.run(0, args, {**clean_env(), "RANK": "1", "WORLD_SIZE": "2"}, REPO, 60)
    assert run.returncode == 2 and "no launcher started it" in run.stderr, run.stderr[-2000:]
