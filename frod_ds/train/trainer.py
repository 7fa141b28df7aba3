"""DeepSpeed training of FRoD adapters: setup → fit → save, with exact resume and SIGTERM checkpoints.

``setup`` validates everything that can be checked before the model is built (recipe, DeepSpeed JSON,
data rows, factor store vs model fingerprint), then builds the model (``frod_ds.model.build``), the optimizer
(two AdamW groups with their own learning rates, passed to DeepSpeed — no optimizer block in the JSON)
and the schedule. ``fit`` runs optimizer steps from a stateless ``BatchPlan`` so resume is a position.

Output dir::

    .frod-ds-output (marker, kind training-run)  metrics.jsonl  loss.png  recipe.yaml  adapter-<step>/  adapter-final/
    checkpoints/<tag>/ (DeepSpeed engine state, rng_rank<r>.pt, trainable_state.safetensors, COMPLETE seal)
    checkpoints/latest_complete

Resume: the newest checkpoint whose files match their seal (``frod_ds.train.checkpoints``); newer ones that do not
are skipped with a ``note:`` and set aside. On the world size and ZeRO stage that wrote it, DeepSpeed loads its
own files (bitwise exact); on another, the world-size-independent record restores σ/S, AdamW and the schedule
(``frod_ds.train.engine_state``, ``frod_ds.train.trainable_state``; the data order depends on the global batch only).
An ``output_dir`` holding files that frod-ds training did not write is refused before anything is written there
(``check_run_dir``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import re
import shutil
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from tqdm import tqdm

from frod_ds.config.ds_config import (
    NvmeParams,
    batch_sizes,
    check_aio_build_env,
    check_nvme_buffer,
    check_nvme_buffer_count,
    load_ds_config,
    nvme_offloads,
    offload_device,
    resolve_ds_config,
    zero_stage,
)
from frod_ds.config.recipe import Recipe, recipe_to_dict
from frod_ds.core.layer import support_nnz, tan_alpha
from frod_ds.formats.adapter_dir import AdapterConfig
from frod_ds.formats.factor_store import StoreIdentity, category_of
from frod_ds.formats.run_identity import (
    BASE_SCOPE,
    RUN_IDENTITY,
    RunIdentity,
    RunIdentityError,
    file_sha256,
    training_hyperparameters,
)
from frod_ds.io.dtypes import FLOAT_DTYPES
from frod_ds.model.adapter import adapter_state, load_adapter_into, read_adapter, supports_from_adapter, write_adapter
from frod_ds.model.apply import frod_groups, frod_param_groups
from frod_ds.model.build import build_frod_model, check_store_quant, fetch_per_layer, gathered, make_supports
from frod_ds.runtime import distributed as dist
from frod_ds.runtime.atomic import check_replaceable, is_marked, mark_dir, marker_kind
from frod_ds.runtime.errors import FrodError, StoreError, note
from frod_ds.train.checkpoints import choose_checkpoint, sealed_checkpoints, step_of, unsealed_checkpoints
from frod_ds.train.data import (
    BatchPlan,
    Example,
    check_vocab,
    collate,
    encode_examples,
    read_training_rows,
    training_file,
)
from frod_ds.train.engine_state import Layout, restore_checkpoint, write_checkpoint

__all__ = ["Run", "setup", "fit", "lr_lambda", "enable_gradient_checkpointing", "check_run_dir"]

STOP_EXIT_CODE = 143  # 128 + SIGTERM: stopped on request, checkpoint written


def lr_lambda(schedule: str, warmup_steps: int, total_steps: int):
    """Multiplier of each group's base LR at optimizer step ``s`` (0-based): linear warmup, then decay."""

    def fn(s: int) -> float:
        if warmup_steps > 0 and s < warmup_steps:
            return (s + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = (s - warmup_steps) / max(1, total_steps - warmup_steps)
        progress = min(max(progress, 0.0), 1.0)
        if schedule == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return fn


@dataclass
class Run:
    recipe: Recipe
    engine: Any
    plan: BatchPlan
    examples: list[Example]
    eval_examples: list[Example]
    total_steps: int
    pad_id: int
    zero3: bool
    store: Any
    store_identity: StoreIdentity
    run_identity: RunIdentity
    out: Path
    adapter_config: AdapterConfig  # step and categories filled in at each save
    sigma0: dict[str, torch.Tensor] = field(default_factory=dict)
    resume: tuple[str | None, list[tuple[str, str]]] = (None, [])  # checkpoint to resume, newer ones skipped
    start_step: int = 0
    stop_requested: bool = False


def _device() -> torch.device:
    return dist.local_device()


def _check_store(recipe: Recipe, resume_tag: str | None = None):
    """Open the factor store and refuse one built from another model — before anything heavy. Returns
    ``(model_dir, store, identity, run_identity)``; the identities are what the adapters and checkpoints
    record, and the checkpoint ``resume_tag`` in ``output_dir`` must have the same ones."""
    from frod_ds.io.hf_checkpoint import HFCheckpoint, check_config_file, resolve_model_dir
    from frod_ds.model.store_reader import FactorStore, check_store_matches

    model_dir = resolve_model_dir(recipe.model.base)
    store = FactorStore.open(recipe.model.factor_store)
    check_store_matches(store, HFCheckpoint(model_dir))
    check_config_file(model_dir)  # HJD needs only the weights; building the model needs the config too
    missing = sorted(set(recipe.model.targets) - set(store.categories))
    if missing:
        raise StoreError(
            f"targets {missing} are not in factor store {store.path} (it has {sorted(store.categories)}); "
            "rebuild it with launch/hjd.py --targets … or change model.targets"
        )
    check_store_quant(store, recipe.model.targets, recipe.model.frozen_quant)
    identity = store.identity(list(recipe.model.targets))
    ckpt = HFCheckpoint(model_dir)
    from frod_ds.io.fingerprint import base_names, weights_fingerprint

    data = {"train": file_sha256(training_file(recipe.data.train))}
    if recipe.data.eval:
        data["eval"] = file_sha256(training_file(recipe.data.eval))
    run_identity = RunIdentity(
        base_fingerprint=weights_fingerprint(ckpt, base_names(ckpt.keys(), recipe.model.targets)),
        data_sha256=data,
        hyperparameters=training_hyperparameters(
            recipe_to_dict(recipe), batch_sizes(recipe, dist.get_world_size()).total
        ),
        base_scope=BASE_SCOPE,
    )
    if resume_tag is not None:
        _check_resume_store(Path(recipe.output_dir), resume_tag, identity)
        _check_resume_run(Path(recipe.output_dir), resume_tag, run_identity)
    return model_dir, store, identity, run_identity


def _checkpoint_record(out: Path, tag: str, name: str, missing_note: str) -> Path | None:
    """The file ``name`` of checkpoint ``tag`` in ``out``; None (with ``note(f"checkpoint <dir> {missing_note}")``)
    when that checkpoint lacks it."""
    recorded = out / "checkpoints" / tag / name
    if not recorded.is_file():
        note(f"checkpoint {recorded.parent} {missing_note}")
        return None
    return recorded


def _check_resume_run(out: Path, tag: str, identity: RunIdentity) -> None:
    """``RunIdentityError`` when checkpoint ``tag`` in ``out`` is of a run with another identity."""
    recorded = _checkpoint_record(
        out,
        tag,
        RUN_IDENTITY,
        "does not record its run identity (written by an older frod-ds): resuming without checking that it is this run",
    )
    if recorded is None:
        return
    recorded_identity = RunIdentity.from_json(recorded.read_text(), recorded)
    if not recorded_identity.comparable_base(identity):
        note(
            f"checkpoint {recorded.parent} records the fingerprint of all base tensors (written by an older frod-ds): "
            "resuming without checking the base model's weights against it"
        )
    diffs = recorded_identity.differences(identity)
    if diffs:
        raise RunIdentityError(
            f"output_dir {out} holds another run ({'; '.join(diffs[:4])}{'; …' if len(diffs) > 4 else ''}); "
            "use another output_dir, or pass train.new_run=true to move that run aside and start anew"
        )


PREVIOUS_RUN = ("checkpoints", "metrics.jsonl", "loss.png", "recipe.yaml", "tensorboard")


def _supersede_previous_run(out: Path) -> None:
    """``train.new_run``: move a previous run's files in ``out`` into ``out/superseded-<time>/`` (nothing is
    deleted; adapters included)."""
    old = (
        [p for p in out.iterdir() if p.name in PREVIOUS_RUN or (p.name.startswith("adapter-") and p.is_dir())]
        if out.is_dir()
        else []
    )
    if not old:
        return
    dest = out / time.strftime("superseded-%Y%m%d-%H%M%S")
    dest.mkdir()
    for p in old:
        os.rename(p, dest / p.name)
    print(f"note: train.new_run: the previous run in {out} moved to {dest}", flush=True)


RUN_KIND = "training-run"  # the marker's kind (frod_ds.runtime.atomic) of an output_dir training wrote
RUN_HOSTS = (RUN_KIND, "demo")  # what training writes into: its own runs, and the demo's directory (launch/demo.py)


def _is_legacy_run(out: Path) -> bool:
    """A run written before training marked its output_dir: sealed checkpoints, or an adapter it wrote."""
    if (out / "checkpoints").is_dir() and sealed_checkpoints(out / "checkpoints"):
        return True
    return any(p.name.startswith("adapter-") and marker_kind(p) == "adapter" for p in out.iterdir() if p.is_dir())


def check_run_dir(out: Path) -> None:
    """``FrodError`` unless training may write into ``output_dir`` ``out``: absent, empty, or a run frod-ds
    training wrote (its marker, or an older run's checkpoints/adapters); the same command on its own run
    resumes. Other commands' outputs beside the adapters (evals, exports) are not this check's business:
    training deletes nothing."""
    check_replaceable(out, RUN_HOSTS, what="output_dir", legacy=_is_legacy_run, nested=False)


STORE_IDENTITY = "factor_store.json"  # beside each engine checkpoint: the store it was trained on


def _check_resume_store(out: Path, tag: str, identity: StoreIdentity) -> None:
    """``StoreError`` when checkpoint ``tag`` in ``out`` was trained on another factor store."""
    recorded = _checkpoint_record(
        out,
        tag,
        STORE_IDENTITY,
        "does not record its factor store (written by an older frod-ds): "
        f"resuming without checking that {identity.fingerprint[:16]}… is the store it was trained on",
    )
    if recorded is None:
        return
    diffs = StoreIdentity.from_json(recorded.read_text(), recorded).differences(identity)
    if diffs:
        raise StoreError(
            f"output_dir {out} holds a run trained on another factor store ({'; '.join(diffs)}); use the factor "
            "store it was trained on, or another output_dir for a new run"
        )


def _model_vocab_size(model_dir) -> int | None:
    """``vocab_size`` of the base model's config.json (also under ``text_config``), None when it names none."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    vocab = cfg.get("vocab_size", (cfg.get("text_config") or {}).get("vocab_size"))
    return vocab if isinstance(vocab, int) and not isinstance(vocab, bool) else None


def _load_tokenizer(recipe: Recipe, model_dir):
    from frod_ds.prep.tokens import load_tokenizer

    tok = load_tokenizer(str(recipe.model.tokenizer or model_dir))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token or tok.unk_token
    return tok


USE_REENTRANT = False  # the gradient-checkpointing variant; see enable_gradient_checkpointing


def enable_gradient_checkpointing(model) -> None:
    """Checkpoint every decoder layer (recomputed in the backward), non-reentrant (``USE_REENTRANT``).

    Why non-reentrant: under ZeRO-3, DeepSpeed charges each frozen parameter a recompute gathers again to the
    innermost module whose backward is running, and releases it when that module's backward ends. A
    non-reentrant recompute runs inside the layer's backward, so a module of that layer holds them and ZeRO-3
    holds about one layer gathered at a time. A reentrant recompute runs before any module of the layer has
    started its backward; where the layer's own hooks are inside the checkpoint (transformers 5.17
    checkpoints the layer's ``__call__``) they go to the model around the layers, whose backward never ends,
    and the whole frozen model stays gathered until the step's end (tests/train/test_checkpoint_residency.py)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": USE_REENTRANT})
    if USE_REENTRANT:  # a reentrant checkpoint passes a gradient only through inputs that require one
        model.enable_input_require_grads()
    else:  # transformers turns it on anyway; without it the backward stops at the first layer's input
        model.disable_input_require_grads()
    model.config.use_cache = False


def _optimizer(model, recipe: Recipe, ds_cfg: dict):
    t = recipe.train
    groups = frod_param_groups(model, t.lr_sigma, t.lr_s, t.weight_decay)
    if offload_device(ds_cfg, "offload_optimizer") is not None:  # DeepSpeed steps an offloaded optimizer on the CPU
        from deepspeed.accelerator import get_accelerator
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        from frod_ds.runtime import op_build

        # DeepSpeedCPUAdam JIT-builds cpu_adam on its first use in a TORCH_EXTENSIONS_DIR: built here under a lock
        # that dies with its holder (a build killed mid-way must not hang every later launch); DeepSpeed then
        # reuses the loaded op, and later launches load the cached build.
        op_build.load_op(get_accelerator().create_op_builder("CPUAdamBuilder"))
        return DeepSpeedCPUAdam(groups, lr=t.lr_sigma, betas=tuple(t.betas), adamw_mode=True)
    return torch.optim.AdamW(groups, lr=t.lr_sigma, betas=tuple(t.betas))


def setup(recipe: Recipe, ds_config_path: str, nvme_path: str | None = None) -> Run:
    """Validate inputs, build model/optimizer/engine, restore the latest complete checkpoint if any."""
    import deepspeed

    world, rank = dist.get_world_size(), dist.get_rank()
    dist.on_all(lambda: check_run_dir(Path(recipe.output_dir)))  # before anything reads or writes there
    # The checkpoint to resume: rank 0 checks the files against their seals (newest first) once for all.
    resume = (
        (None, [])
        if recipe.train.new_run
        else dist.on_main(lambda: choose_checkpoint(Path(recipe.output_dir) / "checkpoints"))
    )
    # Every check of the inputs, on every rank; a user error on any rank stops all of them with one line.
    ds_cfg, model_dir, store, identity, run_identity, tok, examples, eval_examples = dist.on_all(
        lambda: _inputs(recipe, ds_config_path, nvme_path, resume[0])
    )
    # every rank writes its checkpoint shards there and rank 0 seals them: one directory for all nodes
    dist.check_shared_dir(Path(recipe.output_dir), "output_dir")
    plan = BatchPlan(
        len(examples), recipe.train.micro_batch_size, recipe.train.grad_accum, world, rank, recipe.train.seed
    )
    total = plan.total_steps(recipe.train.epochs, recipe.train.max_steps)

    _seed_everything(recipe.train.seed + rank)
    dtype = FLOAT_DTYPES[recipe.model.dtype]
    init = _init_adapter(recipe, store, identity)
    supports = (
        make_supports(store, list(recipe.model.targets), recipe.model.sparsity, recipe.model.seed)
        if init is None
        else supports_from_adapter(*init)
    )
    t_build = time.perf_counter()
    model = build_frod_model(
        model_dir,
        store,
        supports,
        dtype,
        ds_cfg,
        rank=rank,
        quant=recipe.model.frozen_quant,
        quantize_base=recipe.model.quantize_base,
    )
    dist.print0(f"model built in {time.perf_counter() - t_build:.1f} s (skeleton, factor store and checkpoint reads)")
    zero3 = zero_stage(ds_cfg) == 3
    sigma0 = _initial_sigma(model, zero3)  # the factor store's σ, before an init adapter replaces it
    if init is not None:  # before deepspeed.initialize: the optimizer's master copies are made from these values
        load_adapter_into(model, init[0], zero3)
    if recipe.model.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    if zero3:
        fetch_per_layer(model)  # after checkpointing, which turns the first layer's input gradient off
    optimizer = _optimizer(model, recipe, ds_cfg)
    warmup = int(round(recipe.train.warmup_ratio * total))
    fn = lr_lambda(recipe.train.schedule, warmup, total)
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, fn),
        config=ds_cfg,
    )
    out = Path(recipe.output_dir)
    config = AdapterConfig(  # local paths made absolute so the adapter loads from any working directory
        base_model=_absolute_if_local(recipe.model.base),
        factor_store=_absolute_if_local(recipe.model.factor_store),
        factor_store_fingerprint=identity.fingerprint,
        tokenizer=_absolute_if_local(recipe.model.tokenizer) if recipe.model.tokenizer else None,
        targets=list(recipe.model.targets),
        sparsity=recipe.model.sparsity if init is None else init[1].sparsity,
        seed=recipe.model.seed if init is None else init[1].seed,
        init_adapter=_absolute_if_local(recipe.model.init_adapter) if init is not None else None,
        pi=identity.pi,
        dtype=recipe.model.dtype,
        frozen_quant=recipe.model.frozen_quant,  # eval and export rebuild the same quantized model
        quantize_base=recipe.model.quantize_base,
    )
    run = Run(
        recipe,
        engine,
        plan,
        examples,
        eval_examples,
        total,
        tok.pad_token_id,
        zero3,
        store,
        identity,
        run_identity,
        out,
        config,
    )
    run.sigma0 = sigma0
    run.resume = resume
    if dist.is_main():
        if recipe.train.new_run:
            _supersede_previous_run(out)
        out.mkdir(parents=True, exist_ok=True)
        if not is_marked(out):
            mark_dir(out, RUN_KIND)
        (out / "recipe.yaml").write_text(yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False))
    dist.barrier()
    run.start_step = _maybe_resume(run)
    return run


