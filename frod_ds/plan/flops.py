"""Model FLOPs per training token of a LLaMA-shaped model under FRoD and under LoRA, for MFU estimates.

Multiply-adds per token, reported as FLOPs = 2 · MACs: the frozen base's forward and backward to its inputs, plus
each method's own work (LoRA's B A x, FRoD's z = Vᵀx, h = M z and ∂M in the token or the weight order).
Gradient-checkpointing recomputation is not model work and is not counted. The count term by term: docs/memory.md.
"""

from __future__ import annotations

from frod_ds.core.names import DEFAULT_TARGETS

TARGET_SHAPES = DEFAULT_TARGETS  # the FRoD targets counted unless a caller names others

# Dense bf16 tensor-core peaks (no sparsity), FLOP/s, by a substring of torch.cuda.get_device_name().
PEAK_BF16 = [
    ("H100 PCIe", 756e12),
    ("H100", 989.4e12),
    ("H200", 989.4e12),
    ("GH200", 989.4e12),
    ("A100", 312e12),
    ("L40S", 362e12),
]


def peak_bf16_flops(device_name: str) -> float | None:
    for key, peak in PEAK_BF16:
        if key in device_name:
            return peak
    return None


def linear_shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """``{name: (m, n)}`` (out, in) of one decoder layer's linears."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or h // heads
    return {
        "q_proj": (heads * head_dim, h),
        "k_proj": (kv * head_dim, h),
        "v_proj": (kv * head_dim, h),
        "o_proj": (h, heads * head_dim),
        "gate_proj": (inter, h),
        "up_proj": (inter, h),
        "down_proj": (h, inter),
    }


def lora_target_macs(m: int, n: int, r: int) -> float:
    """Extra MACs per token of one LoRA target: B A x forward, backward to x, ∂A and ∂B."""
    return 3 * r * (m + n)


def frod_target_macs(m: int, n: int, nnz: int, tokens_per_call: int, save: str, dgrad: str) -> float:
    """Extra MACs per token of one FRoD target over the frozen linear it replaces (see the module docstring)."""
    from frod_ds.core.sizes import ordering

    if ordering(tokens_per_call, m, n, True, recompute=save == "x") == "weight":
        return m * n + 4 * m * n * n / tokens_per_call
    dmat = n * n if dgrad == "dense" else n + nnz
    return 4 * n * n + dmat + (n * n if save == "x" else 0)


def flops_per_token(
    cfg: dict,
    seq: int,
    method: str,
    tokens_per_call: int,
    *,
    targets=TARGET_SHAPES,
    lora_r: int = 16,
    sparsity: float = 0.02,
    save: str = "z",
    dgrad: str = "dense",
) -> dict:
    """Model FLOPs per training token: base forward, base backward to inputs, adapter, total."""
    L, h, vocab = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]
    shapes = linear_shapes(cfg)
    n_mm = L * sum(m * n for m, n in shapes.values()) + vocab * h  # MACs per token, forward
    attn = L * seq * h  # causal QKᵀ + PV per token, forward
    adapter = 0.0
    for t in targets:
        m, n = shapes[t]
        if method == "lora":
            adapter += L * lora_target_macs(m, n, lora_r)
        elif method == "frod":
            adapter += L * frod_target_macs(m, n, int(round(sparsity * n * n)), tokens_per_call, save, dgrad)
        else:
            raise ValueError(f"method must be frod or lora, got {method!r}")
    out = {"base_forward": 2 * (n_mm + attn), "base_backward_to_input": 2 * (n_mm + 2 * attn), "adapter": 2 * adapter}
    out["total"] = sum(out.values())
    out["formula"] = __doc__.split("\n\n", 2)[1].strip()
    return out
