"""DeepSpeed's CPU op for the jobs of a test session, built at most once per environment.

Every training rank on CPU loads ``deepspeed_shm_comm`` (``deepspeed.init_distributed``), which torch JIT-builds
in ``$TORCH_EXTENSIONS_DIR`` with whichever ``ninja`` is first on ``PATH``. In a directory several test runs
share, a build by another ninja version or with other flags makes the next launch recompile it (30 s on an idle
2-core machine, minutes on a loaded one), and a job killed mid-build leaves torch's lock file behind.

:class:`OpBuild` gives a test session a build directory of its own: copied from a cache under
``<repo>/.cache/prebuilt-ops/<key>`` when one matches this interpreter, DeepSpeed, torch and ninja, else built
there in the background (jobs that start meanwhile wait on torch's lock file and build nothing) and then stored
in the cache for the next session. The environment the jobs get (``environ``) puts the interpreter's directory
first on ``PATH``, so the build and every job run the same ninja.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

from tests.train_env import REPO

OP = "deepspeed_shm_comm"
_LOAD = ("from deepspeed.accelerator import get_accelerator; "
         "get_accelerator().create_op_builder('ShareMemCommBuilder').load(verbose=False)")


def _cache_key(path: str) -> str:
    ninja = shutil.which("ninja", path=path) or "none"
    parts = [sys.executable, version("deepspeed"), version("torch"), ninja,
             str(os.stat(ninja).st_mtime_ns) if ninja != "none" else ""]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


class OpBuild:
    def __init__(self, env: dict[str, str], dest: Path):
        """Start providing the op in ``dest`` for processes run in ``env`` (see :meth:`environ`)."""
        self.env = self.environ(env, dest)
        self.dest = dest
        self.cache = REPO / ".cache" / "prebuilt-ops" / _cache_key(self.env["PATH"])
        self.proc: subprocess.Popen | None = None
        if (self.cache / OP / f"{OP}.so").is_file():
            shutil.copytree(self.cache, dest)  # copy2: mtimes kept, so ninja finds every output up to date
        else:
            self.proc = subprocess.Popen([sys.executable, "-c", _LOAD], env={**self.env, "DS_ACCELERATOR": "cpu"},
                                         cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    @staticmethod
    def environ(env: dict[str, str], dest: Path) -> dict[str, str]:
        return {**env, "TORCH_EXTENSIONS_DIR": str(dest), "PATH": f"{Path(sys.executable).parent}:{env['PATH']}"}

    def wait(self, timeout: float = 900) -> None:
        """Until the op is built (AssertionError with the compiler's output if it failed); the first build of a
        key is then stored in the cache (under a temporary name first: a half copy is never found there)."""
        if self.proc is None:
            return
        try:
            _, err = self.proc.communicate(timeout=timeout)
        finally:
            self.kill()
        assert self.proc.returncode == 0, f"DeepSpeed's {OP} did not build:\n{err[-3000:]}"
        self.proc = None
        if not self.cache.exists():
            tmp = self.cache.with_name(f".{self.cache.name}-{secrets.token_hex(4)}")
            shutil.copytree(self.dest, tmp, ignore=shutil.ignore_patterns("lock", ".frod-ds-build.lock"))
            try:
                tmp.rename(self.cache)
            except OSError:  # another session stored the same key first
                shutil.rmtree(tmp, ignore_errors=True)

    def kill(self) -> None:
        """Stop a build still running (a fixture failing before :meth:`wait`)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