def _inputs(recipe: Recipe, ds_config_path: str, nvme_path: str | None, resume_tag: str | None = None):
    """Everything ``setup`` needs that a user can get wrong, checked before anything heavy: the DeepSpeed
    config, the data rows, the factor store against the model (and against a run to resume), the tokenizer."""
    ds_cfg = resolve_ds_config(load_ds_config(ds_config_path), recipe, dist.get_world_size(), nvme_path)
    if recipe.train.tensorboard:
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: F401
        except ImportError:
            raise FrodError("train.tensorboard=true needs the tensorboard package: pip install tensorboard") from None
    rows = read_training_rows(recipe.data.train, recipe.data.limit)
    eval_rows = read_training_rows(recipe.data.eval) if recipe.data.eval else []
    model_dir, store, identity, run_identity = _check_store(recipe, resume_tag)
    if "offload_param" in nvme_offloads(ds_cfg):  # the model's parameter sizes are read only when they matter
        params = nvme_params(model_dir, store, list(recipe.model.targets), recipe.model.sparsity)
        check_nvme_buffer(ds_cfg, params.largest_frozen, dist.get_world_size())
        check_nvme_buffer_count(ds_cfg, params, dist.get_world_size(), FLOAT_DTYPES[recipe.model.dtype].itemsize)
    check_aio_build_env(ds_cfg, dict(os.environ))
    tok = _load_tokenizer(recipe, model_dir)
    examples = encode_examples(tok, rows, recipe.data.cutoff_len, recipe.data.train_on_inputs)
    eval_examples = encode_examples(tok, eval_rows, recipe.data.cutoff_len, False)
    vocab = _model_vocab_size(model_dir)
    if vocab is not None:
        check_vocab(examples + eval_examples, vocab, str(recipe.model.tokenizer or model_dir), model_dir)
    t, world = recipe.train, dist.get_world_size()
    batch = batch_sizes(recipe, world).total
    if len(examples) < batch:
        limited = (
            f" (data.limit={recipe.data.limit})"
            if recipe.data.limit is not None and len(rows) == recipe.data.limit
            else ""
        )
        raise FrodError(
            f"{training_file(recipe.data.train)} gives {len(examples)} training rows{limited}, fewer than "
            f"one global batch ({batch} = micro_batch_size {t.micro_batch_size} x grad_accum "
            f"{t.grad_accum} x {world} rank(s)); use more data{', a larger data.limit' if limited else ''} "
            "or a smaller batch"
        )
    for c in recipe.model.targets:
        n = store.width(c)
        if support_nnz(n, recipe.model.sparsity) == 0:
            raise FrodError(
                f"model.sparsity={recipe.model.sparsity:g} gives S no entries for {c} (width {n}: "
                f"round(s*n^2) = 0); use model.sparsity >= {0.5 / (n * n):.3g}"
            )
    _check_output_dir(Path(recipe.output_dir))
    return ds_cfg, model_dir, store, identity, run_identity, tok, examples, eval_examples


