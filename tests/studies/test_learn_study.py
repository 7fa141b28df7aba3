"""studies/learn_study.py end to end on CPU with a tiny Llama (frod_ds.testing.toy): generate a task, sweep frod and
stock PEFT FRoD, the S-rate variants and the cross-check, a second seed, timing alone, resume (the same command
again trains nothing), a command cut by its time budget and the next one going on, report.

Checked against independent computations: every run of the task saw the training tokens counted here from the
rows; tan α of frod-ds' and of stock PEFT's FRoD is the ratio of the norms of the merged weight's change with
only S moved and with only σ moved."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from studies import learn_study


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    from transformers import AutoTokenizer

    from frod_ds.testing.toy import train_sentencepiece_tokenizer, write_tiny_llama

    root = tmp_path_factory.mktemp("learn")
    work, out = root / "work", root / "out"
    assert (
        learn_study.main(
            [
                "gen",
                "--work",
                str(work),
                "--tasks",
                "arith",
                "--arith-train",
                "48",
                "--digits",
                "1-2",
                "--validation-rows",
                "8",
                "--test-rows",
                "6",
            ]
        )
        == 0
    )
    rows = [json.loads(line) for line in (work / "tasks" / "arith" / "train.jsonl").read_text().splitlines()]
    texts = [r["prompt"] + r["separator"] + c for r in rows for c in r["choices"]] * 4
    model = root / "model"
    train_sentencepiece_tokenizer(model, texts)
    tok = AutoTokenizer.from_pretrained(model)
    write_tiny_llama(model, len(tok), num_hidden_layers=2)
    argv = [
        "run",
        "--model",
        str(model),
        "--work",
        str(work),
        "--out",
        str(out),
        "--tasks",
        "arith",
        "--methods",
        "frod,peftfrod",
        "--ratio-methods",
        "frod_ratio3",
        "--lrs",
        "frod=1e-2",
        "--lrs",
        "peftfrod=1e-2",
        "--timing-steps",
        "2",
        "--timing-warmup",
        "1",
        "--val-points",
        "2",
        "--steps",
        "2",
        "--batch-size",
        "8",
        "--seeds",
        "2",
        "--extend",
        "0",
        "--checkpoints",
        "1",
        "--device",
        "cpu",
        "--workers",
        "1",
        "--min-study-minutes",
        "0",
        "--eval-reserve-minutes",
        "0.01",
        "--pack",
        str(root / "pack.tgz"),
    ]
    # a command whose budget ends early leaves the rest to the next one, which goes on from its records; a unit
    # starts only with 0.03 of the 0.04 minutes left, so on however fast a host no more than the first one fits
    assert learn_study.main([*argv, "--max-minutes", "0.04", "--min-study-minutes", "0.03"]) == 0
    assert not (out / "arith" / "timing.json").exists()
    assert learn_study.main(argv) == 0
    return root, work, out, argv, rows, tok


def _records(out: Path) -> dict[str, int]:
    return {str(p.relative_to(out)): p.stat().st_mtime_ns for p in out.rglob("records/*.json")}


def _winning_ratio(out: Path) -> str | None:
    """The ratio variant the seeds repeat: the best σ:S ratio at frod's σ LR, unless it is 10:1."""
    doc = json.loads((out / "arith" / "seed0" / "real_study.json").read_text())
    losses = {m: d["sweep"][0]["heldout"]["answer_loss"] for m, d in doc["methods"].items() if m.startswith("frod")}
    best = min(losses, key=losses.get)
    return None if best == "frod" else best


