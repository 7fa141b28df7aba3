"""In-process FRoD for models that fit one process: HJD per category, then swap the targeted linears.

For 7B–70B checkpoints use the distributed HJD stage (``frod hjd``) and build the model under
ZeRO-3 from the factor store instead; this path is for small models, tests and notebooks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from frod_ds.core.layer import TRAINABLE_PREFIX, FRoDLinear, SparseSupport, support_seed
from frod_ds.formats.factor_store import category_of
from frod_ds.hjd.math import decompose
from frod_ds.hjd.sharding import DEFAULT_TARGETS
from frod_ds.runtime.errors import FrodError
from frod_ds.runtime.validate import pi_problem, sparsity_problem, targets_problem, widths_problem

__all__ = [
    "DEFAULT_TARGETS",
    "find_categories",
    "apply_frod",
    "frod_param_groups",
    "mark_only_frod_trainable",
    "frod_modules",
]


def find_categories(model: nn.Module, targets: Sequence[str]) -> dict[str, list[str]]:
    """``{target: [module name, ...]}`` for every ``nn.Linear`` whose last name component is a target.

    Raises ``FrodError`` when a target matches nothing.
    """
    problem = targets_problem(targets)
    if problem:
        raise FrodError(problem)
    found: dict[str, list[str]] = {t: [] for t in targets}
    for name, module in model.named_modules():
        if category_of(name) in found and isinstance(module, nn.Linear):
            found[category_of(name)].append(name)
    missing = [t for t, names in found.items() if not names]
    if missing:
        raise FrodError(
            f"no nn.Linear named {missing} found in the model; check `targets` (LLaMA uses "
            f"{', '.join(DEFAULT_TARGETS)}, down_proj)"
        )
    return found


def set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, leaf, module)


def apply_frod(
    model: nn.Module,
    targets: Sequence[str] = DEFAULT_TARGETS,
    sparsity: float = 0.02,
    seed: int = 0,
    pi: float = 1e-3,
    hjd_dtype: torch.dtype = torch.float64,
) -> nn.Module:
    """Replace every targeted ``nn.Linear`` by a ``FRoDLinear`` (in place; returns ``model``).

    One category per target name across layers; HJD per category (spec §1) on the weights' device in
    ``hjd_dtype``; ``U_i`` stored in the layer's dtype, ``V`` one frozen Parameter per category, the base
    weight dropped. Afterwards σ and the S values are the only trainable parameters.
    """
    problem = sparsity_problem(sparsity, "sparsity s") or pi_problem(pi)
    if problem:
        raise FrodError(problem)
    categories = find_categories(model, targets)
    for category, names in categories.items():
        linears = [model.get_submodule(name) for name in names]
        problem = widths_problem([lin.in_features for lin in linears], f"category {category!r}")
        if problem:
            raise FrodError(problem)
        result = decompose([lin.weight for lin in linears], pi=pi, dtype=hjd_dtype, names=names)
        ref = linears[0].weight
        n = ref.shape[1]
        V = nn.Parameter(result.V.to(device=ref.device, dtype=ref.dtype), requires_grad=False)
        support = SparseSupport.random(n, sparsity, support_seed(seed, category))
        for name, lin, U_i, sigma_i in zip(names, linears, result.U, result.sigma):
            w = lin.weight
            layer = FRoDLinear(U_i.to(device=w.device, dtype=w.dtype), V, sigma_i, support, lin.bias)
            set_submodule(model, name, layer)
    mark_only_frod_trainable(model)
    return model


def frod_modules(model: nn.Module) -> Iterable[tuple[str, FRoDLinear]]:
    return ((name, m) for name, m in model.named_modules() if isinstance(m, FRoDLinear))


def frod_groups(model: nn.Module) -> list[tuple[list[nn.Parameter], list[tuple[str, FRoDLinear]]]]:
    """FRoD layers grouped by the Parameters that hold their σ and S, in module order: one group per decoder layer
    where DeepSpeed's ZeRO holds them per decoder layer (``FRoDTrainables``), one per FRoD layer otherwise. A ZeRO-3
    gather per group reads every member of it."""
    groups: dict[tuple[int, ...], tuple[list[nn.Parameter], list[tuple[str, FRoDLinear]]]] = {}
    for name, m in frod_modules(model):
        params = m.frod_parameters()
        groups.setdefault(tuple(id(p) for p in params), (params, []))[1].append((name, m))
    return list(groups.values())


def mark_only_frod_trainable(model: nn.Module) -> None:
    """σ and S values trainable, everything else frozen."""
    for name, p in model.named_parameters():
        p.requires_grad_(name.rsplit(".", 1)[-1].startswith(TRAINABLE_PREFIX))


def frod_param_groups(
    model: nn.Module, lr_sigma: float | None = None, lr_s: float | None = None, weight_decay: float = 0.0
) -> list[dict]:
    """Two optimizer groups, ``"sigma"`` (all σ_i) and ``"s"`` (all S values), with their own LRs."""
    sigma, s = [], []
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "frod_sigma":
            sigma.append(p)
        elif leaf == "frod_s":
            s.append(p)
    if not sigma:
        raise FrodError("the model has no FRoD layers; call apply_frod (or build it from a factor store) first")
    groups = [
        {"name": "sigma", "params": sigma, "weight_decay": weight_decay},
        {"name": "s", "params": s, "weight_decay": weight_decay},
    ]
    if lr_sigma is not None:
        groups[0]["lr"] = lr_sigma
    if lr_s is not None:
        groups[1]["lr"] = lr_s
    return groups
