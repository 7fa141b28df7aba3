"""``python -m data_prep build|stats|show``: the data-prep script form of ``frod data``; the code is
``frod_ds.prep``. The module paths ``data_prep.io``, ``data_prep.build``, ... are kept for one release
(``frod_ds._moved``)."""

from frod_ds.prep.rows import read_rows
from frod_ds.prep.tasks import TASKS, DataPrepError

__all__ = ["TASKS", "DataPrepError", "read_rows"]