def test_every_method_and_seed_is_recorded_on_the_same_tokens(rehearsal):
    _, _, out, _, rows, tok = rehearsal
    seed0 = {p.split("/")[-1].split("_lr")[0] for p in _records(out) if p.startswith("arith/seed0/")}
    seed1 = {p.split("/")[-1].split("_lr")[0] for p in _records(out) if p.startswith("arith/seed1/")}
    # one ratio past the end the two tried (3 and 10:1) is tried: 1 where ratio 3 won, 30 where 10:1 did
    doc = json.loads((out / "arith" / "seed0" / "real_study.json").read_text())
    loss = {m: doc["methods"][m]["sweep"][0]["heldout"]["answer_loss"] for m in ("frod", "frod_ratio3")}
    past = "frod_ratio1" if loss["frod_ratio3"] < loss["frod"] else "frod_ratio30"
    assert seed0 == {"frod", "frod_ratio3", "peftfrod", "peftfrod_inj", past}
    assert seed1 == {"frod", "peftfrod"} | ({_winning_ratio(out)} - {None})
    for seed in (0, 1):
        doc = json.loads((out / "arith" / f"seed{seed}" / "real_study.json").read_text())
        runs = {m: d["sweep"][0] for m, d in doc["methods"].items()}
        assert doc["data"]["steps"] == 2 and len({r["data_order_sha256"] for r in runs.values()}) == 1
        # the tokens of the rows the 2 steps used, counted here: BOS + prompt + separator + answer, then EOS
        by_id = {r["id"]: r for r in rows}
        assert runs["frod"]["lr_s"] == pytest.approx(1e-3) and runs["peftfrod"].get("lr_s") is None  # one LR
        for name, r in runs.items():
            assert r["steps"] == 2 and r["checkpoints"][-1]["tan_alpha"].keys() >= {"q_proj", "up_proj"}
            assert [p["step"] for p in r["validation"]] == [1, 2], name  # --val-points 2: every step here
        assert all("exact" in d["test"] and "loglik" in d["test"] for d in doc["methods"].values())
        first = [by_id[i] for i in doc["data"]["first_batch_ids"]]
        n_first = sum(len(tok(r["prompt"] + r["separator"] + r["answer"])["input_ids"]) + 1 for r in first)
        assert n_first <= runs["frod"]["tokens"] and all(r["tokens"] == runs["frod"]["tokens"] for r in runs.values())
    ratio3 = json.loads((out / "arith" / "seed0" / "records" / "frod_ratio3_lr0.01.json").read_text())
    assert ratio3["lr_s"] == pytest.approx(1e-2 / 3)


def test_timing_times_the_main_methods_and_the_cross_check_alone(rehearsal):
    _, _, out, _, _, _ = rehearsal
    timing = json.loads((out / "arith" / "timing.json").read_text())
    assert timing["alone"] and timing["steps"] == 2 and set(timing["methods"]) == {"frod", "peftfrod", "peftfrod_inj"}
    for e in timing["methods"].values():
        assert e["step_ms"] > 0 and e["tokens_per_s"] > 0 and e["build_seconds"] > 0 and e["trainable_params"] > 0


def test_a_merged_pack_holds_every_record_and_reports(rehearsal, tmp_path):
    import tarfile

    root, _, out, _, _, _ = rehearsal
    res = tmp_path / "res"
    assert learn_study.main(["merge", "--into", str(res), str(root / "pack.tgz")]) == 0
    assert learn_study.main(["merge", "--into", str(res), str(root / "pack.tgz")]) == 0  # again: the same records
    with tarfile.open(res / "records.tgz") as tar:
        tar.extractall(tmp_path / "records", filter="data")
    assert sorted(_records(tmp_path / "records")) == sorted(_records(out))
    assert (tmp_path / "records" / "arith" / "timing.json").is_file()
    assert (res / "report.md").is_file() and (res / "learn_study.json").is_file() and not (res / "arith").exists()
    assert learn_study.main(["report", "--out", str(res)]) == 0  # from records.tgz


