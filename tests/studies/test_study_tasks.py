"""studies/tasks.py: generated tasks are deterministic from their seed, their splits are disjoint, and every
answer equals one computed here from the row's own text (arithmetic) or from the trained sentences (facts)."""

from __future__ import annotations

import operator
import re

import pytest

from frod_ds.prep.rows import check_row
from studies.tasks import RELATIONS, ArithSpec, FactsSpec, TaskError, parse_task, task_rows, task_steps, write_task

SMALL_ARITH = ArithSpec(
    seed=3, train=300, validation=40, test=40, digits=(1, 2), long_digits=(3, 3), ops=("+", "-", "*")
)


def _problem(row: dict) -> tuple[str, int, int]:
    a, op, b = row["prompt"].split(" ")
    return op, int(a), int(b)


def test_arith_rows_are_valid_and_answers_are_the_arithmetic_of_their_prompt():
    ops = {"+": operator.add, "-": operator.sub, "*": operator.mul}
    seen = set()
    for part, rows in task_rows(SMALL_ARITH).items():
        for row in rows:
            assert check_row(row) is None, row
            op, a, b = _problem(row)
            seen.add(op)
            assert row["separator"] == " = " and row["answer"] == str(ops[op](a, b)) and int(row["answer"]) >= 0
            assert len(set(row["choices"])) == 4 and row["choices"][row["label"]] == row["answer"]
            lengths = {len(str(a)), len(str(b))}
            assert lengths <= ({3} if part == "arith_longer" else {1, 2}), (part, row["prompt"])
    assert seen == {"+", "-", "*"}


def test_no_validation_or_test_pair_is_trained_in_either_order():
    parts = task_rows(SMALL_ARITH)
    keys = {p: {(op, min(a, b), max(a, b)) for op, a, b in map(_problem, rows)} for p, rows in parts.items()}
    assert {p: len(k) for p, k in keys.items()} == {p: len(r) for p, r in parts.items()}  # no repeats inside
    names = list(keys)
    for i, x in enumerate(names):
        for y in names[i + 1 :]:
            assert not keys[x] & keys[y], (x, y)


def test_tasks_are_deterministic_from_their_seed(tmp_path):
    assert task_rows(SMALL_ARITH) == task_rows(SMALL_ARITH)
    assert task_rows(ArithSpec(**{**SMALL_ARITH.__dict__, "seed": 4}))["train"] != task_rows(SMALL_ARITH)["train"]
    spec = FactsSpec(size=20, seed=1, validation=5, test=10)
    a, b = write_task(spec, tmp_path / "a"), write_task(spec, tmp_path / "b")
    assert a == b
    for rel in a["files"]:
        assert (tmp_path / "a" / "facts20" / rel).read_bytes() == (tmp_path / "b" / "facts20" / rel).read_bytes()
    assert task_rows(FactsSpec(size=20, seed=2))["train"] != task_rows(FactsSpec(size=20, seed=1))["train"]


def test_fact_answers_follow_from_the_trained_sentences_and_questions_of_tested_people_are_never_trained():
    spec = FactsSpec(size=40, seed=0, validation=10, test=30)
    parts = task_rows(spec)
    sentence = {r: re.compile("^" + re.escape(t[0]).replace(r"\{e\}", "(.+)") + "$") for r, t in RELATIONS.items()}
    question = {r: re.compile("^" + re.escape(t[1]).replace(r"\{e\}", "(.+)") + "$") for r, t in RELATIONS.items()}

    def parse(row, patterns):
        hits = [(rel, m.group(1)) for rel, p in patterns.items() if (m := p.match(row["prompt"]))]
        assert len(hits) == 1, row["prompt"]
        return hits[0]

    stated, asked = {}, set()
    for row in parts["train"]:
        assert check_row(row) is None
        if row["separator"] == " ":
            stated[parse(row, sentence)] = row["answer"]
        else:
            asked.add(parse(row, question)[1])
    assert len(stated) == 3 * spec.size and len(asked) == spec.size // 2
    for row in parts["recall"]:
        assert stated[parse(row, sentence)] == row["answer"]
    held = {parse(r, question) for r in parts["validation"]}
    qa = {parse(r, question) for r in parts["qa"]}
    for rows in (parts["validation"], parts["qa"]):
        for row in rows:
            rel, person = parse(row, question)
            assert stated[(rel, person)] == row["answer"] and person not in asked
    assert not held & qa and len(qa) == len(parts["qa"])


def test_unknown_task_names_are_refused():
    assert parse_task("facts64").size == 64 and parse_task("arith").digits == (1, 3)
    d12 = parse_task("arith_d12")
    assert (d12.name, d12.digits, d12.long_digits) == ("arith_d12", (1, 2), (3, 3))
    assert {r["task"] for r in task_rows(d12)["train"]} == {"arith_d12"}
    for bad in ("facts", "facts4", "algebra", "arith_d21", "arith_d12x1", "arith_d12x10", "arith_x2"):
        with pytest.raises(TaskError, match="unknown task"):
            parse_task(bad)
    with pytest.raises(TaskError, match="too many"):
        task_rows(ArithSpec(train=500, digits=(1, 1), long_digits=(2, 2)))
    with pytest.raises(TaskError, match="operators"):
        task_rows(ArithSpec(train=50, ops=("/",)))


def test_a_longer_budget_variant_trains_the_same_rows_for_k_times_the_steps(tmp_path):
    """``arith_d12x2``: arith_d12's problems, splits and answers (only the task name differs), and every run of it
    takes twice the study's steps, through the study's own configuration (epochs and validation spacing)."""
    from studies.learn import LearnConfig, _study_config

    d12, x2 = task_rows(parse_task("arith_d12")), task_rows(parse_task("arith_d12x2"))
    assert d12.keys() == x2.keys()

    def strip(rows):
        return [{k: v for k, v in r.items() if k not in ("task", "id")} for r in rows]

    assert all(strip(d12[k]) == strip(x2[k]) for k in d12)
    assert {r["task"] for k in ("train", "validation") for r in x2[k]} == {"arith_d12x2"}
    assert [task_steps(t, 160) for t in ("arith_d12", "arith_d12x2", "arith_d12x3", "facts64")] == [160, 320, 480, 160]
    for name in ("arith_d12", "arith_d12x2"):
        write_task(parse_task(name), tmp_path / "tasks")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")  # the study checks only that it is a checkpoint folder
    cfg = LearnConfig(model=str(tmp_path / "m"), work=str(tmp_path), out=str(tmp_path / "out"), tasks=[], steps=160)
    one, two = (_study_config(cfg, t, 0, ["full"], {"full": (1e-4,)}, 0) for t in ("arith_d12", "arith_d12x2"))
    per_epoch = 4096 / cfg.batch_size
    assert (one.epochs * per_epoch, two.epochs * per_epoch) == (pytest.approx(159.5), pytest.approx(319.5))
    assert two.val_every == 2 * one.val_every
