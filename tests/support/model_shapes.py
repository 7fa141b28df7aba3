"""config.json contents of the model shapes the planner's and the CLI's tests plan for: LLaMA-2-7B and 70B as
published, and a tiny LLaMA of the same architecture."""

from __future__ import annotations

LLAMA2_7B = dict(
    model_type="llama",
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    vocab_size=32000,
)
LLAMA2_70B = dict(
    LLAMA2_7B,
    hidden_size=8192,
    intermediate_size=28672,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
)
TINY = dict(
    model_type="llama",
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=100,
)
