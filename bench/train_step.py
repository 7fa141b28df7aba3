"""One training-step configuration: FRoD or PEFT LoRA r=16 under plain PyTorch, ZeRO-2 or ZeRO-3; step time,
tokens/s per GPU, peak memory, MFU. ``bench/train_matrix.py`` runs the whole matrix with one command.

    python bench/train_step.py make-model --out /tmp/fb/m --layers 32          # random bf16 LLaMA-2-7B shape
    python launch/hjd.py --model /tmp/fb/m --out /tmp/fb/f                     # its factor store
    python bench/train_step.py run --method frod --config ds_configs/zero2.json --model /tmp/fb/m \\
        --factors /tmp/fb/f --out /tmp/fb/out
    python bench/train_step.py run --method lora --config plain --model /tmp/fb/m --out /tmp/fb/out
    torchrun --standalone --nproc_per_node 2 bench/train_step.py run --method lora --config ds_configs/zero3.json ...
    python bench/train_step.py run --method frod --frozen-quant nf4 --config ds_configs/zero2.json ...   # NF4 U_i
    python bench/train_step.py run --method lora --frozen-quant nf4 --quantize-base ...                 # QLoRA

Both methods adapt q/k/v/o/gate/up and get the same treatment: bf16 weights, micro-batch ``--batch`` ×
``--seq`` random token ids per GPU, gradient clipping at 1.0, torch AdamW (fused on CUDA), the same
gradient-checkpointing setting (``--gc``: the trainer's, non-reentrant), LoRA dropout 0. A step is forward +
backward + optimizer step. ``plain`` is one GPU without DeepSpeed (bf16 parameters and AdamW states, no fp32 master
copy); DeepSpeed configs keep fp32 master weights of the trainable parameters. Under ZeRO-3 LoRA is loaded
the way HF users do (``from_pretrained`` under ``HfDeepSpeedConfig``), FRoD by ``build_frod_model``.
Timing: ``--warmup`` untimed steps, then ``--repeats`` windows of ``--steps`` steps, each step timed
between device synchronisations; peak memory is taken over the timed windows (after the optimizer states
exist).

Quantized frozen weights (``--frozen-quant nf4|int8``): FRoD holds every ``U_i`` quantized (``model.frozen_quant``;
``--quantize-base`` also the untargeted linears, ``model.quantize_base``); LoRA loads the targeted linears through
bitsandbytes (``BitsAndBytesConfig``: NF4 in blocks of 64 without double quantization and ``bnb_4bit_quant_storage``
bf16 so ZeRO-3 can partition it, or LLM.int8()), and with ``--quantize-base`` every decoder linear: QLoRA.
``lm_head`` and the embeddings stay bf16 for both. Under ZeRO-3 the NF4 linears run through
``bench/bnb_zero3.py`` (bitsandbytes' own autograd Function keeps every gathered weight alive until the backward).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from frod_ds.config.ds_config import BatchSizes, load_ds_config, zero_stage  # noqa: E402
from frod_ds.core.names import DEFAULT_TARGETS  # noqa: E402

TARGETS = list(DEFAULT_TARGETS)
LORA_R, LORA_ALPHA = 16, 32
GIB = 2**30


def make_model(
    out: str, layers: int, hidden: int = 4096, inter: int = 11008, heads: int = 32, vocab: int = 32000
) -> None:
    """A random bf16 LLaMA-shaped checkpoint (LLaMA-2-7B: 32 layers, 4096/11008, 32 heads, vocab 32000)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        vocab_size=vocab,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(out, max_shard_size="2GB")
    print(f"wrote {out}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters")


# -- one configuration ---------------------------------------------------------------------------------


def _ds_config(path: str, batch: int, world: int, sets: list[str] = ()) -> dict | None:
    """The DeepSpeed JSON with the batch keys filled in and each ``--ds-set KEY=VALUE`` applied (``KEY`` a
    ``zero_optimization`` key, or a dotted path from the top, e.g. ``compile.deepcompile=true``; ``VALUE`` JSON)."""
    if path == "plain":
        if sets:
            raise SystemExit("error: --ds-set needs a DeepSpeed config, not plain")
        return None
    cfg = load_ds_config(path)
    cfg.update(
        train_micro_batch_size_per_gpu=batch,
        gradient_accumulation_steps=1,
        train_batch_size=BatchSizes(batch, 1, world).total,
        gradient_clipping=1.0,
    )
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"error: --ds-set {item!r}: expected KEY=VALUE")
        path_keys = key.split(".") if "." in key else ["zero_optimization", key]
        node = cfg
        for k in path_keys[:-1]:
            node = node.setdefault(k, {})
        node[path_keys[-1]] = json.loads(value)
    return cfg


