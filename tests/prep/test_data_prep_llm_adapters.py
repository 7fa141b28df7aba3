"""LLM-Adapters' files: prompts character for character, both templates, instruction families, the combined
file, drops, --strict, determinism, and the training text reproduced by the one training path."""

from __future__ import annotations

import ast
import hashlib
import json
import random
import re
import shutil
from collections import Counter
from pathlib import Path

import pytest

from frod_ds.formats.ownership import MARKER
from frod_ds.prep.dataset import BuildOptions, build
from frod_ds.prep.rows import ANSWER_SEPARATOR, check_row, dumps_row, read_rows, row_separator, training_text
from frod_ds.prep.tasks import TASKS, DataPrepError

REPO = Path(__file__).resolve().parents[2]
FIXTURE = Path(__file__).parents[1] / "fixtures" / "data_prep" / "llm_adapters"
MIRROR = Path(__file__).parents[1] / "fixtures" / "data_prep" / "mirror"
SHARED_README = REPO.parent / "shared" / "data" / "llm_adapters" / "README.md"

# LLM-Adapters' prompts, copied from the Python literals the shared data README quotes (finetune.py's training
# text with its 16-space indents, two spaces after "request." and a line of 16 spaces; commonsense_evaluate.py's
# scoring prompt with one space after "request." and an empty line).
FINETUNE = "Below is an instruction that describes a task. Write a response that appropriately completes the request.  \n\n                ### Instruction:\n                {instruction}\n                \n                ### Response:\n                {output}"  # noqa: E501
SCORING = "Below is an instruction that describes a task. Write a response that appropriately completes the request. \n\n                ### Instruction:\n                {instruction}\n\n                ### Response:\n                "  # noqa: E501

FOLDER = {
    "boolq": "boolq",
    "piqa": "piqa",
    "siqa": "social_i_qa",
    "hellaswag": "hellaswag",
    "winogrande": "winogrande",
    "obqa": "openbookqa",
    "arc_easy": "ARC-Easy",
    "arc_challenge": "ARC-Challenge",
}
ALL = tuple(TASKS)


def source(task: str, split: str) -> list[dict]:
    return json.loads((FIXTURE / FOLDER[task] / f"{split}.json").read_text())


def run_build(out: Path, src: str, **kw) -> tuple[dict, dict]:
    return build(BuildOptions(source=src, out=out, tasks=kw.pop("tasks", ALL), **kw))


def file_bytes(out: Path) -> dict[str, bytes]:
    """The data files of a build (the publish marker is atomic.py's, not data)."""
    return {
        p.relative_to(out).as_posix(): p.read_bytes()
        for p in sorted(out.rglob("*"))
        if p.is_file() and p.name != MARKER
    }


def words_of(instruction: str) -> list[str]:
    return instruction.rsplit("Answer format: ", 1)[1].split("/")


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    """The fixture folder built with each template, all eight tasks."""
    root = tmp_path_factory.mktemp("la")
    return {
        t: (root / t, run_build(root / t, f"llm-adapters:{FIXTURE}", template=t)[0]) for t in ("llm-adapters", "paper")
    }


def rows_by_id(out: Path) -> dict[str, dict]:
    rows = read_rows(out / "train.jsonl") + [r for t in TASKS for r in read_rows(out / "eval" / f"{t}.jsonl")]
    return {r["id"]: r for r in rows}


def source_of(row_id: str) -> dict:
    task, split, index = row_id.rsplit("-", 2)
    return source(task, split)[int(index)]


# --- the README's literals --------------------------------------------------------------------------


def test_prompt_literals_are_the_shared_readmes():
    if not SHARED_README.is_file():
        pytest.skip(f"the shared data README is not beside this checkout ({SHARED_README})")
    literals = [
        ast.literal_eval(m) for m in re.findall(r'`("Below is an instruction[^`]*")`', SHARED_README.read_text())
    ]
    assert literals == [FINETUNE, SCORING]


# --- --template llm-adapters -------------------------------------------------------------------------


def test_llm_adapters_training_text_is_finetune_py_character_for_character(built):
    out, manifest = built["llm-adapters"]
    rows = read_rows(out / "train.jsonl")
    assert len(rows) == sum(len(source(t, "train")) for t in TASKS) == manifest["train_rows"]
    for row in rows:
        src = source_of(row["id"])
        expected = FINETUNE.format(instruction=src["instruction"], output=src["output"])
        assert row["prompt"] + row["separator"] + row["answer"] == training_text(row) == expected
        assert row["separator"] == "" and row["answer"] == src["output"]
        assert row["prompt"].endswith("### Response:\n" + " " * 16)