def nvme_params(model_dir, store, targets: list[str], sparsity: float) -> NvmeParams:
    """The FRoD model's parameter sizes per decoder layer (checkpoint tensors, a ``U`` in place of each targeted
    weight), the ``V`` shared per category, the rest, and each layer's trainable σ (n) and S (round(s·n²)):
    what ``check_nvme_buffer_count`` counts."""
    from frod_ds.io.hf_checkpoint import HFCheckpoint

    ckpt = HFCheckpoint(model_dir)
    replaced = {f"{m}.weight": math.prod(store.member_shape(m)) for c in targets for m in store.categories[c]}
    layers: dict[int, list[int]] = {}
    trainable: dict[int, list[int]] = {}
    other = []
    for k in sorted(set(ckpt.keys()) | set(replaced)):  # the targeted weights may be gone from the checkpoint
        numel = replaced[k] if k in replaced else math.prod(ckpt.info(k).shape)
        hit = re.search(r"\.layers\.(\d+)\.", k)
        (layers.setdefault(int(hit.group(1)), []) if hit else other).append(numel)
    for c in targets:
        n = store.width(c)
        for m in store.categories[c]:
            hit = re.search(r"\.layers\.(\d+)\.", m + ".")
            trainable.setdefault(int(hit.group(1)), []).extend([n, support_nnz(n, sparsity)])
    return NvmeParams(
        [layers[i] for i in sorted(layers)],
        [store.width(c) ** 2 for c in targets],
        other,
        [trainable.get(i, []) for i in sorted(layers)],
    )


