"""Run by tests/bench/test_qlora_zero3.py under torchrun (gloo, CPU): how much NF4 weight storage QLoRA under ZeRO-3
(``bench/train_step.py build_lora``, ``--frozen-quant nf4 --quantize-base --gc``) holds gathered during a step, with
bitsandbytes' own ``Linear4bit`` forward (``stock``) and with ``bench/bnb_zero3.py`` (``fixed``).

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

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import train_step  # noqa: E402


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


def measure(args, mode: str, steps: int, ds_cfg: dict) -> dict:
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as C

    from frod_ds.model.build import gathered

    args.stock_bnb = mode == "stock"
    torch.manual_seed(0)  # the same LoRA initialisation in both modes
    model, groups = train_step.build_lora(args, ds_cfg, torch.device("cpu"))
    model.config.use_cache = False
    step = train_step.Stepper(model, groups, ds_cfg, torch.device("cpu"))
    sampler = Sampler(step.model)
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
            losses.append(float(step(torch.randint(0, 1000, (args.batch, args.seq), generator=g))))
            grad_norms.append(float(step.engine.get_global_grad_norm()))  # before clipping: the backward's own
    finally:
        C.fetch_sub_module = fetch
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
    train_step.add_run_args(ap)
    ap.add_argument("--modes", default="stock,fixed", help="comma-separated: stock, fixed")
    ap.add_argument("--probe-steps", type=int, default=1, help="optimizer steps per mode")
    args = ap.parse_args()
    dist.init_deepspeed()  # as launch/train.py: the launcher's group, DeepSpeed's comm layer without its shm op
    ds_cfg = train_step._ds_config(args.config, args.batch, dist.get_world_size())
    report = {m: measure(args, m, args.probe_steps, ds_cfg) for m in args.modes.split(",")}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"qlora_rank{dist.get_rank()}.json").write_text(json.dumps(report))
    dist.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
