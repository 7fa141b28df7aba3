"""``python -m frod_ds COMMAND ...`` is ``frod COMMAND ...`` (``python -m frod_ds plan`` among them)."""

from frod_ds.cli.main import console

if __name__ == "__main__":
    console()