def _check_output_dir(out: Path) -> None:
    """``output_dir`` must be a directory this process can write to, or creatable: checked on it or its nearest
    existing parent, without creating anything (a run that fails later leaves no empty ``output_dir``)."""
    import tempfile

    where = out
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        if not where.is_dir():
            raise NotADirectoryError(20, "not a directory")
        with tempfile.TemporaryFile(dir=where):
            pass
    except OSError as e:
        raise FrodError(
            f"output_dir {out} is not writable ({where}: {e.strerror or e}); choose another output_dir"
        ) from None


@contextlib.contextmanager
def removed_if_failed(out: Path) -> Iterator[None]:
    """Run the block; if it raises and ``out`` did not exist before it and holds no sealed checkpoint or adapter
    (what a rerun would resume or keep), rank 0 deletes ``out``: a failed run leaves nothing it created behind, and
    never touches a directory it did not create."""
    created = not os.path.lexists(out)
    try:
        yield
    except BaseException:
        if (
            created
            and dist.is_main()
            and out.is_dir()
            and not out.is_symlink()
            and not sealed_checkpoints(out / "checkpoints")
            and not any(out.glob("adapter-*"))
        ):
            shutil.rmtree(out, ignore_errors=True)  # an unsealed checkpoint is nothing a rerun would resume
        raise