def _zero3(ds_cfg: dict | None) -> bool:
    return ds_cfg is not None and zero_stage(ds_cfg) == 3


def build_frod(args, ds_cfg: dict | None, rank: int):
    """The FRoD model from checkpoint + factor store, and its two AdamW groups (σ, S)."""
    from frod_ds.model.apply import frod_modules, frod_param_groups
    from frod_ds.model.build import build_frod_model, make_supports
    from frod_ds.model.store_reader import FactorStore
    from frod_ds.train.trainer import enable_gradient_checkpointing

    store = FactorStore.open(args.factors)
    supports = make_supports(store, TARGETS, args.sparsity, 0)
    model = build_frod_model(
        args.model,
        store,
        supports,
        torch.bfloat16,
        ds_cfg,
        rank=rank,
        quant=args.frozen_quant,
        quantize_base=args.quantize_base,
        replicate_v=not args.v_partitioned,
        flat_trainables=False if args.per_member_trainables else None,
        flat_frozen=False if args.per_member_frozen else None,
    )
    for _, m in frod_modules(model):
        m.save, m.dgrad, m.impl = args.frod_save, args.frod_dgrad, args.frod_impl
    if args.gc:
        enable_gradient_checkpointing(model)
    return model, frod_param_groups(model, 1e-4, 1e-5)


def _bnb_config(args):
    """``BitsAndBytesConfig`` for LoRA's quantized base (None: bf16): the targeted linears, and with
    ``--quantize-base`` the untargeted ones too (QLoRA); lm_head stays bf16."""
    if args.frozen_quant == "none":
        return None
    from transformers import BitsAndBytesConfig

    skip = ["lm_head"] + ([] if args.quantize_base else ["down_proj"])
    if args.frozen_quant == "int8":
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=False,
        bnb_4bit_compute_dtype=torch.bfloat16,
        bnb_4bit_quant_storage=torch.bfloat16,
        llm_int8_skip_modules=skip,
    )


def build_lora(args, ds_cfg: dict | None, device: torch.device):
    """PEFT LoRA r=16 on the same targets, adapters in bf16 like the base (on a bitsandbytes-quantized base with
    ``--frozen-quant``)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    from frod_ds.train.trainer import enable_gradient_checkpointing  # the trainer's setting, for both methods

    keep = HfDeepSpeedConfig(ds_cfg) if _zero3(ds_cfg) else None  # noqa: F841 - alive while from_pretrained runs
    quant = _bnb_config(args)
    kw = {} if quant is None else {"quantization_config": quant}
    if quant is not None and not _zero3(ds_cfg):
        kw["device_map"] = {"": device}  # bitsandbytes quantizes as the weights reach the device
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16, **kw)
    if args.frozen_quant == "nf4" and _zero3(ds_cfg) and not args.stock_bnb:
        from bench.bnb_zero3 import keep_linear4bit_weights_partitioned

        keep_linear4bit_weights_partitioned(model)  # else each rank keeps the whole gathered NF4 model per step
    if args.gc:
        enable_gradient_checkpointing(model)
    cfg = LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, target_modules=TARGETS, lora_dropout=0.0)
    model = get_peft_model(model, cfg, autocast_adapter_dtype=False)
    return model, [{"params": [p for p in model.parameters() if p.requires_grad]}]


class LayerPasses:
    """How many times each decoder layer's MLP runs per training step: 1 without gradient checkpointing, 2 with it
    (the backward recomputes the layer) — what ``--gc`` did, counted rather than assumed. The MLP, not the layer:
    transformers 5.17 checkpoints a layer's whole ``__call__`` (its hooks run again in the recompute), 5.23 only
    its ``forward`` (they do not); the MLP's hooks run inside either."""

    def __init__(self, model):
        self.mlps = [m.mlp for m in model.modules() if type(m).__name__.endswith("DecoderLayer") and hasattr(m, "mlp")]
        if not self.mlps:
            raise SystemExit(
                f"error: no decoder layer with an .mlp in {type(model).__name__}: cannot check that "
                "--gc checkpoints (bench/train_step.py times LLaMA-family models)"
            )
        self.calls = 0
        self.per_step: float | None = None  # set by check()
        self.handles = [m.register_forward_pre_hook(self._count) for m in self.mlps]

    def _count(self, module, args) -> None:
        self.calls += 1

    def check(self, steps: int, gc: bool) -> None:
        """``per_step``: passes per step over the ``steps`` run so far (hooks removed); ``SystemExit`` when they are
        not what ``gc`` asks for."""
        for h in self.handles:
            h.remove()
        passes = self.per_step = self.calls / (steps * len(self.mlps))
        if passes != (2.0 if gc else 1.0):
            raise SystemExit(
                f"error: each decoder layer ran {passes:g} times per step, expected {2 if gc else 1} "
                f"with gradient checkpointing {'on' if gc else 'off'}: the measurement would not be of "
                "the requested configuration"
            )


