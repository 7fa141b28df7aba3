"""Where FRoD's time and memory go, one layer at a time, and what that means for a whole model.

    python bench/layer_profile.py --out $OUT                               # n = 4096, m = 4096 and 11008, 2048 tokens
    python bench/layer_profile.py --n 64 --m 64 128 --tokens 64 --out /tmp/x   # CPU rehearsal

Per variant (frozen nn.Linear, LoRA r=16, FRoD through plain autograd — the previous implementation, which keeps
M — and the FRoD autograd Functions: token order keeping z or x, ∂S dense or sampled, weight order), one
forward + backward with the input requiring grad as inside a network:

- time (median of CUDA-event timings) and time per op class (profiler self device time of aten ops: GEMM,
  scatter/gather, elementwise, reduction, copy/cast/fill, other);
- bytes kept for the backward by category (saved-tensor hooks, storages counted once): the input x, frozen
  factors (Parameter storage), the dense M (n, n), W (m, n) of the weight order, activations (z, h, LoRA's
  A x), other (indices).

A stand-alone race of the ∂S paths at the same size (dense g_hᵀz + gather, the chunked sampled product, and
torch.sparse.sampled_addmm where the device has it) decides FRoDLinear.dgrad. The whole-model estimate
multiplies the per-layer bytes by the members of a LLaMA-shaped model (``--layers``, targets q/k/v/o/gate/up)
and adds frozen weights and optimizer state, for the README's memory breakdown.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import time_fn, write_result  # noqa: E402
from bench.layer import LoRALinear  # noqa: E402
from frod_ds import FRoDLinear, SparseSupport, decompose  # noqa: E402
from frod_ds.core.frod_function import sampled_product  # noqa: E402

# (name, mode, impl, save, dgrad) of the FRoD variants
FROD_VARIANTS = [
    ("frod_autograd_tokens", "tokens", "autograd", "z", "dense"),
    ("frod_fn_tokens_z_dense", "tokens", "function", "z", "dense"),
    ("frod_fn_tokens_z_sampled", "tokens", "function", "z", "sampled"),
    ("frod_fn_tokens_x_dense", "tokens", "function", "x", "dense"),
    ("frod_fn_tokens_x_sampled", "tokens", "function", "x", "sampled"),
    ("frod_fn_weight_dense", "weight", "function", "z", "dense"),
]
OP_CLASSES = {
    "gemm": ("mm", "addmm", "bmm", "baddbmm", "addmv", "mv", "dot", "_scaled_mm", "sparse_sampled_addmm"),
    "scatter/gather": (
        "scatter",
        "scatter_",
        "gather",
        "index",
        "index_select",
        "index_put_",
        "index_put",
        "take",
        "_index_put_impl_",
    ),
    "reduction": ("sum", "mean", "norm", "amax", "max", "linalg_vector_norm"),
    "elementwise": ("mul", "mul_", "add", "add_", "sub", "div", "neg", "addcmul_", "where"),
    "copy/cast/fill": ("copy_", "_to_copy", "fill_", "zero_", "zeros", "cat", "clone", "contiguous", "empty_like"),
}


def op_class(name: str) -> str:
    op = name.removeprefix("aten::")
    for cls, ops in OP_CLASSES.items():
        if op in ops:
            return cls
    return "other"


def op_breakdown(step, device: torch.device, iters: int = 5) -> dict:
    """Milliseconds per op class per call (self device time on CUDA, self CPU time on the CPU)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(iters):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    out: dict[str, float] = {}
    for e in prof.key_averages():
        if not e.key.startswith("aten::"):
            continue
        us = e.self_device_time_total if device.type == "cuda" else e.self_cpu_time_total
        if us > 0:
            out[op_class(e.key)] = out.get(op_class(e.key), 0.0) + us / 1e3 / iters
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def saved_bytes(layer: nn.Module, x: torch.Tensor, n: int, weight_order: bool = False) -> dict:
    """Bytes the layer's forward keeps for the backward, by category (each storage once). The weight order keeps
    ``W = U M Vᵀ`` (m, n), which has M's shape when m = n."""
    params = {p.untyped_storage().data_ptr(): name for name, p in layer.named_parameters()}
    seen: dict[int, tuple[str, int]] = {}

    def pack(t):
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr in seen or st.nbytes() == 0:
            return t
        if ptr == x.untyped_storage().data_ptr():
            cat = "input x"
        elif ptr in params:
            cat = "frozen factors" if not params[ptr].startswith(("frod_", "A", "B")) else "trainable"
        elif t.dim() == 2 and t.shape[0] == x.shape[0]:  # one row per token (main() keeps tokens != n)
            cat = "activations (z, h, Ax)"
        elif weight_order and t.dim() == 2 and t.shape[1] == n:
            cat = "W = U M Vᵀ (m×n)"
        elif tuple(t.shape) == (n, n):
            cat = "dense M (n×n)"
        else:
            cat = "other (scatter indices)"
        seen[ptr] = (cat, st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x)
    del y
    out: dict[str, int] = {}
    for cat, nb in seen.values():
        out[cat] = out.get(cat, 0) + nb
    return out


