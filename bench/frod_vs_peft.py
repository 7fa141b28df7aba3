"""Does frod-ds' FRoD learn like stock PEFT's FRoD? The deterministic implementation check (issue #26, item 1).

    python launch/convert_gguf.py convert --gguf SmolLM2-135M-Instruct.Q4_1.gguf --out models/smollm2-135m
    python -m bench.frod_vs_peft --first-layers 6 --from-model models/smollm2-135m --model models/smollm2-6l
    python launch/hjd.py --model models/smollm2-6l --out factors/smollm2-6l --device cpu
    python -m bench.frod_vs_peft --model models/smollm2-6l --factor-store factors/smollm2-6l \\
        --data ../shared/data/llm_adapters/ARC-Easy/train.json --steps 50 --batch 4 --cutoff 40 \\
        --model-name "SmolLM2-135M-Instruct, first 6 of its 30 layers (Q4_1 GGUF, dequantized)"
    python -m bench.frod_vs_peft --report-only      # report.md and the plot again, from results.json

One set of frozen factors — frod-ds' factor store (``V`` per category, ``U_i``, ``σ⁰_i``) and frod-ds' S support
(``make_supports``, as training builds it) — goes into both models: frod-ds' model is built from the store as the
trainer builds it (``build_frod_model``); stock PEFT's ``FrodConfig`` model is built by PEFT (its own HJD runs) and
then has its ``frod_V``, ``frod_U``, ``frod_s_indices``, λ (= σ) and S values overwritten with the same tensors
(``inject``). Both then train in lockstep, fp32 on the CPU, on the same fixed batches with the trainer's optimizer:
AdamW over two groups (σ at ``--lr-sigma``, S at ``--lr-s``, one weight decay, AdamW's eps), gradient clipping at
``--max-grad-norm``, the trainer's warmup + cosine schedule. Per step the run records both losses and their relative
difference; to bisect a disagreement it also records the forward at init (logits), the gradients of step 1 and
the parameters after every update (each relative to what the step changed).

Before injection the run also records how each side initialises on its own (PEFT's HJD, support and λ⁰ against
frod-ds' store), for the report's paragraph on initialisation from scratch. Results go to ``--out``
(``results.json``, ``report.md``, ``loss_curves.png``); the report is generated from the JSON alone.

The committed run uses the first 6 of SmolLM2-135M's 30 layers (``--first-layers``): the whole model's 50 lockstep
steps did not fit the time on two shared CPU cores. The check is per layer and per step, so depth changes the
scale of the run, not what it tests; the full model runs with the same commands minus the truncation.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from bench.common import versions
from bench.frod_vs_peft_report import write_report

ADAPTER = "default"  # PEFT's adapter name
DEFAULT_OUT = Path(__file__).parent / "results" / "frod_vs_peft"
TOL = 1e-4  # per-step relative loss agreement the issue asks for


# --------------------------------------------------------------------------------------------- models


def peft_frod_model(base: nn.Module, targets: list[str], sparsity: float, pi: float) -> nn.Module:
    """Stock PEFT's FRoD on ``base`` (fp32), with PEFT's own initialisation (its HJD, support, λ⁰)."""
    from peft import FrodConfig, get_peft_model

    cfg = FrodConfig(
        target_modules=list(targets),
        sparse_rate=sparsity,
        regularization_alpha=pi,
        progressbar=False,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(base, cfg)


def peft_layers(peft_model: nn.Module) -> dict[str, nn.Module]:
    """``{module path in the HF model: PEFT FRoD layer}``."""
    from peft.tuners.frod import FrodLayer

    return {
        name.removeprefix("base_model.model."): m
        for name, m in peft_model.named_modules()
        if isinstance(m, FrodLayer) and ADAPTER in m.frod_lambda_l
    }


def frod_layers(model: nn.Module) -> dict[str, nn.Module]:
    from frod_ds.core.layer import FRoDLinear

    return {name: m for name, m in model.named_modules() if isinstance(m, FRoDLinear)}


def peft_category(peft_model: nn.Module, layer: nn.Module) -> str:
    """PEFT's category key (``self_attn_q_proj``) of ``layer``: the one whose ``frod_V`` it references."""
    return next(k for k, v in peft_model.base_model.frod_V.items() if v is layer.frod_V)


