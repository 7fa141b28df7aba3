"""A FRoD model from a base checkpoint and a factor store: build, store access and verification, adapter files,
applying FRoD to a module tree."""

from frod_ds._moved import old_paths

__path__ = old_paths(__path__, __name__)  # old module paths, kept for one release