def test_llm_adapters_eval_prompt_is_commonsense_evaluate_py(built):
    out, _ = built["llm-adapters"]
    for task in TASKS:
        rows = read_rows(out / "eval" / f"{task}.jsonl")
        assert [r["id"] for r in rows] == [f"{task}-test-{i}" for i in range(len(source(task, "test")))]
        for row, src in zip(rows, source(task, "test")):
            assert row["prompt"] == SCORING.format(instruction=src["instruction"])
            assert (row["separator"], row["answer"], row["task"]) == ("", src["output"], task)


def test_choices_are_every_answer_word_in_order(built):
    out, _ = built["llm-adapters"]
    n_options = Counter()
    for row in rows_by_id(out).values():
        src = source_of(row["id"])
        words = words_of(src["instruction"])
        assert row["choices"] == [f"the correct answer is {w}" for w in words]
        assert row["label"] == words.index(src["answer"]) and row["choices"][row["label"]] == src["output"]
        n_options[row["task"], len(words)] += 1
    assert n_options["boolq", 2] and not any(n for (t, k), n in n_options.items() if t == "boolq" and k != 2)
    assert rows_by_id(out)["boolq-test-0"]["choices"] == ["the correct answer is true", "the correct answer is false"]
    assert {k for t, k in n_options if t == "arc_easy"} == {3, 4, 5}
    assert {k for t, k in n_options if t == "arc_challenge"} == {3, 4, 5}
    assert {k for t, k in n_options if t == "hellaswag"} == {4} and {k for t, k in n_options if t == "siqa"} == {3}


# --- --template paper --------------------------------------------------------------------------------


PAPER_EXPECTED = {
    "piqa-train-0": (
        "Physical situation description:\nHow do I keep {curly} braces in a note?\nChoice A:\nWrite them twice "
        "\nChoice B:\nWrite them once\nQuestion:\nWhich solution is more physically plausible, Choice A or "
        "Choice B?",
        "Choice B",
    ),
    "piqa-train-3": (
        "Physical situation description:\nOpen a jar\nwith a tight lid\nChoice A:\nTap the lid on the counter, "
        "then twist.\nChoice B:\nPour water on the label.\nQuestion:\nWhich solution is more physically "
        "plausible, Choice A or Choice B?",
        "Choice A",
    ),
    "siqa-train-1": (
        'Please choose the correct Choice to the question: Robin shouted "Stop!", Question:\nWhat\'s going to '
        "happen to Robin?\nChoice A:\nget a reply\nChoice B:\nturn into a cat\nChoice C:\nfly\nWhich choice best "
        "answers the question, Choice A, B, or C?",
        "Choice A",
    ),
    "siqa-train-2": (
        "Please choose the correct Choice to the question: Was it late? Robin still went out., Question:\nHow "
        "would Robin feel afterwards?\nChoice A:\ntired\nChoice B:\na {brace}\nChoice C:\npleased\nWhich choice "
        "best answers the question, Choice A, B, or C?",
        "Choice C",
    ),
    "siqa-train-3": (
        "Please choose the correct Choice to the question: Jan gave Sam a ride home after work., Question:\nWhy "
        "did Jan do this?\nChoice A:\nto be kind\nChoice B:\n\nChoice C:\nto lose the car\nWhich choice best "
        "answers the question, Choice A, B, or C?",
        "Choice A",
    ),
    "hellaswag-train-2": (
        "Context:\nThe host says: hello. he\nEnding A:\nleaves.\nEnding B:\nsings.\nEnding C:\nsmiles and "
        "sits down.\nEnding D:\n\nQuestion:\nWhich ending is the most plausible continuation, Ending A, B, "
        "C, or D?",
        "Ending C",
    ),
    "hellaswag-train-1": (
        "Context:\n[header] How to clean a rug [title] Vacuum it first. [step] Then\nEnding A:\nburn the "
        "rug.\nEnding B:\nsprinkle baking soda over it.\nEnding C:\nfold it into a hat.\nEnding D:\nsell the "
        "vacuum.\nQuestion:\nWhich ending is the most plausible continuation, Ending A, B, C, or D?",
        "Ending B",
    ),
    "winogrande-train-1": (
        "Please choose the correct answer to fill in the blank to complete the given sentence: "
        "Zo\u00eb gave Ren\u00e9e {the} book because _ was leaving.\n\nOption1: Zo\u00eb\nOption2:  "
        "Ren\u00e9e .",
        "Option1",
    ),
}


