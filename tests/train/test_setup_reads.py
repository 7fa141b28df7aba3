"""Training's start reads each input once: the base checkpoint (config.json, safetensors index, each shard's header,
tokenizer) and the DeepSpeed JSON, however many of setup's parts and the planner's hint use them."""

from __future__ import annotations

import builtins
import collections
import io
import json
import sys
import types
from pathlib import Path

import pytest

from tests.support.train_env import CPU_ZERO2, REPO, build_env, env_vars

PACKAGES = ("frod_ds", "transformers", "huggingface_hub", "tokenizers", "deepspeed", "safetensors", "torch")
COUNTER = """import sys
from tests.train.test_setup_reads import count_reads
sys.exit(count_reads(sys.argv[1], sys.argv[2:]))
"""


def _opener(frame: types.FrameType | None) -> str:
    """The package of the innermost frame that belongs to one of ``PACKAGES``: who opened the file."""
    while frame is not None:
        top = str(frame.f_globals.get("__name__", "")).split(".")[0]
        if top in PACKAGES:
            return top
        frame = frame.f_back
    return "other"


def spy_opens(monkeypatch: pytest.MonkeyPatch) -> collections.Counter:
    """``{(resolved path, package): opens}`` of every file opened through ``open``/``io.open``/``Path.open``."""
    seen: collections.Counter = collections.Counter()
    real = io.open

    def spy(file, *args, **kwargs):
        if isinstance(file, (str, Path)):
            seen[(str(Path(file).resolve()), _opener(sys._getframe(1)))] += 1
        return real(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", spy)
    monkeypatch.setattr(io, "open", spy)
    return seen


def count_reads(report: str, argv: list[str]) -> int:
    """In a run's own process: ``frod train argv`` with frod-ds's opens of each file, the shard headers read and
    the tokenizers loaded counted, written to ``report`` (JSON); returns the command's exit code."""
    from transformers import AutoTokenizer

    from frod_ds.cli import train
    from frod_ds.io import hf_checkpoint
    from frod_ds.plan import recommend

    headers: collections.Counter = collections.Counter()
    tokenizers: list[str] = []
    hints: list[object] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train, "gpu_memory", lambda: 80 * 2**30)  # a pretended GPU: the hint is computed too
        hint = recommend.train_hint
        mp.setattr(recommend, "train_hint", lambda *a, **k: hints.append(hint(*a, **k)) or hints[-1])
        read_header = hf_checkpoint._read_header
        mp.setattr(hf_checkpoint, "_read_header", lambda f: headers.update([Path(f).name]) or read_header(f))
        load = AutoTokenizer.from_pretrained.__func__
        mp.setattr(
            AutoTokenizer,
            "from_pretrained",
            classmethod(lambda c, *a, **k: tokenizers.append(a[0]) or load(c, *a, **k)),
        )
        opens = spy_opens(mp)
        code = train.main(argv)
        by_frod = {path: n for (path, who), n in opens.items() if who == "frod_ds"}
    doc = {"opens": by_frod, "headers": headers, "tokenizers": tokenizers, "hints": len(hints)}
    Path(report).write_text(json.dumps(doc))
    return code


@pytest.mark.slow
def test_setup_opens_the_base_checkpoint_and_parses_the_deepspeed_json_once(tmp_path):
    """A one-step run (ZeRO-2, one rank, a pretended GPU so that the planner's hint runs): frod-ds opens
    config.json, the index and the DeepSpeed JSON once each, reads every shard's header once and loads the
    tokenizer once, for the hint, fingerprint, vocab, model build and all."""
    from frod_ds.io.hf_checkpoint import INDEX_NAME
    from tests.support import ranks

    env = build_env(tmp_path / "env")
    (tmp_path / "count_reads.py").write_text(COUNTER)
    report = tmp_path / "reads.json"
    argv = ["--config", str(CPU_ZERO2), *env.overrides(tmp_path / "out", **{"train.max_steps": 1})]
    res = ranks.run(0, [str(tmp_path / "count_reads.py"), str(report), *argv], env_vars(), REPO, 300)
    assert res.returncode == 0, res.stderr[-3000:]
    reads = json.loads(report.read_text())
    for path in (env.model / "config.json", env.model / INDEX_NAME, CPU_ZERO2):
        assert reads["opens"].get(str(path.resolve())) == 1, (path, reads["opens"])
    shards = sorted(p.name for p in env.model.glob("*.safetensors"))
    assert len(shards) > 1 and reads["headers"] == dict.fromkeys(shards, 1), reads["headers"]
    assert reads["tokenizers"] == [str(env.model)]
    assert reads["hints"] == 1
