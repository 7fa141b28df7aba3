"""frod-ds's own small records (a store's manifest, an adapter's config, an output's ownership record) read only
when they are regular UTF-8 files of a sane size: a named pipe there blocked the read, a link to /dev/zero filled
the memory, a byte that is no UTF-8 gave a traceback. Each is one error naming the file, at once."""

from __future__ import annotations

import time

import pytest

from frod_ds.formats.adapter_dir import AdapterConfig
from frod_ds.formats.factor_store import Manifest
from frod_ds.formats.output_dir import MARKER, read_record
from frod_ds.runtime.errors import AdapterError, StoreError
from tests.support.odd_files import ODD_ENTRIES, plant

KINDS = [k for k in ODD_ENTRIES if k != "dangling link"]  # a link to nothing: no file, as if none were there


@pytest.mark.parametrize("kind", KINDS)
def test_a_manifest_or_adapter_config_that_is_no_text_file_is_one_error_at_once(tmp_path, kind):
    for reader, error, name in ((Manifest.read, StoreError, "manifest.json"), (AdapterConfig.read, AdapterError, "c")):
        path = tmp_path / name
        plant(path, kind)
        t0 = time.monotonic()
        with pytest.raises(error, match=str(path)) as e:
            reader(path)
        assert time.monotonic() - t0 < 5 and "damaged" in str(e.value)


@pytest.mark.parametrize("kind", KINDS)
def test_an_ownership_record_that_is_no_text_file_is_a_record_of_no_kind(tmp_path, kind):
    plant(tmp_path / MARKER, kind)
    t0 = time.monotonic()
    record = read_record(tmp_path)
    assert record is not None and record.kind is None and time.monotonic() - t0 < 5