def race_dgrad(n: int, tokens: int, sparsity: float, dtype, device: torch.device) -> dict:
    """The ∂S paths on the same (g_h, z): milliseconds each, and their largest difference (exactness)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    gh = torch.randn(tokens, n, generator=g).to(device, dtype)
    z = torch.randn(tokens, n, generator=g).to(device, dtype)
    sup = SparseSupport.random(n, sparsity, 0)
    flat = sup.on(device)
    rows, cols = sup.rows_cols_on(device)
    out = {
        "dense_gemm_gather": time_fn(lambda: (gh.t() @ z).view(-1)[flat]),
        "sampled_chunked": time_fn(lambda: sampled_product(gh, z, rows, cols)),
    }
    ref = (gh.double().t() @ z.double()).view(-1)[flat]
    out["max_rel_err"] = {
        "dense_gemm_gather": ((gh.t() @ z).view(-1)[flat].double() - ref).abs().max().item() / ref.abs().max().item(),
        "sampled_chunked": (sampled_product(gh, z, rows, cols).double() - ref).abs().max().item()
        / ref.abs().max().item(),
    }
    for dt in (dtype, torch.float32):  # cuSPARSE SDDMM; bf16 is not always there, fp32 is timed for reference
        key = f"torch_sparse_sampled_addmm_{str(dt).removeprefix('torch.')}"
        try:
            csr = torch.sparse_csr_tensor(*_csr(rows, cols, n), torch.zeros(sup.nnz, device=device, dtype=dt), (n, n))
            ghT, zt = gh.t().contiguous().to(dt), z.to(dt)
            out[key] = time_fn(lambda: torch.sparse.sampled_addmm(csr, ghT, zt))
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            out[key] = f"unavailable: {type(e).__name__}: {str(e)[:120]}"
    return out


def _csr(rows: torch.Tensor, cols: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """CSR (crow, col) of a support given as row-major sorted (rows, cols)."""
    crow = torch.zeros(n + 1, dtype=torch.int64, device=rows.device)
    crow[1:] = torch.cumsum(torch.bincount(rows, minlength=n), 0)
    return crow, cols


def profile_shape(m: int, n: int, tokens: int, sparsity: float, dtype, device: torch.device) -> dict:
    torch.manual_seed(0)
    W = torch.randn(m, n, device=device) / n**0.5
    res = decompose([W], dtype=torch.float32)
    V = nn.Parameter(res.V.to(dtype), requires_grad=False)
    frod = FRoDLinear(res.U[0].to(dtype), V, res.sigma[0], SparseSupport.random(n, sparsity, 0)).to(device)
    with torch.no_grad():
        frod.frod_s.normal_(std=1e-3)
    frozen = nn.Linear(n, m, bias=False, device=device, dtype=dtype).requires_grad_(False)
    lora = LoRALinear(nn.Linear(n, m, bias=False, device=device, dtype=dtype))
    x = torch.randn(tokens, n, device=device, dtype=dtype, requires_grad=True)
    variants: list[tuple[str, nn.Module, tuple | None]] = [("frozen", frozen, None), ("lora_r16", lora, None)]
    variants += [(name, frod, opts) for name, *opts in FROD_VARIANTS for opts in [tuple(opts)]]
    rows = {}
    for name, layer, opts in variants:
        if opts is not None:
            layer.mode, layer.impl, layer.save, layer.dgrad = opts
        dy = torch.randn(tokens, m, device=device, dtype=dtype)

        def step(layer=layer, dy=dy):
            x.grad = None
            for p in layer.parameters():
                p.grad = None
            layer(x).backward(dy)

        timing = time_fn(step)  # first: it warms up what the profiler then sees
        try:  # the profiler needs CUPTI on CUDA; its absence must not cost the timings
            ops = op_breakdown(step, device)
        except Exception as e:  # noqa: BLE001 - reported in the results
            ops = {"unavailable": f"{type(e).__name__}: {str(e)[:120]}"}
        weight_order = opts is not None and opts[0] == "weight"
        rows[name] = {"time": timing, "op_ms": ops, "saved_bytes": saved_bytes(layer, x, n, weight_order)}
    frod.mode, frod.impl, frod.save, frod.dgrad = "auto", "function", "z", "dense"
    base = rows["frozen"]["time"]["median_ms"]
    for r in rows.values():
        r["ratio_vs_frozen"] = r["time"]["median_ms"] / base
    return {"m": m, "n": n, "tokens": tokens, "variants": rows}


def model_memory(
    shapes: list[dict], layers: int, hidden: int, inter: int, vocab: int, sparsity: float, lora_r: int = 16
) -> dict:
    """GiB by category for a LLaMA-shaped model with q/k/v/o (m = n = hidden) and gate/up (m = inter) targets,
    from the per-layer saved bytes (x is shared by q/k/v and by gate/up: counted once per input)."""
    gib = 2**30
    by_m = {s["m"]: s["variants"] for s in shapes}
    sq, wide = by_m.get(hidden), by_m.get(inter, by_m.get(hidden))
    n_base = layers * (4 * hidden * hidden + 3 * hidden * inter) + 2 * vocab * hidden  # LLaMA, untied embeddings
    members = {"square": 4 * layers, "wide": 2 * layers}
    trainable = {
        "frod": 6 * layers * (hidden + round(sparsity * hidden * hidden)),
        "lora": layers * lora_r * (4 * 2 * hidden + 2 * (hidden + inter)),
    }
    out = {}
    for method, names in (("lora", ["lora_r16"]), ("frod", [v[0] for v in FROD_VARIANTS])):
        for name in names:
            cats: dict[str, float] = {}
            for group, var in (("square", sq), ("wide", wide)):
                for cat, nb in var[name]["saved_bytes"].items():
                    if cat in ("input x", "trainable", "frozen factors"):
                        continue  # x: the block's own input, shared (LoRA keeps it too); params: counted below
                    cats[cat] = cats.get(cat, 0.0) + nb * members[group] / gib
            x_inputs = 3 * layers  # q/k/v share one input, o has one, gate/up share one
            keeps_x = any("input x" in var[name]["saved_bytes"] for var in (sq, wide))
            frozen = n_base * 2 + (6 * hidden * hidden * 2 if method == "frod" else 0)
            row = {
                "frozen weights (bf16)": frozen / gib,
                "optimizer: DeepSpeed bf16 (fp32 master + Adam m, v + fp32 grads)": trainable[method] * 16 / gib,
                "optimizer: plain bf16 (grads + Adam m, v in bf16)": trainable[method] * 6 / gib,
                "adapter inputs x kept for backward": (
                    x_inputs * sq[name]["saved_bytes"].get("input x", 0) / gib if keeps_x else 0.0
                ),
            }
            row.update({f"saved {k}": v for k, v in cats.items()})
            out[name] = row
    return {
        "layers": layers,
        "hidden": hidden,
        "intermediate": inter,
        "tokens_per_call": shapes[0]["tokens"],
        "gib": out,
        "note": "adapter-side memory only; the base model's own activations (attention, MLP, "
        "norms, logits) are the same for both methods and are not included",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=4096, help="input width of the layer")
    ap.add_argument("--m", type=int, nargs="+", default=[4096, 11008], help="output widths (q/k/v/o, gate/up)")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per call (micro-batch x seq)")
    ap.add_argument("--sparsity", type=float, default=0.02, help="density s of S")
    ap.add_argument("--layers", type=int, default=32, help="decoder layers of the whole-model estimate")
    ap.add_argument("--inter", type=int, default=11008, help="intermediate size of the whole-model estimate")
    ap.add_argument("--vocab", type=int, default=32000, help="vocabulary of the whole-model estimate")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="compute dtype")
    ap.add_argument("--out", default=None, help="results dir (default $OUT or bench/results)")
    args = ap.parse_args()
    if args.tokens == args.n:
        ap.error("--tokens must differ from --n (saved tensors are told apart by shape)")

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    shapes = [profile_shape(m, args.n, args.tokens, args.sparsity, dtype, device) for m in args.m]
    race = race_dgrad(args.n, args.tokens, args.sparsity, dtype, device)
    inter = args.inter if args.inter in args.m else args.m[-1]
    mem = model_memory(shapes, args.layers, args.n, inter, args.vocab, args.sparsity)
    for s in shapes:
        print(f"m={s['m']} n={s['n']} tokens={s['tokens']} ({dtype}, {device}):")
        for name, r in s["variants"].items():
            saved = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in r["saved_bytes"].items())
            ops = ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in r["op_ms"].items())
            print(
                f"  {name:26s} {r['time']['median_ms']:8.3f} ms ({r['ratio_vs_frozen']:.2f}x frozen) | ops ms: {ops}"
                f" | saved: {saved}"
            )
    print("dS race:", {k: (v["median_ms"] if isinstance(v, dict) and "median_ms" in v else v) for k, v in race.items()})
    print(f"whole-model adapter memory, GiB ({args.layers} layers):")
    for name, row in mem["gib"].items():
        print(f"  {name:26s} " + ", ".join(f"{k}: {v:.2f}" for k, v in row.items()))
    print(
        write_result(
            "layer_profile",
            {"dtype": str(dtype), "sparsity": args.sparsity, "shapes": shapes, "dgrad_race": race, "model_memory": mem},
            args.out,
        )
    )


if __name__ == "__main__":
    main()
