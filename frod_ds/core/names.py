"""The names the method's settings take, each defined once (torch-free): the linear modules of a LLaMA block,
the default FRoD targets, the kinds of frozen-weight quantization."""

from __future__ import annotations

__all__ = ["LLAMA_LINEARS", "DEFAULT_TARGETS", "QUANT_KINDS"]

# every nn.Linear of a LLaMA decoder layer, by its last path component
LLAMA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# the FRoD paper's targets: all of them but down_proj (each one category of members across layers, spec §1)
DEFAULT_TARGETS = LLAMA_LINEARS[:6]
# model.frozen_quant / --quant: the frozen U_i and untargeted weights as stored, in bf16/fp32, int8 or NF4
QUANT_KINDS = ("none", "int8", "nf4")
