"""Recipe tier of the evaluation: ``launch/eval.py`` end to end on tiny saved models, one process and
two gloo ranks, and its errors on bad input (one ``error:`` line, exit status 2, no output left)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launch.eval import main
from tests.support import pace
from tests.support.eval_fixtures import (
    LLM_ADAPTERS_VOCAB,
    bigram_llama,
    llm_adapters_preference_logits,
    make_llm_adapters_rows,
    make_rows,
    preference_logits,
    random_llama,
    save_model,
    word_tokenizer,
    write_eval_dir,
    write_jsonl,
)
from tests.support.helpers_ckpt import make_adapter
from tests.support.leftovers import clean_env

REPO = Path(__file__).resolve().parents[2]
TASKS = ("boolq", "piqa", "obqa")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """Saved bigram ("known preferences") and random tiny LLaMAs, and a data dir with three tasks."""
    root = tmp_path_factory.mktemp("eval")
    tok = word_tokenizer()
    rows = {"boolq": make_rows("boolq", 9), "piqa": make_rows("piqa", 7), "obqa": make_rows("obqa", 10)}
    return {
        "known": save_model(root / "known", bigram_llama(len(tok), preference_logits(tok)), tok),
        "random": save_model(root / "random", random_llama(len(tok), seed=1), tok),
        "data": write_eval_dir(root / "data", rows),
        "rows": rows,
    }


@pytest.fixture(scope="module")
def la_assets(tmp_path_factory):
    """A bigram LLaMA with a known LLM-Adapters answer (see llm_adapters_preference_logits) and rows in
    LLM-Adapters' format for three tasks."""
    root = tmp_path_factory.mktemp("eval-la")
    tok = word_tokenizer(LLM_ADAPTERS_VOCAB)
    rows = {
        "boolq": make_llm_adapters_rows("boolq", 6),
        "piqa": make_llm_adapters_rows("piqa", 4),
        "obqa": make_llm_adapters_rows("obqa", 7),
    }
    return {
        "known": save_model(root / "known", bigram_llama(len(tok), llm_adapters_preference_logits(tok)), tok),
        "data": write_eval_dir(root / "data", rows),
        "rows": rows,
    }


@pytest.fixture(scope="module")
def adapter(assets, tmp_path_factory):
    """A FRoD adapter checkpoint over the random model (factor store by the HJD stage, σ and S moved off
    their initial values) and its merged export as a plain HF model dir."""
    from transformers import LlamaForCausalLM

    from frod_ds.model.adapter import merged_state_dict

    root = tmp_path_factory.mktemp("adapter")
    ckpt, store, model = make_adapter(assets["random"], root)
    merged = LlamaForCausalLM(model.config)
    merged.load_state_dict(merged_state_dict(model))
    save_model(root / "merged", merged, word_tokenizer())
    return {"checkpoint": ckpt, "store": store, "merged": root / "merged"}


def _read(out: Path) -> tuple[dict, list[dict]]:
    results = json.loads((out / "results.json").read_text())
    preds = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    return results, preds


def test_known_preferences_give_predicted_accuracy_end_to_end(assets, tmp_path, capsys):
    out = tmp_path / "eval"
    argv = [
        "--model",
        str(assets["known"]),
        "--data",
        str(assets["data"]),
        "--tasks",
        ",".join(TASKS),
        "--output",
        str(out),
        "--batch-size",
        "3",
    ]
    assert main(argv) == 0
    results, preds = _read(out)
    # The model always answers false / Choice B / Option C (see preference_logits).
    expected = {
        task: sum(r["label"] == pick for r in assets["rows"][task]) / len(assets["rows"][task])
        for task, pick in (("boolq", 1), ("piqa", 1), ("obqa", 2))
    }
    assert {t: e["accuracy"] for t, e in results["tasks"].items()} == expected
    assert {t: e["n"] for t, e in results["tasks"].items()} == {t: len(assets["rows"][t]) for t in TASKS}
    assert results["average"] == pytest.approx(sum(expected.values()) / 3)
    assert [p["id"] for p in preds] == [r["id"] for t in TASKS for r in assets["rows"][t]]  # file order
    table = (out / "results.md").read_text()
    assert table in capsys.readouterr().out
    assert f"| BoolQ | 9 | {100 * expected['boolq']:.2f} |" in table and "| 87.74 |" in table
    # A second run replaces the files in place and leaves no temporary directory behind.
    assert main(argv + ["--limit", "2"]) == 0
    assert _read(out)[0]["n"] == 6
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval"]


