"""The benchmark runner: suites expand and are validated; a run measures, records failures and time-outs, resumes,
and its report regenerates (FRoD against LoRA per micro-batch where a call measured several); what a step record
measured is the requested model (its first loss is the base model's loss on the same tokens, computed here with
plain transformers); a generated shape is prepared once over its ranks, checkpoint and store complete."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import torch

from bench.kinds import shapes
from bench.predict import read_predictions
from bench.record import RESULTS, Record, read_records
from bench.report import render
from bench.suite import STEP_KEYS, BenchError, load_suite, with_defaults
from frod_ds.formats.factor_store import MANIFEST, Manifest
from frod_ds.io.hf_checkpoint import HFCheckpoint
from frod_ds.model.store_reader import FactorStore, check_store_matches
from tests.support import pace, ranks
from tests.support.helpers_ckpt import REPO
from tests.support.leftovers import clean_env


def _suite(tmp_path: Path, body: str, name: str = "t") -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text('description = "test"\nkind = "step"\n' + body)
    return path


def test_list_values_expand_to_one_configuration_each(tmp_path):
    body = '[[configs]]\nmethod = ["frod", "lora"]\nengine = ["zero2", "zero3"]\ngpus = [1, 2]\n'
    body += '[[configs]]\nmethod = "lora"\nengine = "zero2"\ngpus = 2\nlora_r = 64\ngc = true\ntag = "own"\n'
    suite = load_suite(_suite(tmp_path, body))
    names = [c.name for c in suite.configs]
    assert len(names) == 9 and len(set(names)) == 9
    assert "frod-zero3-2g" in names and "lora-zero2-2g-gc-r64-own" in names
    assert suite.config("lora-zero2-1g")["batch"] == 4  # defaults filled in


@pytest.mark.parametrize(
    "body, says",
    [
        ('[[configs]]\nmethod = "frod"\nengine = "plain"\ngpus = 2\n', "plain runs on one GPU"),
        ('[[configs]]\nmethod = "frod"\nengine = "zero9"\n', "engine 'zero9'"),
        ('[[configs]]\nmethod = "frod"\nengine = "zero2"\nbatchsize = 8\n', "unknown keys ['batchsize']"),
        ('[[configs]]\nmethod = "frod"\nengine = ["zero2", "zero2"]\n', "declared twice"),
        ('[[configs]]\nmethod = "frod"\nengine = "zero2"\nshape = "13b"\n', "shape '13b'"),
        ('[[configs]]\nmethod = "lora"\nengine = "zero2"\nquant = "fp8"\n', "quant 'fp8'"),
        ('[[configs]]\nmethod = "lora"\nengine = "zero2"\nquantize_base = true\n', "quantize_base needs quant"),
        ('[[configs]]\nmethod = "frod"\nengine = "fsdp2"\nload = "direct"\n', "load direct is LoRA's"),
        ('[[configs]]\nmethod = "lora"\nengine = "zero2"\nload = "direct"\n', "load direct is LoRA's"),
        ("", "declares no configurations"),
    ],
)
def test_a_bad_suite_is_refused_with_what_to_change(tmp_path, body, says):
    with pytest.raises(BenchError, match=says.replace("[", r"\[").replace("]", r"\]")):
        load_suite(_suite(tmp_path, body))


def _bench(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """``python -m bench ARGS``, forked from this worker (``tests.support.ranks.run``: its imports paid already);
    past ``timeout`` it is stopped with SIGTERM, which ends its running configuration."""
    try:
        return ranks.run(0, ["-m", "bench", *args], clean_env(), REPO, timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"python -m bench {' '.join(args)} ran past {timeout} s\n{e.output[-2000:]}{e.stderr[-2000:]}")


def _base_loss(model_dir: Path, batch: int, seq: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    g = torch.Generator(device="cpu").manual_seed(1234)  # rank 0's batches (bench/kinds/step.py)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=g)
    with torch.no_grad():
        return float(model(input_ids=ids, labels=ids).loss)


DEFAULTS = f"""
[defaults]
shape = "tiny"
batch = 2
seq = 16
warmup = 1
steps = 2
repeats = 2
timeout_s = {pace.scaled(90):.0f}
"""


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """The tiny shape's checkpoint and factor store, prepared once for this file's runs (the runner's own step)."""
    from bench.kinds.shapes import prepare

    root = tmp_path_factory.mktemp("bench_work")
    prepare("tiny", root, log=lambda line: None)
    return root


def _check_step_record(m: dict, base: float) -> None:
    assert m["losses"][0] == pytest.approx(base, abs=2e-2)  # the method starts exactly at the base model
    assert len(m["step_s_all"]) == 2 and all(len(w) == 2 for w in m["step_s_all"])
    assert m["step_s_p10"] <= m["step_s_median"] <= m["step_s_p90"]


@pytest.mark.slow
def test_a_run_records_a_measurement_a_failure_and_a_time_out_then_resumes(tmp_path, work):
    body = """
[[configs]]
method = "frod"
engine = "plain"
[[configs]]
method = "frod"
engine = "zero2"
tag = "bad"
ds_set = { "zero_optimization.stage" = 9 }
[[configs]]
method = "lora"
engine = "plain"
tag = "slow"
timeout_s = 1
"""
    path = _suite(tmp_path, DEFAULTS + body, "rehearsal")
    results = tmp_path / "results"
    args = ("run", str(path), "--results", str(results), "--work", str(work))
    run = _bench(*args)
    assert run.returncode == 1, run.stdout + run.stderr  # a failure and a time-out: not a success
    records = {r.config: r for r in read_records(results, "rehearsal")}
    status = {name: r.status for name, r in records.items()}
    assert status == {
        "tiny-frod-plain-1g": "ok",
        "tiny-frod-zero2-1g-bad": "failed",
        "tiny-lora-plain-1g-slow": "timeout",
    }
    assert (
        "exit code" in records["tiny-frod-zero2-1g-bad"].error
        and records["tiny-frod-zero2-1g-bad"].error.count("\n") > 2
    )
    assert records["tiny-lora-plain-1g-slow"].error.startswith("stopped after 1 s (its timeout_s)")
    _check_step_record(records["tiny-frod-plain-1g"].metrics, _base_loss(work / "tiny" / "model", 2, 16))

    again = _bench(*args, "--only", "tiny-*-plain-1g*", "--budget-s", "0")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "tiny-frod-plain-1g               done" in again.stdout
    assert "skipped: 0 s of the budget left" in again.stdout  # the time-out is retried only with budget
    assert read_records(results, "rehearsal", "cpu")[0].call == records[sorted(records)[0]].call

    report = results / "rehearsal" / "cpu" / "report.md"
    assert "| `tiny-frod-plain-1g` | frod | plain | 1 |" in report.read_text()
    assert report.read_text() == render(load_suite(path), "cpu", read_records(results, "rehearsal", "cpu"))


@pytest.mark.slow
def test_a_configuration_on_two_ranks_is_recorded_once_with_every_ranks_memory(tmp_path, work):
    body = """
[[configs]]
method = "lora"
engine = "ddp"
gpus = 2
"""
    path = _suite(tmp_path, DEFAULTS + body, "ranks")
    results = tmp_path / "results"
    args = ("run", str(path), "--results", str(results), "--work", str(work))
    run = _bench(*args)
    assert run.returncode == 0, run.stdout + run.stderr
    (record,) = read_records(results, "ranks")
    assert record.status == "ok" and record.config == "tiny-lora-ddp-2g"
    m = record.metrics
    _check_step_record(m, _base_loss(work / "tiny" / "model", 2, 16))
    assert m["world_size"] == 2 and len(m["memory_per_rank"]) == 2
    assert [p.name for p in (results / "ranks" / "cpu").glob("*.json")] == ["tiny-lora-ddp-2g.json"]  # not per rank


def test_committed_reports_regenerate_from_their_records():
    checked = 0
    for report in sorted(RESULTS.glob("*/*/report.md")):
        suite, device = report.parts[-3], report.parts[-2]
        if not (REPO / "bench" / "suites" / f"{suite}.toml").exists():
            continue
        records, predictions = read_records(RESULTS, suite, device), read_predictions(RESULTS, suite)
        if load_suite(suite).kind == "chain":
            from bench.kinds.chain_report import render as render_chain

            assert report.read_text() == render_chain(load_suite(suite), device, records), report
        else:
            assert report.read_text() == render(load_suite(suite), device, records, predictions), report
        checked += 1
    assert checked >= 1


def test_every_committed_record_is_of_a_declared_configuration():
    for path in sorted(RESULTS.glob("*/*/*.json")):
        doc = json.loads(path.read_text())
        if doc.get("schema") is None:
            continue  # results of the scripts before the runner
        suite = load_suite(doc["suite"])
        assert suite.config(doc["config"]).settings == with_defaults(doc["settings"], suite.kind), path


@pytest.mark.slow
def test_a_generated_shape_is_prepared_once_over_its_ranks(tmp_path, monkeypatch):
    model, store = shapes.prepare("tiny-gqa", tmp_path, log=lambda line: None, ranks=2)
    shape = shapes.SHAPES["tiny-gqa"]
    assert len(HFCheckpoint(model).keys()) == 3 + 9 * shape.layers  # embeddings, norm, head; 7 linears, 2 norms a layer
    assert Manifest.read(store / MANIFEST).complete
    check_store_matches(FactorStore.open(store), HFCheckpoint(model))
    monkeypatch.setattr(shapes.subprocess, "run", lambda *a, **k: pytest.fail("prepared again"))
    t0 = time.monotonic()
    assert shapes.prepare("tiny-gqa", tmp_path, log=lambda line: None, ranks=2) == (model, store)
    assert time.monotonic() - t0 < 1


def _record(method: str, engine: str, batch: int, step_s: float) -> Record:
    s = {**STEP_KEYS, "method": method, "engine": engine, "gpus": 4, "batch": batch, "seq": 256}
    m = {f"step_s_{k}": step_s for k in ("median", "p10", "p90")} | {"tokens_per_s_per_gpu": batch * 256 / step_s}
    dev = {"count": 4, "name": "GPU", "key": "gpu"}
    return Record("t", f"{method}-{engine}-b{batch}", s, "ok", "c", dev, [], "d", {}, "x", 1.0, m)


def test_a_call_of_several_micro_batches_sets_frod_against_lora_at_each():
    """LoRA's step at 4 x 256 is the fastest overall; at 32 x 256 FRoD is held against LoRA's 32 x 256 row."""
    rows = [_record("frod", "z3layers", 4, 2.0), _record("lora", "fsdp2", 4, 1.0), _record("lora", "zero3", 4, 1.5)]
    rows += [_record("frod", "z3layers", 32, 12.0), _record("lora", "fsdp2", 32, 6.0)]
    suite = load_suite(REPO / "bench" / "suites" / "step-tiny.toml")
    text = render(suite, "gpu", rows)
    assert "| 4 (4×256) | `z3layers` | 2000.0 | `fsdp2` | 1000.0 | 2.00× |" in text
    assert "| 4 (32×256) | `z3layers` | 12000.0 | `fsdp2` | 6000.0 | 2.00× |" in text
