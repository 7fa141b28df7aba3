"""The files frod-ds ships beside its code: the DeepSpeed JSONs (``ds_configs/``) and the recipes (``recipes/``).

In a checkout they are the repository's ``ds_configs/`` and ``recipes/``; a built wheel carries copies in
``frod_ds/_shipped/`` (setup.py copies them at build time), so an installed ``frod`` finds them wherever it runs.
A shipped file that is missing is an error naming it: nothing is ever planned or trained against a stand-in.
"""

from __future__ import annotations

from pathlib import Path

from frod_ds.runtime.errors import FrodError

__all__ = ["KINDS", "ShippedFileError", "shipped_dir", "shipped_file", "user_file"]

KINDS = ("ds_configs", "recipes")
_PACKAGE = Path(__file__).resolve().parents[1]  # frod_ds/


class ShippedFileError(FrodError):
    """A shipped DeepSpeed JSON or recipe is not where frod-ds keeps them."""


def shipped_dir(kind: str) -> Path:
    """``frod_ds/_shipped/<kind>`` of an installed wheel, else ``<checkout>/<kind>``."""
    assert kind in KINDS, f"unknown kind of shipped file {kind!r}"
    for root in (_PACKAGE / "_shipped", _PACKAGE.parent):
        if (root / kind).is_dir():
            return root / kind
    raise ShippedFileError(
        f"no {kind}/ beside frod_ds ({_PACKAGE}): this install of frod-ds lacks its shipped "
        f"files; reinstall it from a wheel or a checkout"
    )


def shipped_file(kind: str, name: str) -> Path:
    """The shipped file ``<kind>/<name>``; ``ShippedFileError`` listing the shipped ones when it is missing."""
    path = shipped_dir(kind) / name
    if not path.is_file():
        have = ", ".join(sorted(p.name for p in path.parent.iterdir() if p.is_file())) or "none"
        raise ShippedFileError(f"{kind}/{name} is not shipped with this frod-ds (in {path.parent}: {have})")
    return path


def user_file(path: str | Path, kind: str) -> Path:
    """``path`` as given when it exists; else, when it names a shipped file (``ds_configs/zero3.json`` or
    ``zero3.json``, run outside a checkout), that file; else ``path`` unchanged for the caller to report."""
    p = Path(path)
    if p.exists() or p.is_absolute() or p.parent.name not in ("", kind) or len(p.parts) > 2:
        return p
    try:
        return shipped_file(kind, p.name)
    except ShippedFileError:
        return p