def test_two_calls_summaries_of_one_seed_combine_per_method_and_are_never_mixed_in_one_row(rehearsal, tmp_path, capsys):
    """Two calls that did not see each other's records (two GPUs on one task): merge keeps both calls' runs, takes
    each method's summary from the call that lists more of its runs, else the one that swept it (whichever
    tarball comes last), and names runs
    no summary lists; a seed counts only at the LR the first seed's sweep chose."""
    import shutil
    import tarfile

    from studies.learn_report import collect

    _, _, out, _, _, _ = rehearsal
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(out / "arith", a / "arith")
    shutil.copytree(out / "arith", b / "arith")
    doc_path = b / "arith" / "seed0" / "real_study.json"
    doc = json.loads(doc_path.read_text())
    del doc["methods"]["peftfrod"]  # the other call's summary knows no peftfrod run
    frod = doc["methods"]["frod"]
    frod["grid"] = []  # and lists frod's runs as resumed ones, not swept by it, without test results
    frod.pop("test")
    doc_path.write_text(json.dumps(doc))
    for p in (b / "arith" / "seed0" / "records").glob("peftfrod_*.json"):
        p.unlink()
    for name in ("a", "b"):
        with tarfile.open(tmp_path / f"{name}.tgz", "w:gz") as tar:
            tar.add(tmp_path / name / "arith", "arith")
    full = collect(out)["tasks"]["arith"]["methods"]
    for order in (("a", "b"), ("b", "a")):
        res, records = tmp_path / f"res_{order[0]}", tmp_path / f"records_{order[0]}"
        tarballs = [str(tmp_path / f"{n}.tgz") for n in order]
        assert learn_study.main(["merge", "--into", str(res), *tarballs]) == 0
        said = capsys.readouterr().out
        assert "combined arith/seed0" in said and "note:" not in said
        with tarfile.open(res / "records.tgz") as tar:
            tar.extractall(records, filter="data")
        assert (records / "arith" / "seed0" / "records" / "peftfrod_lr0.01.json").is_file()
        got = collect(records)["tasks"]["arith"]["methods"]
        assert got["peftfrod"] == full["peftfrod"] and got["frod"] == full["frod"]
        merged = json.loads((records / "arith" / "seed0" / "real_study.json").read_text())
        assert merged["complete"] is True, "b's summary alone was incomplete; merged with a's, every method is tested"

    # a run that neither summary lists is named, and left out of the report
    for name in ("a", "b"):
        doc_path = tmp_path / name / "arith" / "seed0" / "real_study.json"
        doc = json.loads(doc_path.read_text())
        doc["methods"].pop("peftfrod", None)
        doc_path.write_text(json.dumps(doc))
        with tarfile.open(tmp_path / f"{name}.tgz", "w:gz") as tar:
            tar.add(tmp_path / name / "arith", "arith")
    res = tmp_path / "res"
    assert learn_study.main(["merge", "--into", str(res), str(tmp_path / "a.tgz"), str(tmp_path / "b.tgz")]) == 0
    said = capsys.readouterr().out
    assert "note: arith/seed0 keeps 1 run(s) its summary does not list (peftfrod lr=0.01)" in said
    with tarfile.open(res / "records.tgz") as tar:
        tar.extractall(tmp_path / "records", filter="data")
    assert "peftfrod" not in collect(tmp_path / "records")["tasks"]["arith"]["methods"]

    # seed 1's summary chose another LR for frod than seed 0's sweep did: that seed is left out of frod's row
    seed1 = tmp_path / "records" / "arith" / "seed1" / "real_study.json"
    doc = json.loads(seed1.read_text())
    m = doc["methods"]["frod"]
    m["sweep"][m["chosen"]["index"]]["lr"] = 0.5
    seed1.write_text(json.dumps(doc))
    assert set(collect(tmp_path / "records")["tasks"]["arith"]["methods"]["frod"]["seeds"]) == {"0"}


