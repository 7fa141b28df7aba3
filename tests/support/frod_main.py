"""``python tests/support/frod_main.py ARGS`` is ``frod ARGS``: the command as a script, so
``tests.support.ranks.run`` (which starts scripts) can fork it from a test worker whose imports are paid."""

from frod_ds.cli.main import console

if __name__ == "__main__":
    console()
