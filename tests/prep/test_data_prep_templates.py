"""Rendering of every task's template, label -> answer mapping, and row validation reasons.

Expected prompts are written out by hand from PROMPTS.md, not built with the module's templates.
"""

from __future__ import annotations

import pytest

from frod_ds.prep.templates import RowError, render, row_id

# --- exact rendering with awkward content ------------------------------------------------------


def test_boolq_renders_paper_template_verbatim():
    row = {"question": "is it {0} or {}?", "answer": True, "passage": "  Caf\u00e9 \U0001f30c\nline two "}
    ex = render("boolq", row)
    assert ex.prompt == "Reference document:\n  Caf\u00e9 \U0001f30c\nline two \nQuestion:\nis it {0} or {}?"
    assert (ex.choices, ex.label, ex.answer) == (("true", "false"), 0, "true")


def test_boolq_keeps_empty_question():
    ex = render("boolq", {"question": "", "answer": False, "passage": "p"})
    assert ex.prompt == "Reference document:\np\nQuestion:\n"
    assert ex.answer == "false"


def test_piqa_renders_paper_template_verbatim():
    row = {"goal": "  Open a jar {lid}", "sol1": "Twist.\nGently.", "sol2": "", "label": 1}
    ex = render("piqa", row)
    assert ex.prompt == (
        "Physical situation description:\n  Open a jar {lid}\nChoice A:\nTwist.\nGently.\nChoice B:\n\n"
        "Question:\nWhich solution is more physically plausible, Choice A or Choice B?"
    )
    assert (ex.choices, ex.label, ex.answer) == (("Choice A", "Choice B"), 1, "Choice B")


def test_siqa_renders_paper_template_verbatim_with_odd_comma():
    row = {
        "context": " Zo\u00eb said {hi}\n",
        "question": "",
        "answerA": "\u00e9t\u00e9",
        "answerB": "",
        "answerC": " c ",
        "label": "1",
    }
    ex = render("siqa", row)
    assert ex.prompt == (
        "Please choose the correct Choice to the question:  Zo\u00eb said {hi}\n, Question:\n\n"
        "Choice A:\n\u00e9t\u00e9\nChoice B:\n\nChoice C:\n c \n"
        "Which choice best answers the question, Choice A, B, or C?"
    )
    assert (ex.choices, ex.label, ex.answer) == (("Choice A", "Choice B", "Choice C"), 0, "Choice A")


def test_hellaswag_renders_paper_template_verbatim():
    row = {
        "ctx": "[header] How to {cook}\n rice ",
        "endings": ["", " Boil.", "Fry \U0001f35a", "Wait\nthen eat"],
        "label": "2",
        "activity_label": "ignored",
        "ctx_a": "ignored",
        "ctx_b": "ignored",
    }
    ex = render("hellaswag", row)
    assert ex.prompt == (
        "Context:\n[header] How to {cook}\n rice \n"
        "Ending A:\n\nEnding B:\n Boil.\nEnding C:\nFry \U0001f35a\nEnding D:\nWait\nthen eat\n"
        "Question:\nWhich ending is the most plausible continuation, Ending A, B, C, or D?"
    )
    assert ex.choices == ("Ending A", "Ending B", "Ending C", "Ending D")
    assert (ex.label, ex.answer) == (2, "Ending C")


def test_winogrande_renders_paper_template_verbatim_with_trailing_period():
    row = {
        "sentence": " Zo\u00eb gave Ren\u00e9e {the} book because _ left.\n",
        "option1": "Zo\u00eb",
        "option2": " Ren\u00e9e ",
        "answer": "2",
    }
    ex = render("winogrande", row)
    assert ex.prompt == (
        "Please choose the correct answer to fill in the blank to complete the given sentence: "
        " Zo\u00eb gave Ren\u00e9e {the} book because _ left.\n\n\nOption1: Zo\u00eb\nOption2:  Ren\u00e9e ."
    )
    assert (ex.choices, ex.label, ex.answer) == (("Option1", "Option2"), 1, "Option2")