def test_paper_template_renders_the_parsed_fields(built):
    out, _ = built["paper"]
    rows = rows_by_id(out)
    for row_id, (prompt, answer) in PAPER_EXPECTED.items():
        assert (rows[row_id]["prompt"], rows[row_id]["answer"]) == (prompt, answer), row_id
    assert all("separator" not in r and row_separator(r) == ANSWER_SEPARATOR for r in rows.values())


def test_paper_template_of_real_rows_boolq_without_passage_and_options_by_position(built):
    out, _ = built["paper"]
    head = "Please answer the following question with true or false, question: "
    for row_id, row in rows_by_id(out).items():
        src = source_of(row_id)
        ins = src["instruction"]
        if row["task"] == "boolq":
            assert ins.startswith(head) and ins.endswith("\n\nAnswer format: true/false")
            question = ins[len(head) : -len("\n\nAnswer format: true/false")]
            assert row["prompt"] == "Question:\n" + question
            assert (row["choices"], row["answer"]) == (["true", "false"], src["answer"])
        elif row["task"] in ("obqa", "arc_easy", "arc_challenge"):
            question, options = ins.split("\n\nAnswer1: ")
            texts = re.split(r" Answer\d: ", options.rsplit("\n\nAnswer format: ", 1)[0])
            letters = "ABCDE"[: len(texts)]
            expected = (
                "Please choose the correct answer to the question:"
                + question.split("question: ", 1)[1]
                + "\n"
                + "".join(f"Option {k}:\n{t}\n" for k, t in zip(letters, texts))
                + "."
            )
            assert row["prompt"] == expected, row_id
            assert row["answer"] == f"Option {letters[int(src['answer'][-1]) - 1]}"


# --- manifest, determinism ------------------------------------------------------------------------------


def test_manifest_records_template_sources_families_notes_and_sha256s(built):
    for template, (out, manifest) in built.items():
        assert manifest["template"] == template
        assert manifest["source"] == {"kind": "llm-adapters", "layout": "task folders", "path": str(FIXTURE.resolve())}
        assert manifest["separator"] == ("" if template == "llm-adapters" else "\nAnswer: ")
        for task in TASKS:
            for role, split in (("train", "train"), ("eval", "test")):
                path = f"{FOLDER[task]}/{split}.json"
                data = (FIXTURE / path).read_bytes()
                assert manifest["sources"][task][role] == {"path": path, "sha256": hashlib.sha256(data).hexdigest()}
                n = len(json.loads(data))
                assert manifest["counts"][task][role] == {"split": split, "read": n, "kept": n, "dropped": 0}
        families = manifest["families"]
        assert families["boolq/train.json"] == {"true_false": {"tasks": ["boolq"], "read": 24, "kept": 24}}
        assert families["ARC-Easy/test.json"] == {
            "answer": {"tasks": ["siqa", "obqa", "arc_easy", "arc_challenge"], "read": 26, "kept": 26}
        }
        assert families["winogrande/train.json"] == {"fill_blank": {"tasks": ["winogrande"], "read": 3, "kept": 3}}
        assert manifest["dropped"] == {} and manifest["winogrande_size"] is None
        assert "no passage" in manifest["notes"]["boolq"]
        for name, data in file_bytes(out).items():
            if name != "manifest.json":
                assert manifest["files"][name] == hashlib.sha256(data).hexdigest()
    assert set(built["paper"][1]["notes"]) == {"boolq", "siqa", "hellaswag", "obqa", "arc_easy", "arc_challenge"}
    assert "Question:\\n{question}" in built["paper"][1]["notes"]["boolq"]
    assert set(built["llm-adapters"][1]["notes"]) == {"boolq"}


def test_rebuild_is_byte_identical(built, tmp_path):
    for template, (out, _) in built.items():
        run_build(tmp_path / template, f"llm-adapters:{FIXTURE}", template=template)
        assert file_bytes(tmp_path / template) == file_bytes(out), template


def test_default_template_follows_the_source(built, tmp_path):
    manifest, _ = run_build(tmp_path / "default", f"llm-adapters:{FIXTURE}", tasks=("boolq",))
    assert manifest["template"] == "llm-adapters"
    assert (tmp_path / "default" / "eval" / "boolq.jsonl").read_bytes() == (
        built["llm-adapters"][0] / "eval" / "boolq.jsonl"
    ).read_bytes()


