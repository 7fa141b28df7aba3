"""The ``frod`` command and its other forms: each runs its ``--help``, every flag of every parser has a help text,
``frod`` dispatches to the same code as the script forms, the deprecated forms still run after one stderr line,
and the documented launcher lines (``torchrun --no-python frod``, ``deepspeed --no_python frod``) run it on ranks."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from frod_ds.cli.main import COMMANDS
from tests.support import pace
from tests.support.leftovers import REPO, clean_env

PY = sys.executable
FROD = [PY, "-m", "frod_ds"]  # the module form: what the installed frod program runs (frod_ds.cli.main.console)
SCRIPT_FORMS = {  # docs/commands.md
    "train": [PY, "launch/train.py"],
    "hjd": [PY, "launch/hjd.py"],
    "eval": [PY, "launch/eval.py"],
    "export": [PY, "launch/export.py"],
    "convert-gguf": [PY, "launch/convert_gguf.py"],
    "demo": [PY, "launch/demo.py"],
    "plan": [*FROD, "plan"],
    "data": [PY, "-m", "data_prep"],
}
DEPRECATED = {  # the form, the command its note names
    "python -m frod_ds.cli": ([PY, "-m", "frod_ds.cli", "plan"], "frod plan"),
    "python -m launch.demo": ([PY, "-m", "launch.demo"], "frod demo"),
    "python -m launch.train": ([PY, "-m", "launch.train"], "frod train"),
}


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        cmd,
        cwd=kw.pop("cwd", REPO),
        env=kw.pop("env", clean_env()),
        capture_output=True,
        text=True,
        timeout=kw.pop("timeout", 120),
        **kw,
    )


def usage_of(cmd: list[str]) -> str:
    res = run([*cmd, "--help"])
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.startswith("usage: "), res.stdout[:200]
    return res.stdout


def test_every_command_has_a_script_form():
    assert set(SCRIPT_FORMS) == set(COMMANDS)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_frod_command_and_its_script_form_print_the_same_help(command):
    new = usage_of([*FROD, command])
    assert new.startswith(f"usage: frod {command} ")
    assert usage_of(SCRIPT_FORMS[command]) == new


def test_frod_lists_every_command_and_its_version():
    top = usage_of(FROD)
    assert all(name in top for name in COMMANDS)
    res = run([*FROD, "--version"])
    from frod_ds import __version__

    assert (res.returncode, res.stdout.strip()) == (0, f"frod-ds {__version__}")
    bad = run([*FROD, "tarin"])
    assert bad.returncode == 2 and "invalid choice: 'tarin'" in bad.stderr


def test_the_frod_program_is_the_module_form():
    """The console script an install puts beside the interpreter (``pyproject.toml``) runs what ``-m frod_ds`` runs."""
    program = Path(PY).parent / "frod"
    assert program.is_file(), "the frod program is missing: pip install -e . (make venv) installs it"
    assert usage_of([str(program), "demo"]) == usage_of([*FROD, "demo"])


@pytest.mark.parametrize("form", sorted(DEPRECATED))
def test_a_deprecated_form_says_so_in_one_line_then_runs(form):
    cmd, instead = DEPRECATED[form]
    res = run([*cmd, "--help"])
    assert res.returncode == 0 and res.stdout == usage_of([*FROD, instead.split()[1]])
    notes = [line for line in res.stderr.splitlines() if "DeprecationWarning" in line]
    assert notes == [f"DeprecationWarning: `{form}` goes in 0.3.0; run `{instead}` (docs/commands.md)"], res.stderr
    # under a launcher only rank 0 says it
    launched = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "none"}  # as torchrun sets
    rank1 = run([*cmd, "--help"], env=clean_env(**launched))
    assert rank1.returncode == 0 and "DeprecationWarning" not in rank1.stderr


@pytest.mark.parametrize("command", ["hjd", "data"])
def test_the_forms_that_keep_working_say_nothing_of_deprecation(command):
    for cmd in ([*FROD, command], SCRIPT_FORMS[command]):
        res = run([*cmd, "--help"])
        assert res.returncode == 0 and "Deprecat" not in res.stderr, (cmd, res.stderr)


def _parsers(command: str, monkeypatch) -> list[argparse.ArgumentParser]:
    """The parsers ``frod COMMAND --help`` builds (sub-commands' included), caught as they parse."""
    seen: list[argparse.ArgumentParser] = []
    real = argparse.ArgumentParser.parse_known_args

    def spy(self, args=None, namespace=None):
        seen.append(self)
        return real(self, args, namespace)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", spy)
    from frod_ds.cli.main import main

    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    out = []
    todo = seen[-1:]
    while todo:
        p = todo.pop()
        out.append(p)
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo += list(action.choices.values())
    return out


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_flag_has_help(command, monkeypatch, capsys):
    missing = [
        f"{p.prog}: {a.option_strings or a.dest}"
        for p in _parsers(command, monkeypatch)
        for a in p._actions
        if a.help is None and not isinstance(a, argparse._SubParsersAction)
    ]
    capsys.readouterr()
    assert missing == []


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_no_parser_takes_an_abbreviated_flag(command, monkeypatch, capsys):
    """argparse would read ``--rank 2`` as ``--ranks 2`` (a prefix): a typo must be an error, not another flag."""
    parsers = _parsers(command, monkeypatch)
    capsys.readouterr()
    assert [p.prog for p in parsers if p.allow_abbrev] == []


def test_a_prefix_of_a_flag_is_refused_with_one_line(tmp_path, capsys):
    from frod_ds.cli.main import main

    with pytest.raises(SystemExit) as done:
        main(["demo", "--out", str(tmp_path / "d"), "--rank", "2"])
    assert done.value.code == 2 and "unrecognized arguments: --rank 2" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


def test_deepspeed_launcher_puts_local_rank_before_the_command():
    """``deepspeed --no_python frod train ...`` runs ``frod --local_rank=N train ...`` on each rank."""
    from frod_ds.cli.main import _split

    assert _split(["--local_rank=3", "train", "--config", "c.json"]) == (
        ["train"],
        ["--config", "c.json", "--local_rank=3"],
    )
    assert _split(["--local-rank", "3", "eval", "-h"]) == (["eval"], ["-h", "--local-rank", "3"])
    assert _split(["--", "plan", "--gpus", "1"]) == (["plan"], ["--gpus", "1"])  # the end of frod's own options
    assert _split(["plan", "--gpus", "1"]) == (["plan"], ["--gpus", "1"])


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed"])
def test_the_launcher_lines_run_hjd_on_two_ranks_like_one_process(tmp_path, launcher):
    """``torchrun --no-python frod hjd`` and ``deepspeed --no_python frod hjd`` (2 CPU ranks each, the launcher
    lines of docs/commands.md) write the factors ``frod hjd`` writes in one process (run here, in this one); the
    DeepSpeed launcher's ``--local_rank`` argument is accepted."""
    import torch

    from frod_ds.model.store_reader import FactorStore
    from frod_ds.testing.toy import write_tiny_llama
    from tests.support.helpers_ckpt import hjd_in_process
    from tests.support.leftovers import free_port

    write_tiny_llama(
        tmp_path / "model",
        vocab_size=64,
        hidden_size=16,
        intermediate_size=24,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_hidden_layers=2,
    )
    env = clean_env(PATH=os.pathsep.join([str(Path(PY).parent), os.environ.get("PATH", "")]))  # frod, deepspeed
    args = ["hjd", "--model", str(tmp_path / "model"), "--device", "cpu", "--out"]
    line = {
        "torchrun": [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--no-python", "frod"],
        "deepspeed": ["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), "--no_python", "frod"],
    }[launcher]
    res = run([*line, *args, str(tmp_path / launcher)], env=env, timeout=pace.scaled(240))
    assert res.returncode == 0, res.stderr[-3000:]
    res = hjd_in_process([*args[1:], str(tmp_path / "one")])  # frod hjd in one process, in this one
    assert res.returncode == 0, res.stderr[-3000:]

    one, other = FactorStore.open(tmp_path / "one"), FactorStore.open(tmp_path / launcher)
    assert one.categories and one.manifest.world_size == 1
    assert other.categories == one.categories and other.manifest.world_size == 2
    for category, members in one.categories.items():
        for member in members:  # the weight each store rebuilds, U_i diag(sigma_i) V^T
            wa, wb = (
                (s.load_U(member, torch.float64) * s.load_sigma(member, torch.float64))
                @ s.load_V(category, torch.float64).T
                for s in (one, other)
            )
            assert (torch.linalg.norm(wa - wb) / torch.linalg.norm(wa)).item() < 1e-5, member


def test_every_import_in_the_library_names_a_module():
    """Commands import most of their code inside functions, so a wrong path fails only when that branch runs
    (``frod export --format peft`` and ``--from-peft`` once imported ``frod_ds.interop.hf_export.peft_interop``).
    Read from the source: every ``frod_ds`` import anywhere in the package names one of its module files."""
    from frod_ds._moved import MOVED
    from tests.repo.test_layering import imports, modules

    mods = modules()
    unknown = sorted(
        f"{name} imports {target}"
        for name, path in mods.items()
        for target in imports(path, name, set(mods))
        if target.split(".")[0] == "frod_ds" and target not in mods and target not in MOVED
    )
    assert unknown == []


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--recipe", "missing.yaml"], "--recipe missing.yaml: no such file"),
        (["--ranks", "0"], "--ranks 0"),
        (["--ranks", "100"], "--ranks 100: this machine gives the demo"),
        (["--recipe", "{bad}"], "train.max_step"),
    ],
)
def test_demo_refuses_a_bad_recipe_or_ranks_before_writing_anything(tmp_path, capsys, argv, needle):
    from frod_ds.cli.demo import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  max_step: 2\n")  # a misspelled key
    code = main(["--out", str(tmp_path / "demo"), *[a.replace("{bad}", str(bad)) for a in argv]])
    err = capsys.readouterr().err
    assert code == 2 and err.count("error: ") == 1 and needle in err and "Traceback" not in err, err
    assert not (tmp_path / "demo").exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["--gpu-mem", "nan"],
        ["--gpu-mem", "inf"],
        ["--seq-len", "0"],
        ["--seq-len", "-1"],
        ["--seq-len", "1" + "0" * 400],  # past float's range: the planner's arithmetic raised OverflowError
        ["--gpus", "0"],
    ],
)
def test_plan_refuses_a_number_it_cannot_plan_with(argv, capsys):
    """A memory of nan GiB (no line, exit 1) or a sequence of 0 tokens (a plan, exit 0) was taken as given. The
    line names the one bad value and its rule (it gave the rules of --gpus and --gpu-mem together)."""
    from frod_ds.cli.plan import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(["--model", "m", "--gpus", "1", *argv])
    line = capsys.readouterr().err.splitlines()[-1]
    other = {"--gpus": "--gpu-mem", "--gpu-mem": "--gpus"}.get(argv[0], "--gpu-mem")
    assert e.value.code == 2 and f"{argv[0]} must be" in line and other not in line, line


