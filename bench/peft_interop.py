"""PEFT interop fidelity on a real model: a trained frod-ds adapter exported to stock PEFT, and a stock-PEFT-trained
FRoD adapter imported into frod-ds, each compared by logits with the model it came from (fp32, one process).

    python launch/convert_gguf.py convert --gguf SmolLM2-135M-Instruct.Q4_1.gguf --out models/smollm2-135m
    python launch/hjd.py --model models/smollm2-135m --out factors/smollm2-135m
    python -m bench.peft_interop --model models/smollm2-135m --factor-store factors/smollm2-135m \\
        --data /data/llm_adapters/ARC-Easy/train.json --steps 20 --work /tmp/peft-bench

Each side trains ``--steps`` AdamW steps (σ at ``--lr-sigma``, S at ``--lr-s``) on LLM-Adapters rows
(``instruction`` + ``output``); logits are compared on ``--eval-rows`` held-out rows: ``max |Δlogit|`` and the
same relative to ``max |logit change|`` that training made. PEFT's own HJD runs on the CPU at every PEFT model
build (four times here), so this is for models up to a few hundred million parameters.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.common import write_result


def batches(tokenizer, rows: list[dict], batch: int, cutoff: int) -> list[torch.Tensor]:
    texts = [r["instruction"] + "\n" + r["output"] for r in rows]
    out = []
    for i in range(0, len(texts) - batch + 1, batch):
        enc = tokenizer(
            texts[i : i + batch], return_tensors="pt", padding="max_length", truncation=True, max_length=cutoff
        )
        out.append(enc["input_ids"])
    return out


def train(model, params: list[dict], data: list[torch.Tensor], pad_id: int) -> list[float]:
    opt = torch.optim.AdamW(params)
    losses = []
    model.train()
    for ids in data:
        loss = model(ids, labels=ids.masked_fill(ids == pad_id, -100)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(round(loss.item(), 4))
    model.eval()
    return losses


def compare(got: torch.Tensor, want: torch.Tensor, base: torch.Tensor) -> dict:
    diff, change = (got - want).abs().max().item(), (want - base).abs().max().item()
    return {"max_abs_logit_diff": diff, "max_abs_logit_change": change, "relative": diff / change}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="base checkpoint directory (LLaMA architecture)")
    ap.add_argument("--factor-store", required=True, help="its factor store (launch/hjd.py)")
    ap.add_argument("--data", required=True, help="LLM-Adapters JSON rows (instruction, output)")
    ap.add_argument("--work", required=True, type=Path, help="scratch directory for adapters and exports")
    ap.add_argument("--steps", type=int, default=20, help="AdamW steps on each side")
    ap.add_argument("--lr-sigma", type=float, default=1e-3, help="learning rate of σ (PEFT: frod_lambda_l)")
    ap.add_argument("--lr-s", type=float, default=1e-4, help="learning rate of S (PEFT: frod_lambda_s_values)")
    ap.add_argument("--sparsity", type=float, default=0.02, help="density of S on both sides")
    ap.add_argument("--batch", type=int, default=4, help="rows per step")
    ap.add_argument("--cutoff", type=int, default=96, help="tokens per row")
    ap.add_argument("--eval-rows", type=int, default=4, help="held-out rows whose logits are compared")
    ap.add_argument("--peft-tol", type=float, default=1e-3, help="export's --peft-tol")
    ap.add_argument("--name", default="peft_interop", help="result file name (bench/results/<name>.json)")
    args = ap.parse_args()

    from peft import FrodConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from frod_ds.interop.peft_export import export_peft
    from frod_ds.interop.peft_import import import_peft
    from frod_ds.model.adapter import load_frod_model, save_adapter_from_model
    from frod_ds.model.apply import DEFAULT_TARGETS, frod_param_groups
    from frod_ds.model.build import build_frod_model, make_supports
    from frod_ds.model.store_reader import FactorStore

    def base():
        return AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(args.model)
    tok.pad_token = tok.pad_token or tok.eos_token
    rows = json.loads(Path(args.data).read_text())
    data = batches(tok, rows[: args.steps * args.batch], args.batch, args.cutoff)
    held = batches(tok, rows[-args.eval_rows :], args.eval_rows, args.cutoff)[0]
    with torch.no_grad():
        base_logits = base()(held).logits
    result: dict = {
        "model": args.model,
        "steps": args.steps,
        "lr_sigma": args.lr_sigma,
        "lr_s": args.lr_s,
        "sparsity": args.sparsity,
        "peft_tol": args.peft_tol,
    }

    # frod-ds -> PEFT
    t0 = time.perf_counter()
    store = FactorStore.open(args.factor_store)
    frod = build_frod_model(
        Path(args.model), store, make_supports(store, list(DEFAULT_TARGETS), args.sparsity, 0), torch.float32
    )
    losses = train(frod, frod_param_groups(frod, args.lr_sigma, args.lr_s), data, tok.pad_token_id)
    ckpt = save_adapter_from_model(
        frod,
        args.work / "frod-adapter",
        {
            "base_model": args.model,
            "factor_store": args.factor_store,
            "dtype": "float32",
            "sparsity": args.sparsity,
            "seed": 0,
        },
    )
    report = export_peft(ckpt, args.work / "to-peft", tol=args.peft_tol, overwrite=True)
    with torch.no_grad():
        want = frod(held).logits
        got = PeftModel.from_pretrained(base(), str(args.work / "to-peft")).eval()(held).logits
    result["export"] = {
        "losses": losses,
        "logits": compare(got, want, base_logits),
        "sparse_rate": report["sparse_rate"],
        "categories": report["categories"],
        "seconds": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(result["export"]["logits"]), flush=True)

    # stock PEFT -> frod-ds
    t0 = time.perf_counter()
    peft = get_peft_model(
        base(), FrodConfig(target_modules=list(DEFAULT_TARGETS), sparse_rate=args.sparsity, progressbar=False)
    )
    lam = [p for n, p in peft.named_parameters() if "frod_lambda_l" in n]
    s = [p for n, p in peft.named_parameters() if "frod_lambda_s_values" in n]
    losses = train(peft, [{"params": lam, "lr": args.lr_sigma}, {"params": s, "lr": args.lr_s}], data, tok.pad_token_id)
    peft.save_pretrained(str(args.work / "stock-peft"))
    with torch.no_grad():
        want = PeftModel.from_pretrained(base(), str(args.work / "stock-peft")).eval()(held).logits
    report = import_peft(args.work / "stock-peft", args.work / "from-peft", base_model=args.model, overwrite=True)
    frod, _ = load_frod_model(args.work / "from-peft" / "adapter")
    with torch.no_grad():
        got = frod(held).logits
    result["import"] = {
        "losses": losses,
        "logits": compare(got, want, base_logits),
        "max_weight_error": report["max_weight_error"],
        "max_reconstruction_error": report["max_reconstruction_error"],
        "seconds": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(result["import"]["logits"]), flush=True)
    print(write_result(args.name, result))


if __name__ == "__main__":
    main()
