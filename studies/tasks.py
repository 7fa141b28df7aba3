"""Tasks a small model can learn, generated in code from a seed, as rows the study reads (``studies/learn_study.py``).

A task directory holds ``train.jsonl`` (trained on), ``validation.jsonl`` (the study's LR selection, never trained on,
disjoint from the test splits) and ``eval/<split>.jsonl`` (the test splits), each row in data_prep's format
``{task, id, prompt, separator, answer, choices, label}`` (``frod_ds.prep.rows.check_row``). Choices are the answer
and three near misses, so the study's log-likelihood accuracy works unchanged; the accuracy the report quotes is
exact match of a greedy answer (``studies.evaluate.exact_eval``).

- ``arith``: ``a + b`` and ``a - b`` (a ≥ b; ``ops`` may add ``*``) with operands of ``digits`` digits. Test
  splits: ``arith_unseen`` (operand pairs of the trained lengths that no training or validation row has, in either
  order) and ``arith_longer`` (operands of ``long_digits`` digits, never trained). ``arith_d12x2``: ``arith_d12``'s
  rows (renamed), trained for twice the study's steps (``task_steps``).
- ``facts<N>``: N synthetic entities, each with one attribute per relation (colour, city, instrument), a value drawn
  at random. Trained: every fact as a sentence ("The colour of Varen Tolis is teal.") and the questions about
  half of the entities. Test splits: ``recall`` (the trained sentences' prompts: what was stored) and ``qa``
  (questions about the other half, whose facts were trained only as sentences: stored and retrieved in another
  form). The validation rows are questions of that half too, about other facts than ``qa``'s.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "ArithSpec",
    "FactsSpec",
    "TaskSpec",
    "parse_task",
    "task_steps",
    "arith_rows",
    "facts_rows",
    "task_rows",
    "write_task",
    "ARITH_OPS",
    "RELATIONS",
]

# a pair is one problem in either order: + and * commute, and - is asked as larger - smaller (no negative answers)
ARITH_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}

SYLLABLES = (
    "ka",
    "lo",
    "mi",
    "ren",
    "tor",
    "va",
    "sel",
    "dun",
    "pri",
    "mo",
    "zan",
    "fel",
    "qui",
    "bra",
    "nor",
    "ti",
    "gal",
    "ve",
    "sh",
    "rud",
    "ol",
    "ex",
    "yn",
    "cas",
)
# relation → (sentence template, question template, values); the value ends the sentence and answers the question
RELATIONS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "colour": (
        "The favourite colour of {e} is",
        "What is the favourite colour of {e}?",
        ("red", "blue", "green", "teal", "amber", "violet", "grey", "olive", "coral", "navy", "ivory", "plum"),
    ),
    "city": (
        "{e} was born in the city of",
        "In which city was {e} born?",
        ("Lima", "Oslo", "Perth", "Quito", "Turin", "Hanoi", "Dakar", "Porto", "Bergen", "Tunis", "Minsk", "Kyoto"),
    ),
    "instrument": (
        "The instrument {e} plays is the",
        "Which instrument does {e} play?",
        ("harp", "oboe", "cello", "flute", "drum", "lute", "viola", "tuba", "sitar", "banjo", "organ", "horn"),
    ),
}


@dataclass(frozen=True)
class ArithSpec:
    seed: int = 0
    train: int = 8192  # training rows
    validation: int = 256  # LR-selection rows (unseen pairs, trained lengths)
    test: int = 256  # rows per test split
    digits: tuple[int, int] = (1, 3)  # operand lengths trained (inclusive)
    long_digits: tuple[int, int] = (4, 4)  # operand lengths of the longer split
    ops: tuple[str, ...] = ("+", "-")
    name_: str = "arith"
    steps_factor: int = 1  # arith_d<lo><hi>x<k>: the same rows trained for k times the study's steps

    @property
    def name(self) -> str:
        return self.name_


@dataclass(frozen=True)
class FactsSpec:
    size: int  # entities (facts = size × relations)
    seed: int = 0
    validation: int = 256  # LR-selection questions (at most half the unasked facts; never in ``qa``)
    test: int = 256  # rows per test split (at most)

    @property
    def name(self) -> str:
        return f"facts{self.size}"


TaskSpec = ArithSpec | FactsSpec


class TaskError(ValueError):
    """A task name or setting that cannot be generated; the message says what to write instead."""


def parse_task(name: str, seed: int = 0) -> TaskSpec:
    """``arith``, ``arith_d<lo><hi>`` (operands of lo..hi digits, the longer split hi+1; 4096 training rows) or
    ``facts<N>`` (N ≥ 8) → its spec."""
    if name == "arith":
        return ArithSpec(seed=seed)
    m = re.fullmatch(r"arith_d([1-9])([1-9])(?:x([2-9]))?", name)
    if m and int(m.group(1)) <= int(m.group(2)):
        lo, hi, k = int(m.group(1)), int(m.group(2)), int(m.group(3) or 1)
        return ArithSpec(
            seed=seed, train=4096, digits=(lo, hi), long_digits=(hi + 1, hi + 1), name_=name, steps_factor=k
        )
    if name.startswith("facts") and name[5:].isdigit() and int(name[5:]) >= 8:
        return FactsSpec(size=int(name[5:]), seed=seed)
    raise TaskError(
        f"unknown task {name!r}; use arith, arith_d<lo><hi> (e.g. arith_d12), arith_d<lo><hi>x<k> (k = 2..9 times "
        "the steps) or facts<N> with N >= 8"
    )


def task_steps(name: str, steps: int) -> int:
    """The optimizer steps of every run of task ``name`` when the study's budget is ``steps``: an ``x<k>`` arithmetic
    variant trains the same rows for k times as many (every method alike)."""
    spec = parse_task(name)
    return steps * spec.steps_factor if isinstance(spec, ArithSpec) else steps


def _row(task: str, idx: int, prompt: str, sep: str, answer: str, wrong: list[str], rng: random.Random) -> dict:
    """A data_prep row whose choices are ``answer`` and ``wrong`` (distinct), the answer at a random place."""
    choices = [*wrong]
    label = rng.randrange(len(choices) + 1)
    choices.insert(label, answer)
    assert len(set(choices)) == len(choices), choices
    return {
        "task": task,
        "id": f"{task}-{idx}",
        "prompt": prompt,
        "separator": sep,
        "answer": answer,
        "choices": choices,
        "label": label,
    }


def _near_misses(value: int, rng: random.Random, k: int = 3) -> list[str]:
    """``k`` distinct non-negative integers near ``value`` (off by one, by ten, one digit changed)."""
    out: list[int] = []
    candidates = [value + 1, value - 1, value + 10, value - 10, value + 100]
    rng.shuffle(candidates)
    for c in candidates:
        if c >= 0 and c != value and c not in out:
            out.append(c)
    return [str(c) for c in out[:k]]


def _operand(rng: random.Random, lengths: tuple[int, int]) -> int:
    n = rng.randint(*lengths)
    return rng.randint(0 if n == 1 else 10 ** (n - 1), 10**n - 1)


def _arith_pairs(
    rng: random.Random, n: int, lengths: tuple[int, int], taken: set, ops: tuple[str, ...]
) -> list[tuple[str, int, int]]:
    """``n`` new (op, a, b) whose unordered pair is not in ``taken`` (which gains them); ``-``: a ≥ b."""
    out = []
    space = sum(10**d for d in range(lengths[0], lengths[1] + 1)) ** 2 * len(ops) // 2
    if n + len(taken) > space // 2:  # keep rejection sampling quick and the sets far from exhausting the space
        raise TaskError(
            f"{n} arithmetic rows with {lengths[0]}-{lengths[1]}-digit operands is too many for their "
            f"{space} distinct problems; lower the row counts or widen the digits"
        )
    while len(out) < n:
        op, a, b = rng.choice(sorted(ops)), _operand(rng, lengths), _operand(rng, lengths)
        key = (op, min(a, b), max(a, b))
        if key not in taken:
            taken.add(key)
            out.append((op, max(a, b), min(a, b)) if op == "-" else (op, a, b))
    return out


def arith_rows(spec: ArithSpec) -> dict[str, list[dict]]:
    """``{"train", "validation", "arith_unseen", "arith_longer"}`` → rows; answers by Python's integers."""
    bad = sorted(set(spec.ops) - set(ARITH_OPS))
    if bad or not spec.ops:
        raise TaskError(f"arithmetic operators {bad or '(none)'}: use some of {' '.join(ARITH_OPS)}")
    rng, taken = random.Random(f"arith:{spec.seed}"), set()
    parts = {
        "train": _arith_pairs(rng, spec.train, spec.digits, taken, spec.ops),
        "validation": _arith_pairs(rng, spec.validation, spec.digits, taken, spec.ops),
        "arith_unseen": _arith_pairs(rng, spec.test, spec.digits, taken, spec.ops),
        "arith_longer": _arith_pairs(rng, spec.test, spec.long_digits, taken, spec.ops),
    }
    out = {}
    for part, problems in parts.items():
        task = spec.name if part in ("train", "validation") else part
        out[part] = [
            _row(
                task,
                i if part != "validation" else spec.train + i,
                f"{a} {op} {b}",
                " = ",
                str(ARITH_OPS[op](a, b)),
                _near_misses(ARITH_OPS[op](a, b), rng),
                rng,
            )
            for i, (op, a, b) in enumerate(problems)
        ]
    return out


