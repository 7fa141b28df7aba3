"""Entry point: ``python -m data_prep build|stats|show``, the same as ``frod data ...`` (frod_ds/prep/command.py)."""

from frod_ds.cli.main import module_main

if __name__ == "__main__":
    module_main("data")
