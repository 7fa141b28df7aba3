"""Docstrings say what and why in a few lines: none in ``frod_ds/`` (module, class or function) has 10 or more
lines. Formats, derivations and measurements live in docs/*.md; the old-path shims (``frod_ds/_old_paths``) are
not the library's code."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MAX_LINES = 9
DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def long_docstrings(paths: list[Path], root: Path) -> list[str]:
    """``file:line name: N lines`` for every docstring of ``paths`` longer than ``MAX_LINES`` (counted as
    ``inspect.cleandoc`` leaves it: indentation and blank first and last lines removed)."""
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            doc = ast.get_docstring(node) if isinstance(node, DOCUMENTED) else None
            if doc is not None and len(doc.splitlines()) > MAX_LINES:
                where = f"{path.relative_to(root)}:{getattr(node, 'lineno', 1)}"
                found.append(f"{where} {getattr(node, 'name', '<module>')}: {len(doc.splitlines())} lines")
    return found


def library_files() -> list[Path]:
    return sorted(p for p in (REPO / "frod_ds").rglob("*.py") if "_old_paths" not in p.parts)


def test_no_docstring_in_the_library_has_ten_lines_or_more() -> None:
    found = long_docstrings(library_files(), REPO)
    assert found == [], "move the detail to the matching docs/*.md page:\n" + "\n".join(found)


def test_the_check_counts_every_kind_of_docstring(tmp_path: Path) -> None:
    ten = "\n".join(f"    line {i}" for i in range(1, 11))  # 10 lines of text, closing quotes apart
    nine = "\n".join(f"    line {i}" for i in range(1, 10))
    (tmp_path / "m.py").write_text(
        f'"""\n{ten}\n"""\n\n\nclass C:\n    """\n{ten}\n    """\n\n    def f(self):\n        """Short."""\n\n\n'
        f'async def g():\n    """\n{ten}\n    """\n\n\ndef h():\n    """\n{nine}\n    """\n'
    )
    assert long_docstrings([tmp_path / "m.py"], tmp_path) == [
        "m.py:1 <module>: 10 lines",
        "m.py:15 C: 10 lines",
        "m.py:33 g: 10 lines",
    ]
