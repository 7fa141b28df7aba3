"""An output whose name is legal but long (up to 255 bytes) is written like any other: the names frod-ds derives
beside it (its lease, the lease's temporary, the folders it builds in and moves the old output aside into) are cut
short with a digest of the whole name where they would pass the 255-byte limit, the same in every writer, so two
writers of that output still exclude each other and a dead writer's leftovers are still found."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from frod_ds.formats.building import _build_prefix, building_dir
from frod_ds.formats.lease import LEASE, acquire, holding, lease_path
from frod_ds.formats.output_dir import read_record
from frod_ds.formats.ownership import mark_dir
from frod_ds.formats.sibling_names import fitted_name
from frod_ds.runtime.errors import FrodError
from tests.support.leftovers import REPO, clean_env

HOLD = """
import sys, time
from frod_ds.formats.lease import acquire
lease = acquire(sys.argv[1], "data-build")
print("held", flush=True)
time.sleep(60)
"""

NAMES = {"ascii": "d" * 250, "two-byte characters": "\u00e9" * 127, "255 bytes": "n" * 255}


def build(out: Path, text: str) -> None:
    with holding(out, "data-build"), building_dir(out, "data-build") as tmp:
        (tmp / "train.jsonl").write_text(text)
        (tmp / "manifest.json").write_text("{}")


@pytest.mark.parametrize("name", sorted(NAMES))
def test_an_output_with_a_long_name_is_built_and_replaced(tmp_path, name):
    out = tmp_path / NAMES[name]
    build(out, "first")
    build(out, "second")  # replaces the first: the old one moved aside, then deleted
    assert (out / "train.jsonl").read_text() == "second" and read_record(out).kind == "data-build"
    assert [p.name for p in tmp_path.iterdir()] == [out.name]  # no lease, staging or aside folder left


def test_two_writers_of_an_output_with_a_long_name_exclude_each_other(tmp_path):
    out = tmp_path / ("w" * 250)
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(out)],
        cwd=REPO,
        env={**clean_env(), "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "held"
        path = lease_path(out)
        assert path.is_file() and path.name.endswith(LEASE) and len(os.fsencode(path.name)) <= 255
        with pytest.raises(FrodError, match=f"is being written by frod data build \\(pid {proc.pid} "):
            acquire(out, "data-build")
    finally:
        proc.kill()
        proc.wait()


def test_a_dead_builders_folder_of_a_long_named_output_is_swept(tmp_path):
    out = tmp_path / ("s" * 250)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    left = tmp_path / f"{_build_prefix(out)}{dead.pid}-abcd_123"
    left.mkdir()
    mark_dir(left, "hf-export")  # what a build's folder holds from its start
    build(out, "first")
    assert not left.exists() and [p.name for p in tmp_path.iterdir()] == [out.name]


def test_a_fitted_name_is_the_whole_name_when_it_fits_and_one_name_per_output_when_not():
    assert fitted_name(".run", LEASE) == ".run.frod-ds-lease"
    long_a, long_b = fitted_name("." + "a" * 250, LEASE, 9), fitted_name("." + "a" * 249 + "b", LEASE, 9)
    assert long_a == fitted_name("." + "a" * 250, LEASE, 9) and long_a != long_b
    assert all(len(os.fsencode(n)) + 9 <= 255 and n.endswith(LEASE) for n in (long_a, long_b))


def test_a_factor_store_with_a_255_byte_name_is_built_and_overwritten(tmp_path):
    """HJD's aside for ``--overwrite`` (``.NAME.replaced``) is a derived name too: a 255-byte store name built the
    whole store, then failed on it (that name 265 bytes) with exit 2."""
    from tests.support.helpers_ckpt import write_tiny_llama

    model = write_tiny_llama(tmp_path / "model")
    out = tmp_path / "stores" / ("s" * 255)
    hjd = [sys.executable, "-m", "frod_ds", "hjd", "--device", "cpu", "--model", str(model), "--out", str(out)]
    env = {**clean_env(), "PYTHONPATH": str(REPO)}
    for extra in ([], ["--overwrite"]):
        run = subprocess.run(hjd + extra, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr[-2000:]
        assert read_record(out).kind == "factor-store" and [p.name for p in out.parent.iterdir()] == [out.name]
