"""Run by tests/bench/test_qlora_zero3.py under torchrun (gloo, CPU): how much NF4 weight storage QLoRA under ZeRO-3
(the step kind's ``build_lora``, ``quant = "nf4"``, ``quantize_base``, ``gc``) holds gathered during a step, with
bitsandbytes' own ``Linear4bit`` forward (``stock``) and with ``bench/kinds/bnb_zero3.py`` (``fixed``).

After every fetch of a ``Linear4bit`` by DeepSpeed's parameter coordinator it records two numbers, in bytes:
``available``, the 4-bit weights DeepSpeed counts as gathered (``ds_status`` AVAILABLE), and ``retained``, the storages
that once held a gathered 4-bit weight, are still alive (a weak reference to the storage: PyTorch keeps a storage's
Python object exactly as long as the storage) and are no weight's current data: gathered copies DeepSpeed released
but something else still owns. Writes
``<out>/qlora_rank<r>.json``: per mode those maxima, the losses, the LoRA values after the steps, and the model's
4-bit sizes.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import weakref
from pathlib import Path

import torch

from bench.kinds import step as step_kind
from bench.suite import STEP_KEYS


class Sampler:
    def __init__(self, model):
        import bitsandbytes as bnb

        self.linears = {id(m) for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)}
        self.weights = [p for p in model.parameters() if type(p).__name__ == "Params4bit"]
        self.once_gathered: dict[int, weakref.ref] = {}  # a storage that held a gathered weight, while it lives
        self.available = self.retained = self.both = 0

    def sample(self) -> None:
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        avail = [p for p in self.weights if p.ds_status == ZeroParamStatus.AVAILABLE]
        current = {id(p.untyped_storage()) for p in avail}
        for p in avail:
            s = p.untyped_storage()
            self.once_gathered[id(s)] = weakref.ref(s)
        live = {k: r() for k, r in self.once_gathered.items()}
        self.once_gathered = {k: self.once_gathered[k] for k, s in live.items() if s is not None}
        retained = sum(s.nbytes() for k, s in live.items() if s is not None and k not in current)
        available = sum(p.ds_numel * p.element_size() for p in avail)
        self.available, self.retained = max(self.available, available), max(self.retained, retained)
        self.both = max(self.both, available + retained)


def measure(settings: dict, model_dir: Path, mode: str, steps: int, ds_cfg: dict) -> dict:
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as C

    from frod_ds.model.build import gathered

    torch.manual_seed(0)  # the same LoRA initialisation in both modes
    cpu = torch.device("cpu")
    model, groups = step_kind.build_lora(settings, model_dir, ds_cfg, cpu, zero3_bnb_fix=mode == "fixed")
    model.config.use_cache = False
    step = step_kind.Stepper(model, groups, settings, ds_cfg, cpu)
    sampler = Sampler(step.model)
    handles, passes = step_kind.count_layer_passes(step.model)
    fetch = C.fetch_sub_module

    def fetch_and_sample(coord, module, forward, *, sampler=sampler):
        fetch(coord, module, forward)
        if id(module) in sampler.linears:
            sampler.sample()

    C.fetch_sub_module = fetch_and_sample
    g = torch.Generator().manual_seed(0)
    try:
        losses, grad_norms = [], []
        for _ in range(steps):
            ids = torch.randint(0, 1000, (settings["batch"], settings["seq"]), generator=g)
            losses.append(float(step(ids)))
            grad_norms.append(float(step.engine.get_global_grad_norm()))  # before clipping: the backward's own
    finally:
        C.fetch_sub_module = fetch
        for h in handles:
            h.remove()
    lora = [(n, p) for n, p in step.model.named_parameters() if p.requires_grad]
    with gathered([p for _, p in lora], True):
        values = {n: p.detach().float().flatten().tolist() for n, p in lora if "layers.0.self_attn.q_proj" in n}
    layers = step.model.get_base_model().model.layers
    nf4 = [
        sum(p.ds_numel * p.element_size() for p in layer.parameters() if type(p).__name__ == "Params4bit")
        for layer in layers
    ]
    out = {
        "available": sampler.available,
        "retained": sampler.retained,
        "both": sampler.both,
        "losses": losses,
        "grad_norms": grad_norms,
        "layer_passes_per_step": passes[0] / (steps * len(step.model.get_base_model().model.layers)),
        "lora_layer0_q": values,
        "nf4_layer_bytes": nf4,
        "nf4_module_bytes_max": max(p.ds_numel * p.element_size() for p in sampler.weights),
    }
    step.engine.destroy()
    del step, model, sampler, fetch_and_sample
    gc.collect()
    return out


def main() -> int:
    from frod_ds.runtime import distributed as dist

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, type=Path, help="checkpoint folder")
    ap.add_argument("--out", required=True, type=Path, help="folder for qlora_rank<r>.json")
    ap.add_argument("--modes", default="stock,fixed", help="comma-separated: stock, fixed")
    ap.add_argument("--probe-steps", type=int, default=1, help="optimizer steps per mode")
    args = ap.parse_args()
    dist.init_deepspeed()  # as the trainer: the launcher's group, DeepSpeed's comm layer without its shm op
    settings = {
        **STEP_KEYS,
        "method": "lora",
        "engine": "zero3",
        "gpus": dist.get_world_size(),
        "batch": 2,
        "seq": 32,
        "gc": True,
        "quant": "nf4",
        "quantize_base": True,
        # zero3.json without prefetching, reuse window or persistent parameters: each would keep more of a model
        # this small gathered on purpose
        "ds_set": {
            "zero_optimization.stage3_param_persistence_threshold": 0,
            "zero_optimization.stage3_prefetch_bucket_size": 0,
            "zero_optimization.stage3_max_reuse_distance": 0,
            "zero_optimization.reduce_bucket_size": 500000,
        },
    }
    ds_cfg = step_kind.ds_config(settings, dist.get_world_size())
    report = {m: measure(settings, args.model, m, args.probe_steps, ds_cfg) for m in args.modes.split(",")}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"qlora_rank{dist.get_rank()}.json").write_text(json.dumps(report))
    dist.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
