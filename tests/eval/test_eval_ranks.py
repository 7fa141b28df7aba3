"""Ranks of one ``frod eval`` that were not started alike (a launcher script passing one rank another flag, or a node
reading another copy of the data) are refused on every rank in one line, before anything is written: each rank
would score its share of a different row list, or with another adapter, and rank 0 would report the mix as one
result under its own flags."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.support import ranks
from tests.support.eval_fixtures import make_rows, random_llama, save_model, word_tokenizer, write_eval_dir
from tests.support.helpers_ckpt import REPO
from tests.support.leftovers import clean_env

SCRIPT = REPO / "tests" / "support" / "rank_args.py"


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval-ranks")
    tok = word_tokenizer()
    rows = {"boolq": make_rows("boolq", 6), "piqa": make_rows("piqa", 6)}
    return {"model": save_model(root / "model", random_llama(len(tok), seed=1), tok), "rows": rows, "root": root}


def _eval(args: list[str], monkeypatch, **env: str):
    monkeypatch.setenv("RANK_ARGS_LAUNCH", "eval.py")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return ranks.run(2, [str(SCRIPT), *args], clean_env(), REPO, 200)


def _refused(proc, said: str, out) -> None:
    assert proc.returncode != 0, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "the ranks were not started alike" in errors[0], proc.stderr[-3000:]
    assert said in errors[0], errors[0]
    assert "Traceback" not in proc.stderr and not out.exists()


def test_a_rank_given_another_limit_is_refused(assets, tmp_path, monkeypatch):
    data = write_eval_dir(tmp_path / "data", assets["rows"])
    out = tmp_path / "ev"
    args = ["--model", str(assets["model"]), "--data", str(data), "--tasks", "boolq,piqa", "--output", str(out)]
    _refused(_eval(args, monkeypatch, RANK1_EXTRA="--limit 4"), "--limit: None on rank 0, 4 on rank 1", out)


def test_a_node_reading_another_copy_of_the_data_is_refused(assets, tmp_path, monkeypatch):
    """The same relative ``--data`` on both ranks, another copy of it on rank 1 (piqa's rows in another order)."""
    write_eval_dir(tmp_path / "node0" / "data", assets["rows"])
    write_eval_dir(tmp_path / "node1" / "data", {**assets["rows"], "piqa": assets["rows"]["piqa"][::-1]})
    out = tmp_path / "ev"
    args = ["--model", str(assets["model"]), "--data", "data", "--tasks", "boolq,piqa", "--output", str(out)]
    proc = _eval(args, monkeypatch, RANK_CWD=str(tmp_path / "node{rank}"))
    _refused(proc, "--data rows of piqa:", out)


def test_ranks_started_alike_score_as_before(assets, tmp_path, monkeypatch):
    data = write_eval_dir(tmp_path / "data", assets["rows"])
    out = tmp_path / "ev"
    args = ["--model", str(assets["model"]), "--data", str(data), "--tasks", "boolq,piqa", "--output", str(out)]
    proc = _eval(args, monkeypatch)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["world_size"] == 2 and {t: v["n"] for t, v in results["tasks"].items()} == {
        "boolq": 6,
        "piqa": 6,
    }
    shutil.rmtree(out)
