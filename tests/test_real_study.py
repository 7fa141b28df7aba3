"""bench/real_study.py end to end on CPU: a tiny tied-embedding Llama with a byte-level BPE tokenizer (no BOS,
like SmolLM2), rows in LLM-Adapters' format (separator ""), every method, three LRs each.

Checked against independent computations: the token counts every run saw equal the training rows'
tokenization counted here; the step-1 losses of all methods equal a plain transformers forward of the first
batch (LoRA and FRoD start at the base model); the answer-word loss is the loss of the answer words' tokens.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from bench import real_study

TEMPLATE = ("Below is an instruction that describes a task. Write a response that appropriately completes the "
            "request.  \n\n                ### Instruction:\n                {instruction}\n                \n"
            "                ### Response:\n                ")
WORDS = "red blue green cat dog bird sky sea tree stone rain sun moon fish road hill".split()


def _rows(task: str, n: int, rng: random.Random) -> list[dict]:
    words = ["true", "false"] if task == "boolq" else ["answer1", "answer2", "answer3", "answer4"]
    rows = []
    for i in range(n):
        label = rng.randrange(len(words))
        question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9)))
        instruction = f"Please answer the question: {question}?\n\nAnswer format: {'/'.join(words)}"
        choices = [f"the correct answer is {w}" for w in words]
        rows.append({"task": task, "id": f"{task}-{i}", "prompt": TEMPLATE.format(instruction=instruction),
                     "answer": choices[label], "choices": choices, "label": label, "separator": ""})
    return rows


def _tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=["<|im_end|>"],
                                                     initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<|im_end|>", pad_token="<|im_end|>")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("study")
    rng = random.Random(0)
    train = _rows("boolq", 28, rng) + _rows("arc_easy", 28, rng)
    rng.shuffle(train)
    test = {"boolq": _rows("boolq", 6, rng), "arc_easy": _rows("arc_easy", 6, rng)}
    data = root / "data"
    (data / "eval").mkdir(parents=True)
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train))
    for task, rows in test.items():
        (data / "eval" / f"{task}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = _tokenizer([r["prompt"] + c for r in train for c in r["choices"]])
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      bos_token_id=None)
    model_dir = root / "model"
    LlamaForCausalLM(cfg).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    out = root / "out"
    argv = ["--model", str(model_dir), "--data", str(data), "--out", str(out), "--device", "cpu",
            "--heldout", "8", "--batch-size", "8", "--curve-limit", "3", "--checkpoints", "2",
            "--max-new-tokens", "6", "--gen-batch", "4", "--eval-batch", "8",
            "--lrs", "frod=1e-3,1e-2,1e-1", "--lrs", "lora16=1e-3,1e-2,1e-1",
            "--lrs", "lora32=1e-3,1e-2,1e-1", "--lrs", "full=1e-4,1e-3,1e-2"]
    assert real_study.main(argv) == 0
    doc = json.loads((out / "real_study.json").read_text())
    return doc, train, tok, model_dir, out


def test_study_writes_every_method_sweep_choice_and_test_accuracy(setup):
    doc, _, _, _, out = setup
    assert doc["complete"] is True
    assert set(doc["methods"]) == {"frod", "lora16", "lora32", "full"}
    steps = doc["data"]["steps"]
    assert steps == (56 - 8) // 8
    for name, m in doc["methods"].items():
        assert [r["lr"] for r in m["sweep"]] == m["lrs"] and len(m["lrs"]) == 3
        for run in m["sweep"]:
            assert run["completed"] and run["steps"] == steps
            assert all(len(run["log"][k]) == steps for k in ("loss", "response_loss", "answer_loss", "lr"))
            assert [c["step"] for c in run["checkpoints"]] == doc["data"]["checkpoint_steps"]
        assert m["chosen"]["lr"] in m["lrs"]
        for protocol in ("loglik", "llm-adapters"):
            assert m["test"][protocol]["n"] == 12 and set(m["test"][protocol]["tasks"]) == {"boolq", "arc_easy"}
        ends = (min(m["lrs"]), max(m["lrs"]))
        assert m["chosen"]["at_sweep_end"] == (m["chosen"]["lr"] in ends)
        assert m["chosen"]["at_sweep_end"] == any(w.startswith(f"LR AT SWEEP END: {name} ") for w in doc["warnings"])
    assert doc["methods"]["lora16"]["lora_alpha"] == 32 and doc["methods"]["lora32"]["lora_alpha"] == 64
    assert doc["methods"]["frod"]["sweep"][0]["lr_s"] == pytest.approx(1e-4)
    assert set(doc["claim"]["vs"]) == {"lora16", "lora32"} and doc["claim"]["vs"]["lora16"]["available"]
    assert {"loss_vs_step.png", "accuracy_vs_step.png", "lr_sweep.png"} <= {p.name for p in out.iterdir()}


def test_every_run_sees_the_same_tokens_in_the_same_order(setup):
    doc, train, tok, _, _ = setup
    runs = [r for m in doc["methods"].values() for r in m["sweep"]]
    assert len({r["data_order_sha256"] for r in runs}) == 1
    held = set(doc["data"]["heldout_ids"])
    used = [r for r in train if r["id"] not in held]
    assert len(used) == doc["data"]["steps"] * 8  # every non-held-out row, once
    texts = [r["prompt"] + r["answer"] for r in used]
    expected_tokens = sum(len(ids) + 1 for ids in tok(texts)["input_ids"])  # + EOS
    # answer word: " true" / " answer3"; the byte-level pre-tokenizer never merges across the space
    expected_word = sum(len(tok(" " + r["answer"].rsplit(" ", 1)[1])["input_ids"]) for r in used)
    for r in runs:
        assert r["tokens"] == expected_tokens
        assert r["answer_tokens"] == expected_word


def test_step_one_losses_equal_a_plain_transformers_forward(setup):
    from transformers import AutoModelForCausalLM

    doc, train, tok, model_dir, _ = setup
    by_id = {r["id"]: r for r in train}
    rows = [by_id[i] for i in doc["data"]["first_batch_ids"]]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    nll_resp, nll_word = [], []
    with torch.no_grad():
        for r in rows:
            enc = tok(r["prompt"] + r["answer"], return_offsets_mapping=True)
            full = enc["input_ids"] + [tok.eos_token_id]
            word = tok(" " + r["answer"].rsplit(" ", 1)[1])["input_ids"]
            # the response starts at the first token holding a character of the answer
            n_ctx = next(i for i, (_, end) in enumerate(enc["offset_mapping"]) if end > len(r["prompt"]))
            logp = model(torch.tensor([full])).logits[0].log_softmax(-1)  # (T, V)
            nll = [-logp[t - 1, full[t]].item() for t in range(n_ctx, len(full))]
            nll_resp += nll
            nll_word += nll[-1 - len(word):-1]
    resp, word = sum(nll_resp) / len(nll_resp), sum(nll_word) / len(nll_word)
    for name, m in doc["methods"].items():
        for run in m["sweep"]:
            assert run["log"]["response_loss"][0] == pytest.approx(resp, rel=1e-4), name
            assert run["log"]["loss"][0] == pytest.approx(resp, rel=1e-4), name
            assert run["log"]["answer_loss"][0] == pytest.approx(word, rel=1e-4), name


def test_user_mistakes_exit_2_with_one_line_and_write_nothing(setup, tmp_path, capsys):
    _, _, _, model_dir, _ = setup
    data = Path(setup[4]).parent / "data"
    cases = [
        (["--lrs", "frod=1e-3,1e-2"], "equal sizes"),
        (["--lrs", "frod=abc"], "must be numbers"),
        (["--methods", "frod,dora"], "unknown method"),
        (["--heldout", "1000"], "--heldout 1000"),
    ]
    for extra, needle in cases:
        out = tmp_path / "o"
        rc = real_study.main(["--model", str(model_dir), "--data", str(data), "--out", str(out), "--device", "cpu",
                              *extra])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and err[0].startswith("error:") and needle in err[0], (extra, err)
        assert not out.exists()
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("x")
    assert real_study.main(["--model", str(model_dir), "--data", str(data), "--out", str(busy)]) == 2
    assert "not an empty directory" in capsys.readouterr().err
    assert [p.name for p in busy.iterdir()] == ["keep.txt"]


def test_a_run_past_the_budget_stops_and_leaves_partial_results(setup, tmp_path):
    _, _, _, model_dir, out = setup
    data = out.parent / "data"
    part = tmp_path / "part"
    argv = ["--model", str(model_dir), "--data", str(data), "--out", str(part), "--device", "cpu", "--heldout", "8",
            "--batch-size", "8", "--protocols", "loglik", "--no-base-eval",
            "--max-minutes", "1", "--eval-reserve-minutes", "0.999"]  # training must end 0.06 s after the start
    assert real_study.main(argv) == 0
    doc = json.loads((part / "real_study.json").read_text())
    assert doc["complete"] is False
    assert any(w.startswith("RUN STOPPED BY THE TIME BUDGET: frod") for w in doc["warnings"])
    frod = doc["methods"]["frod"]
    assert len(frod["sweep"]) == 1 and not frod["sweep"][0]["completed"] and "chosen" not in frod
    assert all(not m["sweep"] for k, m in doc["methods"].items() if k != "frod")
    assert doc["claim"]["vs"]["lora16"] == {"available": False}


def test_worker_processes_train_exactly_what_one_process_trains(setup, tmp_path):
    doc, _, _, model_dir, out = setup
    par = tmp_path / "par"
    argv = ["--model", str(model_dir), "--data", str(out.parent / "data"), "--out", str(par), "--device", "cpu",
            "--heldout", "8", "--batch-size", "8", "--curve-limit", "3", "--checkpoints", "2", "--eval-batch", "8",
            "--methods", "frod,lora16", "--lrs", "frod=1e-3,1e-2,1e-1", "--lrs", "lora16=1e-3,1e-2,1e-1",
            "--protocols", "loglik", "--no-base-eval", "--workers", "2"]
    assert real_study.main(argv) == 0
    got = json.loads((par / "real_study.json").read_text())
    assert got["config"]["workers_used"] == 2 and got["complete"] is True
    for name in ("frod", "lora16"):
        for a, b in zip(got["methods"][name]["sweep"], doc["methods"][name]["sweep"], strict=True):
            assert a["lr"] == b["lr"] and a["data_order_sha256"] == b["data_order_sha256"]
            for key in ("loss", "answer_loss"):
                assert a["log"][key] == pytest.approx(b["log"][key], rel=1e-5)
            assert a["heldout"]["accuracy"] == b["heldout"]["accuracy"]
        assert got["methods"][name]["chosen"]["lr"] == doc["methods"][name]["chosen"]["lr"]
        assert got["methods"][name]["test"]["loglik"]["correct_bits"] == doc["methods"][name]["test"]["loglik"]["correct_bits"]
