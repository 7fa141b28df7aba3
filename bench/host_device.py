"""How much of a FRoD step is the host's work and how much the GPU's: the measurement behind the step-time model's
``max(host, device)`` form (``frod_ds/plan/step_time.py``).

    python -m bench.host_device --out $OUT                       # 7B widths × 8 layers and 70B widths × 4, one GPU
    python -m bench.host_device --tiny --out /tmp/hd             # CPU rehearsal (host and device are one there)
    python -m bench.host_device --shapes 7b --quants none --steps 5 --out DIR   # the chains' per-call host probe

A stack of LLaMA decoder layers (transformers' own, FRoD on q/k/v/o/gate/up as ``frod_ds.model`` applies it, random
factors: timing does not depend on values) trains one step under plain PyTorch: forward, loss, backward, AdamW. Per
configuration (frozen U_i in bf16, NF4 or int8; optionally the untargeted base quantized too):

- ``step_ms``: the step as the trainer runs it (median of wall times, synchronized, the GPU idle before each step);
- ``device_ms``: the GPU time of the same work with the launch queue filled ahead of it (a sleep kernel queued first
  holds the GPU while the host queues up to the queue's depth): the work's device time where the host keeps ahead;
- ``host``: the same step on one short sequence (``--host-tokens``, default 1 × 8): the GPU's share shrinks to
  what does not scale with tokens (dequantization, the n×n work), so the step time there is the host's time to
  issue a step (when it exceeds that run's device time, as the row shows).

A step is at least max(host, device); where the two are close, host jitter makes it slower than either.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from bench.common import write_result
from frod_ds.core.layer import FRoDLinear, SparseSupport
from frod_ds.core.names import DEFAULT_TARGETS
from frod_ds.core.quant import QuantSpec, quantize_untargeted, quantized_parameter, spec_of

SHAPES = {  # name: (hidden, intermediate, heads, kv_heads, layers, micro-batch, seq, checkpointing)
    "7b": (4096, 11008, 32, 32, 8, 4, 512, False),
    "70b": (8192, 28672, 64, 8, 4, 4, 256, True),
    "tiny": (64, 160, 4, 2, 2, 2, 16, False),
}
# (frozen U_i, base quantized too)
QUANTS = [("none", False), ("nf4", False), ("nf4", True), ("int8", False), ("int8", True)]


def build(shape: str, quant: str, base: bool, device: torch.device, dtype: torch.dtype, sparsity: float):
    """A LLaMA model of ``shape`` with FRoD layers on the default targets (random U, V, σ; S zero)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, inter, heads, kv, layers, *_ = SHAPES[shape]
    cfg = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        vocab_size=32000,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype)
    model.requires_grad_(False)
    shared: dict[tuple[str, int], tuple[nn.Parameter, SparseSupport]] = {}
    for name, mod in list(model.named_modules()):
        leaf = name.rpartition(".")[2]
        if leaf not in DEFAULT_TARGETS or not isinstance(mod, nn.Linear):
            continue
        m, n = mod.out_features, mod.in_features
        if (leaf, n) not in shared:
            V = nn.Parameter(torch.linalg.qr(torch.randn(n, n, device=device))[0].to(dtype), requires_grad=False)
            shared[(leaf, n)] = (V, SparseSupport.random(n, sparsity, seed=len(shared)))
        V, support = shared[(leaf, n)]
        U = torch.randn(m, n, device=device) / n**0.5
        if quant != "none":
            spec = QuantSpec(quant, (m, n))
            q = quantized_parameter(spec, dtype, device)
            q.data.copy_(spec.pack(U).view(dtype))
            U = q
        else:
            U = U.to(dtype)
        new = FRoDLinear(U, V, torch.ones(n, device=device), support).to(device)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, new)
    if base and quant != "none":
        dense = {
            n: m.weight.detach().clone()
            for n, m in model.named_modules()
            if type(m) is nn.Linear and ".layers." in f".{n}"
        }
        for name in quantize_untargeted(model, quant, dtype):
            w = model.get_submodule(name).weight
            w.data = w.data.to(device)
            w.data.copy_(spec_of(w).pack(dense[name].float()).view(dtype))
    return model


