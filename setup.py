"""The wheel carries the DeepSpeed JSONs and recipes (ds_configs/, recipes/) as frod_ds/_shipped/, where
frod_ds.runtime.shipped finds them once installed; a checkout reads them in place. Everything else is in
pyproject.toml."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

SHIPPED = ("ds_configs", "recipes")


class BuildWithShippedFiles(build_py):
    def run(self) -> None:
        super().run()
        root = Path(__file__).resolve().parent
        for kind in SHIPPED:
            dest = Path(self.build_lib) / "frod_ds" / "_shipped" / kind
            shutil.rmtree(dest, ignore_errors=True)
            shutil.copytree(root / kind, dest)


setup(cmdclass={"build_py": BuildWithShippedFiles})