def _entities(rng: random.Random, n: int) -> list[str]:
    """``n`` distinct two-word made-up names."""
    names: set[str] = set()
    out = []
    while len(out) < n:
        word = lambda: "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()  # noqa: E731
        name = f"{word()} {word()}"
        if name not in names:
            names.add(name)
            out.append(name)
    return out


def facts_rows(spec: FactsSpec) -> dict[str, list[dict]]:
    """``{"train", "validation", "recall", "qa"}`` → rows of the fact base of ``spec.size`` entities."""
    rng = random.Random(f"facts:{spec.size}:{spec.seed}")
    entities = _entities(rng, spec.size)
    facts = {(e, r): rng.choice(RELATIONS[r][2]) for e in entities for r in sorted(RELATIONS)}
    asked = set(entities[: spec.size // 2])  # their questions are trained too
    task = spec.name

    def wrong(r: str, value: str) -> list[str]:
        return rng.sample([v for v in RELATIONS[r][2] if v != value], 3)

    def sentence(i: int, e: str, r: str, split: str) -> dict:
        return _row(split, i, RELATIONS[r][0].format(e=e), " ", facts[(e, r)], wrong(r, facts[(e, r)]), rng)

    def question(i: int, e: str, r: str, split: str) -> dict:
        return _row(split, i, RELATIONS[r][1].format(e=e), " Answer: ", facts[(e, r)], wrong(r, facts[(e, r)]), rng)

    keys = sorted(facts)
    train = [sentence(i, e, r, task) for i, (e, r) in enumerate(keys)]
    train += [question(len(keys) + i, e, r, task) for i, (e, r) in enumerate(k for k in keys if k[0] in asked)]
    rng.shuffle(train)
    unasked = [k for k in keys if k[0] not in asked]
    rng.shuffle(unasked)
    n_held = min(spec.validation, len(unasked) // 2)
    held = [question(10**7 + i, e, r, task) for i, (e, r) in enumerate(unasked[:n_held])]
    qa = [question(i, e, r, f"{task}_qa") for i, (e, r) in enumerate(unasked[n_held : n_held + spec.test])]
    stored = rng.sample(keys, min(spec.test, len(keys)))
    recall = [sentence(i, e, r, f"{task}_recall") for i, (e, r) in enumerate(stored)]
    return {"train": train, "validation": held, "recall": recall, "qa": qa}


def task_rows(spec: TaskSpec) -> dict[str, list[dict]]:
    return arith_rows(spec) if isinstance(spec, ArithSpec) else facts_rows(spec)


def _jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows)


def write_task(spec: TaskSpec, root: Path) -> dict[str, Any]:
    """Write ``root/<task>/{train,validation}.jsonl``, ``eval/<split>.jsonl`` and ``task.json`` (the spec and
    every file's sha256). Rewriting an existing task yields the same bytes (deterministic from the seed)."""
    from frod_ds.runtime.atomic import atomic_write_text

    out = root / spec.name
    (out / "eval").mkdir(parents=True, exist_ok=True)
    files = {}
    for part, rows in task_rows(spec).items():
        rel = f"{part}.jsonl" if part in ("train", "validation") else f"eval/{rows[0]['task']}.jsonl"
        text = _jsonl(rows)
        atomic_write_text(out / rel, text)
        files[rel] = {"rows": len(rows), "sha256": hashlib.sha256(text.encode()).hexdigest()}
    meta = {"task": spec.name, "kind": type(spec).__name__, "spec": asdict(spec), "files": files}
    atomic_write_text(out / "task.json", json.dumps(meta, indent=1, sort_keys=True) + "\n")
    return meta
