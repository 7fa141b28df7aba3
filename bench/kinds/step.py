"""The ``step`` kind: time training steps of FRoD or PEFT LoRA under one engine, in one process per rank.

Both methods adapt the library's default targets and get the same treatment: bf16 weights, ``batch`` × ``seq``
random token ids per GPU, gradient clipping at 1.0, torch AdamW (fused on CUDA), LoRA dropout 0, the trainer's
gradient checkpointing when ``gc``. Engines: ``plain`` (one GPU, no wrapper; bf16 parameters and AdamW states),
``ddp`` (torch DistributedDataParallel, 25 MB buckets, static graph), and DeepSpeed through a shipped JSON
(``zero0`` is ``zero2.json`` at stage 0, DeepSpeed's data parallel; the JSONs keep fp32 master weights), and
``fshard``: ``zero2.json`` with the frozen weights partitioned by ``frod_ds.model.frozen_shards``; ``z3layers``:
``zero3.json`` as ``frod train`` runs it (the same partition, built a unit at a time; σ and S under the JSON's
ZeRO-2 form; ``zero3`` is DeepSpeed's own stage 3 of that JSON); ``fsdp2``: torch
``fully_shard`` per decoder layer (a Parameter shared by layers, FRoD's V, replicated). LoRA's base is loaded
the way HF users do (``from_pretrained``, under ZeRO-3 with ``HfDeepSpeedConfig``), or with ``load = "direct"``
built without weights and each rank's share read straight from the files (``bench/kinds/direct_load.py``); FRoD
by ``build_frod_model``. A step is forward + backward + optimizer step, timed between device synchronisations over
``repeats`` windows of ``steps`` steps after ``warmup`` untimed ones; memory is each rank's peak over the timed
windows (``torch.cuda`` on a GPU: what the process allocated, whatever wrote it, plus what the run added outside
torch's allocator, read off the driver). Each rank's host CPU time per timed step is recorded, and with
``profile`` that many more steps run under the profiler (``bench/kinds/profile.py``).

Quantized frozen weights (``quant`` nf4 or int8): FRoD holds every ``U_i`` quantized (``model.frozen_quant``, with
``quantize_base`` the untargeted linears too); LoRA loads the targeted linears through bitsandbytes (NF4 in blocks
of 64 without double quantization, ``bnb_4bit_quant_storage`` bf16 so ZeRO-3 partitions it; or LLM.int8()), with
``quantize_base`` every decoder linear: QLoRA. ``lm_head`` and the embeddings stay bf16. Under ZeRO-3 the NF4
linears run through ``bench/kinds/bnb_zero3.py`` (bitsandbytes' own forward keeps every gathered weight alive
until the backward).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from frod_ds.config.ds_config import BatchSizes, load_ds_config, zero_stage
from frod_ds.core.names import DEFAULT_TARGETS
from frod_ds.runtime import distributed as dist

__all__ = ["ENGINES", "Stepper", "build_frod", "build_lora", "count_layer_passes", "ds_config", "measure", "summarize"]

REPO = Path(__file__).resolve().parents[2]
TARGETS = list(DEFAULT_TARGETS)
GIB = 2**30
# engine -> (DeepSpeed JSON, overrides), or None for the torch-only engines
ENGINES: dict[str, tuple[str, dict[str, Any]] | None] = {
    "plain": None,
    "ddp": None,
    "zero0": ("ds_configs/zero2.json", {"zero_optimization.stage": 0}),
    "zero2": ("ds_configs/zero2.json", {}),
    "zero3": ("ds_configs/zero3.json", {}),  # DeepSpeed's stage 3 (train.zero3_partition=deepspeed)
    # zero3.json as frod train runs it by default: frozen weights by decoder layer, σ and S under its ZeRO-2 form
    "z3layers": ("ds_configs/zero3.json", {}),
    # zero2.json for the trainables, the frozen weights partitioned by frod_ds.model.frozen_shards
    "fshard": ("ds_configs/zero2.json", {}),
    # torch FSDP2: fully_shard per decoder layer, then the whole model (torchtune's recipes)
    "fsdp2": None,
}
DDP_DEFAULTS = {"bucket_cap_mb": 25, "static_graph": True, "gradient_as_bucket_view": True}


def ds_config(s: dict[str, Any], world: int) -> dict | None:
    """The DeepSpeed JSON of configuration ``s`` with the batch keys filled in and its ``ds_set`` applied."""
    spec = ENGINES[s["engine"]]
    if spec is None:
        return None
    path, overrides = spec
    cfg = load_ds_config(REPO / path)
    b = s["batch"]
    cfg.update(
        train_micro_batch_size_per_gpu=b,
        gradient_accumulation_steps=1,
        train_batch_size=BatchSizes(b, 1, world).total,
        gradient_clipping=1.0,
    )
    for key, value in {**overrides, **s["ds_set"]}.items():
        node = cfg
        *parents, last = key.split(".")
        for k in parents:
            node = node.setdefault(k, {})
        node[last] = value
    return cfg


def _zero3(ds_cfg: dict | None) -> bool:
    return ds_cfg is not None and zero_stage(ds_cfg) == 3


def build_frod(s: dict, model_dir: Path, factors: Path, ds_cfg: dict | None):
    """FRoD from checkpoint + factor store as the trainer builds it, and its two AdamW groups (σ, S)."""
    from frod_ds.model.apply import frod_param_groups
    from frod_ds.model.build import build_frod_model, fetch_per_layer, make_supports
    from frod_ds.model.store_reader import FactorStore
    from frod_ds.train.trainer import enable_gradient_checkpointing

    store = FactorStore.open(factors)
    supports = make_supports(store, TARGETS, s["sparsity"], 0)
    if s["engine"] == "z3layers":
        from frod_ds.config.zero3_layout import host_shards
        from frod_ds.model.build_layers import build_layer_partitioned

        model = build_layer_partitioned(
            model_dir,
            store,
            supports,
            torch.bfloat16,
            dist.local_device(),
            s["quant"],
            s["quantize_base"],
            gather=s["gather"],
            offload=host_shards(ds_cfg, "layers"),  # a ds_set offload_param to the CPU: shards in host memory
        )
    else:
        model = build_frod_model(
            model_dir,
            store,
            supports,
            torch.bfloat16,
            ds_cfg,
            rank=dist.get_rank(),
            quant=s["quant"],
            quantize_base=s["quantize_base"],
        )
    if _zero3(ds_cfg) and s["engine"] != "z3layers":
        fetch_per_layer(model)  # what the trainer does under ZeRO-3
    if s["gc"]:
        enable_gradient_checkpointing(model)
    return model, frod_param_groups(model, 1e-4, 1e-5)


def _bnb_config(s: dict):
    """bitsandbytes settings of LoRA's frozen base (None: bf16): the targeted linears, with ``quantize_base`` all."""
    if s["quant"] == "none":
        return None
    from transformers import BitsAndBytesConfig

    skip = ["lm_head"] + ([] if s["quantize_base"] else ["down_proj"])
    if s["quant"] == "int8":
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=False,
        bnb_4bit_compute_dtype=torch.bfloat16,
        bnb_4bit_quant_storage=torch.bfloat16,
        llm_int8_skip_modules=skip,
    )


