"""The argument parser of every ``frod`` command: argparse's, with a usage error said in one line (what is wrong, the
choice probably meant, and where the arguments are listed) instead of the usage block followed by the error."""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from typing import IO, NoReturn

from frod_ds.runtime.errors import note
from frod_ds.runtime.paths import input_dir, input_path, output_dir, output_path  # the flags' types

__all__ = ["Parser", "input_path", "input_dir", "output_path", "output_dir", "seed_int"]

_CHOICE = re.compile(r"invalid choice: '(?P<got>[^']*)' \(choose from (?P<choices>.*)\)$")


def seed_int(text: str) -> int:
    """A ``--seed`` value: an integer >= 0 (``random.Random(-n)`` is ``Random(n)``: two recorded seeds, one run)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"a seed must be >= 0, got {value}")
    return value


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose usage errors are one line and exit 2; its sub-parsers are of this class.
    An option given an empty value (``--out "$UNSET"``) is a usage error: argparse would take it as the path ".",
    and the command would build from, or write into, the working directory. An option given twice with two values
    takes the last, as argparse does, with a note naming both (as a recipe override given twice does). Help and
    version text that stdout cannot take is an ``OSError`` (argparse drops it silently and exits 0)."""

    def parse_known_args(self, args=None, namespace=None):  # noqa: ANN001, ANN201 - argparse's signature
        self._given: dict[str, str] = {}
        return super().parse_known_args(args, namespace)

    def _get_values(self, action: argparse.Action, arg_strings: list[str]):
        if action.option_strings and "" in arg_strings:
            self.error(f"argument {'/'.join(action.option_strings)}: the value is empty (an unset variable?)")
        if isinstance(action, argparse._StoreAction) and action.option_strings and len(arg_strings) == 1:
            given = self.__dict__.setdefault("_given", {})
            before = given.get(action.dest)
            if before is not None and before != arg_strings[0]:  # argparse keeps the last without a word
                name = "/".join(action.option_strings)
                note(f"{name} is given twice, {before!r} and {arg_strings[0]!r}: the last one is used")
            given[action.dest] = arg_strings[0]
        return super()._get_values(action, arg_strings)

    def _print_message(self, message: str, file: IO[str] | None = None) -> None:
        """argparse's, except that help or version text stdout refuses (``> /dev/full``) raises the write's
        ``OSError``, which the command reports in one line, instead of being dropped with exit 0."""
        if file is None or file is not sys.stdout:
            super()._print_message(message, file)
        elif message:
            file.write(message)
            file.flush()

    def error(self, message: str) -> NoReturn:
        m, close = _CHOICE.search(message), []
        if m:
            close = difflib.get_close_matches(m["got"], re.findall(r"'([^']*)'", m["choices"]), n=1, cutoff=0.6)
        tail = f"did you mean '{close[0]}'? (see {self.prog} --help)" if close else f"see {self.prog} --help"
        self.exit(2, f"{self.prog}: error: {message}; {tail}\n")
