"""Commonsense170K data preparation (``frod data``) in the FRoD paper's or LLM-Adapters' prompt templates.

Modules: `tasks` (task keys, Hub ids, eval splits), `templates` (pure rendering per task),
`llm_adapters` (LLM-Adapters' instruction format and prompts), `sources` (Hub, local-mirror and
LLM-Adapters file reading), `dataset` (mixture, manifest, atomic write),
`rows` (the output row format and its reader `read_rows`), `tokens` (token-length checks),
`command` (``frod data build|stats|show``).
"""

from frod_ds._moved import old_paths

__path__ = old_paths(__path__, __name__)  # old module paths, kept for one release
