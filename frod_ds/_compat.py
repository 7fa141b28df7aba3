"""Old import paths, kept working: ONE table from each module's path before the package was split by stage
(``frod_ds.trainer``, ``data_prep.io``) to where it lives now (``frod_ds.train.trainer``, ``frod_ds.prep.io``).

An import of an old path returns the very module object of the new path (``sys.modules`` holds it under both
names), so classes keep their identity: ``isinstance`` checks, ``monkeypatch.setattr(old_module, ...)`` and
anything pickled under an old class path (engine checkpoints written before the move) keep working. There are
no shim files at the old paths, so git follows every module to its new file. `install` puts the finder on
``sys.meta_path`` once, when ``frod_ds`` is imported; it changes no other process state.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

__all__ = ["OLD_PATHS", "install"]

OLD_PATHS: dict[str, str] = {
    "frod_ds.errors": "frod_ds.runtime.errors",
    "frod_ds.atomic": "frod_ds.runtime.atomic",
    "frod_ds.validate": "frod_ds.runtime.validate",
    "frod_ds.launch_env": "frod_ds.runtime.launch_env",
    "frod_ds.distributed": "frod_ds.runtime.distributed",
    "frod_ds.entry": "frod_ds.runtime.entry",
    "frod_ds.records": "frod_ds.formats.records",
    "frod_ds.checksum": "frod_ds.formats.checksum",
    "frod_ds.store_format": "frod_ds.formats.store_format",
    "frod_ds.adapter_format": "frod_ds.formats.adapter_format",
    "frod_ds.run_identity": "frod_ds.formats.run_identity",
    "frod_ds.hf_checkpoint": "frod_ds.io.hf_checkpoint",
    "frod_ds.safetensors_io": "frod_ds.io.safetensors_io",
    "frod_ds.dtypes": "frod_ds.io.dtypes",
    "frod_ds.fingerprint": "frod_ds.io.fingerprint",
    "frod_ds.layer": "frod_ds.core.layer",
    "frod_ds.frod_function": "frod_ds.core.frod_function",
    "frod_ds.quant": "frod_ds.core.quant",
    "frod_ds.recipe": "frod_ds.config.recipe",
    "frod_ds.ds_config": "frod_ds.config.ds_config",
    "frod_ds.build": "frod_ds.model.build",
    "frod_ds.store": "frod_ds.model.store",
    "frod_ds.store_verify": "frod_ds.model.store_verify",
    "frod_ds.adapter": "frod_ds.model.adapter",
    "frod_ds.apply": "frod_ds.model.apply",
    "frod_ds.evaluation": "frod_ds.eval.evaluation",
    "frod_ds.scoring": "frod_ds.eval.scoring",
    "frod_ds.eval_run": "frod_ds.eval.eval_run",
    "frod_ds.data": "frod_ds.train.data",
    "frod_ds.trainable_state": "frod_ds.train.trainable_state",
    "frod_ds.checkpoint_dir": "frod_ds.train.checkpoint_dir",
    "frod_ds.engine_checkpoint": "frod_ds.train.engine_checkpoint",
    "frod_ds.trainer": "frod_ds.train.trainer",
    "frod_ds.export": "frod_ds.interop.export",
    "frod_ds.peft_interop": "frod_ds.interop.peft_interop",
    "frod_ds.planner": "frod_ds.plan.planner",
    "frod_ds.toy": "frod_ds.testing.toy",
    "frod_ds.realmodel": "frod_ds.testing.realmodel",
    "data_prep.build": "frod_ds.prep.build",
    "data_prep.cli": "frod_ds.prep.cli",
    "data_prep.io": "frod_ds.prep.io",
    "data_prep.llm_adapters": "frod_ds.prep.llm_adapters",
    "data_prep.sources": "frod_ds.prep.sources",
    "data_prep.tasks": "frod_ds.prep.tasks",
    "data_prep.templates": "frod_ds.prep.templates",
    "data_prep.tokens": "frod_ds.prep.tokens",
}


class _AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds old paths only; loading one imports the new module and puts it in ``sys.modules`` under the old
    name (the import system then returns that entry, not the placeholder it created)."""

    def find_spec(self, fullname: str, path: object = None, target: ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in OLD_PATHS:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None  # a placeholder; exec_module swaps the real module in

    def exec_module(self, module: ModuleType) -> None:
        sys.modules[module.__name__] = importlib.import_module(OLD_PATHS[module.__name__])


_FINDER = _AliasFinder()


def install() -> None:
    """Put the old-path finder first on ``sys.meta_path`` (once per process)."""
    if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _FINDER)