def test_generate_mode_takes_first_answer_string_and_unmatched_is_wrong(assets, tmp_path):
    out = tmp_path / "gen"
    assert (
        main(
            [
                "--model",
                str(assets["known"]),
                "--data",
                str(assets["data"]),
                "--tasks",
                "piqa,boolq",
                "--output",
                str(out),
                "--mode",
                "generate",
                "--max-new-tokens",
                "4",
                "--limit",
                "5",
            ]
        )
        == 0
    )
    results, preds = _read(out)
    piqa = assets["rows"]["piqa"][:5]
    assert results["tasks"]["piqa"]["accuracy"] == sum(r["label"] == 1 for r in piqa) / 5
    assert results["tasks"]["boolq"] == {"accuracy": 0.0, "n": 5, "correct": 0, "unmatched": 5}
    assert {p["output"] for p in preds} == {"Choice B"}


def _plain_beam_search(model_dir: Path, rows: list[dict]) -> list[str]:
    """Independent computation: stock transformers beam search (4 beams, 32 new tokens) one unpadded row at a
    time, the whole sequence decoded, text after the prompt's "### Response:" as LLM-Adapters takes it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = AutoModelForCausalLM.from_pretrained(model_dir).eval(), AutoTokenizer.from_pretrained(model_dir)
    outputs = []
    for row in rows:
        ids = torch.tensor([tok(row["prompt"])["input_ids"]])
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                num_beams=4,
                max_new_tokens=32,
                do_sample=False,
                pad_token_id=tok.eos_token_id,
                eos_token_id=tok.eos_token_id,
            )
        outputs.append(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip())
    return outputs


def test_llm_adapters_mode_beside_loglik_end_to_end(la_assets, tmp_path, capsys):
    out = tmp_path / "eval"
    argv = [
        "--model",
        str(la_assets["known"]),
        "--data",
        str(la_assets["data"]),
        "--tasks",
        ",".join(TASKS),
        "--batch-size",
        "3",
    ]
    assert main([*argv, "--mode", "loglik,llm-adapters", "--output", str(out)]) == 0
    results, preds = _read(out)
    rows = la_assets["rows"]
    # The model writes "false, answer2 answer1": BoolQ reads false, OBQA answer2 (first match), PIQA nothing.
    la = results["modes"]["llm-adapters"]["tasks"]
    for task, pick in (("boolq", 1), ("obqa", 1)):
        assert la[task] == {
            "accuracy": sum(r["label"] == pick for r in rows[task]) / len(rows[task]),
            "n": len(rows[task]),
            "correct": sum(r["label"] == pick for r in rows[task]),
            "unmatched": 0,
        }
    assert la["piqa"] == {"accuracy": 0.0, "n": 4, "correct": 0, "unmatched": 4}
    # Every row's searched text and word against stock beam search one row at a time, regex by hand.
    la_preds = [p for p in preds if p["mode"] == "llm-adapters"]
    all_rows = [r for t in TASKS for r in rows[t]]
    assert [p["id"] for p in la_preds] == [r["id"] for r in all_rows]
    patterns = {"boolq": "true|false", "piqa": "solution1|solution2", "obqa": "answer1|answer2|answer3|answer4|answer5"}
    for pred, row, output in zip(la_preds, all_rows, _plain_beam_search(la_assets["known"], all_rows)):
        assert output == "false, answer2 answer1" and pred["output"] == output
        found = re.findall(patterns[row["task"]], output)
        assert pred["prediction"] == (found[0] if found else None)
    # Loglik in the same run gives what a loglik-only run gives; the top level repeats the first mode.
    assert main([*argv, "--output", str(tmp_path / "loglik")]) == 0
    assert results["modes"]["loglik"] == _read(tmp_path / "loglik")[0]["modes"]["loglik"]
    assert results["tasks"] == results["modes"]["loglik"]["tasks"] and results["mode"] == "loglik"
    assert [p["mode"] for p in preds] == ["loglik"] * len(all_rows) + ["llm-adapters"] * len(all_rows)
    table = (out / "results.md").read_text()
    assert table in capsys.readouterr().out
    assert "| task | n | loglik | loglik norm | llm-adapters | llm-adapters unmatched |" in table
    piqa = results["modes"]["loglik"]["tasks"]["piqa"]
    assert f"| PIQA | 4 | {100 * piqa['accuracy']:.2f} | {100 * piqa['accuracy_norm']:.2f} | 0.00 | 4 |" in table
    assert results["config"]["llm_adapters"] == {"num_beams": 4, "max_new_tokens": 32}


def _torchrun(args: list[str], nproc: int) -> subprocess.CompletedProcess:
    env = clean_env()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(REPO / "launch" / "eval.py"),
        *args,
    ]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=pace.scaled(300))


@pytest.mark.slow
def test_two_ranks_equal_one_rank(assets, tmp_path):
    args = [
        "--model",
        str(assets["random"]),
        "--data",
        str(assets["data"]),
        "--tasks",
        ",".join(TASKS),
        "--batch-size",
        "2",
        "--mode",
        "loglik,llm-adapters",
    ]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks run (OMP_NUM_THREADS=1): same kernels, same bits
    try:
        assert main(args + ["--output", str(tmp_path / "one")]) == 0
    finally:
        torch.set_num_threads(threads)
    run = _torchrun(args + ["--output", str(tmp_path / "two")], nproc=2)
    assert run.returncode == 0, run.stderr[-3000:]
    one, two = _read(tmp_path / "one"), _read(tmp_path / "two")
    assert two[0]["config"]["world_size"] == 2
    assert {k: v for k, v in one[0].items() if k != "config"} == {k: v for k, v in two[0].items() if k != "config"}
    assert one[1] == two[1]  # every row's prediction and score, bit for bit
    assert (
        len({p["pred"] for p in one[1] if p["mode"] == "loglik"}) > 1
    )  # the random model does not answer one index everywhere
    assert len({p["output"] for p in one[1] if p["mode"] == "llm-adapters"}) > 1  # nor generate one text everywhere


def test_adapter_checkpoint_scores_like_its_merged_export(assets, adapter, tmp_path):
    args = ["--data", str(assets["data"]), "--tasks", "piqa,obqa", "--dtype", "float32"]  # bf16 on a GPU rounds apart
    assert main(["--checkpoint", str(adapter["checkpoint"]), *args, "--output", str(tmp_path / "ckpt")]) == 0
    assert main(["--model", str(adapter["merged"]), *args, "--output", str(tmp_path / "merged")]) == 0
    assert main(["--model", str(assets["random"]), *args, "--output", str(tmp_path / "base")]) == 0
    ckpt, merged, base = (_read(tmp_path / name)[1] for name in ("ckpt", "merged", "base"))
    assert [p["pred"] for p in ckpt] == [p["pred"] for p in merged]
    for a, b, c in zip(ckpt, merged, base):
        assert a["scores"] == pytest.approx(b["scores"], abs=1e-3)
    assert max(abs(x - y) for a, c in zip(ckpt, base) for x, y in zip(a["scores"], c["scores"])) > 0.1  # σ, S applied


def test_adapter_with_missing_factor_store_is_a_clear_error_and_overridable(assets, adapter, tmp_path, capsys):
    moved = tmp_path / "adapter-final"
    shutil.copytree(adapter["checkpoint"], moved)
    config = json.loads((moved / "adapter_config.json").read_text())
    (moved / "adapter_config.json").write_text(json.dumps({**config, "factor_store": str(tmp_path / "gone")}))
    args = ["--checkpoint", str(moved), "--data", str(assets["data"]), "--tasks", "piqa"]
    _fails([*args, "--output", str(tmp_path / "out")], capsys, "pass --factor-store")
    assert not (tmp_path / "out").exists()
    assert main([*args, "--factor-store", str(adapter["store"]), "--output", str(tmp_path / "out")]) == 0


def _fails(argv: list[str], capsys, match: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("error: ") and match in err[-1], err


def test_a_closed_stdout_is_not_a_failed_write_of_the_results(assets, tmp_path, monkeypatch):
    """``frod eval … | true``: the results are written before the table is printed, and the closed stdout reaches
    the command's end as a broken pipe (stopped quietly there), not as "cannot write results" about the folder."""
    import io

    class Closed(io.StringIO):
        def write(self, text: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

    out = tmp_path / "eval"
    monkeypatch.setattr("sys.stdout", Closed())
    with pytest.raises(BrokenPipeError):
        main(["--model", str(assets["known"]), "--data", str(assets["data"]), "--tasks", "piqa", "--output", str(out)])
    monkeypatch.undo()
    assert json.loads((out / "results.json").read_text())["tasks"]["piqa"]["n"] == len(assets["rows"]["piqa"])


def test_a_special_token_the_vocabulary_lacks_is_named_with_its_file(assets, tmp_path, capsys):
    """An ``unk_token`` in tokenizer_config.json that the vocabulary lacks: transformers adds it as an id one past
    the embedding, and the line names that value and file (the tokenizer is the model's own, not a foreign one)."""
    model = tmp_path / "model"
    shutil.copytree(assets["known"], model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "unk_token": "<nosuch>"}))
    out = tmp_path / "out"
    argv = ["--model", str(model), "--data", str(assets["data"]), "--tasks", "piqa", "--output", str(out)]
    _fails(argv, capsys, f"{model / 'tokenizer_config.json'} gives unk_token '<nosuch>', a token the vocabulary lacks")
    assert not out.exists()


