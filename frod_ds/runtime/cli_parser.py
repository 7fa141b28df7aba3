"""The argument parser of every ``frod`` command: argparse's, with a usage error said in one line (what is wrong,
and where the arguments are listed) instead of the usage block followed by the error."""

from __future__ import annotations

import argparse
from typing import NoReturn

__all__ = ["Parser"]


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose usage errors are one line and exit 2; its sub-parsers are of this class."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")