def _numel(p) -> int:
    return int(getattr(p, "ds_numel", p.numel()))


class Stepper:
    """forward + backward + optimizer step, the DeepSpeed engine's or plain PyTorch's."""

    def __init__(self, model, groups, ds_cfg: dict | None, device: torch.device, compile_engine: bool = False):
        fused = device.type == "cuda"
        opt = torch.optim.AdamW(groups, lr=1e-4, fused=fused or None)
        self.params = [p for g in groups for p in g["params"]]
        if ds_cfg is None:
            placed = getattr(model, "hf_device_map", None) is not None  # a quantized base is already on the device
            self.model, self.opt, self.engine = (model if placed else model.to(device)).train(), opt, None
        else:
            import deepspeed

            self.engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_cfg)
            self.engine.train()  # from_pretrained leaves the base in eval mode, where no layer checkpoints
            if compile_engine:
                self.engine.compile()  # DeepCompile when the config has "compile": {"deepcompile": true}
            self.model = self.engine.module

    def _forward(self, ids: torch.Tensor) -> torch.Tensor:
        return (self.engine if self.engine is not None else self.model)(input_ids=ids, labels=ids).loss

    def _backward(self, loss: torch.Tensor) -> None:
        if self.engine is not None:
            self.engine.backward(loss)
        else:
            loss.backward()

    def _step(self) -> None:
        if self.engine is not None:
            self.engine.step()
            return
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def phases(self, ids: torch.Tensor, sync) -> dict[str, float]:
        """One step, ``sync()`` after each phase: milliseconds of forward, backward and optimizer step."""
        t0 = time.perf_counter()
        loss = self._forward(ids)
        sync()
        t1 = time.perf_counter()
        self._backward(loss)
        sync()
        t2 = time.perf_counter()
        self._step()
        sync()
        t3 = time.perf_counter()
        return {"forward": (t1 - t0) * 1e3, "backward": (t2 - t1) * 1e3, "step": (t3 - t2) * 1e3}

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        loss = self._forward(ids)
        self._backward(loss)
        self._step()
        return loss.detach()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _mem(device: torch.device) -> dict:
    if device.type != "cuda":
        import resource

        return {"max_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    return {
        "allocated_gib": torch.cuda.memory_allocated(device) / GIB,
        "peak_allocated_gib": torch.cuda.max_memory_allocated(device) / GIB,
        "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / GIB,
    }


