"""``launch/train.py``'s command line, with the overrides in ``RANK1_EXTRA`` (space-separated) added on rank 1 only:
nodes that read different copies of a recipe (tests/train/test_ranks_agree.py)."""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

if __name__ == "__main__":
    if os.environ.get("RANK") == "1":
        sys.argv += os.environ["RANK1_EXTRA"].split()
    sys.argv[0] = str(REPO / "launch" / "train.py")
    runpy.run_path(sys.argv[0], run_name="__main__")