def test_plan_and_data_never_import_torch(tmp_path):
    """``frod plan`` (with its quantized alternatives) and ``frod data build`` are torch-free: they answer on a
    login node in a fraction of a second. Checked in a fresh interpreter, the command run to its exit, the
    planner's answer and the data build's output checked too (so the check cannot pass on an early error)."""
    from frod_ds.testing.toy import write_synthetic_tasks

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": 8192,
                "intermediate_size": 28672,
                "num_hidden_layers": 80,
                "num_attention_heads": 64,
                "num_key_value_heads": 8,
                "vocab_size": 32000,
            }
        )
    )
    write_synthetic_tasks(tmp_path / "raw", n_train=16, n_eval=8, seed=0)
    probe = (
        "import runpy, sys\n"
        "sys.argv = sys.argv[1:]\n"
        "try:\n"
        "    runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)\n"
        "except SystemExit as e:\n"
        "    print('exit', e.code)\n"
        "print('torch imported:', 'torch' in sys.modules)\n"
    )
    res = run([PY, "-c", probe, "frod_ds", "plan", "--model", str(tmp_path / "m"), "--gpus", "1"])
    assert "fastest set-up that fits" in res.stdout and "nf4" in res.stdout.lower(), res.stdout + res.stderr
    assert "torch imported: False" in res.stdout, res.stdout[-500:]
    res = run(
        [
            PY,
            "-c",
            probe,
            "data_prep",
            "build",
            "--source",
            str(tmp_path / "raw"),
            "--tasks",
            "boolq,piqa",
            "--out",
            str(tmp_path / "d"),
        ]
    )
    assert (tmp_path / "d" / "train.jsonl").is_file(), res.stdout + res.stderr
    assert "torch imported: False" in res.stdout, res.stdout[-500:]