def _steal_s() -> float | None:
    """CPU time the hypervisor gave other guests, summed over this machine's CPUs (``/proc/stat``), in seconds; None
    where there is no such file. Read per window: a host-bound step slows when it grows."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def time_steps(
    step,
    batches,
    device: torch.device,
    warmup: int,
    steps: int,
    repeats: int,
    after_warmup=None,
    gate=None,
    gc_freeze: bool = False,
    rewarm: int = 0,
) -> dict:
    """``warmup`` untimed steps (``after_warmup()`` then), then ``repeats`` windows of ``steps`` timed steps (seconds
    each). ``gate(k)`` (if given) is called before window k and once more after the last (k = repeats): it returns
    when the window may start (``window_gate``); ``rewarm`` untimed steps then run before the window's timed ones (with
    a gate only)."""
    losses = [float(step(next(batches))) for _ in range(warmup)]
    if after_warmup is not None:
        after_warmup()
    if gc_freeze:  # what the build and warm-up made is never collected again: collections scan only what is new
        gc.collect()
        gc.freeze()
    gc_counts, host = [], []
    _sync(device)
    mem_warm = _mem(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    windows = []
    for k in range(repeats):
        if gate is not None:
            gate(k)
            for _ in range(rewarm):  # back from waiting while others ran: caches and clocks as a running loop has them
                step(next(batches))
        times = []
        before = [g["collections"] for g in gc.get_stats()]
        cpu0, steal0 = time.process_time(), _steal_s()
        for _ in range(steps):
            ids = next(batches)
            _sync(device)
            t0 = time.perf_counter()
            loss = step(ids)
            _sync(device)
            times.append(time.perf_counter() - t0)
        windows.append(times)
        gc_counts.append([g["collections"] - b for g, b in zip(gc.get_stats(), before)])
        host.append(
            {"process_cpu_s": time.process_time() - cpu0, "steal_s": None if steal0 is None else _steal_s() - steal0}
        )
        losses.append(float(loss))
    if gate is not None:
        gate(repeats)
    return {
        "windows": windows,
        "losses": losses,
        "mem_after_warmup": mem_warm,
        "mem_timed": _mem(device),
        "gc_collections": gc_counts,
        "host": host,
    }


def window_gate(directory: str, name: str, repeats: int, wait_s: float = 1800.0):
    """The gate of ``--gate DIR``: before window k this process writes ``DIR/NAME.ready<k>`` and waits for
    ``DIR/NAME.go<k>``; after its last window it writes ``ready<repeats>`` and goes on. A driver running several
    configurations at once on one GPU (``bench/zero3_levers.py --interleave``) opens one window at a time, so each
    configuration's windows alternate with the others' and a machine that slows down for a while slows all of them."""
    gate_dir = Path(directory)

    def gate(k: int) -> None:
        (gate_dir / f"{name}.ready{k}").touch()
        if k >= repeats:
            return
        go, t0 = gate_dir / f"{name}.go{k}", time.monotonic()
        while not go.exists():
            if time.monotonic() - t0 > wait_s:
                raise SystemExit(f"error: no {go} after {wait_s:.0f} s: the driver of --gate is gone")
            time.sleep(0.005)

    return gate


def profile_steps(step, batches, device: torch.device, steps: int = 3, top: int = 25) -> dict:
    """``steps`` more steps under ``torch.profiler``: wall time per step, the device's busy time per step (the sum
    of its kernels' time: far below the wall time means the GPU waits on the host, i.e. Python/hook overhead),
    and the ops with the most host time and the most device time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _sync(device)
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step(next(batches))
        _sync(device)
    wall = (time.perf_counter() - t0) / steps
    events = prof.key_averages()

    def dev(e) -> float:
        return float(getattr(e, "self_device_time_total", 0.0) or getattr(e, "self_cuda_time_total", 0.0) or 0.0)

    busy = sum(dev(e) for e in events) / 1e6 / steps
    rows = [
        {
            "op": e.key,
            "calls_per_step": e.count / steps,
            "host_total_ms": e.cpu_time_total / 1e3 / steps,
            "host_self_ms": e.self_cpu_time_total / 1e3 / steps,
            "device_self_ms": dev(e) / 1e3 / steps,
        }
        for e in events
    ]
    by_host = sorted(rows, key=lambda r: -r["host_self_ms"])[:top]
    by_device = sorted(rows, key=lambda r: -r["device_self_ms"])[:top]
    return {
        "steps": steps,
        "wall_s_per_step": wall,
        "device_busy_s_per_step": busy if device.type == "cuda" else None,
        "top_host_self": by_host,
        "top_device_self": by_device,
    }


def phase_steps(step, batches, device: torch.device, steps: int = 5) -> dict:
    """``steps`` more steps with the device synchronised between forward, backward and optimizer step: the median
    milliseconds of each phase (where a configuration's extra time goes)."""
    phases: dict[str, list[float]] = {"forward": [], "backward": [], "step": []}
    for _ in range(steps):
        ids = next(batches)
        _sync(device)
        for name, ms in step.phases(ids, lambda: _sync(device)).items():
            phases[name].append(ms)
    return {name: statistics.median(v) for name, v in phases.items()}


