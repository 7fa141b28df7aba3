"""A stand-in for a DeepSpeed op builder whose build is real ninja running two sleeping "compilers" (see
tests/runtime/test_op_build.py): no C++ is compiled.

``StubBuilder().load()`` does what torch's JIT build does: it writes ``build.ninja`` in
``$TORCH_EXTENSIONS_DIR/stub_op`` and runs ``ninja`` found on ``PATH``, output captured, raising torch's
``RuntimeError("Error building extension ...")`` when it fails and leaving ``stub_op.so`` when it succeeds. ninja
starts each compiler in a process group of its own. A compiler is a Python sleep whose command line carries
``$FROD_STUB_MARK``; it appends its pid to ``$FROD_STUB_PIDS``, sleeps ``$FROD_STUB_SECONDS`` and exits with
``$FROD_STUB_EXIT``.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

COMPILER = (
    "import os, sys, time; open(sys.argv[1], 'a').write(f'{os.getpid()}\\n'); "
    "time.sleep(float(sys.argv[2])); sys.exit(int(sys.argv[3]))"
)


class StubBuilder:
    name = "stub_op"

    def load(self, verbose: bool = False) -> str:
        build = Path(os.environ["TORCH_EXTENSIONS_DIR"]) / self.name
        build.mkdir(parents=True, exist_ok=True)
        env = os.environ
        argv = [sys.executable, "-c", COMPILER, env["FROD_STUB_PIDS"], env.get("FROD_STUB_SECONDS", "0.2")]
        argv += [env.get("FROD_STUB_EXIT", "0"), env["FROD_STUB_MARK"]]
        (build / "build.ninja").write_text(
            f"rule cc\n  command = {' '.join(map(shlex.quote, argv))} && touch $out\n"
            "build a.o: cc\nbuild b.o: cc\ndefault a.o b.o\n"
        )
        res = subprocess.run(["ninja", "-j2"], cwd=build, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if res.returncode:
            raise RuntimeError(f"Error building extension '{self.name}': {res.stdout}")
        (build / f"{self.name}.so").touch()  # what torch leaves: a later launch loads it without a build
        return f"stub op loaded in {os.getpid()}"
