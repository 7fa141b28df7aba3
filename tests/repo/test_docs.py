"""README.md and docs/*.md: generated tables equal what bench/results gives, relative links resolve, README stays
short, the repository files and modules they name exist, and every ``frod`` command they show (as ``frod <verb>``,
under a launcher, or in one of the forms docs/commands.md lists) is accepted by that command's own parser."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import re
import shlex
from pathlib import Path

import pytest

from bench import readme_table
from frod_ds.cli.main import COMMANDS

REPO = Path(__file__).resolve().parents[2]
MAX_README_LINES = 300
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _pages() -> list[Path]:
    return readme_table.doc_files(REPO)


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_generated_blocks_match_the_committed_results(page: Path) -> None:
    text = page.read_text()
    opened = re.findall(r"^<!-- generated:", text, re.M)
    assert len(opened) == len(readme_table.block_names(text)), (
        f"{page.name}: a generated block's markers do not pair up"
    )
    regenerated = readme_table.rewrite(text)
    assert regenerated == text, (
        f"{page.relative_to(REPO)}: a generated block differs from bench/results; "
        "run python -m bench.readme_table (do not edit generated blocks by hand)"
    )


def test_every_generator_is_used_somewhere() -> None:
    used = {n for p in _pages() for n in readme_table.block_names(p.read_text())}
    assert used == set(readme_table.GENERATORS), f"unused generators: {set(readme_table.GENERATORS) - used}"


def test_a_hand_edited_number_is_rewritten() -> None:
    readme = (REPO / "README.md").read_text()
    ratio = re.search(r"\| \*\*(\d+\.\d\d)×\*\* \|", readme)
    assert ratio, "the headline block holds no bold FRoD ÷ LoRA ratio for this test to edit"
    edited = readme.replace(ratio.group(0), "| **9.99×** |", 1)
    assert edited != readme
    assert readme_table.rewrite(edited) == readme


def test_headline_ratio_equals_the_two_fastest_one_gpu_records() -> None:
    """Independent of the generator's search: from the step-7b records of the call that measured the most, FRoD's
    fastest one-GPU step under a DeepSpeed JSON (what ``frod train`` runs) over LoRA's fastest one-GPU step."""
    calls: dict[str, list[dict]] = {}
    for path in (REPO / "bench" / "results" / "step-7b" / "h200x2").glob("*.json"):
        doc = json.loads(path.read_text())
        if doc["status"] == "ok":
            calls.setdefault(doc["call"], []).append(doc)
    docs = max(calls.values(), key=len)
    one = [d for d in docs if d["settings"]["gpus"] == 1]
    frod = min(
        d["metrics"]["step_s_median"]
        for d in one
        if d["settings"]["method"] == "frod" and d["settings"]["engine"].startswith("zero")
    )
    lora = min(d["metrics"]["step_s_median"] for d in one if d["settings"]["method"] == "lora")
    row = next(
        line for line in readme_table.headline(REPO / "bench" / "results").splitlines() if line.startswith("| 1 |")
    )
    assert f"**{frod / lora:.2f}×**" in row and f"**{frod / lora:.2f}×**" in (REPO / "README.md").read_text()


def test_unknown_block_name_is_refused() -> None:
    with pytest.raises(KeyError, match="no-such-table"):
        readme_table.rewrite("<!-- generated:no-such-table -->\nx\n<!-- /generated:no-such-table -->\n")


