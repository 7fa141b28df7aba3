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
