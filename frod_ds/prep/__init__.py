"""Commonsense170K data preparation (``frod data``) in the FRoD paper's or LLM-Adapters' prompt templates.

Modules: `tasks` (task keys, Hub ids, eval splits), `templates` (pure rendering per task),
`llm_adapters` (LLM-Adapters' instruction format and prompts), `sources` (Hub, local-mirror and
LLM-Adapters file reading), `build` (mixture, manifest, atomic write),
`io` (the output row format and its reader `read_rows`), `tokens` (token-length checks),
`cli` (``frod data build|stats|show``).
"""
