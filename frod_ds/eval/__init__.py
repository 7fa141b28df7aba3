"""Evaluation: log-likelihood and LLM-Adapters scoring, and the evaluation run."""

from frod_ds._moved import old_paths

__path__ = old_paths(__path__, __name__)  # old module paths, kept for one release
