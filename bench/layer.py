"""FRoDLinear fwd+bwd vs a frozen nn.Linear vs a LoRA r=16 layer (bf16, one GPU).

    python -m bench.layer                       # 4096x4096, 8192 tokens (the issue's shape)
    python -m bench.layer --tokens 2048 4096 8192 --out bench/results

Every variant computes dx (the input requires grad, as inside a network) and the gradients of its own
trainable tensors. Ratios are against the frozen layer measured in the same process.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

from bench.common import time_fn, write_result
from frod_ds import FRoDLinear, SparseSupport, decompose


class LoRALinear(nn.Module):
    """Frozen W plus B A, rank r, scale alpha/r (the LoRA baseline)."""

    def __init__(self, base: nn.Linear, r: int = 16, alpha: float = 32.0):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.A = nn.Parameter(torch.randn(r, base.in_features, device=base.weight.device, dtype=base.weight.dtype) / r)
        self.B = nn.Parameter(torch.zeros(base.out_features, r, device=base.weight.device, dtype=base.weight.dtype))
        self.scale = alpha / r

    def forward(self, x):
        return self.base(x) + F.linear(F.linear(x, self.A), self.B) * self.scale


def measure(layer: nn.Module, tokens: int, n: int, dtype, device) -> dict:
    x = torch.randn(tokens, n, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(tokens, layer(x).shape[-1], device=device, dtype=dtype)

    def step():
        x.grad = None
        for p in layer.parameters():
            p.grad = None
        layer(x).backward(dy)

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base_mem = torch.cuda.memory_allocated()
    t = time_fn(step)
    if device.type == "cuda":
        t["peak_extra_mb"] = (torch.cuda.max_memory_allocated() - base_mem) / 2**20
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=4096, help="input = output width of the layer")
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192], help="tokens per call (batch x seq)")
    ap.add_argument("--sparsity", type=float, default=0.02, help="density s of S")
    ap.add_argument("--out", default=None, help="results dir (default $OUT or bench/results)")
    args = ap.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    W = torch.randn(args.n, args.n, device=device) / args.n**0.5
    res = decompose([W], dtype=torch.float32)
    V = nn.Parameter(res.V.to(dtype), requires_grad=False)
    support = SparseSupport.random(args.n, args.sparsity, seed=0)
    frod = FRoDLinear(res.U[0].to(dtype), V, res.sigma[0], support).to(device)
    with torch.no_grad():
        frod.frod_s.normal_(std=1e-3)
    frozen = nn.Linear(args.n, args.n, bias=False, device=device, dtype=dtype).requires_grad_(False)
    lora = LoRALinear(nn.Linear(args.n, args.n, bias=False, device=device, dtype=dtype))

    rows = []
    for tokens in args.tokens:
        row = {
            "tokens": tokens,
            "frozen": measure(frozen, tokens, args.n, dtype, device),
            "lora_r16": measure(lora, tokens, args.n, dtype, device),
        }
        for mode in ("tokens", "weight", "auto"):
            frod.mode = mode
            row[f"frod_{mode}"] = measure(frod, tokens, args.n, dtype, device)
        base = row["frozen"]["median_ms"]
        row["ratio_vs_frozen"] = {
            k: row[k]["median_ms"] / base for k in row if isinstance(row[k], dict) and "median_ms" in row[k]
        }
        row["ratio_vs_lora"] = {k: row[k]["median_ms"] / row["lora_r16"]["median_ms"] for k in row["ratio_vs_frozen"]}
        rows.append(row)
        print(f"tokens={tokens}: " + ", ".join(f"{k} {v:.2f}x" for k, v in row["ratio_vs_frozen"].items()))
    payload = {
        "shape": [args.n, args.n],
        "dtype": str(dtype),
        "sparsity": args.sparsity,
        "hjd_max_rel_error_fp32": max(res.error),
        "rows": rows,
        "target": "FRoDLinear (auto) fwd+bwd <= 3x the frozen layer at 8192 tokens",
    }
    print(write_result("layer", payload, args.out))


if __name__ == "__main__":
    main()
