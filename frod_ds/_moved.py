"""Module paths that moved, kept importable for one release: 0.2.0 warns, 0.3.0 (``REMOVED_IN``) removes them.

Each old path is a three-line file under ``frod_ds/_old_paths/`` whose module-level ``__getattr__`` is
:func:`forward`: each use of a name warns (``DeprecationWarning``, naming the new path) and returns the very object of
the new module, so classes keep their identity. The files sit outside the real sub-packages, on their ``__path__``
(:func:`old_paths`), so a reader of ``frod_ds/`` sees only current modules. ``MOVED`` is the one table;
``tests/repo/test_moved_paths.py`` checks every entry against its file.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["MOVED", "REMOVED", "REMOVED_IN", "forward", "forward_names", "old_paths"]

REMOVED_IN = "0.3.0"

MOVED: dict[str, tuple[str, ...]] = {
    "frod_ds.errors": ("frod_ds.runtime.errors",),
    "frod_ds.atomic": ("frod_ds.runtime.atomic",),
    "frod_ds.validate": ("frod_ds.runtime.validate",),
    "frod_ds.launch_env": ("frod_ds.runtime.launch_env",),
    "frod_ds.distributed": ("frod_ds.runtime.distributed",),
    "frod_ds.entry": ("frod_ds.runtime.entry",),
    "frod_ds.records": ("frod_ds.formats.records",),
    "frod_ds.checksum": ("frod_ds.formats.checksum",),
    "frod_ds.store_format": ("frod_ds.formats.factor_store",),
    "frod_ds.adapter_format": ("frod_ds.formats.adapter_dir",),
    "frod_ds.run_identity": ("frod_ds.formats.run_identity",),
    "frod_ds.hf_checkpoint": ("frod_ds.io.model_dir", "frod_ds.io.hf_checkpoint"),
    "frod_ds.safetensors_io": ("frod_ds.io.safetensors_io",),
    "frod_ds.dtypes": ("frod_ds.io.dtypes",),
    "frod_ds.fingerprint": ("frod_ds.io.fingerprint",),
    "frod_ds.layer": ("frod_ds.core.layer",),
    "frod_ds.frod_function": ("frod_ds.core.frod_function",),
    "frod_ds.quant": ("frod_ds.core.quant",),
    "frod_ds.recipe": ("frod_ds.config.recipe",),
    "frod_ds.ds_config": ("frod_ds.config.nvme", "frod_ds.config.ds_config"),
    "frod_ds.build": ("frod_ds.model.build",),
    "frod_ds.store": ("frod_ds.model.store_reader",),
    "frod_ds.store_verify": ("frod_ds.model.store_verify",),
    "frod_ds.adapter": ("frod_ds.model.adapter",),
    "frod_ds.apply": ("frod_ds.model.apply",),
    "frod_ds.evaluation": ("frod_ds.eval.predict",),
    "frod_ds.scoring": ("frod_ds.eval.accuracy",),
    "frod_ds.eval_run": ("frod_ds.eval.run",),
    "frod_ds.data": ("frod_ds.train.data",),
    "frod_ds.trainable_state": ("frod_ds.train.trainable_state",),
    "frod_ds.checkpoint_dir": ("frod_ds.train.checkpoints",),
    "frod_ds.engine_checkpoint": ("frod_ds.train.engine_state",),
    "frod_ds.trainer": (
        "frod_ds.train.schedule",
        "frod_ds.train.run_dir",
        "frod_ds.train.preflight",
        "frod_ds.train.metrics",
        "frod_ds.train.loop",
        "frod_ds.train.identity",
        "frod_ds.train.trainer",
    ),
    "frod_ds.export": ("frod_ds.interop.hf_export",),
    "frod_ds.peft_interop": (
        "frod_ds.interop.peft_export",
        "frod_ds.interop.peft_import",
        "frod_ds.interop.peft_common",
    ),
    "frod_ds.planner": ("frod_ds.plan.shapes", "frod_ds.plan.memory", "frod_ds.plan.recommend"),
    "frod_ds.toy": ("frod_ds.testing.toy",),
    "frod_ds.realmodel": ("frod_ds.interop.gguf",),
    "data_prep.build": ("frod_ds.prep.dataset", "frod_ds.prep.row_checks", "frod_ds.prep.build_records"),
    "data_prep.cli": ("frod_ds.prep.command",),
    "data_prep.io": ("frod_ds.prep.rows",),
    "data_prep.llm_adapters": ("frod_ds.prep.llm_adapters",),
    "data_prep.sources": ("frod_ds.prep.sources",),
    "data_prep.tasks": ("frod_ds.prep.tasks",),
    "data_prep.templates": ("frod_ds.prep.templates",),
    "data_prep.tokens": ("frod_ds.prep.tokens",),
    "frod_ds.formats.store_format": ("frod_ds.formats.factor_store",),
    "frod_ds.formats.adapter_format": ("frod_ds.formats.adapter_dir",),
    "frod_ds.model.store": ("frod_ds.model.store_reader",),
    "frod_ds.hjd.store_dir": ("frod_ds.hjd.store_writer", "frod_ds.hjd.store_files"),
    "frod_ds.hjd.plan": ("frod_ds.hjd.sharding",),
    "frod_ds.hjd.io": ("frod_ds.hjd.streaming",),
    "frod_ds.eval.evaluation": ("frod_ds.eval.predict",),
    "frod_ds.eval.scoring": ("frod_ds.eval.accuracy",),
    "frod_ds.eval.eval_run": ("frod_ds.eval.run",),
    "frod_ds.plan.planner": ("frod_ds.plan.shapes", "frod_ds.plan.memory", "frod_ds.plan.recommend"),
    "frod_ds.plan.timing": ("frod_ds.plan.step_time",),
    "frod_ds.interop.peft_interop": (
        "frod_ds.interop.peft_export",
        "frod_ds.interop.peft_import",
        "frod_ds.interop.peft_common",
    ),
    "frod_ds.interop.export": ("frod_ds.interop.hf_export",),
    "frod_ds.testing.realmodel": ("frod_ds.interop.gguf",),
    "frod_ds.train.checkpoint_dir": ("frod_ds.train.checkpoints",),
    "frod_ds.train.engine_checkpoint": ("frod_ds.train.engine_state",),
    "frod_ds.prep.io": ("frod_ds.prep.rows",),
    "frod_ds.prep.cli": ("frod_ds.prep.command",),
    "frod_ds.prep.build": ("frod_ds.prep.dataset", "frod_ds.prep.row_checks", "frod_ds.prep.build_records"),
}

# Names that left the package in 0.2.0 instead of moving: the GGUF downloader (nothing that downloads ships in the
# wheel; the tests' copy is tests/support/realmodel.py).
REMOVED: dict[str, str] = {
    name: "the GGUF download left the package in 0.2.0; pass the file to frod convert-gguf convert --gguf"
    for name in (
        "RealModelUnavailable",
        "SMOLLM2_GGUF",
        "SMOLLM2_GGUF_MD5",
        "SMOLLM2_GGUF_SIZE",
        "SMOLLM2_PACKAGE",
        "default_cache_dir",
        "locate_gguf",
    )
}


def _warned(old: str, name: str, module: Any) -> Any:
    """``module.name``, with the warning that ``old`` (where it was imported from) goes in ``REMOVED_IN``."""
    warnings.warn(
        f"{old} is deprecated and goes in frod-ds {REMOVED_IN}: import {name} from {module.__name__}",
        DeprecationWarning,
        stacklevel=3,
    )
    return getattr(module, name)


def forward(old: str) -> Callable[[str], Any]:
    """The ``__getattr__`` of the module at the old path ``old``: looks a name up in its new module(s)."""
    new = MOVED[old]

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        for path in new:
            module = importlib.import_module(path)
            if hasattr(module, name):
                return _warned(old, name, module)
        if name in REMOVED:
            raise AttributeError(f"module {old!r} has no attribute {name!r}: {REMOVED[name]}")
        raise AttributeError(f"module {old!r} has no attribute {name!r} (it moved to {', '.join(new)})")

    return __getattr__


def forward_names(module: str, names: dict[str, str]) -> Callable[[str], Any]:
    """The ``__getattr__`` of a module that stays while some of its names moved (``names``: name -> new module)."""

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        return _warned(f"{module}.{name}", name, importlib.import_module(names[name]))

    return __getattr__


def old_paths(path: list[str], package: str) -> list[str]:
    """``package``'s ``__path__`` with the folder of its old module paths appended (searched after the real one)."""
    folder = Path(__file__).resolve().parent.joinpath("_old_paths", *package.split(".")[1:])
    return [*path, str(folder)]