def _init_adapter(recipe: Recipe, store, identity: StoreIdentity | None = None):
    """``(tensors, config)`` of ``model.init_adapter``, checked to belong to the recipe's factor store and targets;
    None without one. A fresh run starts from its values (new optimizer and schedule); resume still wins."""
    from frod_ds.model.adapter import check_adapter_store

    path = recipe.model.init_adapter
    if not path:
        return None
    tensors, config = read_adapter(path)
    identity = identity or store.identity(list(recipe.model.targets))
    named = config.factor_store
    if (
        not named
        or Path(named).resolve() != store.path.resolve()
        or config.factor_store_fingerprint != identity.fingerprint
    ):
        raise FrodError(
            f"model.init_adapter {path} belongs to factor store {named}, not model.factor_store "
            f"{store.path}; set model.factor_store={named}"
        )
    if sorted(config.categories) != sorted(recipe.model.targets):
        raise FrodError(
            f"model.init_adapter {path} adapts {sorted(config.categories)}, model.targets "
            f"are {sorted(recipe.model.targets)}; set model.targets to the adapter's"
        )
    check_adapter_store(config, store, path)  # V and HJD route per category, where the adapter records them
    return tensors, config


def _absolute_if_local(path_or_id: str) -> str:
    p = Path(path_or_id)
    return str(p.resolve()) if p.exists() else path_or_id


