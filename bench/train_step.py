"""Training step time, tokens/s and peak memory: FRoD vs PEFT LoRA r=16 under the same DeepSpeed config.

    python bench/train_step.py make-model --out /tmp/llama7b-8l            # random bf16, 7B-wide, 8 layers
    torchrun --nproc_per_node 1 launch/hjd.py --model /tmp/llama7b-8l --out /tmp/llama7b-8l-factors
    deepspeed --num_gpus 1 bench/train_step.py run --method frod --model /tmp/llama7b-8l \\
        --factors /tmp/llama7b-8l-factors --config ds_configs/zero3.json --out bench/results
    deepspeed --num_gpus 1 bench/train_step.py run --method lora --model /tmp/llama7b-8l ...
    python bench/train_step.py combine bench/results/train_step_*.json

Both methods adapt q/k/v/o/gate/up, run bf16 under the same ZeRO config with micro-batch 4 × 512 tokens of
random ids per GPU, no gradient checkpointing; the step is forward + backward + optimizer step. The LoRA
model is loaded the way HF users do under ZeRO-3 (``from_pretrained`` with ``HfDeepSpeedConfig``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"]


def make_model(out: str, layers: int, hidden: int = 4096, inter: int = 11008, heads: int = 32) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=heads, vocab_size=32000, max_position_embeddings=4096, dtype="bfloat16")
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out, max_shard_size="2GB")
    print(f"wrote {out}")


def _engine(args, ds_cfg):
    import deepspeed

    from frod_ds import distributed as dist

    rank = dist.get_rank()
    if args.method == "frod":
        from frod_ds.apply import frod_param_groups
        from frod_ds.build import build_frod_model, make_supports
        from frod_ds.store import FactorStore

        store = FactorStore.open(args.factors)
        model = build_frod_model(args.model, store, make_supports(store, TARGETS, 0.02, 0), torch.bfloat16,
                                 ds_cfg, rank=rank)
        opt = torch.optim.AdamW(frod_param_groups(model, 1e-4, 1e-5), lr=1e-4)
    else:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM
        from transformers.integrations import HfDeepSpeedConfig

        keep = HfDeepSpeedConfig(ds_cfg)  # noqa: F841 - must stay alive while from_pretrained runs
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16)
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS, lora_dropout=0.0))
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_cfg)
    return engine


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run(args) -> None:
    import deepspeed

    from frod_ds import distributed as dist

    dist.init_distributed()
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    world = dist.get_world_size()
    ds_cfg = json.loads(Path(args.config).read_text())
    ds_cfg.update(train_micro_batch_size_per_gpu=args.batch, gradient_accumulation_steps=1,
                  train_batch_size=args.batch * world, gradient_clipping=1.0)
    t_build = time.perf_counter()
    engine = _engine(args, ds_cfg)
    build_s = time.perf_counter() - t_build
    trainable = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters() if p.requires_grad)
    dev = dist.local_device()
    g = torch.Generator(device="cpu").manual_seed(1234 + dist.get_rank())
    times = []
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    for i in range(args.warmup + args.steps):
        ids = torch.randint(0, 32000, (args.batch, args.seq), generator=g).to(dev)
        _sync()
        t0 = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        _sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    step = statistics.median(times)
    from frod_ds.trainer import _peak_mem_gb

    peak = _peak_mem_gb()
    peaks = dist.all_gather_object(peak)
    if dist.is_main():
        from bench.common import write_result

        write_result(f"train_step_{args.method}_{world}gpu", {
            "method": args.method, "world_size": world, "layers": engine.module.config.num_hidden_layers, "shape": "LLaMA-7B-wide (4096/11008/32 heads)",
            "micro_batch": args.batch, "seq_len": args.seq, "ds_config": args.config, "trainable_params": trainable,
            "step_time_s_median": step, "step_time_s_all": times, "tokens_per_s": args.batch * args.seq * world / step,
            "peak_mem_gb_per_rank": peaks, "build_s": build_s, "final_loss": float(loss.detach()),
        }, args.out)
    dist.destroy()


def combine(paths: list[str]) -> None:
    docs = [json.loads(Path(p).read_text()) for p in paths]
    by = {(d["method"], d["world_size"]): d for d in docs}
    rows = []
    for world in sorted({d["world_size"] for d in docs}):
        f, l = by.get(("frod", world)), by.get(("lora", world))
        if f and l:
            rows.append({"world_size": world,
                         "step_time_ratio_frod_over_lora": f["step_time_s_median"] / l["step_time_s_median"],
                         "peak_mem_ratio_frod_over_lora": max(f["peak_mem_gb_per_rank"]) / max(l["peak_mem_gb_per_rank"]),
                         "frod_step_s": f["step_time_s_median"], "lora_step_s": l["step_time_s_median"],
                         "frod_tokens_per_s": f["tokens_per_s"], "lora_tokens_per_s": l["tokens_per_s"],
                         "frod_peak_gb": max(f["peak_mem_gb_per_rank"]), "lora_peak_gb": max(l["peak_mem_gb_per_rank"])})
    for r in rows:
        print(json.dumps(r))
    from bench.common import write_result

    out = Path(paths[0]).parent
    write_result("train_step_summary", {"rows": rows, "reference": "stock PEFT FRoD: 1.59x LoRA step time, "
                                        "1.48x memory (plain torch, one H100)", "goal": "<= 1.20x LoRA step time"},
                 str(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--local_rank", type=int, default=None, help="set by the deepspeed launcher (ignored)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make-model", help="write the random 7B-wide checkpoint")
    m.add_argument("--out", required=True, help="checkpoint dir")
    m.add_argument("--layers", type=int, default=8, help="decoder layers")
    m.add_argument("--hidden", type=int, default=4096, help="hidden size (smoke tests: smaller)")
    m.add_argument("--inter", type=int, default=11008, help="intermediate size")
    m.add_argument("--heads", type=int, default=32, help="attention heads")
    r = sub.add_parser("run", help="time training steps of one method")
    r.add_argument("--method", choices=["frod", "lora"], required=True, help="adapter method")
    r.add_argument("--model", required=True, help="checkpoint dir (make-model)")
    r.add_argument("--factors", default=None, help="factor store (frod)")
    r.add_argument("--config", default="ds_configs/zero3.json", help="DeepSpeed JSON")
    r.add_argument("--batch", type=int, default=4, help="micro-batch per GPU")
    r.add_argument("--seq", type=int, default=512, help="tokens per sequence")
    r.add_argument("--steps", type=int, default=10, help="timed steps")
    r.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    r.add_argument("--out", default=None, help="results dir")
    c = sub.add_parser("combine", help="ratios FRoD/LoRA from run results")
    c.add_argument("paths", nargs="+", help="train_step_*.json files")
    args = ap.parse_args()
    if args.cmd == "make-model":
        make_model(args.out, args.layers, args.hidden, args.inter, args.heads)
    elif args.cmd == "run":
        run(args)
    else:
        combine(args.paths)


if __name__ == "__main__":
    main()