def test_missing_task_file_is_a_clear_error(assets, tmp_path, capsys):
    out = tmp_path / "out"
    _fails(
        ["--model", str(assets["known"]), "--data", str(assets["data"]), "--tasks", "piqa,siqa", "--output", str(out)],
        capsys,
        "eval/siqa.jsonl",
    )
    assert not out.exists()


def test_a_tokenizer_with_ids_past_the_models_embedding_is_refused(assets, tmp_path, capsys):
    """A model whose embedding is smaller than the tokenizer's vocabulary (its own, or one given by --tokenizer):
    the ids the rows tokenize to are checked before scoring, one line instead of an IndexError mid-run."""
    tok = word_tokenizer()
    small = save_model(tmp_path / "small", random_llama(8, seed=1), tok)
    top = max(max(ids, default=-1) for ids in tok([r["prompt"] for r in assets["rows"]["piqa"]])["input_ids"])
    assert top >= 8
    for extra in ([], ["--tokenizer", str(assets["known"])]):
        out = tmp_path / f"out{len(extra)}"
        argv = ["--model", str(small), "--data", str(assets["data"]), "--tasks", "piqa", "--output", str(out), *extra]
        _fails(argv, capsys, "but the model's embedding has 8 rows; use the tokenizer the model was trained with")
        assert not out.exists()


