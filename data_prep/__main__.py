"""Entry point: ``python -m data_prep build|stats|show`` (see data_prep/cli.py)."""

import sys

from data_prep.cli import main

if __name__ == "__main__":
    sys.exit(main())
