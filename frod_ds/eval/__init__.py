"""Evaluation: log-likelihood and LLM-Adapters scoring, and the evaluation run."""
