"""bench/host_link.py's CPU rehearsal: each device's rate is the bytes it moved over the median time, and the
machine's is their sum."""

import statistics

import torch


def test_copy_rate_is_bytes_over_the_median_time_per_device_and_their_sum():
    from bench.host_link import copy_rate

    r = copy_rate([torch.device("cpu")] * 2, 1 << 16, 3)
    assert r["devices"] == 2 and len(r["s"]) == 5 and all(t > 0 for t in r["s"])
    assert r["per_device_bytes_per_s"] == (1 << 16) * 3 / statistics.median(r["s"])
    assert r["all_bytes_per_s"] == 2 * r["per_device_bytes_per_s"]