def test_a_model_with_nan_weights_or_only_pickled_weights_is_refused(assets, tmp_path, capsys):
    """--model with NaN in lm_head (every score a tie of NaN logits) or with PyTorch .bin weights only (torch.load of
    a foreign pickle): one line each, nothing written, the pickle never loaded."""
    from safetensors.torch import load_file, save_file

    nan = tmp_path / "nan"
    shutil.copytree(assets["known"], nan)
    for shard in nan.glob("*.safetensors"):
        tensors = load_file(shard)
        if "lm_head.weight" in tensors:
            tensors["lm_head.weight"][0, 0] = float("nan")
            save_file(tensors, shard, metadata={"format": "pt"})
    out = tmp_path / "out"
    argv = ["--model", str(nan), "--data", str(assets["data"]), "--tasks", "piqa", "--output", str(out)]
    _fails(argv, capsys, "lm_head.weight holds 1 non-finite value(s) (NaN/inf)")
    pickled = tmp_path / "pickled"
    shutil.copytree(assets["known"], pickled)
    for shard in pickled.glob("*.safetensors"):
        shard.unlink()
    (pickled / "pytorch_model.bin").write_bytes(b"not to be unpickled")
    argv[1] = str(pickled)
    _fails(argv, capsys, "holds PyTorch .bin weights only; frod-ds reads safetensors checkpoints")
    assert not out.exists()


