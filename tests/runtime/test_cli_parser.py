"""Usage errors of every ``frod`` command are one line naming what is wrong and where the arguments are listed,
exit 2 (``frod_ds.runtime.cli_parser.Parser``), checked against argparse's own message for the same mistake."""

from __future__ import annotations

import argparse
import importlib

import pytest

from frod_ds.runtime.cli_parser import Parser, seed_int


def test_a_usage_error_is_argparses_message_in_one_line(capsys):
    def build(cls):
        p = cls(prog="t")
        p.add_argument("--seed", type=int)
        sub = p.add_subparsers(dest="cmd")
        sub.add_parser("go").add_argument("--n", type=int, required=True)
        return p

    for argv in (["--seed", "abc"], ["go"], ["go", "--n", "x"]):
        with pytest.raises(SystemExit) as stock:
            build(argparse.ArgumentParser).parse_args(argv)
        expected = capsys.readouterr().err.strip().splitlines()[-1]  # "t: error: ..." after the usage block
        with pytest.raises(SystemExit) as ours:
            build(Parser).parse_args(argv)
        err = capsys.readouterr().err
        assert ours.value.code == stock.value.code == 2
        prog = expected.split(": error: ")[0]
        assert err.splitlines() == [f"{expected}; see {prog} --help"], err


@pytest.mark.parametrize(
    "module, argv",
    [
        ("frod_ds.cli.main", ["tarin"]),
        ("frod_ds.cli.train", ["--no-such-flag"]),
        ("frod_ds.cli.eval", ["--no-such-flag"]),
        ("frod_ds.cli.hjd", ["--no-such-flag"]),
        ("frod_ds.cli.export", ["--format", "onnx"]),
        ("frod_ds.cli.plan", ["--no-such-flag"]),
        ("frod_ds.cli.demo", ["--no-such-flag"]),
        ("frod_ds.cli.convert_gguf", ["convert", "--no-such-flag"]),
        ("frod_ds.prep.command", ["build", "--seed", "abc"]),
    ],
)
def test_every_frod_command_says_a_usage_error_in_one_line(module, argv, capsys):
    with pytest.raises(SystemExit) as exc:
        importlib.import_module(module).main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and len(err.splitlines()) == 1, err
    assert ": error: " in err and err.rstrip().endswith((" --help", " --help)")), err


def test_a_mistyped_choice_names_the_one_probably_meant(capsys):
    from frod_ds.cli.main import main

    for argv, meant in ((["trian"], "train"), (["expotr"], "export"), (["zzz"], None)):
        with pytest.raises(SystemExit):
            main(argv)
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and f"invalid choice: '{argv[0]}'" in err, err
        assert (f"did you mean '{meant}'?" in err) if meant else ("did you mean" not in err), err


def _usage_error_in(folder, module: str, argv: list[str], capsys) -> str:
    """``module``'s ``main(argv)`` run from ``folder``: it must exit 2 with one line on stderr, which is returned."""
    import os

    cwd = os.getcwd()
    os.chdir(folder)
    try:
        with pytest.raises(SystemExit) as exc:
            importlib.import_module(module).main(argv)
    finally:
        os.chdir(cwd)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize(
    "module, argv, option",
    [
        ("frod_ds.prep.command", ["build", "--source", "", "--tasks", "boolq", "--out", "x"], "--source"),
        ("frod_ds.prep.command", ["build", "--source", "s", "--tasks", "boolq", "--out", ""], "--out"),
        ("frod_ds.cli.hjd", ["--model", "", "--out", "x"], "--model"),
        ("frod_ds.cli.eval", ["--checkpoint", "", "--data", "d", "--output", "o"], "--checkpoint"),
    ],
)
def test_an_empty_option_value_is_a_usage_error_not_the_working_directory(module, argv, option, capsys, tmp_path):
    """``--source "$UNSET"``: argparse takes "" as a path, which is "." (a build from, or into, the working
    directory). Every frod command refuses it in one line naming the option, before anything reads or writes."""
    err = _usage_error_in(tmp_path, module, argv, capsys)
    assert f"argument {option}: the value is empty (an unset variable?)" in err, err
    assert list(tmp_path.iterdir()) == []
    p = Parser(prog="t")
    p.add_argument("--x", default="")
    assert p.parse_args([]).x == "" and p.parse_args(["--x", " "]).x == " "  # a default, a value of spaces: kept


@pytest.mark.parametrize(
    "module, argv",
    [
        ("frod_ds.prep.command", ["build", "--source", "s", "--tasks", "boolq", "--out", "x", "--seed", "-1"]),
        ("frod_ds.cli.hjd", ["--verify", "f", "--model", "m", "--seed", "-3"]),
    ],
)
def test_a_negative_seed_is_a_usage_error(module, argv, capsys, tmp_path):
    """``random.Random(-1)`` is ``Random(1)``: a build recorded under seed -1 would be seed 1's. Refused in one
    line before anything is read or written."""
    err = _usage_error_in(tmp_path, module, argv, capsys)
    assert "argument --seed: a seed must be >= 0, got -" in err, err
    assert list(tmp_path.iterdir()) == []
    assert seed_int("0") == 0 and seed_int("42") == 42


def test_an_option_given_twice_with_two_values_takes_the_last_with_a_note(capsys):
    """argparse keeps an option's last value without a word: ``--source a --source b`` built from b while the user
    may have meant a. The last still wins (as with a recipe override given twice), and a note names both."""
    p = Parser(prog="frod x")
    p.add_argument("--source")
    p.add_argument("--out")
    args = p.parse_args(["--source", "a", "--out", "o", "--source", "b"])
    assert (args.source, args.out) == ("b", "o")
    assert capsys.readouterr().err == "note: --source is given twice, 'a' and 'b': the last one is used\n"
    p.parse_args(["--source", "a", "--source", "a"])  # the same value twice changes nothing: no note
    p.parse_args(["--source", "c"])  # a later parse starts afresh
    assert capsys.readouterr().err == ""
