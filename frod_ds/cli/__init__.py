"""The ``frod`` command (``frod_ds.cli.main``) and one module per subcommand."""
