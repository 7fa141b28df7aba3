"""Module paths that moved keep working for one release: every entry of ``frod_ds._moved.MOVED`` is a file at
its old path that forwards each name to the very object of its new module with a ``DeprecationWarning``, no old
path is missing its file or left without an entry, and none shadows a current module."""

from __future__ import annotations

import importlib
import json
import warnings
from pathlib import Path

import pytest

from frod_ds._moved import MOVED, REMOVED
from tests.support.leftovers import REPO


def shim_file(old: str) -> Path:
    top, *rest = old.split(".")
    return REPO / top / ("_old_paths" if top == "frod_ds" else "") / Path(*rest).with_suffix(".py")


def test_every_moved_path_has_its_file_and_every_file_an_entry():
    files = {p for p in (REPO / "frod_ds" / "_old_paths").rglob("*.py") if p.name != "__init__.py"}
    files |= {p for p in (REPO / "data_prep").glob("*.py") if p.stem not in ("__init__", "__main__")}
    assert {shim_file(old) for old in MOVED} == files


def test_no_old_path_shadows_a_current_module():
    current = {p for p in (REPO / "frod_ds").rglob("*.py") if "_old_paths" not in p.parts}
    clashes = [old for old in MOVED if (REPO / Path(*old.split("."))).with_suffix(".py") in current]
    assert clashes == []


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_path_forwards_to_the_same_object_and_warns(old):
    module = importlib.import_module(old)
    assert Path(module.__file__) == shim_file(old)
    new = [importlib.import_module(path) for path in MOVED[old]]
    names = [
        (n, m)
        for m in new
        for n in getattr(m, "__all__", None)
        or [k for k, v in vars(m).items() if not k.startswith("_") and getattr(v, "__module__", None) == m.__name__]
    ]
    assert names, f"{MOVED[old]} defines nothing public to forward"
    name, home = names[0]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert getattr(module, name) is getattr(home, name)
    assert [w.category for w in seen] == [DeprecationWarning], seen
    assert home.__name__ in str(seen[0].message) and "0.3.0" in str(seen[0].message)
    with pytest.raises(AttributeError, match="moved to"):
        module.no_such_name_here


# Every public name each library module defined in the last 0.1 tree (commit e313e16), read from its source.
PUBLIC_0_1 = REPO / "tests" / "fixtures" / "public_names_0_1.json"


@pytest.mark.parametrize("module", sorted(json.loads(PUBLIC_0_1.read_text())))
def test_every_public_name_of_0_1_still_imports_from_its_path(module):
    """What a user could import from a module path in 0.1 imports from that path in 0.2 (warning where it moved),
    except the downloader's names, which left the package (``REMOVED``) and say so."""
    names = json.loads(PUBLIC_0_1.read_text())[module]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        mod = importlib.import_module(module)
        missing = [n for n in names if n not in REMOVED and not hasattr(mod, n)]
        for name in (n for n in names if n in REMOVED):
            with pytest.raises(AttributeError, match="left the package"):
                getattr(mod, name)
    assert missing == []


def _pickled_globals(path: Path) -> set[str]:
    """``module.name`` of every class or function a torch checkpoint's pickle refers to."""
    import io
    import pickletools
    import zipfile

    with zipfile.ZipFile(path) as z:
        data = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    ops, strings, found = list(pickletools.genops(io.BytesIO(data))), [], set()
    for op, arg, _ in ops:
        if op.name == "GLOBAL":
            found.add(arg.replace(" ", "."))
        elif op.name == "STACK_GLOBAL":
            found.add(".".join(strings[-2:]))
        elif isinstance(arg, str):
            strings.append(arg)
    return found


def test_committed_engine_checkpoints_name_no_project_class():
    """Moving modules cannot break a stored engine state: the committed checkpoints' pickles name only torch's,
    DeepSpeed's and the standard library's classes, never a frod_ds / data_prep / launch one (so no class path needs
    mapping; the fixtures' resume tests load them). Fails if a checkpoint ever pickles a project class."""
    files = sorted((REPO / "tests" / "fixtures").glob("*/run/checkpoints/*/*.pt"))
    assert len(files) >= 8
    named = {g for f in files for g in _pickled_globals(f)}
    assert any(g.startswith("deepspeed.") for g in named), named  # the scan sees the engine's own classes
    assert [g for g in named if g.split(".")[0] in ("frod_ds", "data_prep", "launch")] == []