def _initial_sigma(model, zero3: bool) -> dict[str, torch.Tensor]:
    """σ⁰ as the model holds it (model dtype, so bf16 rounding is not counted as an update); rank 0 keeps it."""
    sigma0 = {}
    for params, members in frod_groups(model):
        with gathered(params, zero3):
            if dist.is_main():
                sigma0.update({name: m.frod_sigma.detach().float().cpu().clone() for name, m in members})
    return sigma0


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


# -- checkpoints ----------------------------------------------------------------------------------


def _ckpt_root(run: Run) -> Path:
    return run.out / "checkpoints"


def _maybe_resume(run: Run) -> int:
    """Restore the checkpoint ``setup`` chose (``run.resume``); returns the step to continue from (0: none)."""
    tag, skipped = run.resume
    unsealed = [
        u
        for u in dist.on_main(lambda: unsealed_checkpoints(_ckpt_root(run)))
        if tag is None or step_of(u) > step_of(tag)
    ]  # type: ignore[operator]
    if unsealed and dist.is_main():
        note(
            f"{', '.join(unsealed)} in {_ckpt_root(run)}: no COMPLETE seal (a save that never finished), not resumed "
            f"from; {'starting at step 0' if tag is None else f'resuming from {tag}'}"
        )
    step = 0
    if tag is not None:
        t = run.recipe.train
        step = restore_checkpoint(
            run.engine,
            _ckpt_root(run),
            tag,
            skipped,
            Layout(dist.get_world_size(), t.micro_batch_size, t.grad_accum),
            run.zero3,
        )
    metrics = run.out / "metrics.jsonl"
    if dist.is_main() and metrics.is_file():  # rows of steps after the one continued from are replayed (all of
        # them when a run killed before its first sealed checkpoint starts over): dropped, so no step is logged twice
        kept = [line for line in metrics.read_text().splitlines() if line and json.loads(line)["step"] <= step]
        tmp = metrics.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, metrics)
    if tag is not None:
        dist.print0(f"resumed from {tag}: step {step}/{run.total_steps}")
    return step


def save_checkpoint(run: Run, step: int) -> None:
    """The engine checkpoint of ``step`` with the run's identity records, sealed (``frod_ds.train.engine_state``)."""
    t = run.recipe.train
    write_checkpoint(
        run.engine,
        _ckpt_root(run),
        step,
        Layout(dist.get_world_size(), t.micro_batch_size, t.grad_accum),
        t.keep_checkpoints,
        {STORE_IDENTITY: run.store_identity.to_json(), RUN_IDENTITY: run.run_identity.to_json()},
    )


