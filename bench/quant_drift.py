"""Init drift of quantized frozen weights: FRoD with NF4/int8 U_i next to QLoRA-style NF4/int8 of W, against the base.

    python -m bench.quant_drift --model /ckpt/smollm2-135m --factor-store factors/smollm2 --out bench/results
    python -m bench.quant_drift --model /ckpt/llama-2-7b --factor-store factors/llama2-7b \\
        --device cuda --batch 8 --seq-len 256

Every setting is the model at initialisation (S = 0, σ from HJD), compared on one fixed batch with the base model in
the same dtype (bf16 by default): relative logits error ``‖L − L_base‖_F / ‖L_base‖_F`` over the non-padding
positions, top-1 agreement of the next-token argmax there, and the mean KL(base ‖ setting) per position. Settings:

    frod               dense U (the exactness floor: bf16 rounding of U, σ, V)
    frod-nf4, -int8    U_i quantized (model.frozen_quant), the other linears dense
    frod-nf4-base      U_i and the untargeted linears quantized (model.quantize_base)
    w-nf4, w-int8      every linear of the layers quantized as W with the same quantizer (blocks of 64 / row absmax)
    qlora-nf4          QLoRA's own setting: NF4 with double quantization of the scales (bitsandbytes defaults of
                       BitsAndBytesConfig(bnb_4bit_use_double_quant=True)), the weight QLoRA computes with
``w-int8`` is weight-only int8 (what Linear8bitLt stores); LLM.int8's matmul also quantizes activations.
Also reported: the mean relative weight error ``‖W̃ − W‖/‖W‖`` of the targeted weights (FRoD: W̃ = Ũ diag σ Vᵀ).

The batch is the first ``--batch`` instructions of the LLM-Adapters rows under tests/fixtures (real English text,
in the repository), or lines of ``--text``. Writes ``quant_drift.json`` (``--name``) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.common import write_result
from frod_ds.io.dtypes import FLOAT_DTYPES

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "data_prep" / "llm_adapters"
DTYPES = {k: FLOAT_DTYPES[k] for k in ("bfloat16", "float32")}  # compute dtypes this bench runs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", required=True, help="plain HF checkpoint directory (config.json, safetensors, tokenizer)"
    )
    ap.add_argument(
        "--factor-store",
        required=True,
        type=Path,
        help="its factor store; built here with launch/hjd.py (one process) if the directory does not exist",
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="compute dtype of every model")
    ap.add_argument("--batch", type=int, default=8, help="sequences in the fixed batch")
    ap.add_argument("--seq-len", type=int, default=128, help="tokens per sequence at most")
    ap.add_argument("--text", type=Path, default=None, help="a text file, one sequence per line (default: fixtures)")
    ap.add_argument(
        "--settings",
        default="frod,frod-nf4,frod-int8,frod-nf4-base,w-nf4,w-int8,qlora-nf4",
        help="comma list of settings (module docstring)",
    )
    ap.add_argument("--out", default=None, help="result directory (default bench/results, or $OUT)")
    ap.add_argument("--name", default="quant_drift", help="result file name without .json")
    return ap.parse_args(argv)


def texts(args: argparse.Namespace) -> list[str]:
    if args.text is not None:
        return [line for line in args.text.read_text().splitlines() if line.strip()][: args.batch]
    rows = []
    for f in sorted(FIXTURES.glob("*/test.json")):
        rows += [r["instruction"] for r in json.loads(f.read_text())]
    return rows[: args.batch]


def ensure_store(model: str, store: Path) -> None:
    if store.is_dir():
        return
    cmd = [sys.executable, str(REPO / "launch" / "hjd.py"), "--model", model, "--out", str(store)]
    print("building the factor store:", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=REPO)


def qlora_nf4(W: torch.Tensor) -> torch.Tensor:
    """The weight bitsandbytes' Linear4bit computes with under QLoRA's config: NF4, blocks of 64, double
    quantization."""
    from frod_ds.core.quant import _bnb

    F = _bnb()
    flat = W.reshape(-1)
    q, state = F.quantize_4bit(flat, blocksize=64, compress_statistics=True, quant_type="nf4")
    return F.dequantize_4bit(q, state).view(W.shape).to(W.dtype)


@torch.no_grad()
def quantize_linears(model: torch.nn.Module, how) -> None:
    """Replace every decoder-layer linear's weight W by ``how(W)`` in place (QLoRA's targets: all of them)."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in f".{name}":
            module.weight.copy_(how(module.weight.detach()))