def python_profile_steps(step, batches, device: torch.device, steps: int = 3, top: int = 40) -> dict:
    """``steps`` more steps under ``cProfile``: the Python functions with the most own time and the most time
    under them, per step (host-side cost by function: DeepSpeed's hooks, the layer's autograd Functions)."""
    import cProfile
    import pstats

    _sync(device)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(steps):
        step(next(batches))
    _sync(device)
    prof.disable()
    wall = (time.perf_counter() - t0) / steps
    st = pstats.Stats(prof)

    def where(key) -> str:
        path, line, fn = key
        parts = Path(path).parts
        for anchor in ("site-packages", "frod_ds", "bench"):
            if anchor in parts:
                parts = parts[parts.index(anchor) + (anchor == "site-packages") :]
                break
        return f"{'/'.join(parts[-3:])}:{line}({fn})"

    rows = [
        {"function": where(k), "calls_per_step": nc / steps, "own_ms": tt * 1e3 / steps, "cum_ms": ct * 1e3 / steps}
        for k, (cc, nc, tt, ct, _) in st.stats.items()
    ]
    return {
        "steps": steps,
        "wall_s_per_step": wall,
        "python_calls_per_step": st.total_calls / steps,
        "top_own": sorted(rows, key=lambda r: -r["own_ms"])[:top],
        "top_cum": sorted(rows, key=lambda r: -r["cum_ms"])[:top],
    }


def _batches(batch: int, seq: int, vocab: int, rank: int, device: torch.device):
    g = torch.Generator(device="cpu").manual_seed(1234 + rank)
    while True:
        yield torch.randint(0, vocab, (batch, seq), generator=g).to(device)


def summarize(windows: list[list[float]], tokens_per_step: int) -> dict:
    """Median, spread and percentiles of step times; tokens/s per GPU from the median."""
    flat = sorted(t for w in windows for t in w)
    med = statistics.median(flat)
    per_window = [statistics.median(w) for w in windows]

    def pct(q):
        return flat[min(len(flat) - 1, int(q * (len(flat) - 1) + 0.5))]

    return {
        "step_s_median": med,
        "step_s_p10": pct(0.1),
        "step_s_p90": pct(0.9),
        "step_s_min": flat[0],
        "step_s_max": flat[-1],
        "window_medians_s": per_window,
        "window_spread": (max(per_window) - min(per_window)) / med if med else 0.0,
        "tokens_per_s_per_gpu": tokens_per_step / med,
        "step_s_all": windows,
    }


