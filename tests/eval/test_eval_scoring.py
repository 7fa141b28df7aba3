"""Unit tier of the evaluation: token boundaries, loglik against plain forward passes, a model with
known preferences, greedy generation with left padding, answer matching and the results table."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from frod_ds.eval.accuracy import PAPER_RESULTS, markdown_table, summarize
from frod_ds.eval.predict import (
    ANSWER_SEPARATOR,
    EvalError,
    encode_row,
    generate_outputs,
    match_choice,
    plan_batches,
    score_generate_rows,
    score_loglik_rows,
)
from tests.support.eval_fixtures import (
    TASK_CHOICES,
    bigram_llama,
    make_rows,
    metaspace_tokenizer,
    preference_logits,
    random_llama,
    word_tokenizer,
)


def test_answer_separator_is_the_training_format():
    from frod_ds.prep.templates import ANSWER_SEPARATOR as data_prep_separator

    assert ANSWER_SEPARATOR == data_prep_separator


def test_context_plus_continuation_is_the_training_tokenization():
    tok = word_tokenizer()
    enc = encode_row(tok, "Question:\nis it red?", ["true", "false"])
    assert enc.context[0] == tok.bos_token_id
    assert enc.context == tok("Question:\nis it red?" + ANSWER_SEPARATOR)["input_ids"]
    assert enc.continuations == [
        tok("true", add_special_tokens=False)["input_ids"],
        tok("false", add_special_tokens=False)["input_ids"],
    ]


def test_sentencepiece_separator_space_joins_the_answer_token():
    # LLaMA-style "▁": "...Answer: " alone ends in a lone "▁"; "...Answer: Choice B" does not.
    prompt, choices = "Which one is it, Choice A or Choice B?", ["Choice A", "Choice B"]
    tok = metaspace_tokenizer([prompt + ANSWER_SEPARATOR + c for c in choices] * 20)
    assert tok.convert_ids_to_tokens(tok(prompt + ANSWER_SEPARATOR)["input_ids"])[-1] == "▁"
    enc = encode_row(tok, prompt, choices)
    for choice, cont in zip(choices, enc.continuations):
        assert enc.context + cont == tok(prompt + ANSWER_SEPARATOR + choice)["input_ids"]
        assert tok.decode(cont).strip() == choice


def test_choice_without_tokens_of_its_own_is_a_clear_error():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    # No pre-tokenizer: every text is one <unk>, so the answer adds no token after the context.
    t = Tokenizer(models.WordLevel({"<unk>": 0, "true": 1}, unk_token="<unk>"))
    whole_text = PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>")
    with pytest.raises(EvalError, match="'true' of prompt 'is it' tokenizes to no tokens"):
        encode_row(whole_text, "is it", ["true"])


def _reference_loglik(model, tok, prompt: str, choice: str) -> float:
    """Independent computation: one unpadded forward pass of the full training text."""
    ids = tok(prompt + ANSWER_SEPARATOR + choice)["input_ids"]
    n_ctx = len(tok(prompt + ANSWER_SEPARATOR)["input_ids"])
    with torch.no_grad():
        logprobs = model(torch.tensor([ids])).logits[0].double().log_softmax(-1)  # (T, V)
    return sum(logprobs[t - 1, ids[t]].item() for t in range(n_ctx, len(ids)))


def test_batched_loglik_equals_unpadded_forward_passes():
    tok = word_tokenizer()
    model = random_llama(len(tok))
    rows = make_rows("obqa", 5) + make_rows("boolq", 4)  # 4- and 2-choice rows, prompts of 8..40 tokens
    records = score_loglik_rows(model, tok, rows, pad_id=tok.eos_token_id)
    for row, rec in zip(rows, records):
        ref = [_reference_loglik(model, tok, row["prompt"], c) for c in row["choices"]]
        assert rec["scores"] == pytest.approx(ref, abs=1e-4)
        assert rec["pred"] == max(range(len(ref)), key=ref.__getitem__)
        assert rec["scores_norm"] == pytest.approx([s / len(c) for s, c in zip(ref, row["choices"])], abs=1e-4)
        assert rec["correct"] == (rec["pred"] == row["label"])
    assert len({tuple(r["scores"]) for r in records}) == len(records)  # a non-degenerate model


def test_known_preferences_give_the_predicted_accuracy():
    tok = word_tokenizer()
    logits = preference_logits(tok)
    model = bigram_llama(len(tok), logits)
    logp = logits.double().log_softmax(-1)
    v = tok.convert_tokens_to_ids
    for task, expected_pred in (("boolq", 1), ("piqa", 1), ("obqa", 2)):
        rows = make_rows(task, 12)
        records = score_loglik_rows(model, tok, rows, pad_id=tok.eos_token_id)
        assert [r["pred"] for r in records] == [expected_pred] * len(rows)
        accuracy = summarize(records, [task], "loglik")["tasks"][task]["accuracy"]
        assert accuracy == sum(r["label"] == expected_pred for r in rows) / len(rows)
        # Scores are the bigram log-probs, token by token.
        for choice, score in zip(rows[0]["choices"], records[0]["scores"]):
            ids = [v(":")] + tok(choice, add_special_tokens=False)["input_ids"]
            assert score == pytest.approx(sum(logp[a, b].item() for a, b in zip(ids, ids[1:])), abs=1e-5)


def test_greedy_generation_of_known_model_and_unmatched_is_wrong():
    tok = word_tokenizer()
    model = bigram_llama(len(tok), preference_logits(tok))
    piqa, boolq = make_rows("piqa", 6), make_rows("boolq", 3)
    records = score_generate_rows(model, tok, piqa + boolq, pad_id=tok.eos_token_id, max_new_tokens=5)
    assert [r["output"] for r in records] == ["Choice B"] * 9  # stops at EOS
    assert [r["pred"] for r in records] == [1] * 6 + [None] * 3
    results = summarize(records[:6], ["piqa"], "generate")
    assert results["tasks"]["piqa"]["accuracy"] == sum(r["label"] == 1 for r in piqa) / 6
    assert not any(r["correct"] for r in records[6:])
    assert summarize(records[6:], ["boolq"], "generate")["tasks"]["boolq"]["unmatched"] == 3


def test_left_padded_batch_generation_equals_one_row_at_a_time():
    tok = word_tokenizer()
    model = random_llama(len(tok), seed=3)
    rows = make_rows("obqa", 4, seed=1)
    contexts = [encode_row(tok, r["prompt"], r["choices"]).context for r in rows]
    assert len({len(c) for c in contexts}) > 1  # padding is exercised
    batched = generate_outputs(model, tok, contexts, max_new_tokens=6, pad_id=tok.eos_token_id)
    single = [generate_outputs(model, tok, [c], max_new_tokens=6, pad_id=tok.eos_token_id)[0] for c in contexts]
    assert batched == single


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        ("Option C is right, not Option A", 2),  # earliest occurrence wins, not the lowest index
        ("the answer: Option B", 1),
        ("Option", None),  # a prefix of an answer is no answer
        ("", None),
    ],
)
def test_match_choice_takes_the_earliest_answer(output, expected):
    assert match_choice(output, TASK_CHOICES["obqa"]) == expected


def test_match_choice_tie_at_same_position_goes_to_longest():
    assert match_choice("Option10 wins", ["Option1", "Option10"]) == 1
    assert match_choice("true", ["false", "true"]) == 1


def test_plan_batches_covers_every_row_once_longest_first():
    rows = make_rows("obqa", 11)
    batches = plan_batches(rows, 4)
    assert sorted(i for b in batches for i in b) == list(range(11))
    assert [len(b) for b in batches] == [4, 4, 3]
    sizes = [len(rows[i]["prompt"]) for b in batches for i in b]
    assert sizes == sorted(sizes, reverse=True)


def test_table_average_matches_paper_avg_on_the_six_tasks():
    tasks = list(PAPER_RESULTS["FRoD s=0.02"]) + ["arc_easy"]
    records = [{"task": t, "correct": k < 3, "correct_norm": True} for t in tasks for k in range(4)]
    results = summarize(records, tasks, "loglik")
    assert results["average"] == pytest.approx(0.75) and results["average_norm"] == 1.0
    assert results["tasks"]["boolq"] == {
        "accuracy": 0.75,
        "n": 4,
        "correct": 3,
        "accuracy_norm": 1.0,
        "correct_norm": 4,
    }
    table = markdown_table({"loglik": results})
    assert "| **average** | 28 | 75.00 | 100.00 | — | — | — | — |" in table  # ARC has no paper number
    paper_row = next(line for line in table.splitlines() if line.startswith("| average (paper's tasks)"))
    assert "83.53" in paper_row and "84.58" in paper_row  # the paper's own FRoD and Full FT avg
    assert math.isclose(results["average_paper_tasks"], 0.75)


def test_data_given_as_the_builds_eval_folder_names_the_build(tmp_path):
    """``--data BUILD/eval`` said "no eval file BUILD/eval/eval/boolq.jsonl"; it names the build to pass instead."""
    from frod_ds.eval.run import EvalError, load_task_rows
    from frod_ds.prep.command import main as data_main

    mirror = Path(__file__).parents[1] / "fixtures" / "data_prep" / "mirror"
    build = tmp_path / "d"
    assert data_main(["build", "--source", str(mirror), "--tasks", "boolq", "--out", str(build)]) == 0
    assert set(load_task_rows(str(build), "boolq", 2)) == {"boolq"}
    with pytest.raises(EvalError) as e:
        load_task_rows(str(build / "eval"), "boolq", 2)
    want = f"--data {build / 'eval'} is a data build's eval/ folder; pass the data build itself, {build}"
    assert str(e.value) == want
