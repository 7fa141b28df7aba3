"""LoRA's base read straight from the files (``load = "direct"``, ``bench/kinds/direct_load.py``) against
``from_pretrained``'s, on 2 gloo ranks (``tests/support/direct_load_probe.py``, the step kind's own ``build_lora``
and ``Stepper``) on a grouped-KV checkpoint with a 1001-row vocabulary (an uneven split): under FSDP2, DDP and
ZeRO-3 every parameter gathered whole after the build, the losses of two steps and the adapters after them are
the same bit for bit, and the same comparison catches a load that reads rank 0's rows on every rank."""

from __future__ import annotations

import json

import pytest
import torch

from bench.kinds import shapes, synthetic
from tests.support import ranks
from tests.support.helpers_ckpt import REPO
from tests.support.leftovers import clean_env

pytestmark = pytest.mark.slow
PROBE = REPO / "tests" / "support" / "direct_load_probe.py"
SHAPE = shapes.SHAPES["tiny-gqa"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny-gqa checkpoint, every part written here in one process (what the generated shape's ranks write)."""
    model = tmp_path_factory.mktemp("direct_load") / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(synthetic.config_json(SHAPE)))
    for part in ("base", *synthetic.TARGETS):
        synthetic.write_part(model, SHAPE, part, shapes.SEED, torch.device("cpu"), 0, 1)
    synthetic.write_index(model)
    return model


def _probe(checkpoint, out, engines: str) -> dict[str, dict]:
    cmd = [str(PROBE), "--model", str(checkpoint), "--out", str(out), "--engines", engines, "--wrong-rows"]
    run = ranks.run(2, cmd, clean_env(), REPO, 120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return {e: torch.load(out / f"{e}.pt") for e in engines.split(",")}


@pytest.fixture(scope="module")
def torch_runs(checkpoint, tmp_path_factory):
    return _probe(checkpoint, tmp_path_factory.mktemp("torch_runs"), "fsdp2,ddp")


@pytest.fixture(scope="module")
def zero3_runs(checkpoint, tmp_path_factory):
    return _probe(checkpoint, tmp_path_factory.mktemp("zero3_runs"), "zero3")


def differences(a: dict, b: dict) -> list[str]:
    """What differs between two runs: parameter names (after the build), ``losses``, adapter names (after the steps)."""
    out = [n for n, t in a["params"].items() if not torch.equal(t, b["params"][n])]
    out += ["losses"] if a["losses"] != b["losses"] else []
    return out + [f"after steps: {n}" for n, t in a["adapters"].items() if not torch.equal(t, b["adapters"][n])]


def _check_direct_equals_from_pretrained(runs: dict) -> None:
    ref, direct = runs["from_pretrained"], runs["direct"]
    assert sorted(ref["params"]) == sorted(direct["params"])
    assert sum("lora_A" in n for n in ref["params"]) == 6 * SHAPE.layers  # the six targets in every layer
    assert differences(ref, direct) == []
    assert any(t.abs().sum() > 0 for n, t in ref["params"].items() if "lora_A" in n)  # drawn, not zeros
    assert ref["losses"][0] != ref["losses"][1]  # two different steps compared


def _check_wrong_rows_are_caught(runs: dict) -> None:
    found = differences(runs["from_pretrained"], runs["wrong_rows"])
    weights = [n for n, t in runs["from_pretrained"]["params"].items() if t.dim() == 2 and "lora_" not in n]
    assert set(weights) <= set(found) and "losses" in found, found  # every matrix; the norms are all ones


def test_fsdp2_and_ddp_direct_load_equals_from_pretrained(torch_runs):
    for engine in ("fsdp2", "ddp"):
        _check_direct_equals_from_pretrained(torch_runs[engine])


def test_fsdp2_load_of_rank0s_rows_on_every_rank_is_caught(torch_runs):
    _check_wrong_rows_are_caught(torch_runs["fsdp2"])


def test_zero3_direct_load_equals_from_pretrained(zero3_runs):
    _check_direct_equals_from_pretrained(zero3_runs["zero3"])


def test_zero3_load_of_rank0s_span_on_every_rank_is_caught(zero3_runs):
    _check_wrong_rows_are_caught(zero3_runs["zero3"])
