"""``frod`` run as a module, for launchers that start a module rather than a program (docs/commands.md)."""

from frod_ds.cli.main import console

if __name__ == "__main__":
    console()
