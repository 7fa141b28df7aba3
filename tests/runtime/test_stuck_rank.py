"""A rank that stops answering (a hung node, SIGSTOP) must not hold the others forever: each collective waits at
most ``FROD_COLLECTIVE_TIMEOUT_MIN`` minutes, then the rank that waited says so in one line and the job ends."""

from __future__ import annotations

from pathlib import Path

from tests.support import ranks
from tests.support.leftovers import clean_env

REPO = Path(__file__).resolve().parents[2]
SCRIPT = str(REPO / "tests" / "support" / "stuck_rank.py")


def test_a_stuck_rank_ends_the_job_after_the_collective_timeout_with_one_line():
    env = {**clean_env(), "FROD_COLLECTIVE_TIMEOUT_MIN": "0.05", "STUCK_S": "60"}  # 3 s against a 60 s stall
    res = ranks.run(2, [SCRIPT], env, REPO, 50)
    assert res.returncode == 1, res.stdout + res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in res.stderr, res.stderr
    assert "a collective waited 0.05 minutes for another rank of this job" in errors[0]
    assert "FROD_COLLECTIVE_TIMEOUT_MIN sets the wait" in errors[0]
    assert "passed the barrier" not in res.stdout


def test_a_slow_rank_within_the_timeout_is_waited_for():
    env = {**clean_env(), "FROD_COLLECTIVE_TIMEOUT_MIN": "0.5", "STUCK_S": "2"}
    res = ranks.run(2, [SCRIPT], env, REPO, 50)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "rank 0 passed the barrier" in res.stdout and "rank 1 passed the barrier" in res.stdout, res.stdout


def test_a_timeout_that_is_no_number_of_minutes_is_one_line():
    env = {**clean_env(), "FROD_COLLECTIVE_TIMEOUT_MIN": "ten", "STUCK_S": "0"}
    res = ranks.run(2, [SCRIPT], env, REPO, 50)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert "FROD_COLLECTIVE_TIMEOUT_MIN='ten' is no number of minutes (> 0)" in res.stderr
