"""What PEFT export and import share: stock PEFT's FRoD layers of a model, the base model in fp32, the error type.

The PEFT adapter's tensors, and how frod-ds maps its factors into them and back: docs/export.md.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from frod_ds.formats.ownership import check_out
from frod_ds.runtime.errors import FrodError

__all__ = [
    "ADAPTER",
    "EXPORT_REPORT",
    "PEFT_FILES",
    "PeftInteropError",
    "rel_error",
    "check_out_dir",
    "peft_version",
    "frod_layers",
    "first_line",
    "load_base",
    "group_by_leaf",
]

ADAPTER = "default"  # PEFT's adapter name
EXPORT_REPORT = "frod_export.json"  # what frod export --format peft writes beside PEFT's files (their sha256 in it)
PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors")  # the files of a PEFT adapter frod-ds reads


class PeftInteropError(FrodError):
    """Bad input to the PEFT export/import; the message says what to change."""


def rel_error(num: Tensor, den: Tensor) -> float:
    """``‖num‖_F / ‖den‖_F``: 0 when ``num`` is 0, inf when only ``den`` is."""
    d = float(torch.linalg.matrix_norm(den))
    n = float(torch.linalg.matrix_norm(num))
    return 0.0 if n == 0 else (math.inf if d == 0 else n / d)


def check_out_dir(out: Path, overwrite: bool, kind: str, inputs: dict[str, Any]) -> None:
    """Refuse an existing ``--out`` unless ``overwrite`` and the ownership rule (``frod_ds.formats.ownership``) allow a
    command writing ``kind`` from ``inputs`` to replace it."""
    check_out(out, kind, inputs, overwrite, error=PeftInteropError)


def peft_version() -> str:
    """The installed peft's version, recorded in the reports."""
    import peft

    return peft.__version__


def frod_layers(peft_model: Any) -> dict[str, Any]:
    """``{module path in the HF model: PEFT FRoD layer}``."""
    from peft.tuners.frod import FrodLayer

    out = {}
    for name, module in peft_model.named_modules():
        if isinstance(module, FrodLayer) and ADAPTER in module.frod_lambda_l:
            out[name.removeprefix("base_model.model.")] = module
    return out


def first_line(e: BaseException) -> str:
    """The line of an error's message worth showing in one line (a size mismatch first)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return next((line for line in lines if "size mismatch" in line), lines[0] if lines else "")


def load_base(model_dir: Path) -> Any:
    """The base model in fp32 (PEFT's HJD and U run in fp32 whatever the dtype; the comparison is clean)."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    except (OSError, ValueError) as e:
        raise PeftInteropError(f"cannot load base model {model_dir}: {first_line(e)}") from None


def group_by_leaf(layers: dict[str, Any]) -> dict[str, list[str]]:
    """frod-ds categories (the module's last name) of PEFT's layers, members in model order; each must map to
    one PEFT category (one shared ``V``)."""
    cats: dict[str, list[str]] = {}
    for path in layers:
        cats.setdefault(path.rsplit(".", 1)[-1], []).append(path)
    for cat, members in cats.items():
        if len({id(layers[m].frod_V) for m in members}) != 1:
            raise PeftInteropError(
                f"PEFT splits the {cat} modules over several bases; frod-ds shares one basis per "
                "module name, so this adapter cannot be expressed"
            )
    return cats