def run(args) -> None:
    from bench.common import device_name, write_result
    from bench.flops import flops_per_token, peak_bf16_flops
    from frod_ds.runtime import distributed as dist

    if args.warmup < 1:
        raise SystemExit("error: --warmup must be at least 1: the warm-up steps also check what --gc did")
    plain = args.config == "plain"
    if args.nvtx:  # read by init_deepspeed: DeepSpeed's NVTX ranges stay on (its default) in this one-run process
        os.environ[dist.NVTX_ENV] = "1"
    if not plain:
        dist.init_deepspeed()  # one process without a launcher: DeepSpeed still wants a process group
    world, rank = dist.get_world_size(), dist.get_rank()
    assert plain is False or world == 1, "plain PyTorch runs on one GPU (no DDP here)"
    device = dist.local_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ds_cfg = _ds_config(args.config, args.batch, world, args.ds_set)

    t0 = time.perf_counter()
    model, groups = build_frod(args, ds_cfg, rank) if args.method == "frod" else build_lora(args, ds_cfg, device)
    model.config.use_cache = False
    if _zero3(ds_cfg) and (args.leaf_modules if args.method == "lora" else not args.per_module_fetch):
        from frod_ds.model.build import fetch_per_layer

        fetch_per_layer(model)  # FRoD: the trainer's default under ZeRO-3; LoRA: with --leaf-modules
        if args.walk_parameters:  # undo fetch_per_layer's FixedParameters: DeepSpeed walks the modules every time
            for module in model.modules():
                module.__dict__.pop("named_parameters", None)
    step = Stepper(model, groups, ds_cfg, device, compile_engine=args.compile)
    build_s = time.perf_counter() - t0
    mem_built = _mem(device)
    cfg = step.model.config.to_dict()
    trainable = sum(_numel(p) for p in step.model.parameters() if p.requires_grad)
    frozen = sum(_numel(p) for p in step.model.parameters() if not p.requires_grad)
    trainable_dtypes = sorted({str(p.dtype) for p in step.model.parameters() if p.requires_grad})
    trainable_tensors = sum(
        1 for p in step.model.parameters() if p.requires_grad
    )  # DeepSpeed's host work is per tensor

    passes = LayerPasses(step.model)  # checked after the warm-up steps, before any timed one
    timing = time_steps(
        step,
        _batches(args.batch, args.seq, cfg["vocab_size"], rank, device),
        device,
        args.warmup,
        args.steps,
        args.repeats,
        after_warmup=lambda: passes.check(args.warmup, args.gc),
        gate=window_gate(args.gate, args.name, args.repeats) if args.gate else None,
        gc_freeze=args.gc_freeze,
        rewarm=args.rewarm,
    )
    prof = pyprof = phases = None
    if args.profile:
        prof = profile_steps(step, _batches(args.batch, args.seq, cfg["vocab_size"], rank + 7, device), device)
    if args.phases:
        phases = phase_steps(step, _batches(args.batch, args.seq, cfg["vocab_size"], rank + 8, device), device)
    if args.pyprofile:
        pyprof = python_profile_steps(step, _batches(args.batch, args.seq, cfg["vocab_size"], rank + 9, device), device)
    tokens_per_step = args.batch * args.seq
    stats = summarize(timing["windows"], tokens_per_step)
    fl = flops_per_token(
        cfg,
        args.seq,
        args.method,
        tokens_per_step,
        targets=TARGETS,
        lora_r=LORA_R,
        sparsity=args.sparsity,
        save=args.frod_save,
        dgrad=args.frod_dgrad,
    )
    peak = peak_bf16_flops(device_name()) if device.type == "cuda" else None
    mems = dist.all_gather_object(
        {"built": mem_built, "after_warmup": timing["mem_after_warmup"], "timed": timing["mem_timed"]}
    )
    if dist.is_main():
        engine = "plain" if plain else f"zero{zero_stage(ds_cfg)}"
        payload = {
            "method": args.method,
            "engine": engine,
            "config": args.config,
            "ds_config": ds_cfg,
            "world_size": world,
            "gradient_checkpointing": args.gc,
            "frozen_quant": args.frozen_quant,
            "quantize_base": args.quantize_base,
            "stock_bnb": args.stock_bnb,
            "micro_batch": args.batch,
            "seq_len": args.seq,
            "tokens_per_step_per_gpu": tokens_per_step,
            "warmup": args.warmup,
            "steps": args.steps,
            "repeats": args.repeats,
            "model": {
                k: cfg[k]
                for k in (
                    "num_hidden_layers",
                    "hidden_size",
                    "intermediate_size",
                    "num_attention_heads",
                    "num_key_value_heads",
                    "vocab_size",
                )
            },
            "targets": TARGETS,
            "trainable_params": trainable,
            "trainable_tensors": trainable_tensors,
            "frozen_params": frozen,
            "trainable_dtypes": trainable_dtypes,
            "optimizer": "torch.optim.AdamW" + (" fused" if device.type == "cuda" else ""),
            "frod": {
                "sparsity": args.sparsity,
                "save": args.frod_save,
                "dgrad": args.frod_dgrad,
                "impl": args.frod_impl,
            }
            if args.method == "frod"
            else None,
            "lora": {"r": LORA_R, "alpha": LORA_ALPHA, "dropout": 0.0} if args.method == "lora" else None,
            **stats,
            "flops_per_token": fl,
            "peak_bf16_flops": peak,
            "mfu": fl["total"] * stats["tokens_per_s_per_gpu"] / peak if peak else None,
            "memory_per_rank": mems,
            "peak_allocated_gib": max(m["timed"].get("peak_allocated_gib", 0.0) for m in mems) or None,
            "peak_reserved_gib": max(m["timed"].get("peak_reserved_gib", 0.0) for m in mems) or None,
            "build_s": build_s,
            "losses": timing["losses"],
            "layer_passes_per_step": passes.per_step,
            "levers": {
                "ds_set": list(args.ds_set),
                "v_partitioned": args.v_partitioned,
                "per_member_trainables": args.per_member_trainables,
                "per_member_frozen": args.per_member_frozen,
                "walk_parameters": args.walk_parameters,
                "leaf_modules": args.leaf_modules,
                "per_module_fetch": args.per_module_fetch,
                "compile": args.compile,
                "gc_freeze": args.gc_freeze,
                "nvtx": args.nvtx,
            },
            "rewarm_steps": args.rewarm if args.gate else 0,
            "gc_collections_per_window": timing["gc_collections"],
            "host_per_window": timing["host"],
            "profile": prof,
            "phases_ms": phases,
            "python_profile": pyprof,
        }
        path = write_result(args.name or config_name(args, engine, world), payload, args.out)
        print(
            f"{path}: step {stats['step_s_median'] * 1e3:.1f} ms, {stats['tokens_per_s_per_gpu']:.0f} tok/s/GPU, "
            f"peak {payload['peak_allocated_gib']} GiB"
        )
    dist.destroy()


