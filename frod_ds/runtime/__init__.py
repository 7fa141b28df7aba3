"""Process-level helpers every stage uses: typed user errors, atomic writes and the overwrite markers, the
checks of the method's settings, the launcher's environment, torch.distributed helpers, the entry wrapper."""
