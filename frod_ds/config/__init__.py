"""The typed recipe (YAML + dotted overrides) and the one reader of the DeepSpeed JSON."""
