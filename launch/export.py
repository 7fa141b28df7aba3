"""``frod export``, in the form older commands and scripts use (``launch/export.py``); the code is
frod_ds/cli/export.py."""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file from a checkout: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from frod_ds.cli.main import launch_shim  # noqa: E402

launch_shim(__name__, "export")