def test_rows_without_choices_are_a_clear_error(assets, tmp_path, capsys):
    rows = make_rows("piqa", 3)
    del rows[1]["choices"]
    (tmp_path / "data" / "eval").mkdir(parents=True)
    write_jsonl(tmp_path / "data" / "eval" / "piqa.jsonl", rows)
    out = tmp_path / "out"
    _fails(
        ["--model", str(assets["known"]), "--data", str(tmp_path / "data"), "--tasks", "piqa", "--output", str(out)],
        capsys,
        "piqa.jsonl line 2: missing field 'choices'",
    )
    assert not out.exists()


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda r: r.update(choices=[r["answer"]], label=0), "line 2: fewer than two choices"),
        (lambda r: r.update(choices=[r["answer"], r["answer"]], label=0), "line 2: duplicate choices"),
        (lambda r: r.update(prompt=r["prompt"] + "\ud800"), "line 2: field 'prompt' holds a lone surrogate"),
        (lambda r: r.update(id="piqa-0"), "rows 1 and 2 have the same id 'piqa-0': it would be scored twice"),
    ],
)
def test_rows_that_score_a_free_point_or_cannot_be_tokenized_are_refused(assets, tmp_path, capsys, edit, needle):
    """One choice, or two the same: the arg-max over the choices is the label whatever the model says (a free point);
    a lone surrogate stops the tokenizer; a repeated id is scored twice. The loader names the file and line, before
    the model is loaded."""
    rows = make_rows("piqa", 3)
    edit(rows[1])
    (tmp_path / "data" / "eval").mkdir(parents=True)
    write_jsonl(tmp_path / "data" / "eval" / "piqa.jsonl", rows)
    out = tmp_path / "out"
    _fails(
        ["--model", str(assets["known"]), "--data", str(tmp_path / "data"), "--tasks", "piqa", "--output", str(out)],
        capsys,
        f"piqa.jsonl {needle}",
    )
    assert not out.exists()


def test_unknown_task_and_conflicting_model_flags_are_clear_errors(assets, tmp_path, capsys):
    base = ["--data", str(assets["data"]), "--output", str(tmp_path / "out")]
    _fails(["--model", str(assets["known"]), "--tasks", "piqa,mmlu", *base], capsys, "unknown task 'mmlu'")
    _fails(["--model", str(assets["known"]), "--checkpoint", str(assets["known"]), *base], capsys, "exactly one of")
    _fails(["--checkpoint", str(assets["known"]), "--tasks", "piqa", *base], capsys, "not a FRoD adapter checkpoint")
    # a file given as the model is named as such, before the data (which lacks every default task) is read
    weights = str(assets["known"] / "model.safetensors")
    missing = ["--data", str(tmp_path), "--output", str(tmp_path / "out")]
    _fails(["--checkpoint", weights, *missing], capsys, f"--checkpoint {weights} is a file, not a directory")
    _fails(["--model", weights, *missing], capsys, f"--model {weights} is a file, not a directory")
    assert not (tmp_path / "out").exists()