def build_lora(s: dict, model_dir: Path, ds_cfg: dict | None, device: torch.device, zero3_bnb_fix: bool = True):
    """PEFT LoRA on the same targets, adapters in bf16 like the base; ``zero3_bnb_fix=False`` keeps bitsandbytes'
    own NF4 forward under ZeRO-3 (what the fix is measured against). With ``load = "direct"`` the base is built
    without weights and filled from the files; under FSDP2 the model comes back sharded (its shards loaded)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    from bench.kinds import direct_load
    from frod_ds.train.trainer import enable_gradient_checkpointing

    z3, direct = _zero3(ds_cfg), s["load"] == "direct"
    if direct:  # ZeRO-3: each rank's partitions read in (zero.Init by hand: HfDeepSpeedConfig would add its own)
        model = direct_load.base_model(model_dir, ds_cfg)
    keep = HfDeepSpeedConfig(ds_cfg) if z3 else None  # noqa: F841 - alive while the base is loaded and wrapped
    if not direct:
        quant = _bnb_config(s)
        kw = {} if quant is None else {"quantization_config": quant}
        if quant is not None and not z3:
            kw["device_map"] = {"": device}  # bitsandbytes quantizes as the weights reach the device
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, **kw)
    if s["quant"] == "nf4" and z3 and zero3_bnb_fix:
        from bench.kinds.bnb_zero3 import keep_linear4bit_weights_partitioned

        keep_linear4bit_weights_partitioned(model)  # else each rank keeps the whole gathered NF4 model per step
    if z3 and s["leaf_modules"]:
        from frod_ds.model.build import fetch_per_layer

        fetch_per_layer(model)
    if s["gc"]:
        enable_gradient_checkpointing(model)
    cfg = LoraConfig(r=s["lora_r"], lora_alpha=2 * s["lora_r"], target_modules=TARGETS, lora_dropout=0.0)
    torch.manual_seed(0)  # LoRA's A is drawn at random: the same on every rank and in every run
    with direct_load.adapters_off_meta(model) if direct else contextlib.nullcontext():
        model = get_peft_model(model, cfg, autocast_adapter_dtype=False)
    if direct and not z3:
        if s["engine"] == "fsdp2":
            _shard_layers(model, device)
        direct_load.load_weights(model, model_dir, device)  # each rank its rows (FSDP2), else every tensor whole
    return model, [{"params": [p for p in model.parameters() if p.requires_grad]}]


class Stepper:
    """forward + backward + optimizer step under the configuration's engine."""

    def __init__(self, model, groups, s: dict, ds_cfg: dict | None, device: torch.device):
        opt = torch.optim.AdamW(groups, lr=1e-4, fused=(device.type == "cuda") or None)
        self.params = [p for g in groups for p in g["params"]]
        self.engine = None
        if ds_cfg is not None:
            import deepspeed

            self.engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_cfg)
            self.engine.train()  # from_pretrained leaves the base in eval mode, where no layer checkpoints
            self.model = self.wrapped = self.engine.module
            return
        # a quantized base, or the FSDP2 shards of a direct load, are on their device already
        if getattr(model, "hf_device_map", None) is None and not _fsdp2_sharded(model):
            model = model.to(device)
        model = model.train()
        if s["engine"] == "fsdp2":
            opt = _fully_shard(model, groups, device)
            self.params = [p for g in opt.param_groups for p in g["params"]]
        self.model, self.opt, self.wrapped = model, opt, model
        if s["engine"] == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            ids = [device.index] if device.type == "cuda" else None
            self.wrapped = DistributedDataParallel(model, device_ids=ids, **{**DDP_DEFAULTS, **s["ddp"]})

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if self.engine is not None:
            loss = self.engine(input_ids=ids, labels=ids).loss
            self.engine.backward(loss)
            self.engine.step()
            return loss.detach()
        loss = self.wrapped(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()


def _fsdp2_sharded(model) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def _fully_shard(model, groups: list[dict], device: torch.device):
    """FSDP2 over ``model`` (``_shard_layers``, unless the direct load sharded it) and a fused AdamW over its sharded
    parameters, in the same groups: ``fully_shard`` replaces each Parameter by a sharded one."""
    names = {id(p): n for n, p in model.named_parameters()}
    group_of = {names[id(p)]: i for i, g in enumerate(groups) for p in g["params"]}
    if not _fsdp2_sharded(model):
        _shard_layers(model, device)
    sharded: list[list] = [[] for _ in groups]
    for n, p in model.named_parameters():
        if n in group_of:
            sharded[group_of[n]].append(p)
    new = [{**g, "params": ps} for g, ps in zip(groups, sharded)]
    return torch.optim.AdamW(new, lr=1e-4, fused=(device.type == "cuda") or None)


def _shard_layers(model, device: torch.device) -> None:
    """FSDP2: each decoder layer one ``fully_shard`` unit, then the whole model (torchtune's recipes). A Parameter
    shared by several layers (FRoD's V of a category) stays replicated (``ignored_params``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    count: dict[int, int] = {}
    for m in layers:
        for p in m.parameters():
            count[id(p)] = count.get(id(p), 0) + 1
    shared = {p for m in layers for p in m.parameters() if count[id(p)] > 1}
    for m in layers:
        fully_shard(m, mesh=mesh, ignored_params=shared)
    fully_shard(model, mesh=mesh, ignored_params=shared)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _batches(s: dict, vocab: int, device: torch.device):
    g = torch.Generator(device="cpu").manual_seed(1234 + dist.get_rank())
    while True:
        yield torch.randint(0, vocab, (s["batch"], s["seq"]), generator=g).to(device)


def _outside_allocator(device: torch.device) -> float:
    """Bytes the device holds that torch's caching allocator did not reserve (GiB): the CUDA context, NCCL's
    buffers, symmetric memory (the layer partition's peer banks), read off the driver."""
    free, total = torch.cuda.mem_get_info(device)
    return (total - free - torch.cuda.memory_reserved(device)) / GIB


def _peak_memory(device: torch.device, outside0: float) -> dict[str, float]:
    """Peak allocated (torch.cuda) and what the run added outside the allocator since ``outside0`` (its figure
    before the model was built): their sum is the peak the report shows."""
    if device.type != "cuda":
        import resource

        return {"max_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    allocated, outside = torch.cuda.max_memory_allocated(device) / GIB, max(0.0, _outside_allocator(device) - outside0)
    return {
        "peak_allocated_gib": allocated,
        "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / GIB,
        "outside_allocator_gib": outside,
        "peak_gib": allocated + outside,
    }


def summarize(windows: list[list[float]], tokens_per_step: int) -> dict[str, Any]:
    """Median, p10 and p90 of the step times (seconds), each window's median, and tokens/s per GPU at the median."""
    flat = sorted(t for w in windows for t in w)
    med = statistics.median(flat)

    def pct(q: float) -> float:
        return flat[min(len(flat) - 1, int(q * (len(flat) - 1) + 0.5))]

    per_window = [statistics.median(w) for w in windows]
    return {
        "step_s_median": med,
        "step_s_p10": pct(0.1),
        "step_s_p90": pct(0.9),
        "window_medians_s": per_window,
        "window_spread": (max(per_window) - min(per_window)) / med,
        "tokens_per_s_per_gpu": tokens_per_step / med,
        "step_s_all": windows,
    }


def count_layer_passes(model) -> tuple[list, list[int]]:
    """Count MLP forward passes (2 per step with checkpointing, 1 without): what ``gc`` did, counted."""
    mlps = [m.mlp for m in model.modules() if type(m).__name__.endswith("DecoderLayer") and hasattr(m, "mlp")]
    calls = [0]
    handles = [m.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1)) for m in mlps]
    return handles, calls


def measure(s: dict[str, Any], model_dir: Path, factors: Path) -> dict[str, Any] | None:
    """Run configuration ``s`` on this rank; rank 0 returns the metrics, the others None."""
    from frod_ds.plan.flops import flops_per_token, peak_bf16_flops

    ds_cfg = None
    if ENGINES[s["engine"]] is None:
        dist.init_distributed()
    else:
        dist.init_deepspeed()
    world = dist.get_world_size()
    if world != s["gpus"]:
        raise SystemExit(f"error: configuration wants {s['gpus']} ranks, the launcher gave {world}")
    device = dist.local_device()
    outside0 = _outside_allocator(device) if device.type == "cuda" else 0.0
    ds_cfg = ds_config(s, world)
    t0 = time.perf_counter()
    if s["method"] == "frod":
        model, groups = build_frod(s, model_dir, factors, ds_cfg)
    else:
        model, groups = build_lora(s, model_dir, ds_cfg, device)
    model.config.use_cache = False
    from frod_ds.model.frozen_shards import shard_frozen, shards_of

    shards = shards_of(model)
    if s["engine"] == "fshard":
        shards = shard_frozen(model, device, gather=s["gather"])
    if s["engine"] == "z3layers":
        from frod_ds.config.ds_config import as_stage2

        ds_cfg = as_stage2(ds_cfg)
    step = Stepper(model, groups, s, ds_cfg, device)
    build_s = time.perf_counter() - t0
    cfg = step.model.config.to_dict()
    batches = _batches(s, cfg["vocab_size"], device)
    handles, calls = count_layer_passes(step.model)
    losses = [float(step(next(batches))) for _ in range(s["warmup"])]
    for h in handles:
        h.remove()
    passes = calls[0] / (s["warmup"] * cfg["num_hidden_layers"])
    if passes != (2.0 if s["gc"] else 1.0):
        raise SystemExit(f"error: each decoder layer ran {passes:g} times per step with gc={s['gc']}")
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    windows, cpu0 = [], time.process_time()
    for _ in range(s["repeats"]):
        times = []
        for _ in range(s["steps"]):
            ids = next(batches)
            _sync(device)
            t = time.perf_counter()
            loss = step(ids)
            _sync(device)
            times.append(time.perf_counter() - t)
        windows.append(times)
        losses.append(float(loss))
    host_ms = (time.process_time() - cpu0) * 1e3 / (s["repeats"] * s["steps"])  # every thread of this rank
    profiled = None
    if s["profile"] and device.type == "cuda":
        from bench.kinds.profile import collect

        profiled = collect(lambda: step(next(batches)), s["profile"], device)
    per_rank = {**_peak_memory(device, outside0), "host_cpu_ms_per_step": host_ms, "profile": profiled}
    memory = dist.all_gather_object(per_rank)
    if not dist.is_main():
        return None
    tokens = s["batch"] * s["seq"]
    stats = summarize(windows, tokens)
    fl = flops_per_token(
        cfg, s["seq"], s["method"], tokens, targets=TARGETS, lora_r=s["lora_r"], sparsity=s["sparsity"]
    )
    peak = peak_bf16_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    trainable = [p for p in step.model.parameters() if p.requires_grad]
    return {
        **stats,
        "world_size": world,
        "tokens_per_step_per_gpu": tokens,
        "flops_per_token": fl["total"],
        "mfu": fl["total"] * stats["tokens_per_s_per_gpu"] / peak if peak else None,
        "memory_per_rank": memory,
        "peak_allocated_gib": max(m.get("peak_allocated_gib", 0.0) for m in memory) or None,
        "peak_gib": max(m.get("peak_gib", 0.0) for m in memory) or None,
        "trainable_params": sum(int(getattr(p, "ds_numel", p.numel())) for p in trainable),
        "trainable_tensors": len(trainable),
        "ds_config": ds_cfg,
        "build_s": build_s,
        "losses": losses,
        "layer_passes_per_step": passes,
        "frozen_shards": None
        if shards is None
        else {
            "units": len(shards.units),
            "shard_gib": shards.shard_bytes() / GIB,
            "full_gib": shards.full_bytes() / GIB,
            "peak_units_gathered": shards.peak_installed,
            "peer_bank_gib": None if shards.bank is None else shards.bank.views[0].numel() / GIB,
            "largest_unit_gib": max((u.numel * u.shard.element_size() for u in shards.units), default=0) / GIB,
            # frozen tensors every rank keeps whole (V, the final norm): the units' Parameters are empty here
            "replicated_gib": sum(p.numel() * p.element_size() for p in step.model.parameters() if not p.requires_grad)
            / GIB,
        },
    }
