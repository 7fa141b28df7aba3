"""The module form ``frod_ds.cli`` of ``frod``, deprecated in 0.2.0 and gone in 0.3.0: one stderr line, then
``frod`` (the module form that stays is ``frod_ds``)."""

from frod_ds.cli.main import console

if __name__ == "__main__":
    console(old_form=f"python -m {__spec__.parent}")