def test_a_merged_seed_is_complete_only_when_every_asked_method_is_tested():
    """``complete`` is recomputed from the merged summary, not and-ed from the two calls' flags: an earlier call's
    incomplete summary must not hold back a later call that tested every method, nor a complete one hide a method
    the other call asked for and never tested."""
    final = {"chosen": {"final": True}, "sweep": [{"lr": 1e-3}], "test": {}}
    untested = {"chosen": {"final": True}, "sweep": [{"lr": 1e-3}]}
    cfg = {"methods": ["frod", "lora16"], "base_eval": True}
    old = {"config": cfg, "methods": {"frod": untested}, "invocations": [], "complete": False, "base": {}}
    new = {"config": cfg, "methods": {"frod": final, "lora16": final}, "invocations": [], "complete": True}
    assert learn_study.combine_summaries(old, new)["complete"] is True
    wider = {**old, "config": {**cfg, "methods": ["frod", "lora16", "full"]}, "complete": True}
    assert learn_study.combine_summaries(wider, new)["complete"] is False  # full asked, never tested
    no_base = {k: v for k, v in old.items() if k != "base"}
    assert learn_study.combine_summaries(no_base, new)["complete"] is False  # the base was asked, never evaluated


def test_the_same_command_again_trains_nothing(rehearsal, capsys):
    _, _, out, argv, _, _ = rehearsal
    before = _records(out)
    assert learn_study.main(argv) == 0
    assert _records(out) == before
    # sweep, variants, (the ratio past whichever end won: 1 or 30,) seed 1: none loaded again; timing recorded
    records = out / "arith" / "seed0" / "records"
    extended = sum((records / f"frod_ratio{k}_lr0.01.json").is_file() for k in (1, 30))
    assert capsys.readouterr().out.count("finished: ") == 3 + extended


def test_a_copy_resumes_into_a_new_output_without_training(rehearsal, tmp_path):
    _, _, out, argv, _, _ = rehearsal
    new = tmp_path / "new"
    args = [*argv[: argv.index("--out") + 1], str(new), *argv[argv.index("--out") + 2 :], "--resume-from", str(out)]
    assert learn_study.main(args) == 0
    assert sorted(_records(new)) == sorted(_records(out))


def test_report_comes_from_the_json(rehearsal):
    _, _, out, _, _, _ = rehearsal
    assert learn_study.main(["report", "--out", str(out)]) == 0
    doc = json.loads((out / "learn_study.json").read_text())
    t = doc["tasks"]["arith"]
    assert t["seeds"] == [0, 1] and {"frod", "peftfrod", "frod_ratio3", "peftfrod_inj"} <= set(t["methods"])
    for name in ("frod", "peftfrod"):
        e = t["methods"][name]
        assert set(e["seeds"]) == {"0", "1"} and e["alone"]["step_ms"] > 0
        for split, acc in e["exact"].items():
            values = [s["exact"][split] for s in e["seeds"].values()]
            assert acc["mean"] == pytest.approx(sum(values) / 2) and acc["lo"] <= acc["mean"] <= acc["hi"]
    assert t["ratios"]["chosen"] in (1, 3, 10) and {"3", "10"} <= set(t["ratios"]["validation_answer_loss"])
    # the cross-check: stock PEFT on frod-ds' factors trains as frod-ds does (fp32 on CPU)
    assert t["cross_check"]["max_rel_loss_difference"] < 1e-4
    text = (out / "report.md").read_text()
    assert "is not LLaMA-2-7B" in text and "projection to 7B" in text and "tan α" in text
    assert "exact match % arith_longer" in text and "alone on the device" in text
    assert (out / "loss_arith.png").is_file()