def config_name(args, engine: str, world: int) -> str:
    extra = ""
    if args.method == "frod" and (args.frod_save, args.frod_dgrad, args.frod_impl) != ("z", "dense", "function"):
        extra = f"_{args.frod_impl}-{args.frod_save}-{args.frod_dgrad}"
    if args.frozen_quant != "none":
        extra += f"_{args.frozen_quant}{'-base' if args.quantize_base else ''}"
    if args.stock_bnb:
        extra += "_stockbnb"
    return f"train_step_{args.method}{extra}_{engine}{'_gc' if args.gc else ''}_{world}gpu"


def add_run_args(r: argparse.ArgumentParser) -> None:
    r.add_argument("--method", choices=["frod", "lora"], required=True, help="adapter method")
    r.add_argument("--model", required=True, help="checkpoint dir (make-model)")
    r.add_argument("--factors", default=None, help="factor store (frod)")
    r.add_argument(
        "--config", default="ds_configs/zero2.json", help="DeepSpeed JSON, or 'plain' (one GPU, no DeepSpeed)"
    )
    r.add_argument("--batch", type=int, default=4, help="micro-batch per GPU")
    r.add_argument("--seq", type=int, default=512, help="tokens per sequence")
    r.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    r.add_argument("--steps", type=int, default=20, help="timed steps per window")
    r.add_argument("--repeats", type=int, default=2, help="timed windows")
    r.add_argument(
        "--gc", action="store_true", help="gradient checkpointing (the trainer's, non-reentrant) for both methods"
    )
    r.add_argument("--sparsity", type=float, default=0.02, help="FRoD density s of S")
    r.add_argument(
        "--frod-save", choices=["z", "x"], default="z", help="FRoD token order keeps z (or x, recomputing z)"
    )
    r.add_argument("--frod-dgrad", choices=["dense", "sampled"], default="dense", help="FRoD ∂S: dense GEMM or sampled")
    r.add_argument(
        "--frod-impl",
        choices=["function", "autograd"],
        default="function",
        help="FRoD autograd Functions, or plain autograd (keeps M: the previous implementation)",
    )
    r.add_argument(
        "--frozen-quant",
        choices=["none", "int8", "nf4"],
        default="none",
        help="quantized frozen weights: FRoD's U_i (model.frozen_quant), LoRA's targeted base linears (bitsandbytes)",
    )
    r.add_argument(
        "--quantize-base",
        action="store_true",
        help="with --frozen-quant: the untargeted decoder linears too (FRoD model.quantize_base; LoRA: QLoRA)",
    )
    r.add_argument(
        "--stock-bnb",
        action="store_true",
        help="LoRA under ZeRO-3 with NF4: keep bitsandbytes' own Linear4bit forward, which holds every "
        "gathered NF4 weight until the backward (bench/bnb_zero3.py; for comparison)",
    )
    r.add_argument(
        "--ds-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one DeepSpeed setting (a zero_optimization key, or a dotted path from the top; the "
        "value is JSON), e.g. stage3_param_persistence_threshold=2000000; repeatable",
    )
    r.add_argument(
        "--v-partitioned",
        action="store_true",
        help="FRoD under ZeRO-3: leave each shared V partitioned like the other frozen weights (the build "
        "holds it replicated by default)",
    )
    r.add_argument(
        "--leaf-modules",
        action="store_true",
        help="LoRA under ZeRO-3: each decoder layer one fetch unit (frod_ds.model.build.fetch_per_layer, what the "
        "trainer does for FRoD)",
    )
    r.add_argument(
        "--per-member-trainables",
        action="store_true",
        help="FRoD under DeepSpeed (ZeRO-1/2/3): one σ and one S Parameter per FRoD layer (the build "
        "holds them per decoder layer, frod_ds.core.layer.FRoDTrainables, by default)",
    )
    r.add_argument(
        "--rewarm",
        type=int,
        default=1,
        help="with --gate: untimed steps after each gate opens, before the window's timed steps (a process "
        "that waited while others ran resumes cold)",
    )
    r.add_argument(
        "--gc-freeze",
        action="store_true",
        help="after the warm-up: gc.collect() and gc.freeze() (Python's collector then never scans the "
        "build's objects again)",
    )
    r.add_argument(
        "--per-member-frozen",
        action="store_true",
        help="FRoD under ZeRO-3: one frozen U Parameter per FRoD layer (the build holds a decoder layer's "
        "dense U_i as one, frod_ds.core.layer.FRoDFrozen, by default)",
    )
    r.add_argument(
        "--walk-parameters",
        action="store_true",
        help="ZeRO-3: without fetch_per_layer's FixedParameters (DeepSpeed walks a layer's modules for its "
        "parameters at every fetch and release, the whole model's twice per optimizer step)",
    )
    r.add_argument(
        "--per-module-fetch",
        action="store_true",
        help="FRoD under ZeRO-3: leave DeepSpeed's per-submodule fetch hooks (no fetch_per_layer)",
    )
    r.add_argument(
        "--nvtx",
        action="store_true",
        help="keep DeepSpeed's NVTX ranges on, its default (frod_ds turns them off unless FROD_DS_NVTX=1)",
    )
    r.add_argument(
        "--compile",
        action="store_true",
        help="engine.compile() after deepspeed.initialize (DeepCompile with --ds-set compile.deepcompile=true)",
    )
    r.add_argument(
        "--profile",
        action="store_true",
        help="after the timed windows, 3 steps under torch.profiler: "
        "device busy time per step and the top ops (in the result JSON)",
    )
    r.add_argument(
        "--phases",
        action="store_true",
        help="after the timed windows, 5 steps synchronised between "
        "forward, backward and optimizer step: each phase's median ms (in the result JSON)",
    )
    r.add_argument(
        "--pyprofile",
        action="store_true",
        help="after the timed windows, 3 steps under cProfile: the "
        "Python functions with the most host time (in the result JSON)",
    )
    r.add_argument(
        "--gate",
        default=None,
        metavar="DIR",
        help="wait for DIR/NAME.go<k> before timed window k (window_gate; needs --name): a driver "
        "interleaves the windows of configurations sharing one GPU",
    )
    r.add_argument("--name", default=None, help="result file name (default from method, engine, GPUs)")
    r.add_argument("--out", default=None, help="results dir (default $OUT or bench/results)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--local_rank", type=int, default=None, help="set by the deepspeed launcher (ignored)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make-model", help="write a random bf16 LLaMA-shaped checkpoint")
    m.add_argument("--out", required=True, help="checkpoint dir")
    m.add_argument("--layers", type=int, default=32, help="decoder layers")
    m.add_argument("--hidden", type=int, default=4096, help="hidden size")
    m.add_argument("--inter", type=int, default=11008, help="intermediate size")
    m.add_argument("--heads", type=int, default=32, help="attention heads")
    m.add_argument("--vocab", type=int, default=32000, help="vocabulary size")
    add_run_args(sub.add_parser("run", help="time training steps of one method under one engine"))
    args = ap.parse_args()
    if args.cmd == "run" and args.quantize_base and args.frozen_quant == "none":
        ap.error("--quantize-base needs --frozen-quant nf4 or int8")
    if args.cmd == "run" and args.gate and not args.name:
        ap.error("--gate needs --name (the gate files are named by it)")
    if args.cmd == "make-model":
        make_model(args.out, args.layers, args.hidden, args.inter, args.heads, args.vocab)
    else:
        run(args)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    # The result is written and the process group destroyed: skip the interpreter's teardown, where a native
    # thread pool left joinable at exit occasionally aborts a gloo rank ("terminate called without an active
    # exception", exit -6) or hangs a finished multi-GPU run past its deadline.
    os._exit(0)
