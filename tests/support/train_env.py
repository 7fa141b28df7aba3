"""A complete tiny training setup on disk for the training tests: model, tokenizer, data, factor store.

Built with the same library pieces as ``make demo`` (``frod_ds.testing.toy``, ``data_prep``, ``launch/hjd.py``), at
test size. ``run_train`` runs ``launch/train.py`` (or another script) as a subprocess, one process or under
``torchrun --standalone`` on CPU with gloo.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from frod_ds.formats.output_dir import MARKER, read_record, record_text, stamps_of
from tests.support.leftovers import REPO, clean_env

RANKS = REPO / "tests" / "support" / "ranks.py"  # N ranks with torchrun's environment (the module's docstring)
CPU_ZERO3 = REPO / "ds_configs" / "zero3_cpu_fp32.json"
CPU_ZERO2 = REPO / "ds_configs" / "zero2_cpu_fp32.json"


@dataclass
class TrainEnv:
    root: Path
    model: Path
    data: Path
    store: Path

    def overrides(self, out: Path, **extra) -> list[str]:
        base = {
            "model.base": self.model,
            "model.factor_store": self.store,
            "model.dtype": "float32",
            "model.sparsity": 0.1,
            "data.train": self.data / "train.jsonl",
            "data.cutoff_len": 64,
            "train.micro_batch_size": 4,
            "train.grad_accum": 2,
            "train.lr_sigma": 1e-2,
            "train.lr_s": 1e-3,
            "train.log_every": 1,
            "train.rotation_every": 0,
            "output_dir": out,
        }
        base.update(extra)
        return [f"{k}={v}" for k, v in base.items()]


def env_vars() -> dict[str, str]:
    """The environment of a CPU training subprocess: no launcher variables (``tests.support.leftovers.clean_env``)."""
    return clean_env()


# Built setups of this test process, (seed, layers) -> directory: each is built once and copied to every root
# that asks for it (a copy takes milliseconds; a build, two subprocesses and a tokenizer, ~10 s on 2 cores).
_BUILT: dict[tuple[int, int], Path] = {}


def build_env(root: Path, seed: int = 0, layers: int = 2) -> TrainEnv:
    """The setup of ``seed``/``layers`` at ``root``: what :func:`_build` writes there, byte for byte except the
    absolute paths the data and store manifests record (rewritten to ``root``). Each caller gets its own copy,
    so a test may change its files."""
    key = (seed, layers)
    if key not in _BUILT:
        built = Path(tempfile.mkdtemp(prefix=f"frod-trainenv-s{seed}-l{layers}-"))
        atexit.register(shutil.rmtree, built, ignore_errors=True)
        _build(built / "env", seed, layers)
        _BUILT[key] = built / "env"
    src, root = _BUILT[key], Path(root)
    shutil.copytree(src, root, dirs_exist_ok=True)
    for manifest in (root / "data" / "manifest.json", root / "factors" / "manifest.json"):
        manifest.write_text(manifest.read_text().replace(str(src), str(root)))
        record = read_record(manifest.parent)  # the data build stamped its manifest as written: stamp the rewrite
        if record is not None and record.written and manifest.name in record.written:
            record.written.update(stamps_of(manifest.parent, [manifest.name]))
            (manifest.parent / MARKER).write_text(record_text(record))
    return TrainEnv(root, root / "model", root / "data", root / "factors")


def _build(root: Path, seed: int, layers: int) -> None:
    from transformers import AutoTokenizer

    from frod_ds.testing.toy import train_sentencepiece_tokenizer, write_synthetic_tasks, write_tiny_llama

    root.mkdir(parents=True, exist_ok=True)
    write_synthetic_tasks(root / "raw", n_train=48, n_eval=16, seed=seed)
    args = ["data", "build", "--source", str(root / "raw"), "--tasks", "boolq,piqa", "--out", str(root / "data")]
    _forked([str(REPO / "tests" / "support" / "frod_main.py"), *args])
    texts = [
        json.loads(line)["prompt"] + "\nAnswer: " + json.loads(line)["answer"]
        for line in (root / "data" / "train.jsonl").read_text().splitlines()
    ]
    tok_dir = train_sentencepiece_tokenizer(root / "tokenizer", texts, vocab_size=400)
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    write_tiny_llama(
        root / "model",
        vocab_size=len(tok),
        seed=seed,
        max_shard_size="60KB",
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=layers,
    )
    tok.save_pretrained(str(root / "model"))
    _forked([str(REPO / "launch" / "hjd.py"), "--model", str(root / "model"), "--out", str(root / "factors")])


def _forked(cmd: list[str]) -> None:
    """``python CMD`` forked from this test process (``tests.support.ranks.run``: the imports paid already)."""
    from tests.support import ranks

    res = ranks.run(0, cmd, env_vars(), REPO, timeout=300)
    if res.returncode:
        raise subprocess.CalledProcessError(res.returncode, cmd, res.stdout, res.stderr)


def _train_args(config: Path, overrides: list[str], script: Path | None) -> list[str]:
    return [str(script or REPO / "launch" / "train.py"), "--config", str(config), *overrides]


def train_cmd(config: Path, overrides: list[str], nproc: int = 2, script: Path | None = None) -> list[str]:
    cmd = [sys.executable]
    if nproc:  # torchrun's environment, the imports paid once (tests/support/ranks.py)
        cmd += [str(RANKS), str(nproc)]
    return cmd + _train_args(config, overrides, script)


def run_train(
    config: Path, overrides: list[str], nproc: int = 2, script: Path | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """What ``train_cmd``'s command line gives (``subprocess.run``, output captured), its processes forked from
    this test process, whose imports they reuse (``tests.support.ranks.run``)."""
    from tests.support import ranks

    return ranks.run(nproc, _train_args(config, overrides, script), env_vars(), REPO, timeout)


def train_in_process(config: Path, overrides: list[str]) -> subprocess.CompletedProcess:
    """``launch/train.py``'s ``main`` in this process, for runs refused before the engine is built: the exit code
    and what it printed, as ``run_train`` returns them, without a subprocess's start-up (torch, transformers and
    DeepSpeed imports: most of a refused run's time). ``frod_ds.runtime.entry`` undoes its process group."""
    from launch.train import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["--config", str(config), *overrides])
    return subprocess.CompletedProcess(["launch/train.py"], code, out.getvalue(), err.getvalue())


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