@torch.no_grad()
def inject(peft_model: nn.Module, frod_model: nn.Module) -> None:
    """Overwrite PEFT's frozen factors, S support, λ and S values with frod-ds' (``V``, ``U_i``, support, σ, S).

    PEFT's forward is ``y = U (S + diag λ) Vᵀ x + b`` with ``S`` a COO matrix over ``frod_s_indices`` (one per
    category, coalesced, i.e. sorted row-major), so frod-ds' sorted flat support maps to it entry for entry.
    """
    ours, theirs = frod_layers(frod_model), peft_layers(peft_model)
    assert set(ours) == set(theirs), f"targeted modules differ: {sorted(set(ours) ^ set(theirs))[:3]}"
    base = peft_model.base_model
    for path, mine in ours.items():
        layer = theirs[path]
        cat, n = peft_category(peft_model, layer), mine.in_features
        base.frod_V[cat][ADAPTER] = mine.V.detach().clone()  # (n, n): layer.frod_V is this BufferDict
        base.frod_s_indices[cat][ADAPTER] = mine.support.rows_cols().clone()  # (2, nnz)
        base.frod_s_size[cat][ADAPTER] = torch.tensor([n, n])
        layer.frod_U[ADAPTER] = mine.U.detach().clone()  # (m, n)
        layer.frod_lambda_l[ADAPTER] = nn.Parameter(mine.frod_sigma.detach().clone())  # (n,)
        layer.frod_lambda_s_values[ADAPTER] = nn.Parameter(mine.frod_s.detach().clone())  # (nnz,)


def param_groups(model: nn.Module, kind: str, lr_sigma: float, lr_s: float, weight_decay: float) -> list[dict]:
    """The trainer's two AdamW groups: frod-ds' ``frod_param_groups``; for PEFT the same split by its names."""
    if kind == "frod":
        from frod_ds.model.apply import frod_param_groups

        return frod_param_groups(model, lr_sigma, lr_s, weight_decay)
    sigma = [p for n, p in model.named_parameters() if p.requires_grad and ".frod_lambda_l." in n]
    s = [p for n, p in model.named_parameters() if p.requires_grad and ".frod_lambda_s_values." in n]
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(sigma) + len(s) == len(trainable), f"PEFT trains more than λ and S: {trainable[:3]}"
    return [
        {"name": "sigma", "params": sigma, "lr": lr_sigma, "weight_decay": weight_decay},
        {"name": "s", "params": s, "lr": lr_s, "weight_decay": weight_decay},
    ]


def member_tensors(model: nn.Module, kind: str, grad: bool = False) -> dict[str, tuple[Tensor, Tensor]]:
    """``{member: (σ, S values)}`` (or their gradients), in frod-ds' support order on both sides."""
    if kind == "frod":
        get = (lambda p: p.grad) if grad else (lambda p: p)
        return {
            m: (get(layer.frod_sigma).detach().clone(), get(layer.frod_s).detach().clone())
            for m, layer in frod_layers(model).items()
        }
    out = {}
    for m, layer in peft_layers(model).items():
        lam, s = layer.frod_lambda_l[ADAPTER], layer.frod_lambda_s_values[ADAPTER]
        out[m] = ((lam.grad if grad else lam).detach().clone(), (s.grad if grad else s).detach().clone())
    return out


# ------------------------------------------------------------------------------------------- compare


def rel(a: Tensor, b: Tensor, ref: Tensor | None = None) -> float:
    """``‖a − b‖ / ‖ref‖`` (``ref`` = b), 0/0 = 0."""
    num = float(torch.linalg.vector_norm((a - b).double()))
    den = float(torch.linalg.vector_norm((b if ref is None else ref).double()))
    return 0.0 if num == 0 else (math.inf if den == 0 else num / den)


