"""A write the disk refused reaches the user as one line with advice that fits its cause: a full disk or quota
reported only in words (safetensors' Rust writer) is recognised as such, and a read-only disk or a place the user
may not write is not answered with "free space"."""

from __future__ import annotations

import errno
import os

import pytest
from safetensors import SafetensorError

from frod_ds.formats.building import building_dir
from frod_ds.runtime.atomic import disk_advice, disk_full_error, disk_full_line
from frod_ds.runtime.errors import FrodError


def _os_error(code: int, path: str = "/data/out") -> OSError:
    return OSError(code, os.strerror(code), path)


@pytest.mark.parametrize(
    ("message", "code"),
    [
        (
            'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })',
            errno.ENOSPC,
        ),
        ("I/O error: No space left on device (os error 28)", errno.ENOSPC),
        ("I/O error: Disk quota exceeded (os error 122)", errno.EDQUOT),
        ("write failed (os error 122)", errno.EDQUOT),
    ],
)
def test_a_full_disk_said_in_words_is_a_full_disk(tmp_path, message, code):
    """A writer that raises no OSError for a full disk or quota (the disk here has room: only the words tell)."""
    err = disk_full_error(tmp_path / "model.safetensors", SafetensorError(message))
    assert err is not None and err.errno == code
    assert err.filename == str(tmp_path / "model.safetensors")
    assert "free space on that disk" in disk_full_line(err)


@pytest.mark.parametrize("message", ["header too large", "I/O error: Permission denied (os error 13)", "os error 280"])
def test_other_writer_errors_are_not_a_full_disk(tmp_path, message):
    assert disk_full_error(tmp_path / "model.safetensors", SafetensorError(message)) is None


def test_building_dir_turns_a_worded_full_disk_into_one_line_and_leaves_nothing(tmp_path):
    """A full disk that safetensors reports as SafetensorError, on a disk the check of free space finds roomy
    (a big tensor that did not fit): the one disk-full line, and the partial output deleted."""
    out = tmp_path / "model"
    with pytest.raises(FrodError) as info:
        with building_dir(out, "hf-export") as tmp:
            (tmp / "model.safetensors").write_bytes(b"\0" * 1024)
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    line = str(info.value)
    assert line == (
        f"cannot write {out}: No space left on device; free space on that disk (or choose another location) "
        "(nothing was left behind)"
    )
    assert "\n" not in line and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("code", "advice"),
    [
        (errno.EROFS, "the disk is read-only: remount it writable or choose another location"),
        (errno.EACCES, "make it writable or choose another location"),
        (errno.EPERM, "make it writable or choose another location"),
        (errno.ENOSPC, "free space on that disk (or choose another location)"),
        (errno.EDQUOT, "free space on that disk (or choose another location)"),
    ],
)
def test_disk_advice_fits_the_cause(code, advice):
    assert disk_advice(_os_error(code)) == advice
    line = disk_full_line(_os_error(code))
    assert line == f"cannot write /data/out: {os.strerror(code)}; {advice} and re-run the same command"


def test_a_read_only_disk_is_not_told_to_free_space():
    line = disk_full_line(_os_error(errno.EROFS))
    assert "read-only" in line and "free space" not in line
