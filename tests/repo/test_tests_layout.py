"""tests/ mirrors the project: every sub-directory is named after what its tests cover (a frod_ds sub-package,
launch/slurm, bench, or the repository as a whole), shared helpers live in tests/support and data in tests/fixtures,
and no test file sits flat in tests/. A new test file therefore has exactly one obvious home."""

from __future__ import annotations

from tests.support import pace
from tests.support.leftovers import REPO

TESTS = REPO / "tests"
# The directories that are not frod_ds sub-packages, each with the part of the repository it tests.
OTHER_PARTS = {"slurm": "launch/slurm", "bench": "bench", "studies": "studies", "repo": "."}
# Not tests: helpers imported by tests or run by them as scripts, and data files.
NOT_TESTS = {"support", "fixtures", "failure_corpus"}


def _frod_parts() -> set[str]:
    return {p.name for p in (REPO / "frod_ds").iterdir() if (p / "__init__.py").is_file() and p.name[0] != "_"}


def _test_dirs() -> set[str]:
    return {p.name for p in TESTS.iterdir() if p.is_dir() and p.name != "__pycache__"}


def test_every_tests_directory_names_a_part_of_the_project():
    unknown = sorted(_test_dirs() - _frod_parts() - OTHER_PARTS.keys() - NOT_TESTS)
    assert not unknown, (
        f"tests/{unknown[0]}/ names no part of the project: name a test directory after a frod_ds "
        f"sub-package ({', '.join(sorted(_frod_parts()))}) or one of {sorted(OTHER_PARTS)}"
    )
    for name, target in OTHER_PARTS.items():
        assert (REPO / target).is_dir(), f"tests/{name}/ tests {target}/, which does not exist"


def test_every_frod_ds_sub_package_has_its_test_directory():
    missing = sorted(_frod_parts() - _test_dirs())
    assert not missing, f"frod_ds sub-packages without tests/<name>/: {missing}"


def test_no_test_file_is_left_flat_or_outside_a_part():
    flat = sorted(p.name for p in TESTS.glob("*.py") if p.name not in {"conftest.py", "__init__.py"})
    assert not flat, f"files flat in tests/ (move each into the directory of the part it tests): {flat}"
    hidden = sorted(str(p.relative_to(TESTS)) for d in NOT_TESTS for p in (TESTS / d).rglob("test_*.py"))
    assert not hidden, f"test files under a helper or data directory are never collected as tests: {hidden}"


def test_every_test_directory_is_a_package_with_unique_file_names():
    """Each directory is a package, so files import as tests.<part>.<module>; basenames stay unique across the
    tree so a file name alone (in --durations, -k, a junit record or a doc) says which file is meant."""
    dirs = sorted(_test_dirs() - {"fixtures"})
    no_init = [d for d in dirs if not (TESTS / d / "__init__.py").is_file()]
    assert not no_init, f"tests/<dir>/__init__.py missing for {no_init}"
    seen: dict[str, str] = {}
    for d in dirs:
        for p in sorted((TESTS / d).glob("test_*.py")):
            assert p.name not in seen, f"tests/{d}/{p.name} and tests/{seen[p.name]}/{p.name} share a name"
            seen[p.name] = d
    assert seen, "no test files found under tests/<part>/"


def test_an_unknown_test_order_is_one_usage_error_also_under_xdist():
    """``FROD_TEST_ORDER`` is checked before xdist starts its workers: a typo ends the run with pytest's usage error
    (exit 4) naming the value and the accepted ones, not with an xdist internal error from a crashed worker."""
    import subprocess
    import sys

    from tests.support.leftovers import clean_env

    for workers in ([], ["-n", "2"]):
        res = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                *workers,
                "tests/repo/test_tests_layout.py::test_every_tests_directory_names_a_part_of_the_project",
            ],
            cwd=REPO,
            env=clean_env(FROD_TEST_ORDER="shuff:7"),
            capture_output=True,
            text=True,
            timeout=pace.scaled(120),
        )
        out = res.stdout + res.stderr
        assert res.returncode == 4 and "INTERNALERROR" not in out, (workers, res.returncode, out[-2000:])
        assert "FROD_TEST_ORDER='shuff:7': use normal, reverse, shuffle or shuffle:SEED" in out, out[-2000:]


