"""The skeleton of a FRoD model: the base architecture from its config with weight init off, the targeted linears
built without a weight (they are swapped for ``FRoDLinear`` at once), under ``zero.Init`` when ZeRO-3 is on.

Allocating the targeted dense weights only to drop them would be waste: at 70B under ZeRO-3 on 2 GPUs it was 46 GiB
per GPU at the build's peak and minutes of zero.Init partitioning.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from frod_ds.config.ds_config import zero_stage
from frod_ds.runtime.errors import FrodError

__all__ = ["skeleton", "no_init_weights", "recompute_rope"]


def no_init_weights() -> contextlib.AbstractContextManager:
    """transformers' switch that skips weight init (every tensor is loaded afterwards), in 4.x and 5.x."""
    try:  # transformers >= 5
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4.x
        from transformers.modeling_utils import no_init_weights
    return no_init_weights()


def _keep_arange_dtype():
    """Stop zero.Init from casting ``torch.arange`` (RoPE's inv_freq) to the parameter dtype, if supported."""
    try:
        from transformers.integrations.deepspeed import prevent_arange_dtype_change
    except ImportError:  # older transformers: inv_freq is recomputed after the build instead
        return contextlib.nullcontext()
    return prevent_arange_dtype_change()


class _LinearPlaceholders:
    """Patch ``nn.Linear.__init__`` while a skeleton is built: the ``skip``-th constructions (0-based, in
    construction order) get no weight (a bias, if asked for, is made as usual). ``record`` lists every
    ``nn.Linear`` constructed, in order. Entered before ``zero.Init``, which then wraps the patched ``__init__``."""

    def __init__(self, skip: frozenset[int] = frozenset()) -> None:
        self.skip, self.record, self._orig = skip, [], None

    def __enter__(self) -> _LinearPlaceholders:
        orig = self._orig = nn.Linear.__init__
        outer = self

        def init(self, in_features, out_features, bias=True, device=None, dtype=None):
            index = len(outer.record)
            outer.record.append(self)
            if index not in outer.skip:
                return orig(self, in_features, out_features, bias, device, dtype)
            nn.Module.__init__(self)
            self.in_features, self.out_features = in_features, out_features
            self.register_parameter("weight", None)
            self.register_parameter(
                "bias", nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
            )

        nn.Linear.__init__ = init
        return self

    def __exit__(self, *exc) -> None:
        nn.Linear.__init__ = self._orig


def _placeholder_plan(config, dtype: torch.dtype, names: set[str]) -> frozenset[int]:
    """Which ``nn.Linear`` constructions of ``from_config(config)`` are the modules ``names``: a skeleton built
    on the meta device (no memory, about a second at 70B) with the constructions recorded."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"), no_init_weights(), _LinearPlaceholders() as rec:
        meta = AutoModelForCausalLM.from_config(config, dtype=dtype)
    index = {id(m): i for i, m in enumerate(rec.record)}
    return frozenset(index[id(m)] for n, m in meta.named_modules() if n in names and id(m) in index)


def _check_placeholders(model: nn.Module, names: set[str]) -> None:
    """The weightless linears are exactly ``names`` (construction order was the same in both passes)."""
    empty = {n for n, m in model.named_modules() if isinstance(m, nn.Linear) and m.weight is None}
    if empty != names:
        odd = sorted(empty ^ names)[:3]
        raise FrodError(
            f"building the skeleton: the linears built without weights differ from the targeted ones "
            f"({', '.join(odd)}); the model class constructs its layers in a varying order"
        )


def _skeleton_contexts(ds_config: Mapping | None) -> list:
    """No weight init; under ZeRO-3 also ``zero.Init`` (every parameter partitioned as it is made)."""
    ctxs: list = [no_init_weights()]
    if ds_config is not None and zero_stage(ds_config) == 3:
        import deepspeed

        # dtype comes from the config's bf16 switch (resolve_ds_config made it agree with the recipe). Passing
        # dtype= explicitly is unsafe in deepspeed 0.19: on an accelerator without fp16 it yields bf16.
        ctxs += [_keep_arange_dtype(), deepspeed.zero.Init(config_dict_or_path=dict(ds_config))]
    return ctxs


@torch.no_grad()
def recompute_rope(model: nn.Module) -> None:
    """Rebuild RoPE ``inv_freq`` (non-persistent, never loaded) outside zero.Init, so it is exact fp32."""
    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding") and hasattr(module, "config"):
            fresh = type(module)(module.config)
            for buf in ("inv_freq", "original_inv_freq"):
                if isinstance(getattr(module, buf, None), torch.Tensor):
                    setattr(module, buf, getattr(fresh, buf).to(getattr(module, buf).device))


@contextlib.contextmanager
def skeleton(config: Any, dtype: torch.dtype, targeted: set[str], ds_config: Mapping | None) -> Iterator[nn.Module]:
    """The model of ``config`` with the ``targeted`` linears weightless; the block runs under the same contexts
    (``zero.Init`` under ZeRO-3), so the layers it swaps in are partitioned as they are made."""
    from transformers import AutoModelForCausalLM

    with contextlib.ExitStack() as stack:
        stack.enter_context(_LinearPlaceholders(_placeholder_plan(config, dtype, targeted)))
        for ctx in _skeleton_contexts(ds_config):
            stack.enter_context(ctx)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        if getattr(config, "tie_word_embeddings", False):
            model.tie_weights()  # no_init_weights also skips tying; untied, lm_head would be a missing key
        _check_placeholders(model, targeted & {n for n, _ in model.named_modules()})
        yield model