def test_bad_modes_and_rows_the_mode_cannot_score_are_one_line_errors(assets, tmp_path, capsys):
    base = [
        "--model",
        str(assets["known"]),
        "--data",
        str(assets["data"]),
        "--tasks",
        "boolq",
        "--output",
        str(tmp_path / "out"),
    ]
    for mode, match in (
        ("loglik,beam", "unknown --mode 'beam'"),
        ("loglik,loglik", "names a mode twice"),
    ):
        assert main([*base, "--mode", mode]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and match in err[0], err
    with pytest.raises(SystemExit) as empty:  # a usage error, as every option's empty value is
        main([*base, "--mode", ""])
    err = capsys.readouterr().err.strip().splitlines()
    assert empty.value.code == 2 and len(err) == 1 and "argument --mode: the value is empty" in err[0], err
    rows = make_rows("boolq", 3)
    rows[2] = {**rows[2], "choices": ["true", "false", "maybe"]}
    (tmp_path / "data" / "eval").mkdir(parents=True)
    write_jsonl(tmp_path / "data" / "eval" / "boolq.jsonl", rows)
    base[base.index("--data") + 1] = str(tmp_path / "data")
    _fails([*base, "--mode", "loglik,llm-adapters"], capsys, "row 'boolq-2' has 3 choices but boolq has 2 LLM-Adapters")
    assert not (tmp_path / "out").exists()


def test_script_exits_2_with_one_error_line(assets, tmp_path):
    env = clean_env()
    (tmp_path / "not-a-build").mkdir()
    from tests.support import ranks

    args = ["--model", str(assets["known"]), "--data", str(tmp_path / "not-a-build"), "--output", str(tmp_path / "out")]
    run = ranks.run(0, [str(REPO / "launch" / "eval.py"), *args], env, REPO, timeout=120)  # as `python launch/eval.py`
    assert run.returncode == 2
    assert run.stderr.strip().startswith("error: no eval file") and len(run.stderr.strip().splitlines()) == 1


def test_adapter_with_a_store_rebuilt_with_another_pi_is_refused(assets, adapter, tmp_path, capsys):
    """Same base model (the fingerprint matches), other π: another V, so the adapter's σ and S mean nothing there."""
    from frod_ds.hjd.stage import StageConfig, run_stage

    other = tmp_path / "store-pi"
    run_stage(StageConfig(model=str(assets["random"]), out=other, pi=1e-2, device="cpu", fsync=False))
    args = [
        "--checkpoint",
        str(adapter["checkpoint"]),
        "--factor-store",
        str(other),
        "--data",
        str(assets["data"]),
        "--tasks",
        "piqa",
        "--output",
        str(tmp_path / "out"),
    ]
    _fails(args, capsys, "was trained on another factor store")
    assert not (tmp_path / "out").exists()


def test_output_into_a_directory_eval_did_not_write_is_refused(assets, adapter, tmp_path, capsys):
    """Results go into --output: only an empty directory or an earlier eval's (marked, or an older eval's
    results.json) takes them; a user's directory or another command's output (the adapter being scored) is
    refused before anything runs, and stays as it was."""
    import shutil

    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "results.json").with_name("predictions.jsonl").write_text("mine\n")
    common = ["--data", str(assets["data"]), "--tasks", "boolq", "--limit", "2"]
    _fails(
        ["--model", str(assets["known"]), *common, "--output", str(foreign)],
        capsys,
        f"--output {foreign} exists and was not written by frod-ds",
    )
    assert [p.name for p in foreign.iterdir()] == ["predictions.jsonl"]
    for mine in ('{"tasks": {}}', '{"my_experiment": 1}'):  # a user's results.json is no earlier eval's
        (foreign / "predictions.jsonl").unlink(missing_ok=True)
        (foreign / "results.json").write_text(mine)
        _fails(
            ["--model", str(assets["known"]), *common, "--output", str(foreign)],
            capsys,
            f"--output {foreign} exists and was not written by frod-ds",
        )
        assert (foreign / "results.json").read_text() == mine and len(list(foreign.iterdir())) == 1
    scored = tmp_path / "adapter"
    shutil.copytree(adapter["checkpoint"], scored)
    before = sorted(p.name for p in scored.iterdir())
    said = "(a trained adapter) is --checkpoint"
    _fails(["--checkpoint", str(scored), *common, "--output", str(scored)], capsys, said)
    assert sorted(p.name for p in scored.iterdir()) == before
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["--model", str(assets["known"]), *common, "--output", str(empty)]) == 0
    assert (empty / "results.json").is_file()
    assert main(["--model", str(assets["known"]), *common, "--output", str(empty)]) == 0  # its own: again
    # other results each time (another --limit): every run takes the last one's files as its own
    for limit in ("1", "2", "1"):
        argv = ["--model", str(assets["known"]), *common[:-1], limit, "--output", str(empty)]
        assert main(argv) == 0
        assert len((empty / "predictions.jsonl").read_text().splitlines()) == int(limit)


