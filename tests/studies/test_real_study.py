"""studies/real_study.py end to end on CPU: a tiny tied-embedding Llama with a byte-level BPE tokenizer (no BOS,
like SmolLM2), rows in LLM-Adapters' format (separator ""), every method, three LRs each.

Checked against independent computations: the token counts every run saw equal the training rows'
tokenization counted here; the step-1 losses of all methods equal a plain transformers forward of the first
batch (LoRA and FRoD start at the base model); the answer-word loss is the loss of the answer words' tokens.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from studies import real_study

TEMPLATE = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the "
    "request.  \n\n                ### Instruction:\n                {instruction}\n                \n"
    "                ### Response:\n                "
)
WORDS = "red blue green cat dog bird sky sea tree stone rain sun moon fish road hill".split()


def _rows(task: str, n: int, rng: random.Random) -> list[dict]:
    words = ["true", "false"] if task == "boolq" else ["answer1", "answer2", "answer3", "answer4"]
    rows = []
    for i in range(n):
        label = rng.randrange(len(words))
        question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9)))
        instruction = f"Please answer the question: {question}?\n\nAnswer format: {'/'.join(words)}"
        choices = [f"the correct answer is {w}" for w in words]
        rows.append(
            {
                "task": task,
                "id": f"{task}-{i}",
                "prompt": TEMPLATE.format(instruction=instruction),
                "answer": choices[label],
                "choices": choices,
                "label": label,
                "separator": "",
            }
        )
    return rows


def _tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=400, special_tokens=["<|im_end|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
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
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    model_dir = root / "model"
    LlamaForCausalLM(cfg).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    out = root / "out"
    argv = [
        "--model",
        str(model_dir),
        "--data",
        str(data),
        "--out",
        str(out),
        "--device",
        "cpu",
        "--heldout",
        "8",
        "--batch-size",
        "8",
        "--curve-limit",
        "3",
        "--checkpoints",
        "2",
        "--gen-batch",
        "4",
        "--eval-batch",
        "8",
        "--lrs",
        "frod=1e-3,1e-2,1e-1",
        "--lrs",
        "lora16=1e-3,1e-2,1e-1",
        "--lrs",
        "lora32=1e-3,1e-2,1e-1",
        "--lrs",
        "full=1e-4,1e-3,1e-2",
        "--extend",
        "0",
    ]
    assert real_study.main(argv) == 0
    doc = json.loads((out / "real_study.json").read_text())
    return doc, train, tok, model_dir, out, argv


def test_study_writes_every_method_sweep_choice_and_test_accuracy(setup):
    doc, _, _, _, out, _ = setup
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
    doc, train, tok, _, _, _ = setup
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

    doc, train, tok, model_dir, _, _ = setup
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
            nll_word += nll[-1 - len(word) : -1]
    resp, word = sum(nll_resp) / len(nll_resp), sum(nll_word) / len(nll_word)
    for name, m in doc["methods"].items():
        for run in m["sweep"]:
            assert run["log"]["response_loss"][0] == pytest.approx(resp, rel=1e-4), name
            assert run["log"]["loss"][0] == pytest.approx(resp, rel=1e-4), name
            assert run["log"]["answer_loss"][0] == pytest.approx(word, rel=1e-4), name


def test_llm_adapters_results_are_the_library_scorers(setup):
    """The study's llm-adapters numbers are frod_ds.eval.predict.score_llm_adapters_rows's: the base model's
    recorded results (the curve slice) equal that scorer run here on the same rows, one row at a time."""
    from transformers import AutoModelForCausalLM

    from frod_ds.eval.predict import score_llm_adapters_rows
    from frod_ds.prep.rows import read_rows

    doc, _, tok, model_dir, out, _ = setup
    assert doc["data"]["generation_scorer"] == "frod_ds.eval.predict.score_llm_adapters_rows"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    got = doc["base"]["test"]["llm-adapters"]
    for task in ("boolq", "arc_easy"):
        rows = read_rows(out.parent / "data" / "eval" / f"{task}.jsonl", limit=3)  # --curve-limit 3
        records = [r for row in rows for r in score_llm_adapters_rows(model, tok, [row], tok.pad_token_id)]
        assert got["correct_bits"][task] == "".join(
            "1" if r["correct"] else "0" for r in sorted(records, key=lambda r: r["id"])
        )
        assert sorted(got["examples"][task]) == sorted(r["output"] for r in records)  # (in the study's batch order)


def test_study_generation_goes_through_the_library_scorer(setup, monkeypatch):
    """studies's llm-adapters evaluation calls the library's scorer for every row, and returns its records."""
    from transformers import AutoModelForCausalLM

    import frod_ds.eval.predict as fe
    from frod_ds.prep.rows import read_rows
    from studies.evaluate import llm_adapters_eval

    _, _, tok, model_dir, out, _ = setup
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = {"boolq": read_rows(out.parent / "data" / "eval" / "boolq.jsonl", limit=3)}
    real, seen = fe.score_llm_adapters_rows, []

    def spy(model, tokenizer, batch, pad_id):
        seen.extend(r["id"] for r in batch)
        return real(model, tokenizer, batch, pad_id)

    monkeypatch.setattr(fe, "score_llm_adapters_rows", spy)
    summary, records = llm_adapters_eval(model, tok, rows, tok.pad_token_id, 2, torch.device("cpu"))
    assert sorted(seen) == sorted(r["id"] for r in rows["boolq"])  # each row once, in the study's batch order
    by_id = lambda recs: sorted(recs, key=lambda r: r["id"])  # noqa: E731
    assert by_id(records) == by_id(real(model, tok, rows["boolq"], tok.pad_token_id))


def test_user_mistakes_exit_2_with_one_line_and_write_nothing(setup, tmp_path, capsys):
    _, _, _, model_dir, _, _ = setup
    data = Path(setup[4]).parent / "data"
    cases = [
        (["--lrs", "frod=1e-3,1e-2"], "equal sizes"),
        (["--lrs", "frod=abc"], "must be numbers"),
        (["--methods", "frod,dora"], "unknown method"),
        (["--heldout", "1000"], "--heldout 1000"),
        (["--gen-impl", "local"], "score_llm_adapters_rows only"),
        (["--max-new-tokens", "6"], "uses 32"),
    ]
    for extra, needle in cases:
        out = tmp_path / "o"
        rc = real_study.main(
            ["--model", str(model_dir), "--data", str(data), "--out", str(out), "--device", "cpu", *extra]
        )
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and err[0].startswith("error:") and needle in err[0], (extra, err)
        assert not out.exists()
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("x")
    assert real_study.main(["--model", str(model_dir), "--data", str(data), "--out", str(busy)]) == 2
    assert "neither empty nor a study directory" in capsys.readouterr().err
    assert [p.name for p in busy.iterdir()] == ["keep.txt"]


def _runs(out: Path) -> dict[tuple[str, float], dict]:
    return {(r["method"], r["lr"]): r for r in (json.loads(p.read_text()) for p in (out / "records").glob("*.json"))}


def _same_results(got: dict, want: dict) -> None:
    """Two results documents of the same study hold the same runs, choices and test results."""
    assert set(got["methods"]) == set(want["methods"])
    for name, m in want["methods"].items():
        g = got["methods"][name]
        assert [r["lr"] for r in g["sweep"]] == [r["lr"] for r in m["sweep"]], name
        for a, b in zip(g["sweep"], m["sweep"], strict=True):
            assert a["data_order_sha256"] == b["data_order_sha256"]
            for key in ("loss", "answer_loss"):
                assert a["log"][key] == pytest.approx(b["log"][key], rel=1e-5), (name, a["lr"])
            assert a["heldout"]["accuracy"] == b["heldout"]["accuracy"]
        assert g["chosen"]["lr"] == m["chosen"]["lr"]
        for protocol in m["test"]:
            assert g["test"][protocol]["correct_bits"] == m["test"][protocol]["correct_bits"], (name, protocol)


def test_a_command_past_its_budget_leaves_the_runs_to_the_next_one(setup, tmp_path):
    doc, _, _, _, _, argv = setup
    out = tmp_path / "cut"
    argv = [*argv[: argv.index("--out") + 1], str(out), *argv[argv.index("--out") + 2 :]]
    # training must start by 0.06 s after the command's start: no run fits, the base evals are recorded
    assert real_study.main([*argv, "--max-minutes", "1", "--eval-reserve-minutes", "0.999"]) == 0
    cut = json.loads((out / "real_study.json").read_text())
    assert cut["complete"] is False and not _runs(out) and "base" in cut
    assert all(not m["sweep"] and "chosen" not in m for m in cut["methods"].values())
    assert any(w.startswith("LEFT FOR A LATER COMMAND: frod lr=0.01, 0.001, 0.1") for w in cut["warnings"])
    assert any(w.startswith("SWEEP INCOMPLETE: full has 0 of 3 LRs") for w in cut["warnings"])
    assert cut["claim"]["vs"]["lora16"] == {"available": False}
    base = (out / "base.json").read_bytes()
    assert real_study.main(argv) == 0  # the same command again goes on in --out
    got = json.loads((out / "real_study.json").read_text())
    assert got["complete"] is True and len(got["invocations"]) == 2
    assert (out / "base.json").read_bytes() == base  # the base model is not evaluated again
    assert {r["invocation"] for r in _runs(out).values()} == {1}
    _same_results(got, doc)


def test_resume_trains_only_what_is_missing_and_scores_a_best_run_whose_results_were_lost(setup, tmp_path):
    doc, _, _, _, out, argv = setup
    part = tmp_path / "part"
    shutil.copytree(out, part)
    # a command cut off after some runs: two runs missing, the chosen lora16 run never scored
    for name, lr in (("frod", 0.1), ("full", 0.01)):
        (part / "records" / f"{name}_lr{lr!r}.json").unlink()
    lora16 = doc["methods"]["lora16"]["chosen"]["lr"]
    path = part / "records" / f"lora16_lr{lora16!r}.json"
    record = json.loads(path.read_text())
    del record["test"]
    path.write_text(json.dumps(record))
    before = _runs(part)
    src = tmp_path / "src"
    shutil.copytree(part, src)
    src_bytes = {p: p.read_bytes() for p in src.rglob("*") if p.is_file()}

    argv = [*argv[: argv.index("--out") + 1], str(part), *argv[argv.index("--out") + 2 :]]
    assert real_study.main(argv) == 0
    got = json.loads((part / "real_study.json").read_text())
    assert got["complete"] is True
    runs = _runs(part)
    trained_now = {k for k, r in runs.items() if r["invocation"] == 1}
    assert trained_now == {("frod", 0.1), ("full", 0.01), ("lora16", lora16)}
    for k in set(before) - trained_now:
        assert runs[k] == before[k]  # finished runs are not touched
    _same_results(got, doc)

    # --resume-from: the same from a copy, into a new directory; the copy is left as it was
    fresh = tmp_path / "fresh"
    argv = [*argv[: argv.index("--out") + 1], str(fresh), *argv[argv.index("--out") + 2 :], "--resume-from", str(src)]
    assert real_study.main(argv) == 0
    _same_results(json.loads((fresh / "real_study.json").read_text()), doc)
    assert {k for k, r in _runs(fresh).items() if r["invocation"] == 1} == trained_now
    assert {p: p.read_bytes() for p in src.rglob("*") if p.is_file()} == src_bytes


def test_a_study_directory_of_other_settings_is_refused_with_one_line(setup, tmp_path, capsys):
    _, _, _, _, out, argv = setup
    files = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    for extra, needle in (
        (["--batch-size", "4"], "batch_size: 8 there, 4 now"),
        (["--seed", "1", "--cutoff", "64"], "cutoff: 256 there, 64 now; seed: 0 there, 1 now"),
    ):
        assert real_study.main([*argv, *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: --out {out} holds a study with another configuration")
        assert needle in err[0], err
        other = tmp_path / "other"
        args = [
            *argv[: argv.index("--out") + 1],
            str(other),
            *argv[argv.index("--out") + 2 :],
            "--resume-from",
            str(out),
        ]
        assert real_study.main([*args, *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "error: --resume-from" in err[0] and needle in err[0], err
        assert not other.exists()
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == files
    assert real_study.main([*argv[:-2], "--resume-from", str(tmp_path)]) == 2
    assert "is not a study directory" in capsys.readouterr().err


def test_next_lr_steps_past_the_end_on_the_half_decade_grid():
    from studies.schedule import next_lr

    assert next_lr(1e-4, 3e-4) == 3e-5 and next_lr(1e-3, 3e-4) == 3e-3
    assert next_lr(3e-5, 1e-4) == 1e-5 and next_lr(3e-4, 1e-4) == 1e-3
    assert next_lr(1e-2, 3e-3) == 3e-2 and next_lr(1e-3, 3e-3) == 3e-4
    assert next_lr(3e-5, 2e-5) == 4.5e-5  # another grid: its own step, where the half-decade one is not past it


def _record(method: str, lr: float, acc: float, wall: float = 100.0):
    from studies.records import RunRecord

    return RunRecord(
        method=method,
        lr=lr,
        lr_s=None,
        trainable_params=1,
        steps=6,
        train_seconds=1.0,
        step_ms=1.0,
        wall_seconds=wall,
        workers=1,
        tokens=1,
        scored_tokens=1,
        answer_tokens=1,
        data_order_sha256="x",
        peak_mem_gb=None,
        heldout={"accuracy": acc, "answer_loss": 1 - acc},
        checkpoints=[],
        log={},
        invocation=0,
    )


def test_schedule_starts_only_what_fits_and_scores_a_best_run_once_its_method_can_train_no_more(tmp_path):
    from studies.config import StudyConfig, parse_lrs
    from studies.schedule import Schedule

    cfg = StudyConfig(
        model=".",
        data=".",
        out=".",
        methods=["frod", "full"],
        eval_reserve_minutes=1.0,
        lrs=parse_lrs(["frod=1e-3,3e-3,1e-2", "full=3e-5,1e-4,3e-4"], ["frod", "full"]),
    )
    warned = []
    plan = Schedule(
        cfg, {}, deadline=1000.0, train_deadline=940.0, tmp=tmp_path, log=lambda m: None, warn=warned.append
    )
    jobs = [plan.next_job(0.0) for _ in range(4)]  # nothing recorded: every run may start; centre out, by round
    assert [(j[0], j[1], j[2]) for j in jobs] == [
        ("train", "frod", 3e-3),
        ("train", "full", 1e-4),
        ("train", "frod", 1e-3),
        ("train", "full", 3e-5),
    ]
    for (m, lr), acc in {("frod", 3e-3): 0.5, ("frod", 1e-3): 0.4}.items():
        plan.runs[(m, lr)] = _record(m, lr, acc)
        plan.states[(m, lr)] = tmp_path / f"{m}{lr}"
        plan.in_flight.pop((m, lr))
    # frod 1e-2 is predicted to take 110 s: it fits at 800 s, so frod's best is not scored yet
    assert plan.next_job(800.0)[:3] == ("train", "frod", 1e-2)
    plan.in_flight.pop(("frod", 1e-2))
    # at 850 s it no longer fits: frod will train no more in this command, so its best is scored now
    assert plan.next_job(850.0) == ("eval", "frod", 3e-3, str(tmp_path / "frod0.003"))
    assert ("frod", 3e-3) in plan.in_flight and not plan.settled("frod") and warned == []
    # full still trains (1e-4, 3e-5 out): nothing else starts; an eval that cannot end before 1000 s never starts
    assert plan.next_job(850.0) is None
    plan.runs[("full", 1e-4)] = _record("full", 1e-4, 0.3)
    plan.states[("full", 1e-4)] = tmp_path / "full"
    plan.in_flight.pop(("full", 1e-4)), plan.in_flight.pop(("full", 3e-5))
    assert plan.next_job(975.0) is None and warned and warned[0].startswith("TEST EVAL DID NOT FIT: full lr=0.0001")


def test_a_choice_at_an_end_extends_the_sweep_now_and_in_a_later_command(setup, tmp_path):
    _, _, _, model_dir, out, _ = setup
    ext = tmp_path / "ext"
    # LRs far too small to move the model in 6 steps: the held-out answer loss falls with the LR, so the
    # highest LR is the best, and so is every extension past it
    argv = [
        "--model",
        str(model_dir),
        "--data",
        str(out.parent / "data"),
        "--out",
        str(ext),
        "--device",
        "cpu",
        "--heldout",
        "8",
        "--batch-size",
        "8",
        "--curve-limit",
        "3",
        "--checkpoints",
        "1",
        "--eval-batch",
        "8",
        "--methods",
        "full",
        "--lrs",
        "full=1e-5,2e-5,3e-5",
        "--protocols",
        "loglik",
        "--no-base-eval",
        "--select-by",
        "answer_loss",
    ]
    assert real_study.main([*argv, "--extend", "1"]) == 0
    doc = json.loads((ext / "real_study.json").read_text())
    full = doc["methods"]["full"]
    assert full["lrs"] == [1e-5, 2e-5, 3e-5, 4.5e-5] and full["extended"] == [4.5e-5]
    losses = [r["heldout"]["answer_loss"] for r in full["sweep"]]
    assert losses == sorted(losses, reverse=True)
    assert full["chosen"]["lr"] == 4.5e-5 and full["chosen"]["at_sweep_end"] and full["chosen"]["final"]
    assert any(
        w.startswith("LR AT SWEEP END: full chose lr=4.5e-05, the highest") and "raise --extend (now 1)" in w
        for w in doc["warnings"]
    )
    assert set(_runs(ext)) == {("full", lr) for lr in full["lrs"]} and _runs(ext)[("full", 4.5e-5)]["test"]
    assert real_study.main([*argv, "--extend", "2"]) == 0  # a later command may go one further
    doc = json.loads((ext / "real_study.json").read_text())
    full = doc["methods"]["full"]
    assert full["extended"] == [4.5e-5, 1e-4] and full["chosen"]["lr"] == 1e-4  # back on the 1/3 grid
    assert {r["invocation"] for r in _runs(ext).values()} == {0, 1}
    assert _runs(ext)[("full", 1e-4)]["test"] and _runs(ext)[("full", 1e-4)]["invocation"] == 1


def test_worker_processes_train_exactly_what_one_process_trains(setup, tmp_path):
    doc, _, _, model_dir, out, _ = setup
    par, lrs = tmp_path / "par", {}
    for name in ("frod", "lora16"):  # the one-process sweep's pick and one other lr: four runs over two workers
        pick = doc["methods"][name]["chosen"]["lr"]
        other = next(b["lr"] for b in doc["methods"][name]["sweep"] if b["lr"] != pick)
        lrs[name] = sorted({pick, other})
    argv = [
        "--model",
        str(model_dir),
        "--data",
        str(out.parent / "data"),
        "--out",
        str(par),
        "--device",
        "cpu",
        "--heldout",
        "8",
        "--batch-size",
        "8",
        "--curve-limit",
        "3",
        "--checkpoints",
        "2",
        "--eval-batch",
        "8",
        "--methods",
        "frod,lora16",
        "--lrs",
        "frod=" + ",".join(map(repr, lrs["frod"])),
        "--lrs",
        "lora16=" + ",".join(map(repr, lrs["lora16"])),
        "--protocols",
        "loglik",
        "--no-base-eval",
        "--workers",
        "2",
        "--extend",
        "0",
    ]
    assert real_study.main(argv) == 0
    got = json.loads((par / "real_study.json").read_text())
    assert got["config"]["workers_used"] == 2 and got["complete"] is True
    for name in ("frod", "lora16"):
        one = {b["lr"]: b for b in doc["methods"][name]["sweep"]}
        assert [a["lr"] for a in got["methods"][name]["sweep"]] == lrs[name]
        for a in got["methods"][name]["sweep"]:
            b = one[a["lr"]]
            assert a["data_order_sha256"] == b["data_order_sha256"]
            for key in ("loss", "answer_loss"):
                assert a["log"][key] == pytest.approx(b["log"][key], rel=1e-5)
            assert a["heldout"]["accuracy"] == b["heldout"]["accuracy"]
        assert got["methods"][name]["chosen"]["lr"] == doc["methods"][name]["chosen"]["lr"]
        assert (
            got["methods"][name]["test"]["loglik"]["correct_bits"]
            == doc["methods"][name]["test"]["loglik"]["correct_bits"]
        )


def test_a_method_not_yet_run_is_predicted_from_its_kind_before_any_other_method(tmp_path):
    """A FRoD ratio run is as fast as FRoD: a slow stock PEFT FRoD run in the directory must not keep it from
    starting (it once left every variant for a later command)."""
    from studies.config import StudyConfig, parse_lrs
    from studies.schedule import Schedule

    methods = ["frod", "peftfrod", "frod_ratio3", "frod_fp32"]
    cfg = StudyConfig(model=".", data=".", out=".", methods=methods, lrs=parse_lrs([], methods))
    plan = Schedule(cfg, {}, deadline=1000.0, train_deadline=940.0, tmp=tmp_path, log=print, warn=print)
    plan.runs[("frod", 3e-3)] = _record("frod", 3e-3, 0.5, wall=50.0)
    plan.runs[("peftfrod", 1e-3)] = _record("peftfrod", 1e-3, 0.5, wall=600.0)
    assert plan.predicted_wall("frod_ratio3") == pytest.approx(55.0)  # FRoD's kind and precision
    assert plan.predicted_wall("frod_fp32") == pytest.approx(110.0)  # another precision: twice its kind's
    assert plan.predicted_wall("peftfrod") == pytest.approx(660.0)  # its own runs first
    assert plan.predicted_wall("lora16") == pytest.approx(660.0)  # nothing of its kind: the slowest of all
    assert plan.startable(("frod_ratio3", 3e-3), 860.0) and not plan.startable(("frod_fp32", 3e-3), 860.0)


def test_accuracy_intervals_over_seeds_are_cut_to_what_an_accuracy_can_be():
    from studies.intervals import mean_interval, t_quantile

    values = [0.865, 0.859, 0.615]
    wide = mean_interval(values, (0.0, 1.0))
    mean = sum(values) / 3
    sd = (sum((v - mean) ** 2 for v in values) / 2) ** 0.5
    assert wide["mean"] == pytest.approx(mean) and wide["hi"] == 1.0  # mean + t·sd/√3 is past 1
    assert wide["lo"] == pytest.approx(mean - t_quantile(0.975, 2) * sd / 3**0.5)
    assert mean_interval([0.865, 0.859, 0.615])["hi"] > 1.0  # uncut without bounds
    assert t_quantile(0.975, 2) == pytest.approx(4.302653, rel=1e-5)  # the tabulated value


def test_the_cross_check_pairs_stock_peft_frod_with_frod_of_its_own_precision():
    from studies.learn_report import _cross_check

    def run(lr, losses, val):
        return {"lr": lr, "log": {"loss": losses}, "heldout": {"answer_loss": val}}

    def method(*runs):
        return {"sweep": list(runs), "chosen": {"index": 0, "lr": runs[0]["lr"]}}

    seed0 = {
        "config": {"peft_frod_fp32": True},
        "methods": {
            "frod": method(run(3e-3, [2.0, 1.0], 0.5)),
            "peftfrod_inj": method(run(3e-3, [2.0, 1.5], 0.7)),
        },
    }
    bf16 = _cross_check(seed0, 2)
    assert bf16["twin"] == "frod" and not bf16["same_precision"]
    assert bf16["max_rel_loss_difference"] == pytest.approx(0.5)
    seed0["methods"]["frod_fp32"] = method(run(3e-3, [2.0, 1.2], 0.6))
    fp32 = _cross_check(seed0, 2)
    assert fp32["twin"] == "frod_fp32" and fp32["same_precision"]
    assert fp32["max_rel_loss_difference"] == pytest.approx(0.25)
    assert fp32["validation_answer_loss"] == {"frod": 0.6, "peftfrod_inj": 0.7}
    assert fp32["steps_within_tolerance"] == 1  # step 0 agrees, step 1 parts


def test_the_cross_check_says_how_long_the_runs_agree_before_rounding_parts_them():
    from studies.learn_report import _agreement, _cross_check

    a = [2.0 * 0.97**i for i in range(30)]
    b = [x * (1 + 1e-7 * 3**i) for i, x in enumerate(a)]  # rounding that training amplifies step by step
    seed0 = {
        "config": {"peft_frod_fp32": False},
        "methods": {
            "frod": {"sweep": [{"lr": 1e-3, "log": {"loss": a}, "heldout": {"answer_loss": 0.4}}]},
            "peftfrod_inj": {
                "sweep": [{"lr": 1e-3, "log": {"loss": b}, "heldout": {"answer_loss": 0.5}}],
                "chosen": {"index": 0, "lr": 1e-3},
            },
        },
    }
    c = _cross_check(seed0, 30)
    first = next(i for i in range(30) if abs(b[i] - a[i]) / a[i] > 1e-4)  # 3**i > 1000: step 7
    assert c["steps_within_tolerance"] == first == 7
    assert c["max_rel_loss_difference_first_10"] == pytest.approx(1e-7 * 3**9, rel=1e-6)
    assert "within 0.0001 for the first 7 steps, then part" in _agreement(c)
    c = _cross_check(
        {
            **seed0,
            "methods": {
                **seed0["methods"],
                "frod": {"sweep": [{**seed0["methods"]["frod"]["sweep"][0], "log": {"loss": b}}]},
            },
        },
        30,
    )
    assert c["steps_within_tolerance"] == 30 and "over all 30" in _agreement(c)