def test_steps_and_seconds_to_the_better_lora_read_the_validation_curve():
    from studies.learn_convergence import convergence
    from studies.learn_report import _reach

    curve = [[2, 1.0], [4, 0.6], [6, 0.5]]
    assert _reach(curve, 0.6) == 4 and _reach(curve, 0.4) is None
    tasks = {
        "t": {
            "steps": 6,
            "better_lora": "lora16",
            "methods": {
                "frod": {"steps_to_better_lora_final": {"0": 4, "1": None}, "seconds_to_better_lora_final": {}},
                "lora16": {"alone": {"build_seconds": 1.0, "step_ms": 500.0}},
            },
        }
    }
    got = convergence(tasks)
    assert got["tasks"]["t"]["reached"] == 1 and got["tasks"]["t"]["lora_seconds"] == pytest.approx(4.0)
    assert "t: 1/2 seeds, step 4 of 6" in got["sentence"] and "provisional" not in got["sentence"]
    # a task with open LR sweeps is said as provisional; an arithmetic task that failed its pilot gate is left out
    open_task = {**tasks["t"], "open_sweeps": ["lora16"]}
    failed = {**tasks["t"], "gate": {"passed": False, "excluded": True}}
    short = {**tasks["t"], "gate": {"passed": False, "excluded": False}}  # reported with its shortfall
    got = convergence({"t": tasks["t"], "u": open_task, "arith": failed, "arith_d12": short})
    assert set(got["tasks"]) == {"t", "u", "arith_d12"} and got["tasks"]["u"]["provisional"]
    lead, rest = got["sentence"].split("Provisionally", 1)
    assert "t: 1/2 seeds" in lead and "u: 1/2 seeds" not in lead and "u: 1/2 seeds" in rest
    assert convergence({"u": open_task})["sentence"].startswith("No task's LR sweeps are complete yet")
    # the line quotes the test exact match of frod, the better LoRA and full on the task's headline split
    exact = {"arith_unseen": {"mean": 0.9494}, "arith_longer": {"mean": 0.01}}
    methods = {**tasks["t"]["methods"], "full": {"exact": {"arith_unseen": {"mean": 0.95}}}}
    methods["frod"] = {**methods["frod"], "exact": exact}
    methods["lora16"] = {**methods["lora16"], "exact": {"arith_unseen": {"mean": 0.9375}}}
    said = convergence({"arith_x": {**tasks["t"], "methods": methods}})["sentence"]
    assert "arith_x: 1/2 seeds, step 4 of 6 (exact match on arith_unseen: frod 94.9%, lora16 93.8%, full 95.0%)" in said
    facts = {**methods, "frod": {**methods["frod"], "exact": {"f_recall": {"mean": 1.0}}}}
    assert "exact match" not in convergence({"f": {**tasks["t"], "methods": facts}})["sentence"]  # no f_qa: unsaid


def test_the_arith_pilot_gate_reads_full_fine_tunings_exact_match_on_unseen_pairs():
    from studies.config import ARITH_GATE
    from studies.learn_convergence import arith_gate

    def methods(v):
        return {"full": {"exact": {"arith_unseen": {"mean": v}}}}

    assert arith_gate("facts64", methods(0.1)) is None
    failed = arith_gate("arith", methods(ARITH_GATE["min_exact"] - 0.01))
    assert failed["passed"] is False and failed["excluded"]  # the pilot's record only
    replaced = arith_gate("arith_d12", methods(ARITH_GATE["min_exact"] - 0.01))
    assert replaced["passed"] is False and replaced["excluded"]  # arith_d12x2 passed in its place
    short = arith_gate("arith_d12x2", methods(ARITH_GATE["min_exact"] - 0.01))
    assert short["passed"] is False and not short["excluded"]  # the last variant: reported with its shortfall
    assert arith_gate("arith_d12x2", methods(ARITH_GATE["min_exact"]))["passed"] is True
    assert arith_gate("arith", {})["passed"] is None  # not measured yet: neither passed nor failed


def test_t_quantile_matches_the_normal_limit_and_a_known_small_sample_property():
    from studies.learn_report import t_quantile

    assert t_quantile(0.975, 10_000) == pytest.approx(1.95996, abs=1e-3)  # the normal quantile
    # with 1 degree of freedom t is Cauchy: quantile tan(pi (p - 1/2))
    assert t_quantile(0.975, 1) == pytest.approx(float(torch.tan(torch.tensor(torch.pi * 0.475))), rel=1e-3)