def test_obqa_renders_paper_template_verbatim_without_space_after_colon():
    row = {
        "id": "7-980",
        "question_stem": " What is 2+2?\n",
        "choices": {"text": ["four ", "", "{x}", "\u00fcnf"], "label": ["A", "B", "C", "D"]},
        "answerKey": "C",
    }
    ex = render("obqa", row)
    assert ex.prompt == (
        "Please choose the correct answer to the question: What is 2+2?\n\n"
        "Option A:\nfour \nOption B:\n\nOption C:\n{x}\nOption D:\n\u00fcnf\n."
    )
    assert (ex.choices, ex.label, ex.answer) == (("Option A", "Option B", "Option C", "Option D"), 2, "Option C")


def test_arc_renders_obqa_style_template_with_numeric_labels():
    row = {
        "id": "NYSEDREGENTS_2015_4_8",
        "question": "Which tool measures {mass}?",
        "choices": {"text": ["ruler", " balance ", "thermometer"], "label": ["1", "2", "3"]},
        "answerKey": "2",
    }
    for task in ("arc_easy", "arc_challenge"):
        ex = render(task, row)
        assert ex.prompt == (
            "Please choose the correct answer to the question:Which tool measures {mass}?\n"
            "Option 1:\nruler\nOption 2:\n balance \nOption 3:\nthermometer\n."
        )
        assert (ex.choices, ex.label, ex.answer) == (("Option 1", "Option 2", "Option 3"), 1, "Option 2")


def test_arc_five_letter_choices():
    row = {"question": "q", "choices": {"text": list("abcde"), "label": list("ABCDE")}, "answerKey": "E"}
    ex = render("arc_easy", row)
    assert ex.prompt.endswith("Option E:\ne\n.")
    assert (ex.label, ex.answer, len(ex.choices)) == (4, "Option E", 5)


# --- gold label -> answer string, per task --------------------------------------------------

BASE = {
    "boolq": {"question": "q", "passage": "p"},
    "piqa": {"goal": "g", "sol1": "a", "sol2": "b"},
    "siqa": {"context": "c", "question": "q", "answerA": "a", "answerB": "b", "answerC": "c"},
    "hellaswag": {"ctx": "c", "endings": ["a", "b", "c", "d"]},
    "winogrande": {"sentence": "s _", "option1": "a", "option2": "b"},
    "obqa": {"question_stem": "q", "choices": {"text": list("abcd"), "label": list("ABCD")}},
    "arc_easy": {"question": "q", "choices": {"text": list("abcd"), "label": list("ABCD")}},
    "arc_challenge": {"question": "q", "choices": {"text": list("abcd"), "label": list("1234")}},
}
LABEL_FIELD = {
    "boolq": "answer",
    "piqa": "label",
    "siqa": "label",
    "hellaswag": "label",
    "winogrande": "answer",
    "obqa": "answerKey",
    "arc_easy": "answerKey",
    "arc_challenge": "answerKey",
}
GOLD = [
    ("boolq", True, 0, "true"),
    ("boolq", False, 1, "false"),
    ("piqa", 0, 0, "Choice A"),
    ("piqa", 1, 1, "Choice B"),
    ("siqa", "1", 0, "Choice A"),
    ("siqa", "2", 1, "Choice B"),
    ("siqa", "3", 2, "Choice C"),
    ("hellaswag", "0", 0, "Ending A"),
    ("hellaswag", "1", 1, "Ending B"),
    ("hellaswag", "2", 2, "Ending C"),
    ("hellaswag", "3", 3, "Ending D"),
    ("winogrande", "1", 0, "Option1"),
    ("winogrande", "2", 1, "Option2"),
    ("obqa", "A", 0, "Option A"),
    ("obqa", "B", 1, "Option B"),
    ("obqa", "C", 2, "Option C"),
    ("obqa", "D", 3, "Option D"),
    ("arc_easy", "A", 0, "Option A"),
    ("arc_easy", "D", 3, "Option D"),
    ("arc_challenge", "1", 0, "Option 1"),
    ("arc_challenge", "4", 3, "Option 4"),
]


@pytest.mark.parametrize("task,gold,index,answer", GOLD)
def test_gold_label_maps_to_answer_string(task, gold, index, answer):
    ex = render(task, {**BASE[task], LABEL_FIELD[task]: gold})
    assert ex.label == index
    assert ex.answer == answer == ex.choices[index]


def test_prompt_never_contains_answer_separator():
    for task, gold, _, _ in GOLD:
        assert "\nAnswer: " not in render(task, {**BASE[task], LABEL_FIELD[task]: gold}).prompt


# --- validation: each invalid row raises with a countable reason -------------------------------

