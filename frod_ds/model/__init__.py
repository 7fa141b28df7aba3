"""A FRoD model from a base checkpoint and a factor store: build, store access and verification, adapter files,
applying FRoD to a module tree."""