def test_user_mistakes_exit_2_with_one_line(tmp_path, capsys):
    assert learn_study.main(["gen", "--work", str(tmp_path), "--tasks", "algebra"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: unknown task 'algebra'")
    assert (
        learn_study.main(
            ["run", "--model", str(tmp_path), "--work", str(tmp_path), "--out", str(tmp_path / "o"), "--tasks", "arith"]
        )
        == 2
    )
    assert "run `gen --work" in capsys.readouterr().err


def test_tan_alpha_of_both_implementations_is_the_split_of_the_merged_weight_change(rehearsal):
    from frod_ds.model.apply import frod_modules
    from studies.config import StudyConfig
    from studies.models import ModelFactory, load_base
    from studies.rotation import initial_sigmas, rotation_by_category

    root = rehearsal[0]
    base, _ = load_base(str(root / "model"), torch.device("cpu"))
    factory = ModelFactory(base, StudyConfig(model=".", data=".", out="."))
    frod = factory.frod_template()
    sigma0 = initial_sigmas(frod)
    g = torch.Generator().manual_seed(0)
    on, off = {}, {}
    with torch.no_grad():
        for name, layer in frod_modules(frod):
            w0 = layer.merged_weight().clone()
            d_sigma = 1e-2 * torch.randn(layer.frod_sigma.shape, generator=g)
            d_s = 1e-2 * torch.randn(layer.frod_s.shape, generator=g)
            layer.frod_s.add_(d_s)
            w_off = layer.merged_weight() - w0  # S alone
            layer.frod_s.sub_(d_s)
            layer.frod_sigma.add_(d_sigma)
            w_on = layer.merged_weight() - w0  # σ alone
            layer.frod_s.add_(d_s)
            cat = name.rsplit(".", 1)[-1]
            on[cat] = on.get(cat, 0.0) + float(w_on.double().square().sum())
            off[cat] = off.get(cat, 0.0) + float(w_off.double().square().sum())
    want = {c: (off[c] / on[c]) ** 0.5 for c in on}
    got = rotation_by_category(frod, sigma0)
    assert got.keys() == want.keys() and all(got[c] == pytest.approx(want[c], rel=1e-3) for c in want)
    peft = factory.peft_frod_template()  # injected from the template as it is now: the same σ and S
    got_peft = rotation_by_category(peft, sigma0)
    assert all(got_peft[c] == pytest.approx(want[c], rel=1e-3) for c in want)
    # stock PEFT FRoD from its own initialisation: its own λ⁰ is σ⁰, so an untrained model does not rotate
    stock = factory.peft_stock_template(0.02)
    assert set(rotation_by_category(stock, initial_sigmas(stock)).values()) == {0.0}


def test_check_takes_every_method_through_a_short_run(rehearsal, tmp_path, capsys):
    root, work, _, _, _, _ = rehearsal
    args = ["check", "--model", str(root / "model"), "--work", str(work), "--out", str(tmp_path / "c")]
    assert learn_study.main([*args, "--task", "arith", "--batch-size", "8", "--device", "cpu"]) == 0
    assert "check: 9 of 9 methods ok" in capsys.readouterr().out
    assert not (tmp_path / "c").exists()  # nothing recorded


def test_fp32_only_turns_the_study_autocast_off():
    from studies.loop import autocast, fp32_only, sparse_mm_autocast_ok

    cuda = torch.device("cuda")
    assert isinstance(autocast(cuda), torch.autocast)
    with fp32_only():
        assert not isinstance(autocast(cuda), torch.autocast)
    assert isinstance(autocast(cuda), torch.autocast) and sparse_mm_autocast_ok(torch.device("cpu"))


def test_a_task_left_unfinished_does_not_hold_up_the_next(monkeypatch):
    """``run_learn`` gives every task its turn: one whose sweep a run did not fit (``task`` returns False) is
    followed by the next, which may still fit the time left."""
    from studies import learn

    calls = []

    class Fake:
        def __init__(self, *a):
            pass

        def task(self, name):
            calls.append(name)
            return name != "facts256"

        def close(self):
            calls.append("closed")

    monkeypatch.setattr(learn, "Learn", Fake)
    cfg = type("Cfg", (), {"tasks": ["facts256", "facts1024", "arith_d12"]})()
    learn.run_learn(cfg, [], 0.0)
    assert calls == ["facts256", "facts1024", "arith_d12", "closed"]