INVALID = [
    ("boolq", {"question": "q", "answer": True}, "missing field 'passage'"),
    ("boolq", {"question": None, "answer": True, "passage": "p"}, "missing field 'question'"),
    ("boolq", {"question": "q", "answer": "true", "passage": "p"}, "wrong type for 'answer'"),
    ("boolq", {"question": "q", "answer": 1, "passage": "p"}, "wrong type for 'answer'"),
    ("boolq", {"question": 3, "answer": True, "passage": "p"}, "wrong type for 'question'"),
    ("piqa", {**BASE["piqa"], "label": 2}, "label out of range"),
    ("piqa", {**BASE["piqa"], "label": -1}, "label missing"),
    ("piqa", {**BASE["piqa"], "label": "1"}, "wrong type for 'label'"),
    ("piqa", {**BASE["piqa"], "label": True}, "wrong type for 'label'"),
    ("piqa", {"goal": "g", "sol1": "a", "label": 0}, "missing field 'sol2'"),
    ("siqa", {**BASE["siqa"], "label": 1}, "wrong type for 'label'"),
    ("siqa", {**BASE["siqa"], "label": "0"}, "label out of range"),
    ("siqa", {**BASE["siqa"], "label": "4"}, "label out of range"),
    ("siqa", {**BASE["siqa"], "label": ""}, "label missing"),
    ("hellaswag", {**BASE["hellaswag"], "label": ""}, "label missing"),
    ("hellaswag", {**BASE["hellaswag"], "label": "4"}, "label out of range"),
    ("hellaswag", {**BASE["hellaswag"], "label": 3}, "wrong type for 'label'"),
    ("hellaswag", {"ctx": "c", "endings": ["a", "b", "c"], "label": "0"}, "malformed 'endings'"),
    ("hellaswag", {"ctx": "c", "endings": ["a", "b", "c", 4], "label": "0"}, "wrong type for 'endings'"),
    ("hellaswag", {"ctx": "c", "endings": "abcd", "label": "0"}, "wrong type for 'endings'"),
    ("winogrande", {**BASE["winogrande"], "answer": ""}, "label missing"),
    ("winogrande", {**BASE["winogrande"], "answer": "3"}, "label out of range"),
    ("winogrande", {**BASE["winogrande"], "answer": 1}, "wrong type for 'answer'"),
    ("obqa", {**BASE["obqa"], "answerKey": "E"}, "label out of range"),
    ("obqa", {**BASE["obqa"], "answerKey": ""}, "label missing"),
    ("obqa", {"question_stem": "q", "answerKey": "A"}, "missing field 'choices'"),
    ("obqa", {"question_stem": "q", "choices": [["a", "A"]], "answerKey": "A"}, "wrong type for 'choices'"),
    (
        "arc_easy",
        {"question": "q", "choices": {"text": ["a"], "label": ["A", "B"]}, "answerKey": "A"},
        "malformed 'choices'",
    ),
    (
        "arc_easy",
        {"question": "q", "choices": {"text": ["a", "b"], "label": ["A", "A"]}, "answerKey": "A"},
        "malformed 'choices'",
    ),
    (
        "arc_easy",
        {"question": "q", "choices": {"text": ["a", 2], "label": ["A", "B"]}, "answerKey": "A"},
        "wrong type for 'choices'",
    ),
    ("arc_challenge", {**BASE["arc_challenge"], "answerKey": "A"}, "label out of range"),
    (
        "arc_challenge",
        {"question_stem": "q", "choices": BASE["arc_challenge"]["choices"], "answerKey": "1"},
        "missing field 'question'",
    ),
    ("boolq", ["not", "a", "dict"], "row is not an object"),
]


@pytest.mark.parametrize("task,row,reason", INVALID)
def test_invalid_row_raises_with_reason(task, row, reason):
    with pytest.raises(RowError) as info:
        render(task, row)
    assert info.value.reason == reason


def test_row_id_uses_source_id_else_task_split_index():
    assert row_id("obqa", "train", 3, {"id": "7-980"}) == "7-980"
    assert row_id("boolq", "validation", 3, {"question": "q"}) == "boolq-validation-3"
    assert row_id("piqa", "train", 0, {"id": ""}) == "piqa-train-0"
    with pytest.raises(RowError, match="wrong type for 'id'"):
        row_id("obqa", "train", 0, {"id": ["x"]})
