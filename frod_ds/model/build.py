"""Build a FRoD model from a base checkpoint and a factor store, under ZeRO-3 or in one process.

The skeleton (``frod_ds.model.skeleton``) never allocates the targeted weights; U_i, V (one frozen Parameter per
category) and σ_i come from the factor store, every other weight from the checkpoint. Under ZeRO-3 rank 0 reads each
module's tensors into the gathered parameters and DeepSpeed re-partitions them, and each category's ``V`` is held
whole on every rank (``replicate_shared_v``). With ``quant`` (nf4 | int8) every ``U_i`` is a quantized Parameter
(``frod_ds.core.quant``), read as stored or quantized at load time; ``quantize_base`` also quantizes the decoder
layers' untargeted linears.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch
from torch import nn

from frod_ds.config.ds_config import nvme_offloads, zero_settings, zero_stage
from frod_ds.core.layer import FRoDFrozen, FRoDLinear, FRoDTrainables, SparseSupport, support_seed
from frod_ds.core.quant import QuantError, QuantSpec, check_kind, quantize_untargeted, quantized_parameter, spec_of
from frod_ds.model.apply import mark_only_frod_trainable, set_submodule
from frod_ds.model.skeleton import recompute_rope, skeleton
from frod_ds.runtime.errors import FrodError, StoreError

__all__ = [
    "make_supports",
    "build_frod_model",
    "gathered",
    "check_store_quant",
    "replicate_shared_v",
    "fetch_per_layer",
    "FixedParameters",
]


def make_supports(store, categories: list[str], sparsity: float, seed: int) -> dict[str, SparseSupport]:
    """One reproducible support per category (``support_seed(seed, category)``)."""
    return {c: SparseSupport.random(store.width(c), sparsity, support_seed(seed, c)) for c in categories}


@contextlib.contextmanager
def gathered(params: list[nn.Parameter], zero3: bool, modifier_rank: int | None = None) -> Iterator[None]:
    """``deepspeed.zero.GatheredParameters`` under ZeRO-3, a no-op otherwise (no deepspeed import)."""
    if not zero3:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank):
        yield


def check_store_quant(store, categories, quant: str) -> None:
    """``StoreError`` (one line) when the store holds quantized ``U`` of another kind than ``quant``.

    A dense store serves every ``quant`` (quantized at load time); a quantized one only its own kind.
    """
    check_kind(quant)
    for c in categories:
        stored = store.u_quant(c)
        if stored != "none" and stored != quant:
            raise StoreError(
                f"factor store {store.path} holds {stored}-quantized U ({c}) but model.frozen_quant is {quant}; set "
                f"model.frozen_quant={stored} or use a store built without --quant"
            )


def _decoder_layer_of(model: nn.Module) -> dict[str, str]:
    """``{module name: its decoder layer's name}`` for every module inside a ``*DecoderLayer``."""
    layers = [n for n, m in model.named_modules() if type(m).__name__.endswith("DecoderLayer")]
    return {n: layer for layer in layers for n, _ in model.get_submodule(layer).named_modules(prefix=layer)}


def _swap_targets(
    model: nn.Module,
    store,
    supports: Mapping[str, SparseSupport],
    dtype: torch.dtype,
    quant: str = "none",
    flat: bool = False,
    flat_frozen: bool = False,
) -> None:
    """Replace each member of the ``supports``' categories by an empty ``FRoDLinear`` (loaded afterwards). With
    ``flat``, the σ and S of a decoder layer's members are one ``FRoDTrainables`` of that layer (``frod_flat``); with
    ``flat_frozen`` (dense U only), their U one ``FRoDFrozen`` of that layer (``frod_frozen``)."""
    found: dict[str, tuple[str, nn.Parameter, int, int]] = {}  # member -> (category, V, m, n)
    for category in supports:
        members = store.categories[category]
        n = store.width(category)
        V = nn.Parameter(torch.empty(n, n, dtype=dtype), requires_grad=False)
        for name in members:
            try:
                old = model.get_submodule(name)
            except AttributeError:
                raise StoreError(
                    f"factor store member {name!r} is not a module of this model; the store was built for a "
                    "different architecture"
                ) from None
            m, n_in = store.member_shape(name)
            if not isinstance(old, nn.Linear) or (old.out_features, old.in_features) != (m, n_in):
                raise StoreError(f"{name}: model has {old}, factor store has a ({m}, {n_in}) member")
            found[name] = (category, V, m, n)
    holders: dict[str, tuple[FRoDTrainables, int]] = {}
    frozen: dict[str, tuple[FRoDFrozen, int]] = {}
    flat_frozen = flat_frozen and quant == "none"
    if flat or flat_frozen:
        owner = _decoder_layer_of(model)
        order = [name for name, _ in model.named_modules() if name in found and name in owner]
        by_layer: dict[str, list[str]] = {}
        for name in order:
            by_layer.setdefault(owner[name], []).append(name)
        for layer, names in by_layer.items():
            rel = [name[len(layer) + 1 :] for name in names]
            if flat:
                holder = FRoDTrainables(
                    [(r, found[name][3], supports[found[name][0]].nnz) for r, name in zip(rel, names)], dtype
                )
                model.get_submodule(layer).frod_flat = holder
                holders.update({name: (holder, i) for i, name in enumerate(names)})
            if flat_frozen:
                u_holder = FRoDFrozen([(r, found[name][2], found[name][3]) for r, name in zip(rel, names)], dtype)
                model.get_submodule(layer).frod_frozen = u_holder
                frozen.update({name: (u_holder, i) for i, name in enumerate(names)})
    for name, (category, V, m, n) in found.items():
        old = model.get_submodule(name)
        if name in frozen:
            U = None
        elif quant == "none":
            U = torch.empty(m, n, dtype=dtype)
        else:  # the store's own blob layout if it is quantized, else quantized at load time
            U = quantized_parameter(store.u_spec(name) or QuantSpec(quant, (m, n)), dtype)
        layer = FRoDLinear(
            U,
            V,
            torch.empty(n, dtype=dtype),
            supports[category],
            old.bias,
            flat=holders.get(name),
            frozen=frozen.get(name),
        )
        set_submodule(model, name, layer)


def _read_param(name: str, pn: str, module: nn.Module, ckpt, keys: set[str], store) -> torch.Tensor | None:
    """The tensor for parameter ``pn`` of module ``name``: from the factor store for FRoD factors, else from
    the checkpoint; None when the checkpoint lacks it."""
    if isinstance(module, FRoDTrainables) and pn == "frod_sigma":
        owner = name.rsplit(".", 1)[0]
        return torch.cat([store.load_sigma(f"{owner}.{member}") for member in module.members])
    if isinstance(module, FRoDFrozen) and pn == "U":
        owner = name.rsplit(".", 1)[0]
        parts = []
        for member, shape in zip(module.members, module.shapes):
            U = store.load_U(f"{owner}.{member}")
            if tuple(U.shape) != shape:
                raise StoreError(f"{owner}.{member}.U: shape {tuple(U.shape)} in the files, {shape} in the model")
            parts.append(U.reshape(-1))
        return torch.cat(parts)
    if isinstance(module, FRoDLinear) and pn in ("U", "V", "frod_sigma"):
        if pn == "U":
            return store.load_U_packed(name) if store.u_spec(name) is not None else store.load_U(name)
        if pn == "V":
            return store.load_V(store.category_of(name))
        return store.load_sigma(name)
    key = f"{name}.{pn}" if name else pn
    return ckpt.get(key) if key in keys else None


def _load_module(
    name: str,
    module: nn.Module,
    ckpt,
    keys: set[str],
    store,
    rank0: bool,
    zero3: bool,
    state: dict,
    skip: set[int] | frozenset = frozenset(),
) -> None:
    """Fill the direct parameters of ``module`` (rank 0 reads, ZeRO-3 re-partitions) but those in ``skip`` (ids:
    another rank's share of a partitioned unit).

    Problems are recorded in ``state`` (``missing`` keys, the first ``error``) instead of raised, so every
    rank keeps making the same collective gathers; the caller raises once all ranks know.
    """
    params = [(pn, p) for pn, p in module.named_parameters(recurse=False)]
    if not params:
        return
    with gathered([p for _, p in params], zero3, modifier_rank=0):
        if not rank0 or state["error"] is not None:
            return
        for pn, p in params:
            key = f"{name}.{pn}" if name else pn
            if id(p) in skip:
                continue
            if isinstance(module, FRoDLinear) and pn == "V" and id(p) in state["v_done"]:
                continue  # one V per category, shared by its members
            try:
                with torch.no_grad():
                    if isinstance(module, (FRoDLinear, FRoDTrainables)) and pn == "frod_s":
                        p.zero_()
                        continue
                    t = _read_param(name, pn, module, ckpt, keys, store)
                    if t is None:
                        state["missing"].append(key)
                        continue
                    if spec_of(p) is not None:  # a quantized blob (its bytes held in a float dtype): no values
                        t = _packed(t, spec_of(p), p, key)
                    if tuple(t.shape) != tuple(p.shape):
                        raise StoreError(f"{key}: shape {tuple(t.shape)} in the files, {tuple(p.shape)} in the model")
                    if spec_of(p) is None and t.is_floating_point() and not bool(torch.isfinite(t).all()):
                        where = "factor store" if isinstance(module, FRoDLinear) else f"checkpoint {ckpt.dir}"
                        raise StoreError(
                            f"{key} holds {int((~torch.isfinite(t)).sum())} non-finite value(s) (NaN/inf) in the "
                            f"{where}: the file is damaged; use an intact copy of it"
                        )
                    p.copy_(t.to(p.dtype))
                    if pn == "V":
                        state["v_done"].add(id(p))
            except FrodError as e:  # a bad file: reported on every rank by the caller
                state["error"] = f"loading {key}: {e}"
                return


def _quant_device(p: nn.Parameter) -> torch.device:
    """Where a dense weight is quantized: ``p``'s device, or this process's GPU when ``p`` is on the CPU (a
    one-process or ZeRO-2 build): bitsandbytes quantizes ~8M weights/s on one CPU core, a 7B model in minutes."""
    if p.device.type == "cpu" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return p.device


def _packed(t: torch.Tensor, spec: QuantSpec, p: nn.Parameter, key: str) -> torch.Tensor:
    """The bytes of quantized parameter ``p`` in its storage dtype: a stored blob (uint8) as it is, a dense
    weight quantized on the GPU when there is one (``_quant_device``)."""
    if t.dtype != torch.uint8:
        if tuple(t.shape) != spec.shape:
            raise StoreError(f"{key}: shape {tuple(t.shape)} in the files, {spec.shape} in the model")
        t = spec.pack(t.to(_quant_device(p))).to(p.device)
    if t.numel() != spec.nbytes:
        raise StoreError(f"{key}: {t.numel()} bytes in the files, {spec.kind} {spec.shape} needs {spec.nbytes}")
    return t.view(p.dtype)


def replicate_shared_v(model: nn.Module) -> int:
    """Make each category's shared ``V`` a ZeRO-3 persistent parameter: DeepSpeed gathers it at its first use and
    never releases it (``ds_persist``; its 1/N partition stays as well), so the L modules reading one V no longer
    gather and release it L times per pass. A no-op on a model not partitioned by ZeRO-3. Returns the elements
    now held whole on every rank."""
    shared = {id(m.V): m.V for m in model.modules() if isinstance(m, FRoDLinear) and hasattr(m.V, "ds_id")}
    for V in shared.values():
        V.ds_persist = True
    return sum(int(V.ds_numel) for V in shared.values())


def fetch_per_layer(model: nn.Module) -> list[str]:
    """Make each decoder layer one ZeRO-3 fetch unit (``deepspeed.utils.set_z3_leaf_modules``): one gather before
    the layer and one release after it, instead of hooks on each of its ~12 submodules (on one GPU those host-side
    hooks made ZeRO-3 twice as slow as ZeRO-2). Call before ``deepspeed.initialize`` and after
    ``enable_gradient_checkpointing``; returns the leaf class names."""
    from deepspeed.utils import set_z3_leaf_modules

    classes = sorted(
        {type(m) for m in model.modules() if type(m).__name__.endswith("DecoderLayer")}, key=lambda c: c.__name__
    )
    if not classes:
        raise FrodError(f"no decoder layer class in {type(model).__name__}: cannot make the layers ZeRO-3 fetch units")
    set_z3_leaf_modules(model, classes)
    # DeepSpeed reduces a leaf module's gradients in a full backward hook, which PyTorch fires as soon as the output's
    # gradient is ready when no input requires one: the first layer (fed by the frozen embedding) would then read its
    # released parameters before its own backward ran.
    model.enable_input_require_grads()
    for module in [model, *(m for m in model.modules() if type(m) in classes)]:
        module.named_parameters = FixedParameters(module)
    return [c.__name__ for c in classes]


class FixedParameters:
    """``named_parameters`` of a module whose Parameters no longer change: each call's list is walked once, then
    replayed. DeepSpeed's ZeRO-3 walks a fetch unit's submodules for its parameters each time it fetches or releases
    it (four walks per decoder layer and step) and the whole model twice in each optimizer step; at 7B depth those
    walks were about a fifth of ZeRO-3's host-side Python calls per step (``bench/results/host_calls``).
    ``fetch_per_layer`` installs one on the model and on each decoder layer, as an instance attribute: it goes with
    the model (and with a copy of it), nothing else sees it. Its contract is that no Parameter is added to or removed
    from those modules afterwards (ZeRO-3 keeps the Parameter objects and swaps their data); ``forget()`` drops the
    lists after such a change."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.cache: dict[tuple[str, bool, bool], list[tuple[str, nn.Parameter]]] = {}

    def __call__(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        key = (prefix, recurse, remove_duplicate)
        if key not in self.cache:
            self.cache[key] = list(type(self.module).named_parameters(self.module, prefix, recurse, remove_duplicate))
        return iter(self.cache[key])

    def forget(self) -> None:
        self.cache.clear()


def build_frod_model(
    model_dir,
    store,
    supports: Mapping[str, SparseSupport],
    dtype: torch.dtype,
    ds_config: Mapping | None = None,
    rank: int = 0,
    quant: str = "none",
    quantize_base: bool = False,
    replicate_v: bool = True,
    flat_trainables: bool | None = None,
    flat_frozen: bool | None = None,
) -> nn.Module:
    """The base architecture with FRoD layers, loaded; σ and S values the only trainable parameters.

    ``model_dir``: a checkpoint directory (or its ``HFCheckpoint``); ``store``: an open ``FactorStore``;
    ``supports``: ``{category: SparseSupport}`` to apply (``make_supports`` for training, the adapter's for loading).
    ``ds_config``: the resolved DeepSpeed config (ZeRO-3 builds under ``zero.Init``, rank 0 reads), None in one
    process. ``replicate_v``: False leaves V partitioned (the benchmarks' comparison). ``flat_trainables`` /
    ``flat_frozen``: a decoder layer's σ and S (dense U_i) as one ``FRoDTrainables`` (``FRoDFrozen``); None chooses
    per engine.
    """
    from transformers import AutoConfig

    from frod_ds.io.hf_checkpoint import HFCheckpoint

    check_store_quant(store, supports, quant)
    if quantize_base and quant == "none":
        raise QuantError("model.quantize_base=true needs model.frozen_quant nf4 or int8 (the kind it uses)")
    ckpt = model_dir if isinstance(model_dir, HFCheckpoint) else HFCheckpoint(model_dir)
    ckpt.config()  # checked (read once per opened checkpoint)
    keys = set(ckpt.keys())
    stage = 0 if ds_config is None else zero_stage(ds_config)
    zero3 = stage == 3
    config = AutoConfig.from_pretrained(str(ckpt.dir))
    targeted = {name for c in supports for name in store.categories[c]}
    with skeleton(config, dtype, targeted, ds_config) as model:
        # ZeRO's host work is per trainable tensor; its gradient norm sums per-tensor norms in fp64 and rounds to fp32,
        # so grouping leaves training as it was (tests/train/test_zero2_trainables_layout.py). Without DeepSpeed and
        # under stage 0 the norms are fp32: grouping would change their rounding.
        flat = stage > 0 if flat_trainables is None else flat_trainables
        # NVMe parameter offload sizes its swap buffers by the largest parameter (frod_ds.config.nvme.check_nvme_buffer)
        flat_u = (
            (zero3 and "offload_param" not in nvme_offloads(dict(ds_config))) if flat_frozen is None else flat_frozen
        )
        _swap_targets(model, store, supports, dtype, quant, flat, flat_u)
        if quantize_base:
            quantize_untargeted(model, quant, dtype)
    rank0 = rank == 0 or not zero3
    state: dict = {"missing": [], "error": None, "v_done": set()}
    seen: set = set()
    for name, module in model.named_modules():
        fresh = [p for p in module.parameters(recurse=False) if id(p) not in seen or isinstance(module, FRoDLinear)]
        if not fresh:
            continue  # tied weights already loaded through their first module
        seen.update(id(p) for p in module.parameters(recurse=False))
        _load_module(name, module, ckpt, keys, store, rank0, zero3, state)
    missing, error = state["missing"], state["error"]
    if missing:
        error = error or (
            f"{len(missing)} tensors missing from checkpoint {ckpt.dir}: {', '.join(missing[:5])}"
            f"{' …' if len(missing) > 5 else ''}"
        )
    if zero3:
        from frod_ds.runtime.distributed import agree_on_error

        agree_on_error(error, src=0)  # only rank 0 read; all ranks fail together
    elif error is not None:
        raise FrodError(error)
    recompute_rope(model)
    mark_only_frod_trainable(model)
    if zero3 and replicate_v:
        replicate_shared_v(model)
    if zero3 and (flat or flat_u):
        _register_flat_with_zero3(model, ds_config)
    return model


def _register_flat_with_zero3(model: nn.Module, ds_config: Mapping) -> None:
    """Each FRoD layer reads its decoder layer's ``FRoDTrainables`` and ``FRoDFrozen``: declare those Parameters to
    ZeRO-3 as the layer's (``register_external_parameter``), so per-module fetching (no ``fetch_per_layer``) gathers
    them before the layer runs. A holder's σ (S) Parameter is persistent (``ds_persist``: gathered once, held whole on
    every rank) exactly where DeepSpeed would have made every member's own σ (S) persistent, i.e. each member's span is
    within ``stage3_param_persistence_threshold`` (a holder of U likewise): residency is what it was with one Parameter
    per FRoD layer (the
    shipped ``zero3.json``: all of σ and S; a threshold below a member's S: S partitioned, gathered with its layer)."""
    from deepspeed.runtime.zero import register_external_parameter

    threshold = zero_settings(dict(ds_config)).param_persistence_threshold
    for m in model.modules():
        if isinstance(m, FRoDTrainables):
            for leaf, p in m.named_parameters(recurse=False):
                if max(b - a for a, b in m.spans(leaf)) <= threshold:
                    p.ds_persist = True
        if isinstance(m, FRoDLinear) and m._flat is not None:
            for p in m.frod_parameters():
                register_external_parameter(m, p)
        if isinstance(m, FRoDFrozen) and max(b - a for a, b in m.spans) <= threshold:
            m.U.ds_persist = True  # each member's own U would have been persistent: so is their holder
        if isinstance(m, FRoDLinear) and m._frozen is not None:
            register_external_parameter(m, m.u_parameter())
