"""Unit tier of LLM-Adapters' scoring protocol: answer-word extraction on hand-written outputs, the text it
searches, and batched beam search against plain transformers generate one row at a time."""

from __future__ import annotations

import re

import pytest
import torch

from frod_ds.eval.accuracy import markdown_table, summarize
from frod_ds.eval.predict import (
    LLM_ADAPTERS_WORDS,
    EvalError,
    extract_answer_word,
    llm_adapters_response,
    score_llm_adapters_rows,
)
from tests.support.eval_fixtures import (
    LLM_ADAPTERS_VOCAB,
    make_llm_adapters_rows,
    make_rows,
    random_llama,
    word_tokenizer,
)

# LLM-Adapters' regexes per task, written out as its commonsense_evaluate.py spells them.
REFERENCE_PATTERNS = {
    "boolq": r"true|false",
    "piqa": r"solution1|solution2",
    "siqa": r"answer1|answer2|answer3|answer4|answer5",
    "arc_easy": r"answer1|answer2|answer3|answer4|answer5",
    "arc_challenge": r"answer1|answer2|answer3|answer4|answer5",
    "obqa": r"answer1|answer2|answer3|answer4|answer5",
    "hellaswag": r"ending1|ending2|ending3|ending4",
    "winogrande": r"option1|option2",
}


def _reference_extract(text: str, task: str) -> str | None:
    found = re.findall(REFERENCE_PATTERNS[task], text.strip())
    return found[0] if found else None


@pytest.mark.parametrize(
    ("task", "output", "expected"),
    [
        ("obqa", "the correct answer is answer3, not answer1", "answer3"),  # first match wins, not the lowest word
        ("arc_challenge", "answer5", "answer5"),
        ("siqa", "answer4", "answer4"),  # SIQA searches all five words: a match, though no choice of a SIQA row
        ("arc_easy", "the correct answer is Answer2", None),  # case-sensitive, as LLM-Adapters
        ("obqa", "answer12", "answer1"),  # a substring match, as its regex
        ("boolq", "False. it is true", "true"),
        ("boolq", "it is untrue", "true"),
        ("boolq", "", None),
        ("piqa", "solution3 then solution2", "solution2"),
        ("hellaswag", "ending5 or ending4 or ending1", "ending4"),
        ("winogrande", "Option1", None),
        ("winogrande", "the correct answer is option2", "option2"),
    ],
)
def test_extract_answer_word_takes_the_first_match_case_sensitive(task, output, expected):
    assert extract_answer_word(output, task) == expected
    assert _reference_extract(output, task) == expected  # the reference regex agrees on the hand-written case


def test_answer_words_cover_every_task_with_the_reference_patterns():
    from frod_ds.prep.tasks import TASKS

    assert set(LLM_ADAPTERS_WORDS) == set(TASKS)
    for task, words in LLM_ADAPTERS_WORDS.items():
        assert "|".join(words) == REFERENCE_PATTERNS[task]


def test_response_is_the_text_between_the_first_two_markers():
    prompt = "### Instruction:\n  pick one\n\n  ### Response:\n                "
    assert llm_adapters_response(prompt, "the correct answer is answer2") == "the correct answer is answer2"
    # A marker the model writes itself ends the searched text.
    assert llm_adapters_response(prompt, "answer1\n### Response: answer2") == "answer1"
    # No marker anywhere (a paper-template row): the whole output.
    assert llm_adapters_response("Question:\nis it?", "\nAnswer: true ") == "Answer: true"


def _reference_generate(model, tok, prompt: str) -> str:
    """Plain transformers beam search on one unpadded row, decoded, cut at the marker as LLM-Adapters does."""
    ids = torch.tensor([tok(prompt)["input_ids"]])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            num_beams=4,
            max_new_tokens=32,
            do_sample=False,
            pad_token_id=tok.eos_token_id,
            eos_token_id=tok.eos_token_id,
        )
    text = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    return text.split("### Response:")[0].strip()  # the prompt ends with the marker and whitespace only


def test_batched_beam_search_equals_plain_generate_one_row_at_a_time():
    tok = word_tokenizer(LLM_ADAPTERS_VOCAB)
    model = random_llama(len(tok), seed=0)
    rows = (
        make_llm_adapters_rows("obqa", 4)
        + make_llm_adapters_rows("boolq", 3)
        + make_llm_adapters_rows("piqa", 2)
        + make_rows("boolq", 3, seed=2)
    )  # paper-like rows too: generated on their prompt as stored
    assert len({len(tok(r["prompt"])["input_ids"]) for r in rows}) > 3  # left padding is exercised
    records = score_llm_adapters_rows(model, tok, rows, pad_id=tok.eos_token_id)
    for row, rec in zip(rows, records):
        output = _reference_generate(model, tok, row["prompt"])
        word = _reference_extract(output, row["task"])
        gold = {"boolq": ["true", "false"], "piqa": ["solution1", "solution2"]}.get(
            row["task"], [f"answer{k}" for k in range(1, 6)]
        )
        assert rec["output"] == output
        assert (rec["prediction"], rec["answer"], rec["correct"]) == (
            word,
            gold[row["label"]],
            word == gold[row["label"]],
        )
        assert rec["pred"] == (None if word is None else gold.index(word))
    assert len({r["output"] for r in records}) > 2  # a non-degenerate model
    assert {r["pred"] is None for r in records} == {True, False}  # matched and unmatched rows
    entry = summarize(records[:4], ["obqa"], "llm-adapters")["tasks"]["obqa"]
    assert entry["unmatched"] == sum(r["prediction"] is None for r in records[:4])
    assert entry["accuracy"] == sum(r["correct"] for r in records[:4]) / 4


def test_row_with_more_choices_than_answer_words_is_a_clear_error():
    tok = word_tokenizer(LLM_ADAPTERS_VOCAB)
    row = {**make_rows("boolq", 1)[0], "choices": ["true", "false", "maybe"]}
    with pytest.raises(EvalError, match="has 3 choices but boolq has 2 LLM-Adapters answer words"):
        score_llm_adapters_rows(random_llama(len(tok)), tok, [row], pad_id=tok.eos_token_id)


def test_table_shows_each_mode_per_task_with_row_counts():
    loglik = summarize(
        [{"task": t, "correct": k < 2, "correct_norm": k < 3} for t in ("boolq", "arc_easy") for k in range(4)],
        ["boolq", "arc_easy"],
        "loglik",
    )
    llm = summarize(
        [{"task": t, "correct": k < 1, "pred": None if k == 3 else 0} for t in ("boolq", "arc_easy") for k in range(4)],
        ["boolq", "arc_easy"],
        "llm-adapters",
    )
    table = markdown_table({"loglik": loglik, "llm-adapters": llm})
    assert "| task | n | loglik | loglik norm | llm-adapters | llm-adapters unmatched | paper FRoD s=0.02 |" in table
    assert "| BoolQ | 4 | 50.00 | 75.00 | 25.00 | 1 | 87.74 |" in table
    assert "| ARC-e | 4 | 50.00 | 75.00 | 25.00 | 1 | — |" in table
    assert "| **average** | 8 | 50.00 | 75.00 | 25.00 | 2 | — |" in table
    assert "| average (paper's tasks) | 4 | 50.00 | 75.00 | 25.00 | 1 | 87.74 |" in table
