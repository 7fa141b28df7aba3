"""One vocabulary: the library's strings (help texts, errors, log lines, docstrings), README.md, docs/*.md and
the shipped recipes name a command as ``frod <verb>``. The script and module forms that keep working
(``launch/X.py``, ``python -m frod_ds``, ``python -m data_prep``) and the deprecated ones are listed once, in
docs/commands.md (and in CHANGELOG.md); anywhere else they are a second vocabulary."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
THE_LIST = REPO / "docs" / "commands.md"
OLD_FORMS = re.compile(
    r"\blaunch/(?!slurm\b)[\w*<>]+(?:\.py)?"  # a script of launch/ (launch/hjd.py, launch/*.py), not the SLURM ones
    r"|(?:-m|--module)\s+(?:frod_ds|launch|data_prep)\b(?:\.\w+)?"  # a module form, under python or a launcher
    r"|\blaunch\.(?:train|hjd|eval|export|demo|convert_gguf)\b"  # a launch module by name
)


def old_forms_in_strings(source: str) -> list[str]:
    """``line N: form`` for each old command form in a Python source's string literals (f-strings included)."""
    return [
        f"line {tok.start[0]}: {m.group(0)!r}"
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.STRING
        for m in OLD_FORMS.finditer(tok.string)
    ]


def old_forms_in_text(text: str) -> list[str]:
    return [
        f"line {n}: {m.group(0)!r}" for n, line in enumerate(text.splitlines(), 1) for m in OLD_FORMS.finditer(line)
    ]


def _pages() -> list[Path]:
    """README, docs/ and the shipped recipes (their header comments show how to run them)."""
    docs = sorted(p for p in (REPO / "docs").glob("*.md") if p != THE_LIST)
    return [REPO / "README.md", *docs, *sorted((REPO / "recipes").glob("*.yaml"))]


@pytest.mark.parametrize(
    "package", sorted(p.name for p in (REPO / "frod_ds").iterdir() if p.is_dir() and p.name[0] != "_")
)
def test_the_library_names_commands_as_frod_verb(package: str) -> None:
    found = [
        f"{path.relative_to(REPO)} {hit}"
        for path in sorted((REPO / "frod_ds" / package).rglob("*.py"))
        for hit in old_forms_in_strings(path.read_text())
    ]
    assert found == [], "say `frod <verb>` (the other forms are listed in docs/commands.md only):\n" + "\n".join(found)


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_the_docs_name_commands_as_frod_verb(page: Path) -> None:
    found = old_forms_in_text(page.read_text())
    assert found == [], f"{page.relative_to(REPO)}: say `frod <verb>` (docs/commands.md lists the other forms): {found}"


def test_the_one_list_names_every_form_that_keeps_working() -> None:
    text = THE_LIST.read_text()
    for form in (
        "deepspeed launch/train.py --config ds_configs/zero3.json",
        "python launch/hjd.py",
        "python launch/eval.py",
        "python launch/export.py",
        "python -m data_prep",
        "launch/slurm/",
        "python -m frod_ds",
        "torchrun --nproc-per-node 2 --no-python frod train",
        "deepspeed --no_python frod train",
    ):
        assert form in text, form


def test_the_check_finds_each_old_form() -> None:
    source = '''"""Run ``python launch/hjd.py`` first."""
ERR = "rebuild it with launch/hjd.py --overwrite"
HELP = f"or torchrun -m frod_ds.cli {1}"
LINE = "python -m data_prep build"
DEMO = "python -m launch.demo"  # a comment: launch/x.py is not a string
OK = "frod hjd; launch/slurm/hjd.sbatch; deepspeed.launcher.launch; the launch/ folder"
'''
    assert old_forms_in_strings(source) == [
        "line 1: 'launch/hjd.py'",
        "line 2: 'launch/hjd.py'",
        "line 3: '-m frod_ds.cli'",
        "line 4: '-m data_prep'",
        "line 5: '-m launch.demo'",
    ]
    assert old_forms_in_text("srun python launch/train.py\n`deepspeed --module frod_ds.cli train`\n") == [
        "line 1: 'launch/train.py'",
        "line 2: '--module frod_ds.cli'",
    ]