def measure(
    model, shape: str, device: torch.device, steps: int, windows: int, tokens: tuple[int, int] | None = None
) -> dict:
    """Step and device milliseconds (medians; every value under ``all``) of ``steps`` × ``windows`` training steps on
    the shape's micro-batch, or on ``tokens`` = (batch, seq) instead."""
    *_, batch, seq, _ = SHAPES[shape]
    batch, seq = tokens or (batch, seq)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=device)

    def step() -> None:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(3):
        step()
    sync()
    rows: dict[str, list[float]] = {"step_ms": [], "device_ms": []}
    for _ in range(windows):
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            sync()
            rows["step_ms"].append((time.perf_counter() - t0) * 1e3)
        for _ in range(steps):
            if not cuda:
                continue
            # the GPU busy with a sleep while the host fills the launch queue: the work then runs back to back
            torch.cuda._sleep(int(50e-3 * 2e9))  # ~50 ms at ~2 GHz
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step()
            b.record()
            torch.cuda.synchronize()
            rows["device_ms"].append(a.elapsed_time(b))
    out = {k: statistics.median(v) if v else None for k, v in rows.items()}
    out["all"] = rows
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["7b", "70b"], choices=[s for s in SHAPES if s != "tiny"])
    ap.add_argument(
        "--tiny", action="store_true", help="the CPU rehearsal shape (fp32, NF4 via bitsandbytes' CPU path)"
    )
    names = [q + ("+base" if b else "") for q, b in QUANTS]
    ap.add_argument("--quants", nargs="+", default=names, choices=names, help="the frozen weights' forms to time")
    ap.add_argument("--steps", type=int, default=10, help="steps per window")
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--sparsity", type=float, default=0.02)
    ap.add_argument(
        "--host-tokens",
        type=int,
        nargs=2,
        default=[1, 8],
        metavar=("BATCH", "SEQ"),
        help="the short step that measures the host's time",
    )
    ap.add_argument("--out", default=None, help="results dir (default $OUT or bench/results)")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = ["tiny"] if args.tiny else args.shapes
    runs = []
    for shape in shapes:
        for quant, base in [(q, b) for q, b in QUANTS if q + ("+base" if b else "") in args.quants]:
            name = f"{shape}_{quant}" + ("+base" if base else "")
            model = build(shape, quant, base, device, dtype, args.sparsity)
            if SHAPES[shape][-1]:
                from frod_ds.train.trainer import enable_gradient_checkpointing

                enable_gradient_checkpointing(model)
            res = measure(model, shape, device, args.steps, args.windows)
            res["host"] = measure(model, shape, device, args.steps, args.windows, tuple(args.host_tokens))
            hidden, inter, heads, kv, layers, batch, seq, ckpt = SHAPES[shape]
            runs.append(
                {
                    "name": name,
                    "shape": shape,
                    "quant": quant,
                    "quantize_base": base,
                    "hidden": hidden,
                    "intermediate": inter,
                    "heads": heads,
                    "kv_heads": kv,
                    "layers": layers,
                    "micro_batch": batch,
                    "seq_len": seq,
                    "checkpointing": ckpt,
                    **res,
                }
            )
            h = res["host"]
            print(
                f"{name}: step {res['step_ms']:.1f} ms, device {res['device_ms'] or 0:.1f}; on "
                f"{'x'.join(map(str, args.host_tokens))} tokens: step {h['step_ms']:.1f}, "
                f"device {h['device_ms'] or 0:.1f}",
                flush=True,
            )
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print(
        write_result(
            "host_device",
            {
                "dtype": str(dtype),
                "sparsity": args.sparsity,
                "targets": list(DEFAULT_TARGETS),
                "host_tokens": args.host_tokens,
                "runs": runs,
            },
            args.out,
        )
    )


if __name__ == "__main__":
    main()