def test_an_earlier_eval_that_cannot_be_replaced_is_refused_before_scoring(assets, tmp_path, capsys, monkeypatch):
    """An earlier eval's folder, or a file of it, that this process cannot write (immutable, read-only: what
    os.access says; root passes mode bits, so the refusal is simulated here) is refused before the model loads,
    naming it and the fix, not after the scores were computed."""
    import os

    common = ["--model", str(assets["known"]), "--data", str(assets["data"]), "--tasks", "boolq", "--limit", "2"]
    out = tmp_path / "ev"
    assert main([*common, "--output", str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real = os.access
    for stuck in (out / "results.json", out):
        monkeypatch.setattr(os, "access", lambda p, mode, s=stuck: False if Path(p) == s else real(p, mode))
        _fails([*common, "--output", str(out)], capsys, f"{stuck} cannot be written (read-only or immutable)")
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A ``frod data build`` of BoolQ and PIQA from the committed mirror (its manifest records every file's sha256)."""
    from frod_ds.prep.command import main as data_main

    out = tmp_path_factory.mktemp("built") / "data"
    mirror = REPO / "tests" / "fixtures" / "data_prep" / "mirror"
    assert data_main(["build", "--source", str(mirror), "--tasks", "boolq,piqa", "--out", str(out)]) == 0
    return out


def _flip_first_label(path: Path) -> None:
    """Row 1's label moved to the other choice: still a valid row, another test set."""
    lines = path.read_text().splitlines()
    row = json.loads(lines[0])
    row["label"] = 1 - row["label"]
    row["answer"] = row["choices"][row["label"]]
    path.write_text("\n".join([json.dumps(row), *lines[1:]]) + "\n")


def test_a_task_file_edited_after_the_build_is_refused(assets, built, tmp_path, capsys):
    """eval checks each task file against the sha256 the build recorded: a flipped label (a valid row, so no row
    check catches it) is one error line and nothing written; the same edit in a folder with no manifest is scored,
    and scores differently (what the check keeps from being reported as the task's accuracy)."""
    import hashlib

    data = tmp_path / "data"
    shutil.copytree(built, data)
    recorded = json.loads((data / "manifest.json").read_text())["files"]["eval/boolq.jsonl"]
    assert hashlib.sha256((data / "eval" / "boolq.jsonl").read_bytes()).hexdigest() == recorded
    argv = ["--model", str(assets["known"]), "--tasks", "boolq", "--limit", "4"]
    assert main([*argv, "--data", str(data), "--output", str(tmp_path / "ok")]) == 0
    _flip_first_label(data / "eval" / "boolq.jsonl")
    capsys.readouterr()
    assert main([*argv, "--data", str(data), "--output", str(tmp_path / "edited")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "boolq.jsonl was changed after frod data build wrote it" in err[0], err
    assert not (tmp_path / "edited").exists()
    hand = tmp_path / "hand"
    shutil.copytree(data, hand, ignore=shutil.ignore_patterns("manifest.json", ".frod-ds-output"))
    assert main([*argv, "--data", str(hand), "--output", str(tmp_path / "hand-out")]) == 0
    assert "has no manifest.json (not a frod data build)" in capsys.readouterr().err
    ok, hand_out = (_read(tmp_path / d)[1][0] for d in ("ok", "hand-out"))  # row 1's record
    assert ok["pred"] == hand_out["pred"] and ok["correct"] != hand_out["correct"]


def test_a_task_file_the_build_did_not_write_is_refused(assets, built, tmp_path, capsys):
    data = tmp_path / "data"
    shutil.copytree(built, data)
    write_eval_dir(data, {"obqa": make_rows("obqa", 4)})  # added by hand beside the build's files
    _fails(
        [
            "--model",
            str(assets["known"]),
            "--data",
            str(data),
            "--tasks",
            "boolq,obqa",
            "--output",
            str(tmp_path / "o"),
        ],
        capsys,
        "lists no eval/obqa.jsonl",
    )
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("gone", ["adapter_config.json", "adapter.safetensors"])
def test_an_adapter_with_a_file_removed_names_the_file_and_what_to_do(assets, adapter, tmp_path, capsys, gone):
    """An adapter folder (its output record says so) missing one of its two files: the line names the missing file
    and the fix, not "is not an adapter ... it is a trained adapter"."""
    import shutil

    ad = tmp_path / "ad"
    shutil.copytree(adapter["checkpoint"], ad)
    (ad / gone).unlink()
    argv = ["--checkpoint", str(ad), "--data", str(assets["data"]), "--tasks", "boolq", "--output", str(tmp_path / "o")]
    _fails(argv, capsys, f"the adapter {ad} has no {gone} (removed since it was written): copy the adapter again")
    assert not (tmp_path / "o").exists()