def save_adapter(run: Run, step: int, name: str) -> None:
    tensors, categories = adapter_state(run.engine.module, run.zero3, run.store_identity)  # collective under ZeRO-3
    if dist.is_main():
        write_adapter(
            run.out / name,
            tensors,
            dataclasses.replace(run.adapter_config, step=step, categories=categories),
            extra_files={"recipe.yaml": yaml.safe_dump(recipe_to_dict(run.recipe), sort_keys=False)},
        )
    dist.barrier()


# -- metrics --------------------------------------------------------------------------------------


def _peak_mem_gb() -> float:
    """GPU: the most memory allocated since the last ``_reset_peak_mem`` (one training step's peak, the figure
    ``python -m frod_ds plan`` predicts); CPU: the process's max RSS so far."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB → GiB (Linux)


def _reset_peak_mem() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def rotation_angles(run: Run) -> dict[str, float]:
    """``tan α`` per category (spec §2): ``sqrt(Σ‖ΔW_off‖² / Σ‖ΔW_on‖²)`` over the category's members."""
    sums: dict[str, list[float]] = {}
    for held, members in frod_groups(run.engine.module):  # one gather per decoder layer under ZeRO-3
        params = {id(p): p for p in [*held, *(p for _, m in members for p in (m.u_parameter(), m.V))]}
        with gathered(list(params.values()), run.zero3):
            if dist.is_main():
                for name, m in members:
                    on, off = m.update_norms_sq(run.sigma0[name])
                    acc = sums.setdefault(category_of(name), [0.0, 0.0])
                    acc[0] += on
                    acc[1] += off
    return {cat: tan_alpha(on, off) for cat, (on, off) in sums.items()}


def _lrs(run: Run) -> tuple[float, float]:
    groups = run.engine.optimizer.param_groups
    by_name = {g.get("name"): g["lr"] for g in groups}
    if "sigma" in by_name:
        return by_name["sigma"], by_name.get("s", float("nan"))
    return groups[0]["lr"], groups[1]["lr"]


@torch.no_grad()
def eval_loss(run: Run) -> float:
    """Mean answer-token loss over the held-out rows, split across ranks."""
    engine, dev = run.engine, _device()
    engine.eval()
    mine = run.eval_examples[dist.get_rank() :: dist.get_world_size()]
    total = torch.zeros(2, dtype=torch.float64, device=dev)
    mb = run.recipe.train.micro_batch_size
    n_batches = math.ceil(len(run.eval_examples) / (mb * dist.get_world_size()))
    for b in range(n_batches):  # same number of forwards on every rank (ZeRO-3 gathers are collective)
        chunk = mine[b * mb : (b + 1) * mb] or run.eval_examples[:1]
        batch = {k: v.to(dev) for k, v in collate(chunk, run.pad_id).items()}
        loss = engine(**batch).loss.double()
        count = (batch["labels"][:, 1:] != -100).sum()
        if mine[b * mb : (b + 1) * mb]:
            total += torch.stack([loss * count, count.double()])
    engine.train()
    total = dist.all_reduce_sum(total)
    return float(total[0] / total[1].clamp(min=1))


# -- the loop ---------------------------------------------------------------------------------------


def _install_sigterm(run: Run) -> None:
    def handler(signum, frame):  # noqa: ARG001
        run.stop_requested = True

    signal.signal(signal.SIGTERM, handler)


def _train_step(run: Run, step: int) -> dict[str, float]:
    engine, dev = run.engine, _device()
    _reset_peak_mem()
    t0 = time.perf_counter()
    lr_sigma, lr_s = _lrs(run)  # the rates this step applies (the scheduler advances inside engine.step)
    losses, tokens = [], 0
    for idx in run.plan.micro_batches(step):
        batch = {k: v.to(dev) for k, v in collate([run.examples[i] for i in idx], run.pad_id).items()}
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().float())
        tokens += int(batch["attention_mask"].sum())
    stats = dist.all_reduce_sum(
        torch.tensor([torch.stack(losses).mean().item(), tokens], dtype=torch.float64, device=dev)
    )
    dt = time.perf_counter() - t0
    grad_norm = engine.get_global_grad_norm()
    return {
        "loss": float(stats[0]) / dist.get_world_size(),
        "lr_sigma": lr_sigma,
        "lr_s": lr_s,
        "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
        "tokens_per_s": float(stats[1]) / dt,
        "step_time_s": dt,
        "peak_mem_gb": _peak_mem_gb(),
    }