def compare_members(
    a: dict[str, tuple[Tensor, Tensor]],
    b: dict[str, tuple[Tensor, Tensor]],
    ref: dict[str, tuple[Tensor, Tensor]] | None = None,
) -> dict[str, Any]:
    """Worst member's ``‖a − b‖ / ‖ref‖`` for σ and S (``ref`` defaults to ``b``), and which member it is."""
    out: dict[str, Any] = {}
    for j, name in ((0, "sigma"), (1, "s")):
        worst, who = 0.0, None
        for m in b:
            r = rel(a[m][j], b[m][j], None if ref is None else ref[m][j])
            if r >= worst:
                worst, who = r, m
        out[name], out[f"{name}_member"] = worst, who
    return out


def update(now: dict[str, tuple[Tensor, Tensor]], init: dict[str, tuple[Tensor, Tensor]]):
    return {m: (now[m][0] - init[m][0], now[m][1] - init[m][1]) for m in now}


# ---------------------------------------------------------------------------------------------- data


def fixed_batches(tokenizer, data: Path, steps: int, batch: int, cutoff: int) -> list[dict[str, Tensor]]:
    """``steps`` fixed batches of LLM-Adapters rows (``instruction`` → ``output``), answer-only labels, as the
    trainer encodes them (``frod_ds.train.data``); row ``i`` of batch ``k`` is row ``k·batch + i`` of the file."""
    from frod_ds.train.data import collate, encode_examples

    rows = json.loads(Path(data).read_text())
    need = steps * batch
    if len(rows) < need:
        raise SystemExit(f"{data} has {len(rows)} rows; {steps} steps of {batch} need {need}")
    rows = [{"prompt": r["instruction"], "answer": r["output"]} for r in rows[:need]]
    examples = encode_examples(tokenizer, rows, cutoff, train_on_inputs=False)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return [collate(examples[k * batch : (k + 1) * batch], pad) for k in range(steps)]


# ---------------------------------------------------------------------------------------------- train


@dataclass
class OptCfg:
    lr_sigma: float = 1e-3
    lr_s: float = 1e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    max_grad_norm: float = 1.0
    warmup_ratio: float = 0.1
    schedule: str = "cosine"


class Side:
    """One model with the trainer's optimizer (two AdamW groups) and schedule."""

    def __init__(self, model: nn.Module, kind: str, cfg: OptCfg, steps: int):
        from frod_ds.train.schedule import lr_lambda

        self.model, self.kind = model.train(), kind
        groups = param_groups(model, kind, cfg.lr_sigma, cfg.lr_s, cfg.weight_decay)
        self.params = [p for g in groups for p in g["params"]]
        self.opt = torch.optim.AdamW(groups, lr=cfg.lr_sigma, betas=cfg.betas, eps=cfg.eps)
        warmup = math.ceil(cfg.warmup_ratio * steps)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(cfg.schedule, warmup, steps))
        self.max_grad_norm = cfg.max_grad_norm
        self.seconds = 0.0

    def forward_backward(self, batch: dict[str, Tensor]) -> float:
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        loss = self.model(**batch).loss
        loss.backward()
        self.seconds += time.perf_counter() - t0
        return float(loss.detach())

    def step(self) -> float:
        t0 = time.perf_counter()
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm) if self.max_grad_norm else torch.nan
        self.opt.step()
        self.sched.step()
        self.seconds += time.perf_counter() - t0
        return float(norm)


