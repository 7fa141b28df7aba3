"""bench/results/host_calls: the committed report is what ``bench/host_calls.py --report`` generates from the JSONs
beside it, and every call's rows are in it."""

from __future__ import annotations

import json

from tests.support.leftovers import REPO

RESULTS = REPO / "bench" / "results" / "host_calls"


def test_committed_report_is_the_generated_one(tmp_path):
    from bench.host_calls import report
    from tests.support.reports import regenerated

    text = regenerated(RESULTS, report, tmp_path)
    for path in RESULTS.glob("host_calls_*.json"):
        doc = json.loads(path.read_text())
        assert f"## Call of {doc['date']}" in text, path.name
        for r in doc["runs"]:
            assert f"| {r['name']} | {r['what']} |" in text and f"{r['python_calls_per_step']:,.0f}" in text, r["name"]
