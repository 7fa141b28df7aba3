"""The benchmark runner: declared suites (``bench/suites/*.toml``), one JSON per configuration, generated reports.

python -m bench list                          # the suites and what each measures
python -m bench list step-7b                  # a suite's configurations
python -m bench run step-7b                   # measure what is not measured yet on this machine, then report
python -m bench run step-7b --budget-s 480 --results "$OUT/results"   # within one bounded device call
python -m bench predict zero3-2gpu            # the planner's predictions, committed before the suite runs
python -m bench report step-7b                # regenerate the suite's reports from its records
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from bench.record import RESULTS
from bench.suite import BenchError, load_suite, suite_names


def _list(args) -> None:
    if args.suite is None:
        for name in suite_names():
            s = load_suite(name)
            print(f"{name:<16} {len(s.configs):>3} configurations  {s.description}")
        return
    for c in load_suite(args.suite).configs:
        print(c.name)


def _run(args) -> int:
    from bench.report import write_reports
    from bench.runner import run_suite

    suite = load_suite(args.suite)
    outcomes = run_suite(suite, args.results, args.work, budget_s=args.budget_s, only=args.only, series=args.series)
    for path in write_reports(args.results, suite):
        print(f"wrote {path}")
    bad = [o for o in outcomes if o.status in ("failed", "timeout")]
    for o in outcomes:
        print(f"{o.config:<32} {o.status}")
    return 1 if bad else 0


def _report(args) -> int:
    from bench.report import write_reports

    paths = write_reports(args.results, load_suite(args.suite))
    if not paths:
        raise BenchError(f"no records of {args.suite} under {args.results}")
    for path in paths:
        print(f"wrote {path}")
    return 0


def _predict(args) -> int:
    from bench.predict import write_predictions

    suite = load_suite(args.suite)
    if suite.kind == "chain":
        raise BenchError(f"{suite.name}: a chain's prediction is its first stage (python -m bench run writes it)")
    print(f"wrote {write_predictions(args.results, suite)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("list", help="list the suites, or one suite's configurations")
    p.add_argument("suite", nargs="?", help="a suite name")
    p = sub.add_parser("run", help="measure a suite's configurations not yet measured on this machine")
    p.add_argument("suite", help="a suite name or a TOML path")
    p.add_argument("--results", type=Path, default=RESULTS, help="results root (default bench/results)")
    p.add_argument("--work", type=Path, default=Path("/tmp/frod-bench"), help="scratch: checkpoints, stores, logs")
    p.add_argument("--budget-s", type=float, default=float("inf"), help="start nothing after this many seconds")
    p.add_argument("--only", default=None, help="globs over configuration names, comma-separated")
    p.add_argument(
        "--series", type=int, default=1, help="measure the suite again in a later call: series 2, 3, ... (own records)"
    )
    p = sub.add_parser("predict", help="write the planner's predictions for a suite, before it is measured")
    p.add_argument("suite", help="a suite name")
    p.add_argument("--results", type=Path, default=RESULTS, help="results root (default bench/results)")
    p = sub.add_parser("report", help="regenerate a suite's reports from its records")
    p.add_argument("suite", help="a suite name")
    p.add_argument("--results", type=Path, default=RESULTS, help="results root (default bench/results)")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "list":
            _list(args)
            return 0
        return {"run": _run, "predict": _predict}.get(args.cmd, _report)(args)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stopped: unwind, so the running configuration is killed
    sys.exit(main())
