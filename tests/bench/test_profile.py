"""The profile summary of a rank's GPU work (``bench/kinds/profile.py``) against sums done by hand on made-up
kernel timelines: NCCL time counted once where kernels overlap, compute beside NCCL only where they meet."""

from __future__ import annotations

import pytest

from bench.kinds.profile import summarize


def test_compute_beside_nccl_is_the_intersection_and_nccl_is_counted_once():
    spans = [
        ("compute", 0, 100),
        ("nccl", 50, 150),  # overlaps the first GEMM by 50
        ("nccl", 120, 180),  # overlaps the first NCCL kernel: the union is 50..180
        ("compute", 160, 200),  # 20 of it beside NCCL
        ("copy", 300, 400),
        ("compute", 380, 420),  # beside a copy, not beside NCCL
    ]
    got = summarize(spans, steps=2)
    assert got["compute_ms"] == pytest.approx((100 + 40 + 40) * 1e-6 / 2)
    assert got["nccl_ms"] == pytest.approx(130 * 1e-6 / 2)
    assert got["copy_ms"] == pytest.approx(100 * 1e-6 / 2)
    assert got["compute_beside_nccl_ms"] == pytest.approx((50 + 20) * 1e-6 / 2)
    assert got["gpu_busy_ms"] == pytest.approx((200 + 120) * 1e-6 / 2)  # 0..200 and 300..420
    assert got["kernels_per_step"] == 1.5


def test_a_timeline_without_nccl_has_nothing_beside_it():
    got = summarize([("compute", 0, 10), ("copy", 5, 20)], steps=1)
    assert got["nccl_ms"] == 0 and got["compute_beside_nccl_ms"] == 0
    assert got["gpu_busy_ms"] == pytest.approx(20e-6)


def _record(engine: str, peak: float, fs: dict | None = None, losses=(2.0, 1.0)):
    from bench.record import Record
    from bench.suite import with_defaults

    settings = with_defaults({"method": "frod", "engine": engine, "gpus": 4})
    metrics = {"step_s_median": 0.25, "peak_gib": peak, "losses": list(losses), "frozen_shards": fs}
    return Record("s", f"frod-{engine}-4g", settings, "ok", "c", {"key": "k"}, [], "d", {}, "x", 1.0, metrics)


def test_a_partitioned_peak_is_held_to_zero2s_less_the_partitioned_share():
    """(1 − 1/4) of a 12 GiB frozen model (V's 0.5 included) off zero2's 26 GiB, plus two 0.4 GiB units and 1 GiB:
    18.8 GiB due; 18 passes, 23 does not. Losses are compared step by step with zero2's."""
    from bench.report import _memory_bound, _vs_zero2

    fs = {"full_gib": 11.5, "replicated_gib": 0.5, "largest_unit_gib": 0.4}
    zero2 = _record("zero2", 26.0)
    ok, over = _record("z3layers", 18.0, fs, (2.0, 1.001)), _record("z3layers", 23.0, fs)
    assert _memory_bound(ok, [zero2, ok]) == " (≤ 18.8 due)"
    assert _memory_bound(over, [zero2, over]).startswith(" (>")
    assert _memory_bound(ok, [ok]) == ""  # no zero2 row in the call: nothing to hold it to
    assert _vs_zero2(ok, [zero2, ok]) == "1.000× | 1.0e-03"


def test_a_profiled_row_is_held_to_the_calls_zero2_profiled_as_it_is_where_there_is_one():
    """Profiled steps run after the timed ones, so an unprofiled zero2 row is a fair baseline when the call has no
    profiled one; a profiled zero2 row in the call is preferred."""
    import dataclasses

    from bench.report import _zero2

    def profiled(r, n: int):
        return dataclasses.replace(r, config=r.config + f"-p{n}", settings={**r.settings, "profile": n})

    zero2, mine = _record("zero2", 26.0), profiled(_record("z3layers", 18.0), 2)
    assert _zero2(mine, [zero2, mine]) is zero2
    zero2_prof = profiled(zero2, 2)
    assert _zero2(mine, [zero2, zero2_prof, mine]) is zero2_prof
    other_gpus = dataclasses.replace(zero2, settings={**zero2.settings, "gpus": 2})
    assert _zero2(mine, [other_gpus, mine]) is None


def test_a_prediction_written_before_a_settings_key_existed_still_matches_its_record():
    """A key the runner added after the prediction was written (at its default) does not orphan the prediction;
    a setting that differs does."""
    from bench.report import _predicted

    r = _record("z3layers", 18.0)
    old = {k: v for k, v in r.settings.items() if k != "load"}
    pred = {"settings": old, "step_s": 0.3, "peak_allocated_gib": 20.0, "date": "c"}
    assert len(_predicted([r], {r.config: pred})) == 5
    assert _predicted([r], {r.config: {**pred, "settings": {**old, "batch": 8}}}) == []


def test_predictions_plan_each_engine_as_the_run_builds_it():
    """``bench predict``'s engine per configuration: ``z3layers`` is the layer partition even where its ds_set
    offloads parameters (the run builds host shards, ``build_frod``), ``zero3`` DeepSpeed's coordinator."""
    from bench.predict import _engine
    from bench.suite import with_defaults

    offload = {"zero_optimization.offload_param": {"device": "cpu", "pin_memory": True}}
    for engine, layers in (("z3layers", True), ("zero3", False)):
        for ds_set in ({}, offload):
            s = with_defaults({"method": "frod", "engine": engine, "gpus": 2, "ds_set": ds_set})
            e = _engine(s)
            assert (e.stage, e.layers, e.offload_param) == (3, layers, bool(ds_set)), (engine, ds_set, e)