def test_a_test_or_shared_fixture_past_the_time_limit_fails_in_every_order(tmp_path):
    """tests/conftest.py fails a test whose own set-up and call took longer than FROD_TEST_LIMIT_S (120 s unless set),
    and the test during whose set-up a module fixture took longer than that to build. The fixture is not charged
    to the tests that use it after it is built, so the same number of tests fail in either order (the fixture's
    error falls on whichever test builds it); the report's header names the limit."""
    import re
    import subprocess
    import sys

    from tests.support.leftovers import clean_env

    (tmp_path / "test_limit.py").write_text(
        "import time\nimport pytest\n\n\n"
        "@pytest.fixture(scope='module')\ndef built():\n    time.sleep(2)\n\n\n"
        "def test_quick():\n    pass\n\n\n"
        "def test_slow_call():\n    time.sleep(2)\n\n\n"
        "def test_slow_setup(built):\n    time.sleep(1)\n\n\n"
        "def test_setup_already_built(built):\n    pass\n"
    )
    # normal: test_slow_setup builds the fixture; shuffle:1 runs test_setup_already_built first
    for order, builder in (("normal", "test_slow_setup"), ("shuffle:1", "test_setup_already_built")):
        res = subprocess.run(
            [sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", "-p", "tests.conftest", str(tmp_path)],
            cwd=REPO,
            env=clean_env(FROD_TEST_LIMIT_S="1.5", FROD_TEST_ORDER=order, FROD_TEST_PACE="1"),
            capture_output=True,
            text=True,
            timeout=pace.scaled(120),
        )
        out = res.stdout + res.stderr
        assert res.returncode == 1 and "1 failed, 2 passed, 1 error" in out, out[-2000:]  # set-ups' are errors
        assert "time limit per test and per shared fixture's set-up: 1.5 s (FROD_TEST_LIMIT_S)" in out, out[-2000:]
        assert re.search(r"test_slow_call took 2\.\d s \(its own set-up 0\.\d s\), over the 1\.5 s", out), out
        assert re.search(rf"{builder}: fixture 'built' \(module\) took 2\.\d s to set up, over the 1\.5 s", out), out
        outcomes = dict((name, what) for what, name in re.findall(r"^(PASSED|FAILED|ERROR) \S+::(\w+)", out, re.M))
        others = {"test_slow_setup", "test_setup_already_built"} - {builder}
        assert outcomes == {
            "test_quick": "PASSED",
            "test_slow_call": "FAILED",
            builder: "ERROR",
            **dict.fromkeys(others, "PASSED"),
        }, outcomes


def test_the_time_limit_scales_with_the_machines_pace(tmp_path):
    """At pace 2 (FROD_TEST_PACE, else measured) a 1.5 s limit allows 3 s: a 2 s test passes that fails at pace 1
    (the test above); the header says the pace, and a pace below 1 is a usage error before any test runs."""
    import subprocess
    import sys

    from tests.support.leftovers import clean_env

    (tmp_path / "test_paced.py").write_text("import time\n\n\ndef test_two_seconds():\n    time.sleep(2)\n")
    runs = {}
    for value in ("2", "0.5"):
        runs[value] = subprocess.run(
            [sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", "-p", "tests.conftest", str(tmp_path)],
            cwd=REPO,
            env=clean_env(FROD_TEST_LIMIT_S="1.5", FROD_TEST_PACE=value),
            capture_output=True,
            text=True,
            timeout=pace.scaled(120),
        )
    two, half = (runs[v].stdout + runs[v].stderr for v in ("2", "0.5"))
    assert runs["2"].returncode == 0 and "1 passed" in two, two[-2000:]
    assert "this machine's pace: 2 (given; FROD_TEST_PACE)" in two, two[-2000:]
    assert runs["0.5"].returncode == 4 and "FROD_TEST_PACE='0.5': use a number of at least 1" in half, half[-2000:]
    assert (pace.from_probe(3.5), pace.from_probe(14.0), pace.from_probe(1e3)) == (1.0, 2.0, pace.MAX_PACE)


def test_a_test_past_a_measured_pace_is_judged_at_the_pace_measured_when_it_ended(tmp_path):
    """A measured pace (FROD_TEST_PACE_MEASURED equal to FROD_TEST_PACE) is taken again for a test past its limit:
    the probe here says 14 s (pace 2), so a 2 s test passes a 1.5 s limit set at pace 1. A given pace is final."""
    import subprocess
    import sys

    from tests.support.leftovers import clean_env

    (tmp_path / "conftest.py").write_text("from tests.support import pace\n\npace.measure = lambda env: 14.0\n")
    (tmp_path / "test_slowed.py").write_text("import time\n\n\ndef test_two_seconds():\n    time.sleep(2)\n")
    codes = {}
    for measured in ("1", ""):
        res = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest", str(tmp_path)],
            cwd=REPO,
            env=clean_env(FROD_TEST_LIMIT_S="1.5", FROD_TEST_PACE="1", FROD_TEST_PACE_MEASURED=measured),
            capture_output=True,
            text=True,
            timeout=pace.scaled(120),
        )
        codes[measured] = res.returncode, res.stdout + res.stderr
    assert codes["1"][0] == 0, codes["1"][1][-2000:]
    assert codes[""][0] == 1 and "over the 1.5 s a test may take" in codes[""][1], codes[""][1][-2000:]
