"""A ``launch/`` script's command line with the arguments in ``RANK1_EXTRA`` (space-separated) added on rank 1 only:
nodes that read different copies of a recipe, or a launcher script passing one rank other flags
(tests/train/test_ranks_agree.py, tests/hjd/test_distributed_hjd_errors.py, tests/eval/test_eval_ranks.py).
``RANK_ARGS_LAUNCH`` names the script (``train.py`` unless set); ``RANK_CWD``, where set, is each rank's working
directory with ``{rank}`` in it (one relative path naming another copy of a file on each rank)."""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

if __name__ == "__main__":
    if os.environ.get("RANK_CWD"):
        os.chdir(os.environ["RANK_CWD"].format(rank=os.environ["RANK"]))
    if os.environ.get("RANK") == "1":
        sys.argv += os.environ.get("RANK1_EXTRA", "").split()
    sys.argv[0] = str(REPO / "launch" / os.environ.get("RANK_ARGS_LAUNCH", "train.py"))
    runpy.run_path(sys.argv[0], run_name="__main__")