def test_paper_builds_from_mirrors_are_unchanged_by_the_separator_field(tmp_path):
    # sha256s of this mirror's build before rows could carry a separator: such builds stay byte-identical
    run_build(tmp_path / "m", str(MIRROR))
    got = {name: hashlib.sha256(data).hexdigest()[:16] for name, data in file_bytes(tmp_path / "m").items()}
    assert {k: v for k, v in got.items() if k != "manifest.json"} == {
        "train.jsonl": "60e5aa474b2c8672",
        "eval/arc_challenge.jsonl": "2de9eafe1a919d9f",
        "eval/arc_easy.jsonl": "1ebdf6c1b3df805a",
        "eval/boolq.jsonl": "95f29dd8a6e64df8",
        "eval/hellaswag.jsonl": "e7f50a029ee45ad0",
        "eval/obqa.jsonl": "145ceac2cf27cc18",
        "eval/piqa.jsonl": "19096bcbaf9a31a9",
        "eval/siqa.jsonl": "cd4ec0af442f77e7",
        "eval/winogrande.jsonl": "0227fca4bffc130a",
    }
    assert "template" not in json.loads((tmp_path / "m" / "manifest.json").read_text())


# --- the combined file -------------------------------------------------------------------------------


BAD_ROWS = [
    ["not", "an", "object"],
    {"instruction": "Translate to French: cat", "input": "", "output": "the correct answer is chat", "answer": "chat"},
]


@pytest.fixture(scope="module")
def combined(tmp_path_factory) -> Path:
    """A commonsense_170k.json mixing every family's training rows (shuffled) and two bad rows."""
    rows = [r for task in TASKS for r in source(task, "train")] + BAD_ROWS
    random.Random(0).shuffle(rows)
    path = tmp_path_factory.mktemp("cs") / "commonsense_170k.json"
    path.write_text(json.dumps(rows, indent=4))
    return path


def test_combined_file_tasks_families_and_ids(combined, tmp_path):
    manifest, files = run_build(tmp_path / "out", f"llm-adapters:{combined}")
    assert set(files) == {"train.jsonl", "manifest.json"}
    raw = json.loads(combined.read_text())
    rows = read_rows(tmp_path / "out" / "train.jsonl")
    shared = "siqa|obqa|arc_easy|arc_challenge"
    n = {task: len(source(task, "train")) for task in TASKS}
    assert Counter(r["task"] for r in rows) == {
        "boolq": n["boolq"],
        "piqa": n["piqa"],
        "hellaswag": n["hellaswag"],
        "winogrande": n["winogrande"],
        shared: n["siqa"] + n["obqa"] + n["arc_easy"] + n["arc_challenge"],
    }
    for row in rows:
        src = raw[int(row["id"].rsplit("-", 1)[1])]
        assert row["id"].startswith("commonsense_170k-")
        assert training_text(row) == FINETUNE.format(instruction=src["instruction"], output=src["output"])
    families = manifest["families"]["commonsense_170k.json"]
    assert {k: (f["read"], f["kept"]) for k, f in families.items()} == {
        "true_false": (n["boolq"],) * 2,
        "solution": (n["piqa"],) * 2,
        "ending": (n["hellaswag"],) * 2,
        "fill_blank": (n["winogrande"],) * 2,
        "answer": (len(rows) - n["boolq"] - n["piqa"] - n["hellaswag"] - n["winogrande"],) * 2,
        "unrecognized": (2, 0),
    }
    assert manifest["dropped"] == {
        "commonsense_170k.json": {"train": {"row is not an object": 1, "unrecognized instruction": 1}}
    }
    assert manifest["counts"] == {
        "commonsense_170k.json": {"train": {"split": "train", "read": len(raw), "kept": len(rows), "dropped": 2}}
    }
    assert manifest["source"]["layout"] == "combined file"


