"""The ``frod`` command (``frod_ds.cli.main``) and one module per subcommand; ``launch/*.py`` are thin shims."""