def build(setting: str, args: argparse.Namespace, dtype: torch.dtype):
    """The model of one setting, in ``dtype`` on the device, at initialisation."""
    from transformers import AutoModelForCausalLM

    from frod_ds.core.quant import roundtrip
    from frod_ds.model.build import build_frod_model, make_supports
    from frod_ds.model.store_reader import FactorStore

    if setting.startswith("frod"):
        store = FactorStore.open(args.factor_store)
        quant = {
            "frod": "none",
            "frod-nf4": "nf4",
            "frod-int8": "int8",
            "frod-nf4-base": "nf4",
            "frod-int8-base": "int8",
        }[setting]
        model = build_frod_model(
            args.model,
            store,
            make_supports(store, store.targets, 0.02, 0),
            dtype,
            quant=quant,
            quantize_base=setting.endswith("-base"),
        )
        return model.to(args.device).eval()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(args.device).eval()
    if setting == "base":
        return model
    how = {"w-nf4": lambda W: roundtrip(W, "nf4"), "w-int8": lambda W: roundtrip(W, "int8"), "qlora-nf4": qlora_nf4}
    if setting not in how:
        raise SystemExit(f"error: unknown setting {setting!r}")
    quantize_linears(model, how[setting])
    return model


@torch.no_grad()
def weight_error(setting: str, args: argparse.Namespace, model) -> float:
    """Mean ‖W̃ − W‖/‖W‖ over the targeted weights (FRoD: W̃ = Ũ diag σ Vᵀ, from the built model)."""
    from frod_ds.io.hf_checkpoint import HFCheckpoint
    from frod_ds.model.apply import frod_modules

    ckpt = HFCheckpoint(args.model)
    errs = []
    if setting.startswith("frod"):
        for name, m in frod_modules(model):
            W = ckpt.get(name + ".weight").float().to(args.device)
            errs.append(float((m.merged_weight(torch.float32).float() - W).norm() / W.norm()))
    else:
        modules = dict(model.named_modules())
        for key in ckpt.keys():
            mod = key.removesuffix(".weight")
            if (
                key.endswith(".weight")
                and isinstance(modules.get(mod), torch.nn.Linear)
                and ".layers." in f".{mod}"
                and not mod.endswith("down_proj")
            ):
                W = ckpt.get(key).float().to(args.device)
                errs.append(float((modules[mod].weight.float() - W).norm() / W.norm()))
    return sum(errs) / max(len(errs), 1)


@torch.no_grad()
def compare(logits: torch.Tensor, base: torch.Tensor, mask: torch.Tensor) -> dict:
    L, B = logits[mask].float(), base[mask].float()  # (positions, vocab)
    kl = torch.nn.functional.kl_div(L.log_softmax(-1), B.log_softmax(-1), log_target=True, reduction="none").sum(-1)
    return {
        "rel_logits_error": float((L - B).norm() / B.norm()),
        "top1_agreement": float((L.argmax(-1) == B.argmax(-1)).float().mean()),
        "mean_kl": float(kl.mean()),
        "positions": int(mask.sum()),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    dtype = DTYPES[args.dtype]
    ensure_store(args.model, args.factor_store)
    tok = AutoTokenizer.from_pretrained(args.model)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    batch = tok(texts(args), return_tensors="pt", padding=True, truncation=True, max_length=args.seq_len)
    batch = {k: v.to(args.device) for k, v in batch.items()}
    mask = batch["attention_mask"].bool()
    base_model = build("base", args, dtype)
    base = base_model(**batch).logits
    del base_model
    results = {}
    for setting in [s for s in args.settings.split(",") if s]:
        t0 = time.perf_counter()
        model = build(setting, args, dtype)
        row = compare(model(**batch).logits, base, mask)
        row["weight_rel_error"] = weight_error(setting, args, model)
        row["build_s"] = round(time.perf_counter() - t0, 2)
        results[setting] = row
        print(
            f"{setting:>14}: rel logits error {row['rel_logits_error']:.4f}, top-1 agreement "
            f"{row['top1_agreement']:.4f}, KL {row['mean_kl']:.2e}, weight error {row['weight_rel_error']:.4f}",
            flush=True,
        )
        del model
    path = write_result(
        args.name,
        {
            "model": str(args.model),
            "factor_store": str(args.factor_store),
            "dtype": args.dtype,
            "batch": args.batch,
            "seq_len": args.seq_len,
            "positions": int(mask.sum()),
            "settings": results,
        },
        args.out,
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
