"""The failure-policy corpus (tests/failure_corpus/corpus.yaml) is well formed, and a handful of its fastest cases pass
through its runner (tests/failure_corpus/run.py) as the corpus says they should. The whole corpus is a bench run
(`python -m tests.failure_corpus.run`), not a test: it builds a world and runs ~470 commands."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from tests.support.leftovers import REPO

# cases that need no world (no model, store or adapter): their inputs are the data_prep fixtures or made in the case
FAST = [
    "missing path: data build --source",
    "data with no subcommand",
    "data build from a mirror with --tasks misspelled",
    "data build --out a foreign directory with --overwrite",
    "python -m data_prep build --tasks misspelled",
    "data build while a live process writes its output",
    "data build after its writer is gone (a dead pid on this host)",
    "data build after its writer is gone (a heartbeat stale on another host)",
]


@pytest.fixture(scope="module")
def corpus():
    spec = importlib.util.spec_from_file_location("failure_corpus", REPO / "tests" / "failure_corpus" / "run.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def test_every_case_names_a_known_class_step_tool_and_placeholder(corpus):
    cases = corpus.load(corpus.CORPUS)
    assert corpus.validate(cases) == []
    assert len(cases) >= 300 and {c["class"] for c in cases} == set(corpus.CLASSES)


@pytest.mark.parametrize(
    "bad, problem",
    [
        ({"class": "clear-eror"}, "unknown class"),
        ({"prepare": "no_such_step"}, "unknown prepare step"),
        ({"cmd": ["hjd", "--out", "{nwe}"]}, "unknown placeholder {nwe}"),
        ({"cmd": ["frod-train"]}, "unknown tool"),
        ({"class": "exact-recovery"}, "needs a fix or an interrupt"),
        ({"fix_": "noop"}, "unknown key"),
    ],
)
def test_the_validator_names_what_is_wrong(corpus, bad, problem):
    case = {"name": "x", "class": "clear-error", "cmd": ["hjd", "--out", "{new}"], **bad}
    assert any(problem in p for p in corpus.validate([case])), corpus.validate([case])


def test_each_expands_into_one_case_per_entry(corpus):
    raw = [
        {
            "name": "{t} x",
            "class": "clear-error",
            "cmd": ["plan", "{c}"],
            "each": [{"t": "a", "c": ["--gpus", "0"]}, {"t": "b", "c": []}],
        }
    ]
    a, b = raw[0]["each"]
    assert corpus.expand(raw) == [  # a prepare step reads the entry's values as vars
        {"name": "a x", "class": "clear-error", "cmd": ["plan", "--gpus", "0"], "vars": a},
        {"name": "b x", "class": "clear-error", "cmd": ["plan"], "vars": b},
    ]


def test_the_fastest_cases_run_as_the_corpus_says(corpus, tmp_path):
    cases = {c["name"]: c for c in corpus.load(corpus.CORPUS)}
    world = corpus.World(REPO, tmp_path, corpus._env(REPO))  # no model or store: these cases need none
    world.paths = {k: str(tmp_path / "absent" / k) for k in corpus.PLACEHOLDERS}
    world.paths.update(fixtures=str(REPO / "tests" / "fixtures" / "data_prep"), repo=str(REPO))
    results = [corpus.run_case(world, cases[name], tmp_path / f"case{i}") for i, name in enumerate(FAST)]
    assert [r["observed"] for r in results] == [cases[n]["class"] for n in FAST], results
