"""``python -m data_prep build|stats|show``: kept for existing commands and imports; the code is ``frod_ds.prep``
(``frod data ...``). Importing ``frod_ds`` makes the old module paths (``data_prep.io``, ...) resolve to it."""

import frod_ds  # noqa: F401  (installs the old-path table, frod_ds._compat)
from frod_ds.prep.io import read_rows
from frod_ds.prep.tasks import TASKS, DataPrepError

__all__ = ["TASKS", "DataPrepError", "read_rows"]