def lockstep(
    frod: nn.Module, peft: nn.Module, batches: list[dict[str, Tensor]], cfg: OptCfg, log=print, on_step=None
) -> dict[str, Any]:
    """Train both models step by step on the same batches; per step: both losses, their relative difference,
    both gradient norms, and the parameters' disagreement relative to the update so far. Step 1 also records
    the logits at init and the gradients (the bisection: forward, then gradients, then the optimizer)."""
    steps = len(batches)
    sides = {"frod": Side(frod, "frod", cfg, steps), "peft": Side(peft, "peft", cfg, steps)}
    init = {k: member_tensors(s.model, k) for k, s in sides.items()}
    with torch.no_grad():
        logits = {k: s.model(**batches[0]).logits for k, s in sides.items()}
    out: dict[str, Any] = {
        "init": {
            "params": compare_members(init["peft"], init["frod"]),
            "logits_max_abs_diff": float((logits["peft"] - logits["frod"]).abs().max()),
            "logits_max_abs": float(logits["frod"].abs().max()),
        },
        "steps": [],
    }
    del logits
    for i, batch in enumerate(batches):
        loss = {k: s.forward_backward(batch) for k, s in sides.items()}
        if i == 0:
            g = {k: member_tensors(s.model, k, grad=True) for k, s in sides.items()}
            out["step1_grads"] = compare_members(g["peft"], g["frod"])
            del g
        norm = {k: s.step() for k, s in sides.items()}
        now = {k: member_tensors(s.model, k) for k, s in sides.items()}
        d_frod = update(now["frod"], init["frod"])
        params = compare_members(update(now["peft"], init["peft"]), d_frod)
        row = {
            "step": i + 1,
            "loss_frod": loss["frod"],
            "loss_peft": loss["peft"],
            "loss_rel_diff": abs(loss["peft"] - loss["frod"]) / abs(loss["frod"]),
            "grad_norm_frod": norm["frod"],
            "grad_norm_peft": norm["peft"],
            "lr_sigma": sides["frod"].opt.param_groups[0]["lr"],
            "update_rel_diff": params,
        }
        out["steps"].append(row)
        if on_step is not None:
            on_step(out)
        log(
            f"step {i + 1}/{steps}: loss frod-ds {loss['frod']:.6f} peft {loss['peft']:.6f} "
            f"rel {row['loss_rel_diff']:.2e}; update σ {params['sigma']:.2e} S {params['s']:.2e}"
        )
    out["seconds"] = {k: round(s.seconds, 1) for k, s in sides.items()}
    return out


# ---------------------------------------------------------------------------------------- own inits


@torch.no_grad()
def own_inits(peft_model: nn.Module, store, supports: dict) -> dict[str, Any]:
    """How PEFT initialises on its own, against frod-ds' store and supports, per frod-ds category: its basis
    ``V_p`` against ``V_o`` (``G = V_p⁻¹ V_o``: how far from a signed permutation), λ⁰ against σ⁰ matched
    through ``G``'s largest entries, U's reconstruction, and the S supports (size and overlap)."""
    from frod_ds.interop.peft_export import basis_change

    layers = peft_layers(peft_model)
    out = {}
    for cat, members in store.categories.items():
        if cat not in supports:
            continue
        V_o = store.load_V(cat, torch.float64)
        V_p = layers[members[0]].frod_V[ADAPTER].double()
        G = basis_change(V_o, V_p)  # (n, n), V_o = V_p G
        perm = G.abs().argmax(dim=0)  # column j of V_o ~ ±column perm[j] of V_p
        sign = torch.sign(G[perm, torch.arange(G.shape[1])])
        G_perm = torch.zeros_like(G)
        G_perm[perm, torch.arange(G.shape[1])] = sign
        is_perm = bool(torch.unique(perm).numel() == perm.numel())
        col_err = torch.linalg.vector_norm(V_o - V_p[:, perm] * sign, dim=0) / torch.linalg.vector_norm(V_o, dim=0)
        sig_err, flips = 0.0, int((sign < 0).sum())
        for m in members:
            lam = layers[m].frod_lambda_l[ADAPTER].double()
            sig = store.load_sigma(m, torch.float64)
            sig_err = max(sig_err, rel(lam[perm], sig))
        n = V_o.shape[0]
        idx = layers[members[0]].frod_s_indices[ADAPTER]
        peft_flat = torch.unique(idx[0] * n + idx[1])
        ours = supports[cat].flat
        out[cat] = {
            "n": n,
            "members": len(members),
            "basis_columns_matched_one_to_one": is_perm,
            "basis_columns_reordered": int((perm != torch.arange(n)).sum()),
            "basis_columns_sign_flipped": flips,
            "basis_max_column_rel_diff": float(col_err.max()),
            "basis_median_column_rel_diff": float(col_err.median()),
            "lambda0_vs_sigma0_max_rel_diff": sig_err,
            "nnz_peft": int(peft_flat.numel()),
            "nnz_frod": int(ours.numel()),
            "support_overlap": int(torch.isin(ours, peft_flat).sum()),
            "support_overlap_expected_if_independent": round(ours.numel() * peft_flat.numel() / (n * (n - 1)), 1),
        }
    return out


