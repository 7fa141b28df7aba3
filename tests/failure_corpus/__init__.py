"""The failure-policy corpus: commands a careless user would type, and the runner that counts what they do."""
