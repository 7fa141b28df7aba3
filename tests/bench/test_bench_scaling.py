"""The multi-GPU columns of the training-step matrix (bench/train_matrix.py): the link floor of a ZeRO-3 step and
the scaling against the method's fastest one-GPU configuration, against hand-computed values."""

import json

import pytest


def _rec(method, engine, n, tps, step_s, gc=False, frozen=6.0e9):
    return {
        "method": method,
        "engine": engine,
        "world_size": n,
        "gradient_checkpointing": gc,
        "tokens_per_s_per_gpu": tps,
        "step_s_median": step_s,
        "config": f"ds_configs/{engine}.json",
        "frod": {},
        "frozen_params": frozen,
    }


def test_link_floor_is_the_missing_half_of_the_frozen_weights_once_per_pass():
    from bench.train_matrix import link_floor_s

    d = _rec("frod", "zero3", 2, 1.0, 0.5)
    # 2 passes (forward, backward) x 6e9 params x 2 B x 1/2 at 200 GB/s = 60 ms
    assert link_floor_s(d, 200e9) == pytest.approx(0.060)
    # checkpointing recomputes the forward: a third pass; 4 GPUs: a rank lacks 3/4 of the weights
    assert link_floor_s({**d, "gradient_checkpointing": True, "world_size": 4}, 200e9) == pytest.approx(0.135)


def test_scaling_rows_name_the_fastest_one_gpu_config_and_the_link_floor(tmp_path):
    from bench.train_matrix import link_bandwidths, scaling_table

    (tmp_path / "link_2gpu.json").write_text(
        json.dumps(
            {"world_size": 2, "sizes": [{"size_mib": 16, "busbw_gbs": 50.0}, {"size_mib": 1024, "busbw_gbs": 200.0}]}
        )
    )
    links = link_bandwidths(tmp_path)
    assert links == {2: 200e9}, "the largest message's bus bandwidth"
    results = [
        _rec("frod", "plain", 1, 1000.0, 0.25),
        _rec("frod", "zero2", 1, 800.0, 0.30),
        _rec("frod", "zero2", 2, 900.0, 0.28),
        _rec("frod", "zero3", 2, 450.0, 0.56),
    ]
    md, rows = scaling_table(results, links)
    got = {(r["config"], r["gpus"]): r for r in rows}
    z2, z3 = got[("FRoD zero2", 2)], got[("FRoD zero3", 2)]
    assert z2["best_1gpu"] == "FRoD plain" and z2["scaling_vs_best_1gpu"] == pytest.approx(1.8)  # 2 x 900 / 1000
    assert z2["scaling_vs_1gpu"] == pytest.approx(2.25)  # 2 x 900 / 800
    assert z3["step_over_zero2"] == pytest.approx(2.0) and z3["link_floor_s"] == pytest.approx(0.060)
    assert z2["link_floor_s"] is None, "ZeRO-2 gathers no frozen weights"
    assert "| FRoD zero3 | 2 | 560 |" in md and "| 60 |" in md


def test_two_gpu_report_is_what_its_json_gives():
    """The committed 2-GPU report is the generator's output from the committed JSONs (no hand edits), and its goal
    ratios are the ones computed directly from two config JSONs."""
    from pathlib import Path

    from bench.two_gpu_report import collect, render

    root = Path(__file__).resolve().parents[2] / "bench" / "results" / "two_gpu_2xh200"
    doc = collect(root)
    assert (root / "report.md").read_text() == render(doc)
    z2 = json.loads((root / "matrix" / "configs" / "train_step_frod_zero2_2gpu.json").read_text())
    z3 = json.loads((root / "matrix" / "configs" / "train_step_frod_zero3_2gpu.json").read_text())
    (ratio,) = [g["value"] for g in doc["goals"] if g["key"] == "7b_zero3_over_zero2_2gpu"]
    assert ratio == pytest.approx(z3["step_s_median"] / z2["step_s_median"])
