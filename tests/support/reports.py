"""The committed benchmark reports against their generators: a report under ``bench/results/<name>/`` is what its
generator writes from the JSON files beside it (tables are never edited by hand)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path


def regenerated(results: Path, report: Callable[[Path], Path], tmp_path: Path) -> str:
    """``report`` run on a copy of ``results`` (never on the committed folder); asserts the text equals the committed
    report of the same name, with the copy's path written as the committed folder's (the command it names), and
    returns it."""
    copy = tmp_path / results.name
    shutil.copytree(results, copy)
    written = report(copy)
    rel = results.relative_to(results.parents[2]).as_posix()  # bench/results/<name>
    text = written.read_text().replace(str(copy), rel)
    assert text == (results / written.name).read_text(), f"{results / written.name} is not what its JSONs generate"
    return text
