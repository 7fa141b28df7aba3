"""Entry point: ``python -m data_prep build|stats|show``, the same as ``frod data ...`` (frod_ds/prep/command.py)."""

import sys

from frod_ds.prep.command import main

if __name__ == "__main__":
    sys.exit(main())