# --------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from frod_ds.core.names import DEFAULT_TARGETS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="fp32 HF checkpoint directory (launch/convert_gguf.py convert)")
    p.add_argument("--factor-store", type=Path, help="frod-ds factor store of --model (launch/hjd.py)")
    p.add_argument("--data", type=Path, help="LLM-Adapters JSON file (instruction/output rows), read in file order")
    p.add_argument(
        "--model-name", default="SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)", help="what --model is, for the report"
    )
    p.add_argument("--targets", nargs="+", default=list(DEFAULT_TARGETS), help="targeted linear names")
    p.add_argument("--sparsity", type=float, default=0.02, help="density s of S (PEFT's sparse_rate)")
    p.add_argument("--seed", type=int, default=0, help="frod-ds' support seed (make_supports)")
    p.add_argument("--steps", type=int, default=50, help="optimizer steps (one fixed batch each)")
    p.add_argument("--batch", type=int, default=8, help="rows per batch")
    p.add_argument("--cutoff", type=int, default=64, help="tokens per row at most (prompt truncated from the left)")
    p.add_argument("--lr-sigma", type=float, default=1e-3, help="LR of the σ group (recipe smollm2_135m)")
    p.add_argument("--lr-s", type=float, default=1e-4, help="LR of the S group")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay of both groups")
    p.add_argument("--eps", type=float, default=1e-8, help="AdamW eps")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping (0: none)")
    p.add_argument("--warmup-ratio", type=float, default=0.1, help="linear warmup share of the steps")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results directory")
    p.add_argument("--report-only", action="store_true", help="regenerate report.md and the plot from results.json")
    p.add_argument(
        "--first-layers",
        type=int,
        default=None,
        help="write --model as the first N decoder layers of --from-model (fp32), then exit",
    )
    p.add_argument("--from-model", type=Path, default=None, help="the full checkpoint --first-layers reads")
    args = p.parse_args(argv)
    if args.first_layers is not None:
        if not (args.from_model and args.model and args.first_layers > 0):
            p.error("--first-layers N (N > 0) needs --from-model and --model (the output)")
    elif not args.report_only and not (args.model and args.factor_store and args.data):
        p.error("--model, --factor-store and --data are required (or --report-only)")
    return args


def build_pair(args: argparse.Namespace):
    """frod-ds' model from the store, PEFT's with its own init (recorded), then injected. Returns
    ``(frod, peft, own_init)``."""
    from transformers import AutoModelForCausalLM

    from frod_ds.model.build import build_frod_model, make_supports
    from frod_ds.model.store_reader import FactorStore

    store = FactorStore.open(args.factor_store)
    supports = make_supports(store, list(args.targets), args.sparsity, args.seed)
    frod = build_frod_model(args.model, store, supports, torch.float32)
    base = AutoModelForCausalLM.from_pretrained(str(args.model), dtype=torch.float32)
    peft = peft_frod_model(base, list(args.targets), args.sparsity, store.pi)
    own = own_inits(peft, store, supports)
    inject(peft, frod)
    return frod, peft, own, store.pi


