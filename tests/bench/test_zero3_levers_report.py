"""bench/zero3_levers.py's report is what its committed JSONs give: regenerated from a copy of the results folder, it
equals the committed zero3_levers.md (tables are never edited by hand); its DeepCompile section lists every run of
every depth, failed ones with what their log says."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
RESULTS = REPO / "bench" / "results" / "zero3_levers"


def test_committed_report_is_the_generated_one(tmp_path):
    from bench.zero3_levers import report
    from tests.support.reports import regenerated

    text = regenerated(RESULTS, report, tmp_path)
    section = text.split("## DeepCompile, one layout choice at a time", 1)[1]
    runs = [
        p
        for p in RESULTS.glob("deepcompile_*_layers/*/*")
        if p.suffix in (".json", ".log") and not (p.suffix == ".log" and p.with_suffix(".json").is_file())
    ]
    assert runs and all(f"| {p.stem}" in section for p in runs), "every DeepCompile run in the table"
    assert "'weight' must be 2-D" in section and "did not finish" in section
