"""bench/run_summary.py: the numbers it reports, against a hand-computed run."""

from __future__ import annotations

import json

from bench.run_summary import main, summarise


def _rows():
    return [
        {"step": i, "loss": 10.0 - i, "step_time_s": t, "tokens_per_s": tok, "peak_mem_gb": g}
        for i, t, tok, g in [
            (1, 9.0, 10, 12.0),
            (2, 5.0, 50, 13.5),
            (3, 2.0, 400, 12.7),
            (4, 1.0, 300, 12.7),
            (5, 4.0, 500, 12.8),
        ]
    ]


def test_summary_skips_the_first_two_steps_and_subtracts_the_host_baseline():
    s = summarise(_rows(), "x\nmodel built in 25.3 s (skeleton...)\n", [1024.0, 4096.0, 3072.0])
    assert s["step_s_median"] == 2.0 and s["tokens_per_s_median"] == 400  # steps 3-5
    assert s["gpu_peak_alloc_gib"] == 13.5 and s["build_s"] == 25.3 and s["host_used_peak_gib"] == 3.0
    assert s["steps"] == 5 and s["losses"][0] == 9.0


def test_a_failed_run_is_recorded_with_its_error(tmp_path):
    log = tmp_path / "run.log"
    log.write_text(
        "[2026-11-26 13:12:01,000] [INFO] start\n[rank0]: AssertionError: Not enough buffers 1 for swapping 2\n"
    )
    rc = main(
        [
            "--metrics",
            str(tmp_path / "none.jsonl"),
            "--log",
            str(log),
            "--device",
            "1x GPU",
            "--command",
            "c",
            "--out",
            str(tmp_path),
            "--name",
            "r",
        ]
    )
    doc = json.loads((tmp_path / "r.json").read_text())
    assert rc == 0 and doc["completed"] is False and doc["steps"] == 0 and doc["step_s_median"] is None
    assert doc["error"].endswith("Not enough buffers 1 for swapping 2") and doc["date"] == "2026-11-26T13:12:01+00:00"