def command_line(args: argparse.Namespace) -> str:
    """The run's command, with the local model and store directories as placeholders (no machine paths)."""
    import shlex

    argv = sys.argv[1:]
    names = {str(args.model): "MODEL_DIR", str(args.factor_store): "STORE_DIR"}
    return shlex.join(["python", "bench/frod_vs_peft.py", *(names.get(a, a) for a in argv)])


def first_layers(src: Path, dst: Path, n: int) -> None:
    """``dst``: checkpoint ``src`` with only its first ``n`` decoder layers (fp32), and its tokenizer files."""
    import shutil

    from transformers import AutoModelForCausalLM

    if dst.exists():
        raise SystemExit(f"--model {dst} exists; choose a new directory")
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    if not 0 < n <= len(model.model.layers):
        raise SystemExit(f"--first-layers must be 1..{len(model.model.layers)}, got {n}")
    model.model.layers = model.model.layers[:n]
    model.config.num_hidden_layers = n
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:n]
    model.save_pretrained(str(dst))
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name in (
            "special_tokens_map.json",
            "chat_template.jinja",
            "generation_config.json",
        ):
            shutil.copy(f, dst / f.name)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.out
    if args.first_layers is not None:
        first_layers(args.from_model, args.model, args.first_layers)
        return 0
    if args.report_only:
        write_report(json.loads((out / "results.json").read_text()), out)
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from bench.common import device_name

    t0 = time.perf_counter()
    frod, peft, own, pi = build_pair(args)
    batches = fixed_batches(
        AutoTokenizer.from_pretrained(str(args.model)), args.data, args.steps, args.batch, args.cutoff
    )
    print(f"models built and injected in {time.perf_counter() - t0:.0f} s; training {args.steps} steps", flush=True)
    cfg = OptCfg(
        args.lr_sigma, args.lr_s, args.weight_decay, (0.9, 0.999), args.eps, args.max_grad_norm, args.warmup_ratio
    )

    def results_of(run: dict[str, Any]) -> dict[str, Any]:
        return {
            "benchmark": "frod_vs_peft",
            "device": device_name(),
            "versions": versions(),
            "setup": {
                "model_name": args.model_name,
                "model_note": args.model.name,
                "targets": list(args.targets),
                "members": len(frod_layers(frod)),
                "sparsity": args.sparsity,
                "pi": pi,
                "seed": args.seed,
                "steps": args.steps,
                "batch": args.batch,
                "cutoff": args.cutoff,
                "data": "/".join(args.data.parts[-2:]),
                "tokens": int(sum(int(b["attention_mask"].sum()) for b in batches)),
                "optimizer": {
                    "lr_sigma": cfg.lr_sigma,
                    "lr_s": cfg.lr_s,
                    "weight_decay": cfg.weight_decay,
                    "betas": list(cfg.betas),
                    "eps": cfg.eps,
                    "max_grad_norm": cfg.max_grad_norm,
                    "warmup_ratio": cfg.warmup_ratio,
                    "schedule": cfg.schedule,
                },
            },
            "command": command_line(args),
            "run": run,
            "own_init": own,
            "max_loss_rel_diff": max(r["loss_rel_diff"] for r in run["steps"]),
            "tolerance": TOL,
            "seconds": round(time.perf_counter() - t0, 1),
            "complete": len(run["steps"]) == args.steps,
        }

    def save(run: dict[str, Any]) -> None:  # after every step: an interrupted run keeps what it measured
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / "results.json.tmp"
        tmp.write_text(json.dumps(results_of(run), indent=1) + "\n")
        tmp.replace(out / "results.json")

    run = lockstep(frod, peft, batches, cfg, log=lambda s: print(s, flush=True), on_step=save)
    save(run)
    results = results_of(run)
    write_report(results, out)
    print(
        f"max per-step relative loss difference {results['max_loss_rel_diff']:.2e} (tolerance {TOL:g}); "
        f"{out / 'report.md'}"
    )
    return 0 if results["max_loss_rel_diff"] <= TOL else 1


if __name__ == "__main__":
    sys.exit(main())
