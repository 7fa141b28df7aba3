"""How every launch script runs: process group, user errors as one line, bugs as tracebacks, teardown.

    from frod_ds import entry

    def main(argv=None) -> int:
        args = parse_args(argv)
        return entry.run(lambda: work(args))          # joins the launcher's process group first

``run`` calls ``body`` and returns the process's exit code:

- ``body``'s return value (``None`` is 0);
- 2 for a user mistake (``FrodError``): a ``CollectiveError`` (every rank knows it: ``distributed.on_all``,
  ``on_main``, ``agree_on_error``) is printed once, by rank 0; any other ``FrodError`` by the rank that
  raised it, prefixed with ``[rank r]`` when there are several (the launcher then stops the others);
- anything else is a bug: it propagates, so Python prints its traceback on the rank where it happened and
  the process exits with 1.

The process group is left in every case.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from frod_ds import distributed as D
from frod_ds.errors import FrodError

__all__ = ["USER_ERROR", "run", "report"]

USER_ERROR = 2  # exit status of a user mistake


def report(error: FrodError) -> None:
    """Print the one ``error:`` line of ``error`` where it belongs (see the module docstring)."""
    if isinstance(error, D.CollectiveError):
        if D.is_main():
            print(f"error: {error}", file=sys.stderr, flush=True)
        return
    where = f"[rank {D.get_rank()}] " if D.get_world_size() > 1 else ""
    print(f"error: {where}{error}", file=sys.stderr, flush=True)


def run(body: Callable[[], int | None], *, init_group: bool = True, backend: str | None = None) -> int:
    """Run a launch script's ``body`` (see the module docstring). ``init_group``: join the launcher's
    process group first (``distributed.init_distributed(backend)``); pass False when ``body`` sets up its
    own (training: cheap checks first, then DeepSpeed's group)."""
    try:
        if init_group:
            D.init_distributed(backend)
        code = body()
        return 0 if code is None else int(code)
    except FrodError as e:
        report(e)
        if isinstance(e, D.CollectiveError):
            D.barrier()  # rank 0 has printed before any rank leaves
        return USER_ERROR
    finally:
        D.destroy()
