"""The package's layering, read from the source (ast, nothing imported; imports inside functions count): no import
cycle between frod_ds's sub-packages nor between its modules, each sub-package imports only from layers below it
(or itself), library code uses no old module path (frod_ds/_moved.py), frod_ds never imports data_prep / launch /
bench, and frod_ds.formats imports no torch, directly or through any frod_ds module it imports."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

from tests.support.leftovers import REPO

PKG = REPO / "frod_ds"
# Lowest first. A sub-package may import its own modules and those of lower layers; sub-packages sharing a
# layer do not import each other. docs/layout.md explains the order.
LAYERS: list[tuple[str, ...]] = [
    ("runtime",),
    ("formats",),
    ("prep",),
    ("io",),
    ("core",),
    ("config",),
    ("hjd",),
    ("model",),
    ("eval",),
    ("train", "interop", "plan"),
    ("testing",),
    ("cli",),
]
RANK = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}
TOP_LEVEL = {"frod_ds", "frod_ds._moved", "frod_ds.__main__"}  # the package's door: may name every layer
TORCH = ("torch", "safetensors.torch", "deepspeed", "transformers", "bitsandbytes", "peft")


def module_name(path: Path, root: Path = REPO) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(pkg: Path = PKG) -> dict[str, Path]:
    """The package's modules, without the old paths kept for one release (frod_ds/_old_paths/, not a package)."""
    return {module_name(p, pkg.parent): p for p in sorted(pkg.rglob("*.py")) if "_old_paths" not in p.parts}


def imports(path: Path, name: str, known: set[str]) -> set[str]:
    """Every module ``path`` imports anywhere in it: ``from a.b import c`` is ``a.b.c`` when that is a module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known}
    return out


def graph(pkg: Path = PKG) -> dict[str, set[str]]:
    mods = modules(pkg)
    return {name: imports(path, name, set(mods)) for name, path in mods.items()}


def subpackage(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in RANK) else None


def layer_violations(g: dict[str, set[str]]) -> list[str]:
    out = []
    for src, targets in g.items():
        if src in TOP_LEVEL:
            continue
        a = subpackage(src)
        assert a in RANK, f"{src} is in no declared layer: add its sub-package to LAYERS (and docs/layout.md)"
        for t in sorted(x for x in targets if x.startswith("frod_ds.")):
            b = subpackage(t)
            if b is None or b == a:
                continue
            if b not in RANK or RANK[b] > RANK[a] or (RANK[b] == RANK[a]):
                out.append(f"{src} imports {t} ({a} may import only layers below it: {LAYERS[: RANK[a]]})")
    return out


def package_cycles(g: dict[str, set[str]]) -> list[list[str]]:
    edges: dict[str, set[str]] = {}
    for src, targets in g.items():
        a = subpackage(src)
        for t in targets:
            b = subpackage(t) if t.startswith("frod_ds.") else None
            if a and b and a != b:
                edges.setdefault(a, set()).add(b)
    cycles, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    return cycles


def module_cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (or a module importing itself), sorted."""
    edges = {m: sorted(t for t in ts if t in g) for m, ts in g.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = stack[stack.index(v) :]
            del stack[stack.index(v) :]
            if len(comp) > 1 or v in edges[v]:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(out)


@pytest.fixture(scope="module")
def g() -> dict[str, set[str]]:
    return graph()


def test_no_import_cycle_between_subpackages(g):
    assert package_cycles(g) == []


def test_no_import_cycle_between_modules(g):
    assert module_cycles(g) == []


def test_module_cycle_check_sees_imports_inside_functions(tmp_path):
    """A synthetic package: a imports b at the top, b imports a inside a function, c stands apart; d imports
    itself. The check reports {a, b} and {d}, nothing else."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from pkg import a\n    return a\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    (pkg / "d.py").write_text("def g():\n    from pkg.d import g\n")
    assert module_cycles(graph(pkg)) == [["pkg.a", "pkg.b"], ["pkg.d"]]


def test_module_cycle_check_catches_the_old_circle_in_plan(tmp_path):
    """The real package with the circle plan/ had (planner.py and timing.py importing each other inside functions)
    put back: the sub-package check cannot see it, the module check names both modules."""
    copy = tmp_path / "frod_ds"
    shutil.copytree(PKG, copy, ignore=shutil.ignore_patterns("__pycache__", "_old_paths"))
    memory = copy / "plan" / "memory.py"
    memory.write_text(memory.read_text() + "\n\ndef _seconds():\n    from frod_ds.plan.step_time import step_time\n")
    g = graph(copy)
    assert package_cycles(g) == []
    assert module_cycles(g) == [["frod_ds.plan.memory", "frod_ds.plan.step_time"]]


def test_each_subpackage_imports_only_lower_layers(g):
    assert layer_violations(g) == []


def test_library_uses_no_old_module_paths(g):
    from frod_ds._moved import MOVED

    used = [f"{src} imports {t} (now {MOVED[t]})" for src, ts in g.items() for t in ts if t in MOVED]
    assert used == []


def test_frod_ds_and_data_prep_import_one_way(g):
    """data_prep (``python -m data_prep``) is an entry point of frod_ds.prep; frod_ds never imports it, nor the
    scripts outside the wheel (launch/, bench/)."""
    back = [
        f"{src} imports {t}"
        for src, ts in g.items()
        for t in ts
        if t.split(".")[0] in ("data_prep", "launch", "bench", "studies", "tests")
    ]
    assert back == []
    dp = graph(REPO / "data_prep")
    assert any(t.startswith("frod_ds") for ts in dp.values() for t in ts)


def test_formats_import_no_torch(g):
    """Reading a record (store manifest, adapter config, run identity) never loads torch: everything a
    formats module imports, followed through frod_ds, is torch-free."""
    seen, todo, found = set(), [m for m in g if m.startswith("frod_ds.formats")], []
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        for t in g[m]:
            if t.split(".")[0] in {x.split(".")[0] for x in TORCH} and any(
                t == x or t.startswith(x + ".") for x in TORCH
            ):
                found.append(f"{m} imports {t}")
            if t in g:
                todo.append(t)
    assert found == [], f"formats reach torch: {found}"
    assert {m.split(".")[1] for m in seen} <= {"formats", "runtime", "_moved"}, sorted(seen)