def fit(run: Run) -> int:
    """Train from ``run.start_step`` to ``run.total_steps``; returns the process exit code."""
    bar = tqdm(
        total=run.total_steps, initial=run.start_step, disable=not dist.is_main(), desc="train", dynamic_ncols=True
    )
    try:
        return _fit(run, bar)
    except BaseException:
        bar.close()  # so that the one error line starts a line of its own, not after the progress bar
        raise


def _fit(run: Run, bar) -> int:
    t = run.recipe.train
    _install_sigterm(run)
    writer = _tensorboard(run) if t.tensorboard and dist.is_main() else None  # importable: checked in setup
    metrics_path = run.out / "metrics.jsonl"
    run.engine.train()
    step = run.start_step
    if step >= run.total_steps and (run.out / "adapter-final").is_dir():
        bar.close()
        dist.print0(f"{run.out} holds a finished run (step {step}/{run.total_steps}); adapter-final left as it is")
        return 0
    if torch.cuda.is_available():
        dist.print0(
            f"memory: {_peak_mem_gb():.2f} GiB allocated at most while building and restoring the model "
            "(rank 0); metrics.jsonl's peak_mem_gb is each step's own peak"
        )
    nonfinite = 0
    while step < run.total_steps:
        row = _train_step(run, step)
        step += 1
        row = {"step": step, **row}
        nonfinite = 0 if math.isfinite(row["loss"]) else nonfinite + 1
        if nonfinite >= t.max_nonfinite_steps:  # the loss is all-reduced: every rank agrees
            bar.close()
            raise dist.CollectiveError(
                f"{nonfinite} consecutive steps with a non-finite loss (last: step {step}, loss "
                f"{row['loss']}, grad norm {row['grad_norm']}); stopped without writing adapter-final. Check the "
                "base weights and factor store for NaN/inf and lower train.lr_sigma / train.lr_s "
                "(train.max_nonfinite_steps sets how many are allowed)"
            )
        if t.eval_every and run.eval_examples and step % t.eval_every == 0:
            row["eval_loss"] = eval_loss(run)
        if t.rotation_every and (step % t.rotation_every == 0 or step == run.total_steps):
            row["tan_alpha"] = rotation_angles(run)
        if dist.is_main() and (step % t.log_every == 0 or step == run.total_steps or "tan_alpha" in row):
            with open(metrics_path, "a") as f:
                f.write(json.dumps(row) + "\n")
            if writer is not None:
                for k, v in row.items():
                    if isinstance(v, (int, float)) and k != "step":
                        writer.add_scalar(f"train/{k}", v, step)
            bar.set_postfix(
                loss=f"{row['loss']:.4f}",
                lr_sigma=f"{row['lr_sigma']:.2e}",
                lr_s=f"{row['lr_s']:.2e}",
                tok_s=f"{row['tokens_per_s']:.0f}",
            )
        bar.update(1)
        stop = dist.all_reduce_sum(torch.tensor([float(run.stop_requested)], device=_device())).item() > 0
        if t.save_every and step % t.save_every == 0 and step < run.total_steps and nonfinite and not stop:
            # the optimizer skipped this step: its state may not exist yet (DeepSpeed fails to save it) and a
            # non-finite state is nothing to resume from; the non-finite stop above decides what happens
            dist.print0(f"step {step}: loss not finite, checkpoint skipped")
        elif t.save_every and step % t.save_every == 0 and step < run.total_steps or stop:
            save_checkpoint(run, step)
            save_adapter(run, step, f"adapter-{step}")
        if stop:
            bar.close()
            dist.print0(f"SIGTERM: checkpoint saved at step {step}; re-run the same command to resume")
            return STOP_EXIT_CODE
    bar.close()
    if step > run.start_step:  # resumed at the last step: the checkpoint resumed from is that step's
        save_checkpoint(run, step)
    save_adapter(run, step, "adapter-final")
    if dist.is_main():
        plot_loss(metrics_path, run.out / "loss.png")
    if writer is not None:
        writer.close()
    return 0


def _tensorboard(run: Run):
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(str(run.out / "tensorboard"))


def plot_loss(metrics_path: Path, png: Path) -> None:
    """Loss (and eval loss) against step, from metrics.jsonl."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="train loss")
    ev = [r for r in rows if "eval_loss" in r]
    if ev:
        ax.plot([r["step"] for r in ev], [r["eval_loss"] for r in ev], "o-", label="eval loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = png.with_name(png.stem + ".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, png)