def test_combined_file_paper_template_refuses_the_shared_family(combined, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(
        DataPrepError,
        match=r"--template paper cannot render commonsense_170k\.json's 'answer' rows: "
        r"siqa, obqa, arc_easy, arc_challenge share",
    ):
        run_build(out, f"llm-adapters:{combined}", template="paper")
    with pytest.raises(
        DataPrepError, match=r"cannot tell siqa, obqa, arc_easy, arc_challenge apart .* select all of them or none"
    ):
        run_build(out, f"llm-adapters:{combined}", tasks=("boolq", "obqa"))
    assert not out.exists()


def test_combined_file_paper_template_renders_the_single_task_families(combined, tmp_path, built):
    tasks = ("boolq", "piqa", "hellaswag", "winogrande")
    manifest, _ = run_build(tmp_path / "out", f"llm-adapters:{combined}", template="paper", tasks=tasks)
    rows = read_rows(tmp_path / "out" / "train.jsonl")
    by_folder_build = {
        (r["task"], r["prompt"], r["answer"])
        for r in read_rows(built["paper"][0] / "train.jsonl")
        if r["task"] in tasks
    }
    assert {(r["task"], r["prompt"], r["answer"]) for r in rows} == by_folder_build
    counts = manifest["counts"]["commonsense_170k.json"]["train"]
    n_shared = sum(len(source(t, "train")) for t in ("siqa", "obqa", "arc_easy", "arc_challenge"))
    assert counts["not_selected"] == n_shared
    assert counts["kept"] == len(rows) and counts["dropped"] == 2


def test_cli_reports_rows_of_unselected_families(combined, tmp_path, capsys):
    from frod_ds.prep.command import main

    argv = [
        "build",
        "--source",
        f"llm-adapters:{combined}",
        "--out",
        str(tmp_path / "o"),
        "--tasks",
        "boolq,piqa,hellaswag,winogrande",
    ]
    assert main(argv) == 0
    n_shared = sum(len(source(t, "train")) for t in ("siqa", "obqa", "arc_easy", "arc_challenge"))
    assert (
        f"not selected: commonsense_170k.json train: {n_shared} rows of instruction families outside --tasks"
        in capsys.readouterr().out
    )


# --- drops, --strict, missing folders, bad options -----------------------------------------------------


def _bad(instruction: str, answer: str = "true", output: str | None = None, input_: str = "") -> dict:
    return {
        "instruction": instruction,
        "input": input_,
        "output": f"the correct answer is {answer}" if output is None else output,
        "answer": answer,
    }


BOOLQ_Q = "Please answer the following question with true or false, question: is it?\n\nAnswer format: true/false"
ARC_Q = (
    "Please choose the correct answer to the question: Which?\n\nAnswer1: a Answer2: b Answer3: c"
    "\n\nAnswer format: answer1/answer2/answer3"
)


@pytest.fixture()
def broken(tmp_path) -> Path:
    """boolq and ARC-Easy folders with one bad row of each kind appended to their train files."""
    root = tmp_path / "broken"
    for folder in ("boolq", "ARC-Easy", "social_i_qa"):
        shutil.copytree(FIXTURE / folder, root / folder)
    extra = {
        "boolq": [
            "a string",
            {"instruction": BOOLQ_Q, "input": "", "answer": "true"},
            _bad(BOOLQ_Q, input_="context"),
            _bad("Tell me a joke"),
            _bad(BOOLQ_Q.replace("true/false", "yes/no")),
            _bad(BOOLQ_Q, answer="maybe"),
            _bad(BOOLQ_Q, output="the answer is true"),
            _bad(ARC_Q, answer="answer1"),
            _bad("Please answer the following question with true or false, question: is it?", answer="true"),
        ],
        "ARC-Easy": [
            _bad(ARC_Q.replace("answer1/answer2/answer3", "answer1/answer2/answer3/answer4"), answer="answer1"),
            _bad(ARC_Q.replace(" Answer3: c", " Answer3: c Answer4: d"), answer="answer1"),
            _bad(ARC_Q.replace("answer1/answer2/answer3", "answer1/answer3"), answer="answer1"),
        ],
        "social_i_qa": [
            _bad(
                "Please choose the correct answer to the question: Jordan left early What will Jordan do next?\n\n"
                "Answer1: a Answer2: b Answer3: c\n\nAnswer format: answer1/answer2/answer3",
                answer="answer2",
            ),
        ],
    }
    for folder, rows in extra.items():
        path = root / folder / "train.json"
        path.write_text(json.dumps(json.loads(path.read_text()) + rows))
    return root


def test_unparseable_rows_are_dropped_and_counted_by_reason(broken, tmp_path):
    tasks = ("boolq", "siqa", "arc_easy")
    manifest, _ = run_build(tmp_path / "la", f"llm-adapters:{broken}", tasks=tasks)
    assert manifest["dropped"] == {
        "boolq": {
            "train": {
                "row is not an object": 1,
                "missing field 'output'": 1,
                "non-empty 'input'": 1,
                "unrecognized instruction": 1,
                "malformed 'Answer format:' line": 1,
                "'answer' is not one of the answer words": 1,
                "'output' is not 'the correct answer is <answer>'": 1,
                "instruction of another task's format": 1,
                "no 'Answer format:' line": 1,
            }
        },
        "arc_easy": {"train": {"malformed options": 2, "malformed 'Answer format:' line": 1}},
    }
    assert manifest["counts"]["boolq"]["train"] == {"split": "train", "read": 33, "kept": 24, "dropped": 9}
    families = manifest["families"]["boolq/train.json"]
    assert {k: (f["read"], f["kept"]) for k, f in families.items()} == {
        "true_false": (30, 24),
        "answer": (1, 0),
        "unrecognized": (2, 0),
    }
    # the SIQA row without a sentence end before its question is fine for LLM-Adapters' template, not for the paper's
    assert manifest["counts"]["siqa"]["train"]["kept"] == 5
    paper, _ = run_build(tmp_path / "paper", f"llm-adapters:{broken}", tasks=tasks, template="paper")
    assert paper["dropped"]["siqa"] == {"train": {"cannot split SIQA context and question": 1}}


def test_strict_names_task_file_and_row_and_writes_nothing(broken, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(DataPrepError) as info:
        run_build(out, f"llm-adapters:{broken}", tasks=("boolq",), strict=True)
    assert str(info.value) == (
        f"boolq: {broken / 'boolq' / 'train.json'} row index 24: row is not an object (got str) (--strict)"
    )
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]
    manifest, _ = run_build(out, f"llm-adapters:{FIXTURE}", tasks=("boolq", "arc_easy"), strict=True)
    assert manifest["dropped"] == {}


def test_strict_on_the_combined_file_names_file_and_row(combined, tmp_path):
    raw = json.loads(combined.read_text())
    index = min(raw.index(bad) for bad in BAD_ROWS)
    reason = "row is not an object" if raw[index] == BAD_ROWS[0] else "unrecognized instruction"
    with pytest.raises(
        DataPrepError, match=rf"^{re.escape(str(combined))} row index {index}: {reason} .*\(--strict\)$"
    ):
        run_build(tmp_path / "out", f"llm-adapters:{combined}", strict=True)


def test_only_selected_tasks_need_folders(tmp_path):
    root = tmp_path / "la"
    shutil.copytree(FIXTURE / "boolq", root / "boolq")
    shutil.copytree(FIXTURE / "openbookqa", root / "openbookqa")
    (root / "openbookqa" / "test.json").unlink()
    manifest, _ = run_build(tmp_path / "ok", f"llm-adapters:{root}", tasks=("boolq",))
    assert manifest["tasks"] == ["boolq"]
    with pytest.raises(DataPrepError) as info:
        run_build(tmp_path / "bad", f"llm-adapters:{root}", tasks=("boolq", "piqa", "obqa"))
    message = str(info.value)
    assert f"piqa (no {root / 'piqa' / 'train.json'} and no {root / 'piqa' / 'test.json'})" in message
    assert f"obqa (no {root / 'openbookqa' / 'test.json'})" in message
    assert message.endswith("pass --tasks boolq to build only the tasks present")
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize(
    "src,kw,pattern",
    [
        (str(MIRROR), {"template": "llm-adapters"}, r"--template llm-adapters needs --source llm-adapters:PATH"),
        ("llm-adapters:", {}, r"llm-adapters:PATH needs a PATH"),
        ("llm-adapters:/nonexistent/la", {}, r"llm-adapters:/nonexistent/la: no such file or directory"),
        (f"llm-adapters:{FIXTURE}", {"template": "alpaca"}, r"unknown template 'alpaca'"),
    ],
)
def test_bad_source_or_template_is_one_clear_error(tmp_path, src, kw, pattern):
    with pytest.raises(DataPrepError, match=pattern):
        run_build(tmp_path / "out", src, **kw)
    assert not (tmp_path / "out").exists()


def test_cli_builds_and_shows_llm_adapters_rows(tmp_path, capsys):
    from frod_ds.prep.command import main

    assert (
        main(["build", "--source", f"llm-adapters:{FIXTURE}", "--out", str(tmp_path / "o"), "--tasks", "boolq,piqa"])
        == 0
    )
    out = capsys.readouterr().out
    assert "template: llm-adapters" in out and "families: boolq/train.json: true_false 24 read/24 kept" in out
    assert "note: boolq: LLM-Adapters' BoolQ rows have no passage" in out
    assert main(["show", "--source", f"llm-adapters:{FIXTURE}", "--task", "boolq", "-n", "1", "--repr"]) == 0
    src = source("boolq", "train")[0]
    assert repr(FINETUNE.format(instruction=src["instruction"], output=src["output"])) in capsys.readouterr().out
    assert main(["show", "--source", str(MIRROR), "--task", "boolq", "--template", "llm-adapters"]) == 2
    assert "error: --template llm-adapters needs --source llm-adapters:PATH" in capsys.readouterr().err


# --- the row field ---------------------------------------------------------------------------------------


def test_separator_field_is_optional_validated_and_serialized_after_prompt():
    row = {"task": "t", "id": "1", "prompt": "p", "answer": "a", "choices": ["a", "b"], "label": 0}
    assert dumps_row(row) == json.dumps(row) and row_separator(row) == "\nAnswer: " == ANSWER_SEPARATOR
    with_sep = {**row, "separator": ""}
    assert list(json.loads(dumps_row(with_sep))) == ["task", "id", "prompt", "separator", "answer", "choices", "label"]
    assert row_separator(with_sep) == "" and training_text(with_sep) == "pa" and check_row(with_sep) is None
    assert check_row({**row, "separator": None}) == "field 'separator' must be str when present, got NoneType"


def test_evaluation_uses_the_data_prep_separator():
    from frod_ds.eval import predict as evaluation

    assert evaluation.ANSWER_SEPARATOR is ANSWER_SEPARATOR


# --- the one training path reproduces LLM-Adapters' text ------------------------------------------------


class CharTokenizer:
    """One id per character (BOS 1, EOS 2): no token ever straddles the prompt/answer boundary."""

    bos_token_id, eos_token_id = 1, 2

    def __call__(self, texts, add_special_tokens=True):
        return {"input_ids": [[1] * add_special_tokens + [3 + ord(c) for c in t] for t in texts]}


def _bpe(texts: list[str], kind: str):
    """A BPE tokenizer trained on `texts`: GPT-2 byte-level without BOS (as SmolLM2's) or LLaMA-style metaspace."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.BPE(unk_token=None if kind == "bytelevel" else "<unk>"))
    if kind == "bytelevel":
        t.pre_tokenizer, t.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
        t.train_from_iterator(
            texts,
            trainers.BpeTrainer(
                vocab_size=400, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
            ),
        )
        t.post_processor = processors.ByteLevel(trim_offsets=True)
    else:
        t.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
        t.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
        t.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"]))
        t.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", t.token_to_id("<s>"))]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=t, bos_token="<s>", eos_token="</s>", unk_token=None if kind == "bytelevel" else "<unk>"
    )


@pytest.fixture(scope="module")
def train_rows(built) -> list[dict]:
    from frod_ds.train.data import read_training_rows

    return read_training_rows(built["llm-adapters"][0], limit=40)


def _expected_text(row: dict) -> tuple[str, str]:
    src = source_of(row["id"]) if "-train-" in row["id"] else None
    assert src is not None
    return FINETUNE.format(instruction=src["instruction"], output=src["output"]), src["output"]


def test_training_tokens_are_the_finetune_text_and_eos_with_loss_on_output_only(train_rows):
    from frod_ds.train.data import IGNORE_INDEX, encode_examples

    tok = CharTokenizer()
    examples = encode_examples(tok, train_rows, cutoff_len=2048, train_on_inputs=False)
    for row, ex in zip(train_rows, examples):
        text, output = _expected_text(row)
        assert ex.input_ids == [1] + [3 + ord(c) for c in text] + [2]
        assert [t for t in ex.labels if t != IGNORE_INDEX] == [3 + ord(c) for c in output] + [2]
        assert ex.labels[: len(ex.labels) - len(output) - 1] == [IGNORE_INDEX] * (len(ex.labels) - len(output) - 1)
    whole = encode_examples(tok, train_rows, cutoff_len=2048, train_on_inputs=True)
    assert all(ex.labels == ex.input_ids for ex in whole)


@pytest.mark.parametrize("kind", ["bytelevel", "metaspace"])
def test_bpe_training_tokens_decode_to_the_finetune_text_and_loss_starts_at_output(train_rows, kind):
    from frod_ds.train.data import IGNORE_INDEX, encode_examples

    tok = _bpe([training_text(r) for r in train_rows] * 3, kind)
    for row, ex in zip(train_rows, encode_examples(tok, train_rows, cutoff_len=2048, train_on_inputs=False)):
        text, output = _expected_text(row)
        assert ex.input_ids == tok(text)["input_ids"] + [tok.eos_token_id]
        labelled = [t for t in ex.labels if t != IGNORE_INDEX]
        assert ex.labels == [IGNORE_INDEX] * (len(ex.labels) - len(labelled)) + ex.input_ids[-len(labelled) :]
        if kind == "bytelevel":
            assert tok.decode(ex.input_ids) == text + "</s>"
            # the answer's first token " the" carries the prompt's 16th space; nothing else of the prompt is in the loss
            assert tok.decode(labelled) == " " + output + "</s>"
        else:
            assert tok.decode(labelled) == output + "</s>"  # "▁the": the prompt's last space, as LLaMA writes it
            assert tok.convert_ids_to_tokens(labelled)[0] == "\u2581the"


# --- scoring uses each row's separator -----------------------------------------------------------------


def test_loglik_scores_condition_on_each_rows_separator(built):
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from frod_ds.eval.predict import score_loglik_rows
    from tests.support.eval_fixtures import random_llama

    la = read_rows(built["llm-adapters"][0] / "eval" / "boolq.jsonl")[0]
    paper = read_rows(built["paper"][0] / "eval" / "boolq.jsonl")[0]
    texts = [r["prompt"] + s + c for r in (la, paper) for c in r["choices"] for s in ("", ANSWER_SEPARATOR)]
    words = sorted({w for t in texts for w in re.findall(r"\w+|[^\w\s]+", t)})
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>"] + words)}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok = PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    model = random_llama(len(vocab))

    def reference(prompt: str, sep: str, choice: str) -> float:
        ids = tok(prompt + sep + choice)["input_ids"]
        n_ctx = len(tok(prompt + sep)["input_ids"])
        with torch.no_grad():
            logprobs = model(torch.tensor([ids])).logits[0].double().log_softmax(-1)
        return sum(logprobs[i - 1, ids[i]].item() for i in range(n_ctx, len(ids)))

    records = score_loglik_rows(model, tok, [la, paper], pad_id=0)
    for row, record in zip((la, paper), records):
        expected = [reference(row["prompt"], row_separator(row), c) for c in row["choices"]]
        assert record["scores"] == pytest.approx(expected, abs=1e-4)
    other = [reference(la["prompt"], ANSWER_SEPARATOR, c) for c in la["choices"]]
    assert records[0]["scores"] != pytest.approx(other, abs=1e-3)


def test_a_blank_question_is_kept_as_published_and_refused_under_strict(tmp_path):
    """An instruction whose question is whitespace only: rendered verbatim (as the paper path keeps a blank question),
    refused under --strict."""
    root = tmp_path / "blank"
    shutil.copytree(FIXTURE / "boolq", root / "boolq")
    path = root / "boolq" / "train.json"
    rows = json.loads(path.read_text())
    blank = _bad(BOOLQ_Q.replace("question: is it?", "question:   "))
    path.write_text(json.dumps([*rows, blank]))
    manifest, _ = run_build(tmp_path / "kept", f"llm-adapters:{root}", tasks=("boolq",))
    assert manifest["counts"]["boolq"]["train"]["kept"] == len(rows) + 1
    with pytest.raises(DataPrepError, match=rf"row index {len(rows)}: blank question"):
        run_build(tmp_path / "strict", f"llm-adapters:{root}", tasks=("boolq",), strict=True)
    assert not (tmp_path / "strict").exists()


def test_a_test_row_in_training_is_found_through_the_two_templates_layouts(tmp_path):
    """LLM-Adapters renders one instruction with other indentation for training and for test: a test row copied into
    training is still counted."""
    root = tmp_path / "leak"
    shutil.copytree(FIXTURE / "boolq", root / "boolq")
    test = json.loads((root / "boolq" / "test.json").read_text())
    train_path = root / "boolq" / "train.json"
    train_path.write_text(json.dumps([*json.loads(train_path.read_text()), test[0]]))
    manifest, _ = run_build(tmp_path / "out", f"llm-adapters:{root}", tasks=("boolq",))
    assert manifest["test_rows_in_training"]["rows"] == {"boolq": 1}
    clean, _ = run_build(tmp_path / "clean", f"llm-adapters:{FIXTURE}", tasks=("boolq",))
    assert clean["test_rows_in_training"]["rows"] == {}