def test_check_mode_reports_a_stale_block(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("<!-- generated:layer -->\nstale\n<!-- /generated:layer -->\n")
    monkeypatch.setattr(readme_table, "REPO", tmp_path)
    monkeypatch.setattr(readme_table, "doc_files", lambda repo=tmp_path: [tmp_path / "README.md"])
    assert readme_table.main(["--check"]) == 1
    assert "stale" in (tmp_path / "README.md").read_text()  # --check changes nothing
    assert readme_table.main([]) == 0
    assert readme_table.main(["--check"]) == 0


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_relative_links_point_at_existing_files(page: Path) -> None:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks hold no links
    missing = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = (page.parent / target.split("#", 1)[0]).resolve()
        if not path.exists():
            missing.append(target)
    assert not missing, f"{page.relative_to(REPO)}: links to missing files: {missing}"


def test_readme_is_short() -> None:
    lines = (REPO / "README.md").read_text().count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines (at most {MAX_README_LINES}: move detail to docs/)"


def _without_code_blocks(text: str) -> str:
    """The prose of a page: fenced blocks blanked out, line numbers kept."""
    return re.sub(r"```.*?```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)


def _inline_spans(text: str) -> list[tuple[int, str]]:
    """(line number, text) of every backticked span in the prose."""
    return [
        (n, span)
        for n, line in enumerate(_without_code_blocks(text).splitlines(), 1)
        for span in re.findall(r"`([^`]+)`", line)
    ]


# A path into the repository as prose names it: `frod_ds/model/build.py`, `bench/results/x.json`, `launch/slurm/`.
REPO_PATH = re.compile(r"(?<![\w./-])((?:frod_ds|data_prep|launch|bench|tests|ds_configs|recipes)/[\w./-]*)")
PLACEHOLDER = re.compile(r"[<>*{}|]|\.\.\.")


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_repository_paths_in_prose_exist(page: Path) -> None:
    missing = [
        f"line {n}: {path}"
        for n, span in _inline_spans(page.read_text())
        if not PLACEHOLDER.search(span)
        for path in (m.rstrip(".,:") for m in REPO_PATH.findall(span))
        if not (REPO / path).exists()
    ]
    assert not missing, f"{page.relative_to(REPO)} names files that do not exist (moved? see docs/layout.md): {missing}"


# A dotted name of the project: `frod_ds.model.store_reader.FactorStore`, `frod_ds.prep.rows.MAX_ROW_CHARS`,
# `launch.demo`.
MODULE_NAME = re.compile(r"(?<![\w./-])((?:frod_ds|data_prep|launch)(?:\.\w+)+)")
OLD_PATHS_SECTION = "## Old import paths"  # docs/layout.md's table of old names, old on purpose


def _unresolved(name: str) -> str | None:
    """Why ``name`` names no module file (with its attributes defined in it) of the checkout, or None. Old module
    paths fail here: their files (frod_ds/_old_paths/) only forward, for one release."""
    parts = name.split(".")
    path = REPO / parts[0]
    for i, part in enumerate(parts[1:], 1):
        if (path / part / "__init__.py").is_file():
            path = path / part
        elif (path / f"{part}.py").is_file():
            path, parts = path / f"{part}.py", parts[i + 1 :]
            break
        else:
            parts = parts[i:]
            break
    else:
        parts = []
    source = (path / "__init__.py" if path.is_dir() else path).read_text()
    for attr in parts:  # defined (def, class, assignment) or named as a string (__all__, a lazy export table)
        if not re.search(
            rf"^\s*(?:(?:async\s+)?def|class)\s+{attr}\b|^\s*{attr}\s*[:=]|[\"']{attr}[\"']", source, re.M
        ):
            return f"{name}: no {attr!r} in {path.relative_to(REPO)}"
    return None


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_module_names_in_prose_resolve_at_their_new_paths(page: Path) -> None:
    text = page.read_text().split(OLD_PATHS_SECTION)[0]
    problems = [
        f"line {n}: {why}"
        for n, span in _inline_spans(text)
        for name in MODULE_NAME.findall(span)
        if (why := _unresolved(name.rstrip(".")))
    ]
    assert not problems, f"{page.relative_to(REPO)}: {problems} (old module paths: see docs/layout.md)"


# ---- every command shown works as written --------------------------------------------------------------------
COMMAND_LINE = re.compile(r"^(?:[A-Z_]+=\S*\s+)*(?:frod|python3?|deepspeed|torchrun|srun)\s")
LAUNCHERS = {"deepspeed", "torchrun", "srun"}
PYTHONS = {"python", "python3", "$PYTHON"}
FROD_OWN_FLAGS = {"-h", "--help", "--version"}


def _shown_commands(text: str) -> list[tuple[str, bool]]:
    """(command line, whole) for each command line in a shell block (``whole``: a complete command, continuation
    lines joined, comments cut) or a backticked span (often a fragment: a command's name and a flag)."""
    shown = []
    for block in re.findall(r"```(?:bash|sh)?\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"(^|\s)#.*", "", line).strip()
            if COMMAND_LINE.match(line + " "):
                shown.append((line, "..." not in line))
    shown += [(span.strip(), False) for _, span in _inline_spans(text) if COMMAND_LINE.match(span)]
    return shown


def _as_frod(line: str) -> list[str] | None:
    """The ``frod`` arguments a command line amounts to, or None when it runs something else (a bench script)."""
    words = shlex.split(line)
    while words and re.match(r"[A-Z_]+=", words[0]):
        words.pop(0)
    if words and words[0] in LAUNCHERS:  # the launcher's own options end at the program it starts
        program = PYTHONS | {"-m", "--module", "frod"}  # `--no-python frod` starts the frod program itself
        i = next((i for i, w in enumerate(words) if w.endswith(".py") or w in program), len(words))
        words = (
            ["python", "-m", *words[i + 1 :]]
            if words[i : i + 1] in (["-m"], ["--module"])
            else (["python", *words[i:]] if words[i : i + 1] and words[i].endswith(".py") else words[i:])
        )
    if not words:
        return None
    if words[0] == "frod":
        return words[1:]
    if words[0] not in PYTHONS or len(words) < 2:
        return None
    module = {
        ("-m", "frod_ds"): [],
        ("-m", "frod_ds.cli"): [],
        ("-m", "data_prep"): ["data"],
        ("-m", "launch.demo"): ["demo"],
    }.get(tuple(words[1:3]))
    if module is not None:
        return module + words[3:]
    script = re.fullmatch(r"launch/(\w+)\.py", words[1])
    return [script.group(1).replace("_", "-"), *words[2:]] if script else None


def _parsers(command: str) -> list[argparse.ArgumentParser]:
    """The parser ``frod COMMAND`` builds and its sub-command parsers, caught before it parses anything."""
    seen: list[argparse.ArgumentParser] = []

    class Caught(Exception):
        pass

    def catch(self, args=None, namespace=None):
        seen.append(self)
        raise Caught

    module = importlib.import_module(COMMANDS[command].module)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(argparse.ArgumentParser, "parse_known_args", catch)
        with contextlib.suppress(Caught):
            module.main([])
    todo, out = seen[:1], []
    while todo:
        out.append(p := todo.pop())
        todo += [s for a in p._actions if isinstance(a, argparse._SubParsersAction) for s in a.choices.values()]
    return out


def _problem(args: list[str], whole: bool) -> str | None:
    """Why ``frod ARGS`` would be refused by its parser; for a fragment, only its command and flag names count."""
    if not args or args[0] in FROD_OWN_FLAGS:
        return None if all(a in FROD_OWN_FLAGS for a in args) else f"frod takes {sorted(FROD_OWN_FLAGS)} here"
    command, rest = args[0], args[1:]
    if command not in COMMANDS:
        return None if PLACEHOLDER.search(command) or command.isupper() else f"frod has no command {command!r}"
    if not whole:
        flags = {o for p in _parsers(command) for a in p._actions for o in a.option_strings}
        subs = {
            n
            for p in _parsers(command)
            for a in p._actions
            if isinstance(a, argparse._SubParsersAction)
            for n in a.choices
        }
        unknown = [w for w in rest if w.startswith("-") and w.split("=")[0] not in flags]
        if subs and rest and not rest[0].startswith("-") and rest[0] not in subs and not PLACEHOLDER.search(rest[0]):
            unknown.insert(0, rest[0])
        return f"frod {command} has no {unknown}" if unknown else None
    module = importlib.import_module(COMMANDS[command].module)
    parse = getattr(module, "parse_args", None) or module.make_parser().parse_args
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parse(rest)
    except SystemExit:
        return err.getvalue().strip().splitlines()[-1]
    return None


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_command_shown_is_accepted_by_its_parser(page: Path) -> None:
    shown = [
        (line, args, whole) for line, whole in _shown_commands(page.read_text()) if (args := _as_frod(line)) is not None
    ]
    problems = [f"{line!r}: {why}" for line, args, whole in shown if (why := _problem(args, whole))]
    assert not problems, f"{page.relative_to(REPO)}: " + "\n".join(problems)


def test_the_command_check_catches_a_wrong_command() -> None:
    # The forms the docs use, each with a mistake the parsers refuse.
    for line in (
        "frod data --source hub --out d",
        "frod convert-gguf --out m",
        "python launch/hjd.py --out f",
        "deepspeed --num_gpus 2 launch/train.py --recipe r.yaml",
        "torchrun --nproc_per_node 2 -m frod_ds.cli eval --data d --output o --no-such-flag",
        "torchrun --nproc-per-node 2 --no-python frod eval --data d --output o --no-such-flag",
        "deepspeed --no_python frod train --recipe r.yaml",
        "python -m data_prep build --out d",
    ):
        args = _as_frod(line)
        assert args is not None and _problem(args, whole=True), line
    assert _problem(_as_frod("python -m launch.demo --outdir"), whole=False)
    assert _problem(_as_frod("frod data built --out d"), whole=False)
    assert _problem(["frod-data"], whole=True)
    for line in (
        "frod data build --source hub --out data/x",
        "srun python launch/hjd.py --model m --out f",
        "deepspeed --module frod_ds.cli train --config c.json --recipe r.yaml output_dir=o",
        "python -m frod_ds plan --model m --gpus 2",
        "python launch/convert_gguf.py fetch",
        "torchrun --nproc-per-node 8 --no-python frod hjd --model m --out f",
        "deepspeed --no_python frod train --config c.json --recipe r.yaml output_dir=o",
    ):
        assert _problem(_as_frod(line), whole=True) is None, line
    assert _as_frod("python -m bench.layer --tiny") is None and _as_frod("python -m bench run step-7b") is None
