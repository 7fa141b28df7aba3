"""Run the failure-policy corpus (tests/failure_corpus/corpus.yaml) against a frod-ds checkout and count what happened.

    python -m tests.failure_corpus.run                          # this checkout, every case
    python -m tests.failure_corpus.run --repo ../other-checkout --json results.json
    python -m tests.failure_corpus.run --only "full disk"        # cases whose name contains this
    python -m tests.failure_corpus.run --validate                # check the corpus file only (no command runs)
    python -m tests.failure_corpus.run --report results.json     # the Markdown report of a results JSON

Builds one tiny world (model, tokenizer, data, factor store, a trained adapter, its export, a second model of
another shape and its store) with the checkout's own commands, then runs every case in its own directory and
classifies the outcome against the case's expected class:

- ``success``: exit 0 and the case's ``check`` holds.
- ``clear-error``: exit 2, exactly one ``error:`` line, no traceback, nothing under the case directory or the
  world changed.
- ``failed-check``: exit 1 (a check such as ``frod hjd --verify`` found damage), one ``error:`` line, no
  traceback, nothing changed.
- ``exact-recovery``: the command fails (a clear error, or the ``interrupt`` signal kills it mid-run), the
  ``fix`` runs, the same command again succeeds and its ``check`` holds (``same_output``: bitwise equal to an
  uninterrupted run of the same command).

A case's ``env`` (variables added to the first run's environment, e.g. a launcher's left in a shell) is not
given to the run after the ``fix``: that run is the user's with the environment cleaned up.

Anything else is ``unclear-failure`` (a traceback, another exit code, several or no ``error:`` lines, something
left behind), ``wrong-result`` (exit 0 where an error was due, or a failed check), ``data-loss`` (a file of the
world, i.e. another command's output, changed) or ``hang`` (no exit within the case's time limit). A case whose
preparation cannot run here (mounting a tmpfs needs root) is ``skipped`` with the reason.

Commands are written in ``frod`` form (``[train, ...]`` runs ``python -m frod_ds train ...``) or in an older
form (``[launch/train.py, ...]``, ``[data_prep, ...]``, ``[frod_ds, plan, ...]``). A checkout without ``frod``
(frod-ds before the single entry point) runs each ``frod`` command as the older form it had: ``launch/<cmd>.py``,
``python -m data_prep``, ``python -m frod_ds plan``; a command it does not have at all runs as written and counts
as whatever it does.
"""

from __future__ import annotations

import argparse
import datetime
import fnmatch
import gzip
import hashlib
import itertools
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parents[2]  # the checkout this file is in
CORPUS = Path(__file__).with_name("corpus.yaml")
CLASSES = ("success", "clear-error", "failed-check", "exact-recovery")
OBSERVED = (*CLASSES, "unclear-failure", "wrong-result", "data-loss", "hang", "skipped")
FROD = ("data", "hjd", "train", "eval", "export", "plan", "demo", "convert-gguf")
LAUNCHERS = ("ranks2",)  # two CPU ranks with torchrun's environment (tests/support/ranks.py), then a script
OLD_FORMS = (
    "launch/train.py",
    "launch/hjd.py",
    "launch/eval.py",
    "launch/export.py",
    "launch/demo.py",
    "launch/convert_gguf.py",
    "data_prep",
    "frod_ds",
)
CASE_KEYS = {
    "name",
    "class",
    "cmd",
    "env",
    "prepare",
    "fix",
    "check",
    "each",
    "interrupt",
    "timeout",
    "output",
    "compare",
    "note",
    "edit",
}
DEFAULT_TIMEOUT = 300.0


@dataclass
class World:
    repo: Path
    root: Path
    env: dict[str, str]
    paths: dict[str, str] = field(default_factory=dict)
    frod: bool = True  # the checkout has ``python -m frod_ds COMMAND`` (frod_ds/cli/main.py)
    _refs: dict[str, Path] = field(default_factory=dict)

    def python(
        self, *argv: str, cwd: Path | None = None, timeout: float = 900, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, *argv],
            cwd=cwd or self.repo,
            env=env or self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def run(self, argv: list[str], timeout: float = 900) -> subprocess.CompletedProcess:
        return self.python(*command(self, argv), timeout=timeout)

    @property
    def base(self) -> list[str]:
        p = self.paths
        return [
            f"model.base={p['model']}",
            f"model.factor_store={p['store']}",
            "model.dtype=float32",
            "model.sparsity=0.1",
            f"data.train={p['train_jsonl']}",
            "data.cutoff_len=64",
            "train.micro_batch_size=4",
            "train.grad_accum=2",
            "train.log_every=1",
            "train.rotation_every=0",
        ]


def _env(repo: Path) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")
        and not k.startswith("SLURM_")
    }
    env.update(
        OMP_NUM_THREADS="1",
        DS_ACCELERATOR="cpu",
        CUDA_VISIBLE_DEVICES="",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=str(repo),
        TORCH_EXTENSIONS_DIR=os.environ.get("TORCH_EXTENSIONS_DIR", str(repo / ".cache" / "torch_extensions")),
    )
    return env


def command(world: World, argv: list[str]) -> list[str]:
    """The interpreter arguments that run ``argv`` (a corpus command) in ``world.repo``."""
    tool, rest = argv[0], list(argv[1:])
    if tool == "train":  # the world's set-up first; the case's flags and overrides after it win
        rest = ["--config", world.paths["ds"], *world.base, *rest]
    if tool in FROD:
        if world.frod:
            return ["-m", "frod_ds", tool, *rest]
        if tool == "data":
            return ["-m", "data_prep", *rest]
        if tool == "plan":
            return ["-m", "frod_ds", "plan", *rest]
        return [str(world.repo / "launch" / f"{tool.replace('-', '_')}.py"), *rest]
    if tool == "ranks2":  # the rest: a script under the repo (or -m MODULE) and its arguments, run on each rank
        script = rest[0] if rest[0] == "-m" else str(world.repo / rest[0])
        return [str(world.repo / "tests" / "support" / "ranks.py"), "2", script, *rest[1:]]
    if tool.startswith("launch/"):
        return [str(world.repo / tool), *rest]
    if tool in ("data_prep", "frod_ds"):
        return ["-m", tool, *rest]
    raise ValueError(f"unknown tool {tool!r} in the corpus")


def _stage0_json(repo: Path, root: Path) -> Path:
    """The CPU ZeRO-2 JSON at ZeRO stage 0 (DeepSpeed's plain data parallel), beside the worlds."""
    cfg = json.loads((repo / "ds_configs" / "zero2_cpu_fp32.json").read_text())
    cfg["zero_optimization"] = {"stage": 0}
    path = root / "zero0_cpu_fp32.json"
    path.write_text(json.dumps(cfg, indent=1))
    return path


def build_world(repo: Path, root: Path) -> World:
    """Model, tokenizer, data and store as the training tests make them (``tests.train_env.build_env`` of
    ``repo``), an adapter from two training steps, its merged export, and a second model (another seed and depth)
    with its own store for the mismatched-pair cases."""
    world = World(repo, root, _env(repo), frod=(repo / "frod_ds" / "cli" / "main.py").is_file())
    where = "tests.support.train_env" if (repo / "tests" / "support" / "train_env.py").is_file() else "tests.train_env"
    code = (
        f"import sys; from pathlib import Path; from {where} import build_env; "
        "build_env(Path(sys.argv[1])); build_env(Path(sys.argv[2]), seed=1, layers=3)"
    )
    res = world.python("-c", code, str(root / "world"), str(root / "world2"))
    if res.returncode:
        raise SystemExit(f"building the world failed:\n{res.stderr[-3000:]}")
    w, w2 = root / "world", root / "world2"
    world.paths = {
        "model": str(w / "model"),
        "store": str(w / "factors"),
        "data": str(w / "data"),
        "train_jsonl": str(w / "data" / "train.jsonl"),
        "model2": str(w2 / "model"),
        "store2": str(w2 / "factors"),
        "data2": str(w2 / "data"),
        "ds": str(repo / "ds_configs" / "zero2_cpu_fp32.json"),
        "ds3": str(repo / "ds_configs" / "zero3_cpu_fp32.json"),
        "ds0": str(_stage0_json(repo, root)),
        "repo": str(repo),
        "fixtures": str(repo / "tests" / "fixtures" / "data_prep"),
        "run": str(w / "run"),
    }
    for step, argv in (
        ("training the world's adapter", ["train", "train.max_steps=2", f"output_dir={w / 'run'}"]),
        ("exporting it", ["export", "--checkpoint", str(w / "run" / "adapter-final"), "--out", str(w / "export")]),
    ):
        res = world.run(argv)
        if res.returncode:
            raise SystemExit(f"{step} failed:\n{res.stderr[-3000:]}")
    world.paths.update(adapter=str(w / "run" / "adapter-final"), export=str(w / "export"))
    return world


# ------------------------------------------------------------------------------------------ preparations
# Each step takes (world, case directory, the case's spec); what it writes goes under the case directory.


class Skip(Exception):
    """This case cannot be prepared here."""


def _copy_model(world: World, dst: Path, edit: Callable[[dict], None]) -> None:
    from safetensors.torch import load_file, save_file

    shutil.copytree(world.paths["model"], dst)
    for shard in sorted(dst.glob("*.safetensors")):
        tensors = load_file(shard)
        edit(tensors)
        save_file(tensors, shard, metadata={"format": "pt"})


def _store_of(world: World, model: Path, out: Path, *argv: str) -> None:
    res = world.run(["hjd", "--device", "cpu", "--model", str(model), "--out", str(out), *argv])
    if res.returncode:
        raise RuntimeError(f"hjd for the case failed: {res.stderr[-2000:]}")


def _copy(world: World, key: str, dst: Path) -> Path:
    shutil.copytree(world.paths[key], dst, symlinks=True)
    return dst


def _json_edit(world: World, case: Path, edit: dict) -> None:
    """A case's ``edit``: a copy of the world's folder ``copy`` at ``{case}/<copy>`` (unless the prepare step made
    it), then in its JSON ``file`` each ``set`` entry: ``path`` (the keys down to the value, a tensor name one key)
    gets ``value``."""
    dst = case / edit["copy"]
    if not dst.exists():
        _copy(world, edit["copy"], dst)
    path = dst / edit["file"]
    doc = json.loads(path.read_text())
    for entry in edit["set"]:
        *above, last = entry["path"]
        node = doc
        for key in above:
            node = node[key]
        node[last] = entry["value"]
    path.write_text(json.dumps(doc))


def _ds(world: World, case: Path, **edit) -> None:
    cfg = json.loads(Path(world.paths["ds"]).read_text())
    cfg.update(edit)
    (case / "ds.json").write_text(json.dumps(cfg))


def _first(d: Path, pattern: str) -> Path:
    found = sorted(d.rglob(pattern))
    if not found:
        raise Skip(f"no {pattern} under {d.name} in this checkout's output")
    return found[0]


def _truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _flip_byte(path: Path, at: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    i = min(len(data) - 1, max(0, int(len(data) * at)))
    data[i] ^= 0x01
    path.write_bytes(bytes(data))


def _mount(case: Path, name: str, opts: str) -> Path:
    (case / name).mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(case / name)], capture_output=True).returncode:
        raise Skip("cannot mount a tmpfs here (needs root)")
    return case / name


# -- recipes and DeepSpeed JSONs


def bad_yaml(world, case, spec):
    (case / "bad.yaml").write_text("model:\n  base: m\n   factor_store: f\n")


def yaml_list(world, case, spec):
    (case / "r.yaml").write_text("- model\n- train\n")


def yaml_empty(world, case, spec):
    (case / "r.yaml").write_text("")


def yaml_typo_key(world, case, spec):
    (case / "r.yaml").write_text("train:\n  max_step: 2\n")


def yaml_typo_section(world, case, spec):
    (case / "r.yaml").write_text("trian:\n  max_steps: 2\n")


def yaml_bad_value(world, case, spec):
    (case / "r.yaml").write_text("train:\n  lr_sigma: fast\n")


def ds_clip(world, case, spec):
    _ds(world, case, gradient_clipping=0.3)


def ds_typo(world, case, spec):
    _ds(world, case, gradient_cliping=1.0)


def ds_stage9(world, case, spec):
    cfg = json.loads(Path(world.paths["ds"]).read_text())
    cfg.setdefault("zero_optimization", {})["stage"] = 9
    (case / "ds.json").write_text(json.dumps(cfg))


def ds_list(world, case, spec):
    (case / "ds.json").write_text("[1, 2]")


def ds_torn(world, case, spec):
    text = Path(world.paths["ds"]).read_text()
    (case / "ds.json").write_text(text[: len(text) // 2])


def ds_empty(world, case, spec):
    (case / "ds.json").write_text("")


def ds_batch(world, case, spec):
    _ds(world, case, train_batch_size=7)


def ds_micro(world, case, spec):
    _ds(world, case, train_micro_batch_size_per_gpu=3)


def ds_fp16(world, case, spec):
    _ds(world, case, fp16={"enabled": True}, bf16={"enabled": True})


def ds_lr_sched(world, case, spec):
    _ds(world, case, optimizer={"type": "Adam", "params": {"lr": 1e-3}})


def ds_duplicate(world, case, spec):
    text = Path(world.paths["ds"]).read_text().rstrip().rstrip("}")
    (case / "ds.json").write_text(text + ', "steps_per_print": 10, "steps_per_print": 20}\n')  # a key given twice


def ds_string_bool(world, case, spec):
    _ds(world, case, bf16={"enabled": "false"})


def ds_negative_bucket(world, case, spec):
    cfg = json.loads(Path(world.paths["ds"]).read_text())
    cfg["zero_optimization"]["reduce_bucket_size"] = -1
    (case / "ds.json").write_text(json.dumps(cfg))


def ds_offload_gpu(world, case, spec):
    cfg = json.loads(Path(world.paths["ds3"]).read_text())
    cfg["zero_optimization"]["offload_param"] = {"device": "gpu"}
    (case / "ds.json").write_text(json.dumps(cfg))


def ds_steps_word(world, case, spec):
    _ds(world, case, steps_per_print="often")


def ds_offload_optimizer(world, case, spec):
    cfg = json.loads(Path(world.paths["ds"]).read_text())
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    (case / "ds.json").write_text(json.dumps(cfg))


def ds_stage3_keys(world, case, spec):
    cfg = json.loads(Path(world.paths["ds"]).read_text())
    cfg["zero_optimization"].update(stage3_prefetch_bucket_size=0, stage3_max_live_parameters=1000)
    (case / "ds.json").write_text(json.dumps(cfg))


# -- training data


def _jsonl(case: Path, lines: list[str], name: str = "train.jsonl") -> None:
    (case / name).write_text("".join(line + "\n" for line in lines))


def _rows(world: World, n: int = 40) -> list[str]:
    return Path(world.paths["train_jsonl"]).read_text().splitlines()[:n]


def data_empty(world, case, spec):
    (case / "train.jsonl").write_text("")


def data_not_json(world, case, spec):
    rows = _rows(world)
    rows[5] = "{not json"
    _jsonl(case, rows)


DEEP = "[" * 20_000 + "]" * 20_000  # past Python's recursive JSON and YAML readers


def _with_deep_value(text: str, deep: str = DEEP) -> str:
    return text.rstrip().rstrip("}") + ', "x": ' + deep + "}"


def data_deep(world, case, spec):
    rows = _rows(world)
    rows[5] = DEEP
    _jsonl(case, rows)


def ds_deep(world, case, spec):
    (case / "ds.json").write_text(_with_deep_value(Path(world.paths["ds"]).read_text()))


def ds_deep_900(world, case, spec):
    """900 levels: within what Python's JSON reader follows, past what a recursive walk over the result can."""
    (case / "ds.json").write_text(_with_deep_value(Path(world.paths["ds"]).read_text(), "[" * 900 + "]" * 900))


def yaml_deep(world, case, spec):
    (case / "r.yaml").write_text("train:\n  lr_sigma: " + "[" * 10_000 + "]" * 10_000 + "\n")


def model_config_deep(world, case, spec):
    _copy(world, "model", case / "model")
    path = case / "model" / "config.json"
    path.write_text(_with_deep_value(path.read_text()))


def model_config_dup_key(world, case, spec):
    """config.json with hidden_size given twice (the weights' value, then another): transformers keeps the last."""
    _copy(world, "model", case / "model")
    path = case / "model" / "config.json"
    cfg = json.loads(path.read_text())
    path.write_text(json.dumps(cfg)[:-1] + f', "hidden_size": {cfg["hidden_size"] * 2}}}')


def mirror_deep(world, case, spec):
    """A BoolQ source whose second training row is arrays nested 20,000 deep."""
    (case / "mirror" / "boolq").mkdir(parents=True)
    good = {"question": "is it dry", "answer": True, "passage": "It is dry."}
    (case / "mirror" / "boolq" / "train.jsonl").write_text(json.dumps(good) + "\n" + DEEP + "\n")
    (case / "mirror" / "boolq" / "validation.jsonl").write_text(json.dumps({**good, "question": "is it"}) + "\n")


def _edit_row(world, case, index: int, edit: Callable[[dict], None]) -> None:
    """The world's training rows with row ``index`` changed by ``edit``, as the case's train.jsonl."""
    rows = _rows(world)
    row = json.loads(rows[index])
    edit(row)
    rows[index] = json.dumps(row)
    _jsonl(case, rows)


def data_missing_answer(world, case, spec):
    _edit_row(world, case, 3, lambda row: row.pop("answer", None))


def data_missing_prompt(world, case, spec):
    _edit_row(world, case, 7, lambda row: row.pop("prompt", None))


def data_number_answer(world, case, spec):
    _edit_row(world, case, 2, lambda row: row.update(answer=3))


def data_dup_id(world, case, spec):
    rows = _rows(world)
    a, b = json.loads(rows[0]), json.loads(rows[1])
    if "id" not in a:
        raise Skip("rows of this checkout carry no id")
    b["id"] = a["id"]
    rows[1] = json.dumps(b)
    _jsonl(case, rows)


def data_latin1(world, case, spec):
    rows = _rows(world)
    (case / "train.jsonl").write_bytes(
        ("\n".join(rows[:4]) + "\n").encode()
        + b'{"prompt": "caf\xe9", "answer": "x"}\n'
        + ("\n".join(rows[4:]) + "\n").encode()
    )


def data_torn(world, case, spec):
    text = "\n".join(_rows(world)) + "\n"
    (case / "train.jsonl").write_text(text[: len(text) // 2 + 7])


def data_array(world, case, spec):
    (case / "train.json").write_text(json.dumps([json.loads(r) for r in _rows(world)]))


def data_blank_lines(world, case, spec):
    rows = _rows(world)
    _jsonl(case, rows[:10] + ["", "   "] + rows[10:])


def data_huge_row(world, case, spec):
    rows = _rows(world)
    row = json.loads(rows[0])
    row["prompt"] = "a " * 60_000
    rows[0] = json.dumps(row)
    _jsonl(case, rows)


def data_surrogate(world, case, spec):
    rows = _rows(world)
    row = json.loads(rows[6])
    row["answer"] += "\udc80"  # json.dumps writes the lone surrogate as its \\udc80 escape
    rows[6] = json.dumps(row)
    _jsonl(case, rows)


def _data_row_edit(world: World, case: Path, edit: Callable[[dict], None]) -> None:
    rows = _rows(world)
    row = json.loads(rows[5])
    edit(row)
    rows[5] = json.dumps(row)
    _jsonl(case, rows)


def data_one_choice(world, case, spec):
    _data_row_edit(world, case, lambda r: r.update(choices=[r["answer"]], label=0))


def data_same_choices(world, case, spec):
    _data_row_edit(world, case, lambda r: r.update(choices=[r["answer"], r["answer"]], label=0))


def data_label_range(world, case, spec):
    _data_row_edit(world, case, lambda r: r.update(label=len(r["choices"]) + 3))


def data_label_bool(world, case, spec):
    _data_row_edit(world, case, lambda r: r.update(label=True))


def data_answer_elsewhere(world, case, spec):
    _data_row_edit(world, case, lambda r: r.update(answer=r["answer"] + " not a choice"))


def data_empty_answer(world, case, spec):
    _data_row_edit(world, case, lambda r: r.update(answer="", choices=["", "x"], label=0))


def data_fifo(world, case, spec):
    os.mkfifo(case / "train.jsonl")


def data_loop(world, case, spec):
    os.symlink(case / "loop_b", case / "train.jsonl")
    os.symlink(case / "train.jsonl", case / "loop_b")


def data_dir_no_train(world, case, spec):
    shutil.copytree(world.paths["data"], case / "data")
    (case / "data" / "train.jsonl").unlink()


def data_dir_empty(world, case, spec):
    (case / "data").mkdir()


# -- models, stores, adapters


def small_vocab(world, case, spec):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig.from_pretrained(world.paths["model"])
    cfg.vocab_size = 64
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(str(case / "model"), max_shard_size="60KB")
    _store_of(world, case / "model", case / "store")


def nan_norm(world, case, spec):
    def edit(tensors: dict) -> None:
        name = "model.layers.0.input_layernorm.weight"
        if name in tensors:
            tensors[name][0] = float("nan")

    _copy_model(world, case / "model", edit)
    _store_of(world, case / "model", case / "store")


def foreign_dir(world, case, spec):
    (case / "foreign").mkdir()
    (case / "foreign" / "notes.txt").write_text("not frod-ds output\n")


def a_file(world, case, spec):
    (case / "afile").write_text("a file where a directory belongs\n")


def empty_dir(world, case, spec):
    (case / "empty").mkdir()


def other_model_store(world, case, spec):
    _store_of(world, Path(world.paths["model"]), case / "store", "--categories", "q_proj")

    def edit(tensors: dict) -> None:
        for name in tensors:
            if ".q_proj." in name:
                tensors[name] = tensors[name] + 0.05

    _copy_model(world, case / "other", edit)


def index_missing_member(world, case, spec):
    _copy(world, "model", case / "model")
    index = case / "model" / "model.safetensors.index.json"
    if not index.is_file():
        raise Skip("the world's model is not sharded")
    data = json.loads(index.read_text())
    del data["weight_map"]["model.layers.1.self_attn.q_proj.weight"]
    index.write_text(json.dumps(data))


def model_torn_shard(world, case, spec):
    _copy(world, "model", case / "model")
    _truncate(_first(case / "model", "*.safetensors"), 0.6)


def model_no_config(world, case, spec):
    _copy(world, "model", case / "model")
    (case / "model" / "config.json").unlink()


def model_bad_config(world, case, spec):
    _copy(world, "model", case / "model")
    (case / "model" / "config.json").write_text('{"hidden_size": ')


def model_no_weights(world, case, spec):
    _copy(world, "model", case / "model")
    for f in (case / "model").glob("*.safetensors*"):
        f.unlink()


def model_empty_shard(world, case, spec):
    _copy(world, "model", case / "model")
    _first(case / "model", "*.safetensors").write_bytes(b"")


def _config_edit(world: World, case: Path, **edit) -> None:
    _copy(world, "model", case / "model")
    cfg = json.loads((case / "model" / "config.json").read_text())
    (case / "model" / "config.json").write_text(json.dumps({**cfg, **edit}))


def model_config_layers(world, case, spec):
    cfg = json.loads((Path(world.paths["model"]) / "config.json").read_text())
    _config_edit(world, case, num_hidden_layers=cfg["num_hidden_layers"] + 1)


def model_config_billion_layers(world, case, spec):
    _config_edit(world, case, num_hidden_layers=10**9)  # a typo no step may walk or allocate


def model_config_no_layers(world, case, spec):
    _copy(world, "model", case / "model")
    cfg = json.loads((case / "model" / "config.json").read_text())
    del cfg["num_hidden_layers"]
    (case / "model" / "config.json").write_text(json.dumps(cfg))


def model_config_unknown_type(world, case, spec):
    _config_edit(world, case, model_type="foo")


def model_config_gpt2(world, case, spec):
    _config_edit(world, case, model_type="gpt2")  # an architecture transformers knows, not of these weights


def model_config_bert_arch(world, case, spec):
    _config_edit(world, case, architectures=["BertModel"])


def model_config_bad_dtype(world, case, spec):
    _config_edit(world, case, torch_dtype="float99")


def model_config_heads_split(world, case, spec):
    """A LLaMA whose heads do not divide its hidden size, with a head_dim (transformers' LlamaConfig refuses it)."""
    cfg = json.loads((Path(world.paths["model"]) / "config.json").read_text())
    _config_edit(world, case, num_attention_heads=cfg["hidden_size"] // 2 + 1, num_key_value_heads=1, head_dim=8)


def model_config_dir(world, case, spec):
    _copy(world, "model", case / "model")
    (case / "model" / "config.json").unlink()
    (case / "model" / "config.json").mkdir()


def model_config_fifo(world, case, spec):
    _copy(world, "model", case / "model")
    (case / "model" / "config.json").unlink()
    os.mkfifo(case / "model" / "config.json")  # nobody writes it: reading it would wait forever


def model_config_dangling(world, case, spec):
    _copy(world, "model", case / "model")
    (case / "model" / "config.json").unlink()
    os.symlink(case / "gone.json", case / "model" / "config.json")


def mirror_same_options(world, case, spec):
    """A PIQA source whose second training row has the same text for both solutions."""
    (case / "mirror" / "piqa").mkdir(parents=True)
    good = {"goal": "Dry a phone", "sol1": "Put it in rice.", "sol2": "Put it in water.", "label": 0}
    same = {"goal": "Open a door", "sol1": "Push it.", "sol2": "Push it.", "label": 0}
    (case / "mirror" / "piqa" / "train.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(same) + "\n")
    (case / "mirror" / "piqa" / "validation.jsonl").write_text(json.dumps(good) + "\n")


def data_build_edited(world, case, spec):
    """An earlier build whose eval file the user edited since (its sha256 no longer the manifest's)."""
    shutil.copytree(world.paths["data"], case / "data")
    eval_file = sorted((case / "data" / "eval").glob("*.jsonl"))[0]
    eval_file.write_text(eval_file.read_text() + "\n")


def data_build_long_eval_row(world, case, spec):
    """A build whose first boolq eval row's prompt is 200,000 characters, the manifest's sha256 updated to match (a
    build tool's own output, not a user's edit): scoring it would fill the memory."""
    import hashlib

    shutil.copytree(world.paths["data"], case / "data")
    eval_file = case / "data" / "eval" / "boolq.jsonl"
    lines = eval_file.read_text().splitlines()
    row = json.loads(lines[0])
    row["prompt"] = "word " * 40_000
    eval_file.write_text("\n".join([json.dumps(row), *lines[1:]]) + "\n")
    manifest = case / "data" / "manifest.json"
    doc = json.loads(manifest.read_text())
    doc["files"][f"eval/{eval_file.name}"] = hashlib.sha256(eval_file.read_bytes()).hexdigest()
    manifest.write_text(json.dumps(doc, indent=2))


def data_build_future_format(world, case, spec):
    """A build whose manifest names a later format than this frod-ds writes (v2)."""
    shutil.copytree(world.paths["data"], case / "data")
    manifest = case / "data" / "manifest.json"
    doc = json.loads(manifest.read_text())
    doc["format"] = doc["format"].rsplit("/", 1)[0] + "/v2"
    manifest.write_text(json.dumps(doc, indent=2))


def data_build_linked(world, case, spec):
    """An earlier build whose train.jsonl the user replaced by a link to their own copy of it."""
    shutil.copytree(world.paths["data"], case / "data")
    train = case / "data" / "train.jsonl"
    shutil.copy(train, case / "mine.jsonl")
    train.unlink()
    train.symlink_to(case / "mine.jsonl")


def data_build_fifo(world, case, spec):
    """An earlier build one of whose eval files the user replaced by a named pipe."""
    shutil.copytree(world.paths["data"], case / "data")
    eval_file = sorted((case / "data" / "eval").glob("*.jsonl"))[0]
    eval_file.unlink()
    os.mkfifo(eval_file)


def data_build_train_edited(world, case, spec):
    """A data build whose train.jsonl lost a row after the build (its sha256 no longer the manifest's)."""
    shutil.copytree(world.paths["data"], case / "data")
    train = case / "data" / "train.jsonl"
    lines = train.read_text().splitlines(True)
    train.write_text("".join(lines[:1] + lines[2:]))


def data_build_forged_list(world, case, spec):
    """An earlier build holding the user's notes file, which the user also wrote into its ownership record's list."""
    shutil.copytree(world.paths["data"], case / "data")
    (case / "data" / "notes.txt").write_text("mine\n")
    marker = case / "data" / ".frod-ds-output"
    record = json.loads(marker.read_text())
    record["files"] = sorted([*record["files"], "notes.txt"])
    marker.write_text(json.dumps(record))


def model_config_tied_own_head(world, case, spec):
    _config_edit(world, case, tie_word_embeddings=True)  # the tiny model's lm_head.weight is its own


def out_link(world, case, spec):
    (case / "target").mkdir()
    os.symlink(case / "target", case / "out")


def out_link_loop(world, case, spec):
    os.symlink(case / "loop_b", case / "out")
    os.symlink(case / "out", case / "loop_b")


def model_config_zero_hidden(world, case, spec):
    _config_edit(world, case, hidden_size=0)


def model_config_kv(world, case, spec):
    cfg = json.loads((Path(world.paths["model"]) / "config.json").read_text())
    _config_edit(world, case, num_key_value_heads=cfg["num_attention_heads"] - 1)


def _scale(world: World, case: Path, name: str, factor: float) -> None:
    def edit(tensors: dict) -> None:
        if name in tensors:
            tensors[name] = tensors[name] * factor

    _copy_model(world, case / "model", edit)


def model_huge_k(world, case, spec):
    """One layer's k_proj ×1e20: finite, but the stack's QR loses the other layers (reconstruction off by ~1e13)."""
    _scale(world, case, "model.layers.1.self_attn.k_proj.weight", 1e20)


def model_tiny_q(world, case, spec):
    """One layer's q_proj ×1e-30: its column norms underflow in fp32 and its factors come out all zero."""
    _scale(world, case, "model.layers.1.self_attn.q_proj.weight", 1e-30)


def model_zero_q(world, case, spec):
    """One layer's q_proj all zeros: exact to decompose, but into a zero U_i no training can move."""
    _scale(world, case, "model.layers.1.self_attn.q_proj.weight", 0.0)


def model_max_q(world, case, spec):
    """One layer's q_proj all 3e38: finite float32 values whose squares overflow it."""

    def edit(tensors: dict) -> None:
        name = "model.layers.1.self_attn.q_proj.weight"
        if name in tensors:
            tensors[name] = tensors[name] * 0 + 3e38

    _copy_model(world, case / "model", edit)


def model_huge_q(world, case, spec):
    """One layer's q_proj ×1e20 (square members, a stack the Gram route holds): reconstructs, the probe passes."""
    _scale(world, case, "model.layers.1.self_attn.q_proj.weight", 1e20)


def peft_dir(world, case, spec):
    """The files stock PEFT's save_pretrained writes for an adapter (the tensors do not matter here)."""
    import torch
    from safetensors.torch import save_file

    (case / "peft").mkdir()
    (case / "peft" / "adapter_config.json").write_text(
        json.dumps({"peft_type": "FROD", "base_model_name_or_path": world.paths["model"]})
    )
    save_file({"x": torch.zeros(1)}, str(case / "peft" / "adapter_model.safetensors"))


def yaml_alias_bomb(world, case, spec):
    """Nine levels of nine YAML aliases (billion laughs): 300 bytes that expand to 9^9 strings."""
    text = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
    for i in range(1, 9):
        text += f"{chr(97 + i)}: &{chr(97 + i)} [{','.join(['*' + chr(96 + i)] * 9)}]\n"
    (case / "r.yaml").write_text(text + "model: {sparsity: 0.1, bomb: *i}\n")


def a_fifo(world, case, spec):
    os.mkfifo(case / "fifo")


def mirror_gzipped(world, case, spec):
    """The fixtures' mirror with boolq's train.jsonl gzip-compressed under its own name."""
    shutil.copytree(world.repo / "tests" / "fixtures" / "data_prep" / "mirror", case / "src")
    train = case / "src" / "boolq" / "train.jsonl"
    train.write_bytes(gzip.compress(train.read_bytes()))


def data_build_manifest_folder(world, case, spec):
    """A folder that looks like a data build but whose manifest.json is a folder."""
    (case / "d" / "manifest.json").mkdir(parents=True)


def a_link_loop(world, case, spec):
    os.symlink(case / "loop_b", case / "loop")
    os.symlink(case / "loop", case / "loop_b")


def store_copy(world, case, spec):
    _copy(world, "store", case / "store")


def store_flip_manifest(world, case, spec):
    _copy(world, "store", case / "store")
    m = case / "store" / "manifest.json"
    text = m.read_text()
    i = text.index('"', len(text) // 2)  # a byte inside the manifest's second half, kept valid JSON
    m.write_text(text[: i + 1] + ("x" if text[i + 1] != "x" else "y") + text[i + 2 :])


def _unstamped(store: Path) -> None:
    """A store's record as a killed HJD leaves it: its stamps go before HJD writes the manifest again."""
    record = json.loads((store / ".frod-ds-output").read_text())
    record.pop("written", None)
    (store / ".frod-ds-output").write_text(json.dumps(record, indent=1) + "\n")


def store_unmarked(world, case, spec):
    """The world's store as HJD leaves it when stopped between its last category and the completion mark."""
    _copy(world, "store", case / "store")
    m = case / "store" / "manifest.json"
    m.write_text(json.dumps({**json.loads(m.read_text()), "complete": False}, indent=1))
    _unstamped(case / "store")


def store_torn_manifest(world, case, spec):
    _copy(world, "store", case / "store")
    _truncate(case / "store" / "manifest.json", 0.5)


def store_no_manifest(world, case, spec):
    _copy(world, "store", case / "store")
    (case / "store" / "manifest.json").unlink()


def store_torn_factor(world, case, spec):
    _copy(world, "store", case / "store")
    _truncate(_first(case / "store", "*.safetensors"), 0.5)


def store_torn_unmarked(world, case, spec):
    """A finished factor file torn in half, and the manifest's completion mark lost (its last write undone): a
    resume must redo that category, not mark the store complete around it."""
    store_torn_factor(world, case, spec)
    m = case / "store" / "manifest.json"
    doc = json.loads(m.read_text())
    doc["complete"] = False
    m.write_text(json.dumps(doc, indent=1))
    _unstamped(case / "store")


def _plant_tmp(case: Path, tmp: Path, kind: str) -> None:
    """At a writer's temporary name: a link to ``{case}/decoy.txt`` (a file frod-ds never wrote), or a named pipe."""
    if kind == "link":
        (case / "decoy.txt").write_text("a user's file\n")
        tmp.symlink_to(case / "decoy.txt")
    else:
        os.mkfifo(tmp)


def _eval_tmp(kind: str):
    def prepare(world, case, spec):
        """An earlier eval of the world's adapter in ``{case}/ev``, with its results.json's temporary planted."""
        argv = ["eval", "--checkpoint", world.paths["adapter"], "--data", world.paths["data"], "--tasks", "boolq"]
        res = world.run([*argv, "--limit", "2", "--output", str(case / "ev")])
        if res.returncode:
            raise RuntimeError(f"the case's earlier eval failed: {res.stderr[-2000:]}")
        _plant_tmp(case, case / "ev" / "results.json.frod-tmp", kind)

    prepare.__name__ = f"eval_tmp_{kind}"
    return prepare


eval_tmp_link, eval_tmp_fifo = _eval_tmp("link"), _eval_tmp("fifo")


def store_record_link(world, case, spec):
    """The world's complete store whose ownership record (.frod-ds-output) is a link to a user's file."""
    _copy(world, "store", case / "store")
    (case / "store" / ".frod-ds-output").unlink()
    _plant_tmp(case, case / "store" / ".frod-ds-output", "link")


def store_tmp_link(world, case, spec):
    """A store to resume (a torn file, its completion mark lost) whose manifest.json.frod-tmp links to a user's file."""
    store_torn_unmarked(world, case, spec)
    _plant_tmp(case, case / "store" / "manifest.json.frod-tmp", "link")


def store_flip_factor(world, case, spec):
    _copy(world, "store", case / "store")
    _flip_byte(_first(case / "store", "*.safetensors"), 0.9)


def store_missing_factor(world, case, spec):
    _copy(world, "store", case / "store")
    _first(case / "store", "*.safetensors").unlink()


def store_interrupted(world, case, spec):
    """An HJD killed mid-way: a store directory holding only part of what a finished run writes."""
    _copy(world, "store", case / "store")
    for f in sorted((case / "store").rglob("*.safetensors"))[1:]:
        f.unlink()
    with_manifest = case / "store" / "manifest.json"
    if with_manifest.exists():
        with_manifest.unlink()


def adapter_copy(world, case, spec):
    _copy(world, "adapter", case / "adapter")


def adapter_no_config(world, case, spec):
    _copy(world, "adapter", case / "adapter")
    (case / "adapter" / "adapter_config.json").unlink()


def adapter_bad_config(world, case, spec):
    _copy(world, "adapter", case / "adapter")
    _truncate(case / "adapter" / "adapter_config.json", 0.5)


def adapter_torn(world, case, spec):
    _copy(world, "adapter", case / "adapter")
    _truncate(case / "adapter" / "adapter.safetensors", 0.5)


def adapter_flip(world, case, spec):
    _copy(world, "adapter", case / "adapter")
    _flip_byte(case / "adapter" / "adapter.safetensors", 0.95)


def adapter_no_crc(world, case, spec):
    """A byte of the weights changed and the checksum that would catch it deleted from adapter_config.json."""
    adapter_flip(world, case, spec)
    config = json.loads((case / "adapter" / "adapter_config.json").read_text())
    if config.pop("weights_crc32", None) is None:
        raise Skip("this checkout's adapters record no weights checksum")
    (case / "adapter" / "adapter_config.json").write_text(json.dumps(config, indent=2))


def adapter_sparsity_edited(world, case, spec):
    """The adapter's recorded sparsity edited by hand (its weights untouched)."""
    _copy(world, "adapter", case / "adapter")
    config = json.loads((case / "adapter" / "adapter_config.json").read_text())
    (case / "adapter" / "adapter_config.json").write_text(json.dumps({**config, "sparsity": 0.5}, indent=2))


def store_float64(world, case, spec):
    """The world's model decomposed again in float64: the same V, other U_i and σ_i."""
    res = world.run(["hjd", "--model", world.paths["model"], "--out", str(case / "f64"), "--dtype", "float64"])
    if res.returncode:
        raise RuntimeError(f"the float64 store for the case failed: {res.stderr[-2000:]}")


def peft_export_changed(world, case, spec):
    """The world's adapter exported as a PEFT adapter, then a byte of its weights changed (still loadable)."""
    res = world.run(["export", "--checkpoint", world.paths["adapter"], "--format", "peft", "--out", str(case / "peft")])
    if res.returncode:
        raise RuntimeError(f"the PEFT export for the case failed: {res.stderr[-2000:]}")
    _flip_byte(case / "peft" / "adapter_model.safetensors", 0.999)


def peft_import_edited(world, case, spec):
    """The world's adapter exported as PEFT and imported back into ``{case}/imp``, then its nested
    ``adapter/adapter_config.json`` edited by a user (independent round 26: ``--overwrite`` deleted the edit)."""
    for argv in (
        ["export", "--checkpoint", world.paths["adapter"], "--format", "peft", "--out", str(case / "peft")],
        ["export", "--from-peft", str(case / "peft"), "--base-model", world.paths["model"], "--out", str(case / "imp")],
    ):
        res = world.run(argv)
        if res.returncode:
            raise RuntimeError(f"{argv[1]} for the case failed: {res.stderr[-2000:]}")
    config = case / "imp" / "adapter" / "adapter_config.json"
    config.write_text(config.read_text() + " \n")


def peft_config_array(world, case, spec):
    """A PEFT export whose adapter_config.json was replaced by a JSON array."""
    peft_export_changed(world, case, spec)
    (case / "peft" / "adapter_config.json").write_text("[]\n")


def peft_config_no_type(world, case, spec):
    """A PEFT export whose adapter_config.json lost its peft_type."""
    peft_export_changed(world, case, spec)
    cfg = json.loads((case / "peft" / "adapter_config.json").read_text())
    del cfg["peft_type"]
    (case / "peft" / "adapter_config.json").write_text(json.dumps(cfg))


def adapter_empty_weights(world, case, spec):
    _copy(world, "adapter", case / "adapter")
    (case / "adapter" / "adapter.safetensors").write_bytes(b"")


def adapter_nan(world, case, spec):
    from safetensors.torch import load_file, save_file

    _copy(world, "adapter", case / "adapter")
    f = case / "adapter" / "adapter.safetensors"
    tensors = load_file(f)
    name = sorted(k for k, t in tensors.items() if t.is_floating_point())[0]  # a σ or S, not an int64 support
    tensors[name].view(-1)[0] = float("nan")
    save_file(tensors, f, metadata={"format": "pt"})


def run_copy(world, case, spec):
    _copy(world, "run", case / "run")


def _run_ckpt_link(name: str, tag: str):
    def prepare(world, case, spec):
        """The world's run, unfinished (it resumes), with ``checkpoints/<name>`` (a file every save writes there)
        replaced by a symbolic link to ``{case}/decoy.txt``, a file the run never wrote: no save writes through it."""
        ck = _unfinished_run(world, case)
        shutil.rmtree(ck)  # the resumed run saves again
        (case / "decoy.txt").write_text("a user's file\n")
        link = case / "run" / "checkpoints" / name
        if link.exists() or link.is_symlink():
            link.unlink()
        link.symlink_to(case / "decoy.txt")

    prepare.__name__ = f"run_ckpt_link_{tag}"  # the step's name in the corpus
    return prepare


def run_fifo_metrics(world, case, spec):
    """The world's run, unfinished, its metrics.jsonl replaced by a named pipe: opening it to append blocks."""
    shutil.rmtree(_unfinished_run(world, case))
    (case / "run" / "metrics.jsonl").unlink(missing_ok=True)
    os.mkfifo(case / "run" / "metrics.jsonl")


def run_fifo_latest(world, case, spec):
    """The world's run, unfinished, its checkpoints/latest (DeepSpeed's pointer) replaced by a named pipe."""
    shutil.rmtree(_unfinished_run(world, case))
    (case / "run" / "checkpoints" / "latest").unlink(missing_ok=True)
    os.mkfifo(case / "run" / "checkpoints" / "latest")


def _run_ckpt_hardlink(name: str, tag: str):
    def prepare(world, case, spec):
        """The world's run, unfinished (it resumes), with ``checkpoints/<name>`` a second name (a hard link) of
        ``{case}/decoy.txt``, a file the run never wrote: DeepSpeed's in-place save would write into it."""
        shutil.rmtree(_unfinished_run(world, case))
        (case / "decoy.txt").write_text("a user's file\n")
        link = case / "run" / "checkpoints" / name
        link.unlink(missing_ok=True)
        os.link(case / "decoy.txt", link)

    prepare.__name__ = f"run_ckpt_hardlink_{tag}"
    return prepare


def run_tmp_link_plot(world, case, spec):
    """The world's run, unfinished, with ``loss.png.frod-tmp`` (the plot's temporary) a link to a user's file."""
    shutil.rmtree(_unfinished_run(world, case))
    (case / "decoy.png").write_text("a user's picture\n")
    (case / "run" / "loss.png.frod-tmp").symlink_to(case / "decoy.png")


USERS_TMP = ("run/loss.png.tmp", "run/metrics.jsonl.tmp", "run/.frod-ds-output.tmp", "run/recipe.yaml.tmp")


def run_users_tmp(world, case, spec):
    """The world's run, unfinished, with a user's files at the names frod-ds's temporaries had before
    ``.frod-tmp`` (``<name>.tmp``), in the run's folder and its checkpoints' (independent round 23)."""
    ck = _unfinished_run(world, case)
    _users_files(case, [*USERS_TMP, f"{ck.parent.relative_to(case)}/latest_complete.tmp"])


def _users_files(case: Path, rels: list[str]) -> None:
    """A user's file at each of ``rels`` (under ``case``), listed in ``{case}/users_files.txt`` for the check."""
    for rel in rels:
        (case / rel).write_text("a user's file\n")
    (case / "users_files.txt").write_text("\n".join(rels) + "\n")


def store_users_tmp(world, case, spec):
    """A store to resume (a torn file, its completion mark lost) with a user's ``manifest.json.tmp``."""
    store_torn_unmarked(world, case, spec)
    _users_files(case, ["store/manifest.json.tmp"])


run_ckpt_hardlink_latest = _run_ckpt_hardlink("latest", "latest")
run_ckpt_hardlink_script = _run_ckpt_hardlink("zero_to_fp32.py", "script")
run_ckpt_link_latest = _run_ckpt_link("latest", "latest")
run_ckpt_link_script = _run_ckpt_link("zero_to_fp32.py", "script")
run_ckpt_link_pointer = _run_ckpt_link("latest_complete", "pointer")
run_ckpt_link_step = _run_ckpt_link("step00000002", "step")  # the save the resumed run makes


def _checkpoint(case: Path) -> Path:
    ckpts = sorted(p for p in (case / "run").rglob("step*") if p.is_dir())
    if not ckpts:
        raise Skip("the world's run has no engine checkpoint")
    return ckpts[-1]


def _unfinished_run(world: World, case: Path) -> Path:
    """The world's run without its final adapter, so that re-running it resumes from the checkpoint."""
    _copy(world, "run", case / "run")
    for p in (case / "run").glob("adapter-*"):
        shutil.rmtree(p)
    return _checkpoint(case)


def ckpt_no_seal(world, case, spec):
    ck = _unfinished_run(world, case)
    if not (ck / "COMPLETE").exists():
        raise Skip("this checkout's checkpoints have no COMPLETE seal")
    (ck / "COMPLETE").unlink()


def ckpt_missing_file(world, case, spec):
    ck = _unfinished_run(world, case)
    _first(ck, "*optim_states.pt").unlink()


def ckpt_torn_file(world, case, spec):
    ck = _unfinished_run(world, case)
    _truncate(_first(ck, "*model_states.pt"), 0.5)


class _RunsWhenUnpickled:
    """Unpickled in full (``torch.load(..., weights_only=False)``), it creates ``path``: a foreign pickle."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch '{self.path}'",)


def _reseal(ck: Path, changed: Path) -> None:
    """Record ``changed``'s new size and sha256 in the checkpoint's COMPLETE seal, as its maker would."""
    seal = ck / "COMPLETE"
    if seal.is_file() and seal.read_text().strip():
        record = json.loads(seal.read_text())
        digest = hashlib.sha256(changed.read_bytes()).hexdigest()
        record["files"][str(changed.relative_to(ck))] = {"bytes": changed.stat().st_size, "sha256": digest}
        seal.write_text(json.dumps(record, indent=1))


def ckpt_foreign_pickle(world, case, spec):
    """The checkpoint's rng file replaced by a pickle that runs a command (``{case}/ran``), sealed to match."""
    import torch

    ck = _unfinished_run(world, case)
    rng = _first(ck, "rng_rank0.pt")
    torch.save({"python": _RunsWhenUnpickled(case / "ran")}, rng)
    _reseal(ck, rng)


def metrics_torn_row(world, case, spec):
    """The run as a kill mid-row leaves it: a row past its checkpoint half written, no newline."""
    _unfinished_run(world, case)
    with open(case / "run" / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "loss": 6.91')


def metrics_whole_line(world, case, spec):
    """The world's finished run with a whole line appended to its metrics.jsonl (``{}``: parses, so no kill tore it)."""
    _copy(world, "run", case / "run")
    with open(case / "run" / "metrics.jsonl", "a") as f:
        f.write(spec["vars"].get("line", "{}") + "\n")


def demo_user_entry(world, case, spec):
    """``{case}/demo`` as frod demo leaves it (its list naming model/ and run/ whole; model/ published sealed, the
    world's run in run/), ``finished`` (tree-stamped) or stopped after its first stages; then a user's ``entry``
    at ``at`` in it: a file, an empty folder, a link to a folder of theirs, or a file at a lease's name."""
    from frod_ds.cli.demo import DEMO_FILES, DEMO_FOLDERS
    from frod_ds.formats.ownership import mark_dir
    from frod_ds.formats.sibling_names import owned_sibling
    from frod_ds.formats.tree_stamps import nest, publish_sealed, seal_folders, stamp_tree

    demo = case / "demo"
    demo.mkdir()
    mark_dir(demo, "demo", DEMO_FILES)
    seal_folders(demo, DEMO_FOLDERS)
    (demo / "demo.log").write_text("frod-ds demo\n")
    built = owned_sibling(demo / "model", "tmp")
    shutil.copytree(world.paths["model"], built, dirs_exist_ok=True)
    publish_sealed(demo, "model", built)
    nest(demo, "run")
    _copy(world, "run", demo / "run")
    if spec["vars"]["finished"]:
        stamp_tree(demo)
    at = demo / spec["vars"]["at"]
    if spec["vars"]["entry"] == "empty folder":
        at.mkdir()
    elif spec["vars"]["entry"] == "copy of an export":
        _copy(world, "export", at)
    elif spec["vars"]["entry"] == "folder link":
        (case / "mine").mkdir()
        (case / "mine" / "notes.txt").write_text("mine\n")
        at.symlink_to(case / "mine", target_is_directory=True)
    else:
        at.parent.mkdir(parents=True, exist_ok=True)
        at.write_text("mine\n")


def run_copy_other_tokenizer(world, case, spec):
    """The world's run, and at ``{case}/tok`` its tokenizer with the ids of the two tokens its data uses most swapped
    (same files, same size, other ids)."""
    from transformers import AutoTokenizer

    _copy(world, "run", case / "run")
    (case / "tok").mkdir()
    for f in Path(world.paths["model"]).glob("tokenizer*"):
        shutil.copy(f, case / "tok")
    tok = AutoTokenizer.from_pretrained(world.paths["model"])
    text = [json.loads(x)["prompt"] for x in _rows(world)]
    counts = Counter(i for ids in tok(text)["input_ids"] for i in ids if i not in tok.all_special_ids)
    (a, _), (b, _) = counts.most_common(2)
    spec_json = json.loads((case / "tok" / "tokenizer.json").read_text())
    vocab = spec_json["model"]["vocab"]
    if not isinstance(vocab, dict):
        raise Skip("the world's tokenizer is not a BPE vocabulary")
    ta, tb = tok.convert_ids_to_tokens([a, b])
    vocab[ta], vocab[tb] = b, a
    (case / "tok" / "tokenizer.json").write_text(json.dumps(spec_json))


def run_copy_other_config(world, case, spec):
    """The world's run, and at ``{case}/model`` its base model with another ``rope_theta`` (same weights)."""
    _copy(world, "run", case / "run")
    _copy(world, "model", case / "model")
    config = json.loads((case / "model" / "config.json").read_text())
    config["rope_theta"] = 2 * config.get("rope_theta", 10000.0)
    (case / "model" / "config.json").write_text(json.dumps(config, indent=2))


def export_copy(world, case, spec):
    _copy(world, "export", case / "export")


def export_edited(world, case, spec):
    """An earlier export whose config.json the user edited since (another size: no hash needed to see it)."""
    _copy(world, "export", case / "export")
    cfg = json.loads((case / "export" / "config.json").read_text())
    (case / "export" / "config.json").write_text(json.dumps({**cfg, "my_note": "keep"}))


def store_edited(world, case, spec):
    """An earlier factor store one of whose V files the user replaced with their own bytes (a store has no stamps:
    its manifest's checksums tell)."""
    _copy(world, "store", case / "store")
    (case / "store" / "q_proj.V.safetensors").write_text("the user's own file under a store's name\n")


def run_without_checkpoints(world, case, spec):
    _copy(world, "run", case / "run")
    shutil.rmtree(case / "run" / "checkpoints")


def model_config_bad_act(world, case, spec):
    _config_edit(world, case, hidden_act="bogus")


def model_config_short_context(world, case, spec):
    """config.json's max_position_embeddings below the training examples' length (the weights unchanged)."""
    _config_edit(world, case, max_position_embeddings=8)


def model_index_gone(world, case, spec):
    """A sharded checkpoint whose model.safetensors.index.json is gone (the shards are all there)."""
    _copy(world, "model", case / "model")
    (case / "model" / "model.safetensors.index.json").unlink()


def mirror_control_char(world, case, spec):
    """A BoolQ source whose second training row's passage holds a NUL (a cut or mis-decoded file)."""
    (case / "mirror" / "boolq").mkdir(parents=True)
    good = {"question": "is it dry", "answer": True, "passage": "It is dry."}
    nul = {"question": "is it wet", "answer": False, "passage": "It is\u0000 dry."}
    (case / "mirror" / "boolq" / "train.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(nul) + "\n")
    (case / "mirror" / "boolq" / "validation.jsonl").write_text(json.dumps({**good, "question": "is it"}) + "\n")


def mirror_blank_question(world, case, spec):
    """A BoolQ source whose second training row's question is whitespace only."""
    (case / "mirror" / "boolq").mkdir(parents=True)
    good = {"question": "is it dry", "answer": True, "passage": "It is dry."}
    (case / "mirror" / "boolq" / "train.jsonl").write_text(
        json.dumps(good) + "\n" + json.dumps({**good, "question": "   "}) + "\n"
    )
    (case / "mirror" / "boolq" / "validation.jsonl").write_text(json.dumps({**good, "question": "is it"}) + "\n")


def mirror_test_in_train(world, case, spec):
    """A BoolQ source one of whose test rows is also a training row."""
    (case / "mirror" / "boolq").mkdir(parents=True)
    rows = [{"question": f"is it {w}", "answer": i % 2 == 0, "passage": f"It is {w}."} for i, w in enumerate("abc")]
    (case / "mirror" / "boolq" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (case / "mirror" / "boolq" / "validation.jsonl").write_text(json.dumps(rows[1]) + "\n")


def mirror_bom(world, case, spec):
    """A BoolQ source saved with a UTF-8 byte-order mark (as editors on Windows write)."""
    mirror_test_in_train(world, case, spec)
    for f in (case / "mirror" / "boolq").iterdir():
        f.write_bytes(b"\xef\xbb\xbf" + f.read_bytes())


def export_torn(world, case, spec):
    _copy(world, "export", case / "export")
    _truncate(_first(case / "export", "*.safetensors"), 0.4)


def export_no_tokenizer(world, case, spec):
    _copy(world, "export", case / "export")
    for f in (case / "export").glob("tokenizer*"):
        f.unlink()


# -- eval data


def _eval_dir(world: World, case: Path) -> Path:
    shutil.copytree(world.paths["data"], case / "data")
    return case / "data" / "eval"


def _first_task(ev: Path) -> Path:
    return sorted(ev.glob("*.jsonl"))[0]


def eval_missing_field(world, case, spec):
    f = _first_task(_eval_dir(world, case))
    rows = f.read_text().splitlines()
    row = json.loads(rows[0])
    row.pop(spec.get("field", "label") if spec.get("field", "label") in row else sorted(row)[0])
    rows[0] = json.dumps(row)
    f.write_text("\n".join(rows) + "\n")


def eval_not_json(world, case, spec):
    f = _first_task(_eval_dir(world, case))
    rows = f.read_text().splitlines()
    rows[1] = rows[1][: len(rows[1]) // 2]
    f.write_text("\n".join(rows) + "\n")


def eval_empty(world, case, spec):
    _first_task(_eval_dir(world, case)).write_text("")


def eval_no_dir(world, case, spec):
    shutil.rmtree(_eval_dir(world, case))


def eval_bad_label(world, case, spec):
    f = _first_task(_eval_dir(world, case))
    rows = f.read_text().splitlines()
    row = json.loads(rows[0])
    for key in ("label", "answer", "gold"):
        if key in row:
            row[key] = 99 if isinstance(row[key], int) else "not-a-choice"
            break
    rows[0] = json.dumps(row)
    f.write_text("\n".join(rows) + "\n")


def _eval_edit(world: World, case: Path, edit: Callable[[dict], None]) -> None:
    f = _first_task(_eval_dir(world, case))
    rows = f.read_text().splitlines()
    row = json.loads(rows[1])
    edit(row)
    rows[1] = json.dumps(row)
    f.write_text("\n".join(rows) + "\n")


def eval_one_choice(world, case, spec):
    _eval_edit(world, case, lambda row: row.update(choices=[row["answer"]], label=0))


def eval_same_choices(world, case, spec):
    _eval_edit(world, case, lambda row: row.update(choices=[row["answer"], row["answer"]], label=0))


def eval_flipped_label(world, case, spec):
    """Row 1's label moved to another choice: a valid row, so only the build's sha256 tells the file changed."""
    f = _first_task(_eval_dir(world, case))
    rows = f.read_text().splitlines()
    row = json.loads(rows[0])
    row["label"] = (row["label"] + 1) % len(row["choices"])
    row["answer"] = row["choices"][row["label"]]
    rows[0] = json.dumps(row)
    f.write_text("\n".join(rows) + "\n")


# -- data build sources


def mirror_copy(world, case, spec):
    shutil.copytree(Path(world.paths["fixtures"]) / "mirror", case / "mirror")


def _boolq_append(world: World, case: Path, *lines: str) -> None:
    mirror_copy(world, case, spec=None)
    f = case / "mirror" / "boolq" / "train.jsonl"
    f.write_text(f.read_text().rstrip("\n") + "\n" + "".join(line + "\n" for line in lines))


SURROGATE_ROW = '{"question": "q", "answer": true, "passage": "torn \\ud800 text"}'  # a lone surrogate's escape


def mirror_repeat(world, case, spec):
    """BoolQ's first training row again (BoolQ rows have no id: the repeat gets its own row index)."""
    _boolq_append(world, case, _mirror_line(world, "boolq/train.jsonl", 0))


def mirror_surrogate(world, case, spec):
    _boolq_append(world, case, SURROGATE_ROW)


def mirror_repeat_and_surrogate(world, case, spec):
    _boolq_append(world, case, _mirror_line(world, "boolq/train.jsonl", 0), SURROGATE_ROW)


def _mirror_line(world: World, rel: str, i: int) -> str:
    return (Path(world.paths["fixtures"]) / "mirror" / rel).read_text().splitlines()[i]


def mirror_torn(world, case, spec):
    mirror_copy(world, case, spec)
    f = _first(case / "mirror" / "boolq", "train*")
    _truncate(f, 0.5)


def mirror_empty_task(world, case, spec):
    mirror_copy(world, case, spec)
    for f in (case / "mirror" / "boolq").iterdir():
        f.write_text("")


def la_copy(world, case, spec):
    shutil.copytree(Path(world.paths["fixtures"]) / "llm_adapters", case / "dataset")


def la_torn(world, case, spec):
    la_copy(world, case, spec)
    _truncate(case / "dataset" / "boolq" / "train.json", 0.5)


def la_not_list(world, case, spec):
    la_copy(world, case, spec)
    (case / "dataset" / "boolq" / "train.json").write_text('{"instruction": "x"}')


def la_missing_field(world, case, spec):
    la_copy(world, case, spec)
    f = case / "dataset" / "boolq" / "train.json"
    rows = json.loads(f.read_text())
    rows[0].pop("answer", None)
    rows[0].pop("output", None)
    f.write_text(json.dumps(rows))


def test_json_only(world, case, spec):
    fixture = Path(world.paths["fixtures"]) / "llm_adapters"
    shutil.copytree(fixture / "boolq", case / "dataset" / "boolq")
    (case / "dataset" / "piqa").mkdir(parents=True)
    shutil.copy(fixture / "piqa" / "test.json", case / "dataset" / "piqa" / "test.json")


def data_build_copy(world, case, spec):
    shutil.copytree(world.paths["data"], case / "data")


def data_build_tmp_folder(world, case, spec):
    """The world's data build with a user's folder (holding a file) at ``train.jsonl.frod-tmp`` (round 24)."""
    shutil.copytree(world.paths["data"], case / "data")
    (case / "data" / "train.jsonl.frod-tmp").mkdir()
    (case / "data" / "train.jsonl.frod-tmp" / "keep").write_text("a user's file\n")


def dead_builders_shape(world, case, spec):
    """A user's folder (holding a file) beside ``{case}/data`` named as a killed build's temporary of a dead pid,
    but with no record (round 30: the next build deleted it)."""
    import socket

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    mine = case / f".data.tmp-{socket.gethostname()}-{dead.pid}-abcdefgh"
    mine.mkdir()
    (mine / "notes.txt").write_text("a user's file\n")


def data_build_unstamped_edited(world, case, spec):
    """The world's data build with its record's stamps removed (as an older frod-ds wrote it), then its
    manifest.json edited by a user (round 30: --overwrite deleted the edit)."""
    from frod_ds.formats.output_dir import read_record
    from frod_ds.formats.ownership import mark_dir

    shutil.copytree(world.paths["data"], case / "data")
    mark_dir(case / "data", "data-build", read_record(case / "data").files or ())
    time.sleep(0.01)
    manifest = case / "data" / "manifest.json"
    manifest.write_text(manifest.read_text().replace("{", '{"mine": 1, ', 1))


def decoy_file(world, case, spec):
    """A user's file, ``{case}/decoy.txt`` (round 25: an output through its ``..``)."""
    (case / "decoy.txt").write_text("a user's file\n")


def home_copies(world, case, spec):
    """A home folder (the case sets HOME to it) holding copies of the world's data build and store."""
    shutil.copytree(world.paths["data"], case / "home" / "data")
    shutil.copytree(world.paths["store"], case / "home" / "store")


def data_build_flip(world, case, spec):
    shutil.copytree(world.paths["data"], case / "data")
    _flip_byte(case / "data" / "train.jsonl", 0.3)


def data_build_no_manifest(world, case, spec):
    shutil.copytree(world.paths["data"], case / "data")
    (case / "data" / "manifest.json").unlink()


def gguf_torn(world, case, spec):
    (case / "m.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 7)


def gguf_not(world, case, spec):
    (case / "m.gguf").write_text("this is not a gguf file\n")


def gguf_cut(world, case, spec):
    """A GGUF written by gguf-py's own writer (two tensors), its last 64 bytes cut off: a torn download."""
    from tests.support.gguf_files import write_two_tensor_gguf

    (case / "m.gguf").write_bytes(write_two_tensor_gguf(case / "whole.gguf")[:-64])
    (case / "whole.gguf").unlink()


def gguf_blocks_past(world, case, spec):
    """A whole GGUF whose header names 300 blocks for its one layer's tensors (an edited header)."""
    from tests.support.gguf_files import write_two_tensor_gguf

    write_two_tensor_gguf(case / "m.gguf", block_count=300)


# -- the environment


def small_disk(world, case, spec):
    _mount(case, "disk", "size=64k")


def page_disk(world, case, spec):
    _mount(case, "disk", "size=4k")  # one page: a second file does not fit


def grow_disk(world, case, spec):
    subprocess.run(["mount", "-o", "remount,size=64m", str(case / "disk")], check=True)


def read_only(world, case, spec):
    _mount(case, "ro", "size=1m,ro")


def _read_only_copy(world: World, case: Path, key: str) -> None:
    """A read-only directory that holds an earlier output of the same command (its marker included)."""
    d = _mount(case, "ro", "size=16m")
    shutil.copytree(world.paths[key], d / "out")
    subprocess.run(["mount", "-o", "remount,ro", str(d)], check=True)


def ro_export(world, case, spec):
    _read_only_copy(world, case, "export")


def ro_data(world, case, spec):
    _read_only_copy(world, case, "data")


def ro_store(world, case, spec):
    _read_only_copy(world, case, "store")


# -- who owns a folder: files frod-ds did not write, and the lease of a writer alive, dead or silent


def _with_foreign_file(folder: Path) -> None:
    (folder / "my_notes.md").write_text("the user's own notes, put there after the command wrote it\n")


def export_copy_foreign(world, case, spec):
    _with_foreign_file(_copy(world, "export", case / "export"))


def data_build_copy_foreign(world, case, spec):
    _with_foreign_file(_copy(world, "data", case / "data"))


def store_copy_foreign(world, case, spec):
    _with_foreign_file(_copy(world, "store", case / "store"))


def results_json_foreign(world, case, spec):
    """A folder that is no eval's output, though it holds a ``results.json`` (the user's own)."""
    (case / "ev").mkdir()
    (case / "ev" / "results.json").write_text('{"my": "own results"}\n')
    _with_foreign_file(case / "ev")


def _lease(case: Path, name: str, pid: int, host: str | None = None, age: float = 0.0) -> None:
    """The lease file a writer of ``case/name`` holds (as frod_ds.formats.lease writes it), ``age`` seconds old."""
    path = case / f".{name}.frod-ds-lease"
    record = {
        "format": "frod-ds-lease",
        "kind": "training-run",
        "host": host or platform.node(),
        "pid": pid,
        "started": time.time() - age,
        "token": os.urandom(8).hex(),
        "command": "frod train",
    }
    path.write_text(json.dumps(record) + "\n")
    os.utime(path, (time.time() - age, time.time() - age))


def live_lease_new(world, case, spec):
    """A live writer of ``{new}`` on this host: this runner's own process, alive while the case runs."""
    _lease(case, "new", os.getpid())


def live_lease_run(world, case, spec):
    """The world's run, its writer still training (a live process holds its lease)."""
    _copy(world, "run", case / "run")
    _lease(case, "run", os.getpid())


def dead_lease_new(world, case, spec):
    """The lease a writer of ``{new}`` killed with SIGKILL left: its pid is gone."""
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    _lease(case, "new", int(proc.stdout))


def stale_lease_new(world, case, spec):
    """The lease of a writer on another host whose heartbeat stopped ten minutes ago (its node was lost)."""
    _lease(case, "new", 1, host="another-node-of-the-cluster", age=600)


def remove_checkpoints(world, case, spec):
    """What the error says to do when no checkpoint of a run can be resumed."""
    shutil.rmtree(case / "run" / "checkpoints")


def noop(world, case, spec):
    """Nothing to prepare (the ``fix`` of a recovery that needs none)."""


# -- checks (True when the case's result is right)


def verify_store(world, case, spec) -> bool:
    res = world.run(
        ["hjd", "--device", "cpu", "--verify", str(case / "disk" / "store"), "--model", world.paths["model"]]
    )
    return res.returncode == 0 and "OK" in res.stdout


def verify_store_in_case(world, case, spec) -> bool:
    res = world.run(["hjd", "--device", "cpu", "--verify", str(case / "store"), "--model", world.paths["model"]])
    return res.returncode == 0


def verify_new_store(world, case, spec) -> bool:
    res = world.run(["hjd", "--device", "cpu", "--verify", str(case / "new"), "--model", world.paths["model"]])
    return res.returncode == 0


def counts_repeat_and_surrogate(world, case, spec) -> bool:
    """The build dropped the repeated training row and the lone surrogate and counted both."""
    manifest = json.loads((case / "new" / "manifest.json").read_text())
    dropped = manifest.get("dropped", {}).get("boolq", {}).get("train", {})
    return manifest.get("repeated", {}).get("rows", {}).get("boolq", {}).get("train") == 1 and all(
        dropped.get(k) == 1 for k in ("repeated row", "lone surrogate (not Unicode text)")
    )


def verify_new_store_of_case_model(world, case, spec) -> bool:
    res = world.run(["hjd", "--device", "cpu", "--verify", str(case / "new"), "--model", str(case / "model")])
    return res.returncode == 0


def has_new(world, case, spec) -> bool:
    return (case / "new").is_dir() and any((case / "new").iterdir())


def new_has_umask_mode(world, case, spec) -> bool:
    """``new`` exists and has the mode a folder made now gets (the runner's umask), not a temporary's 700."""
    probe = case / "probe"
    probe.mkdir()
    return has_new(world, case, spec) and (case / "new").stat().st_mode & 0o777 == probe.stat().st_mode & 0o777


def users_tmp_kept(world, case, spec) -> bool:
    """Every user's file a preparer wrote (``{case}/users_files.txt`` lists them) is there with its content."""
    rels = (case / "users_files.txt").read_text().split()
    return bool(rels) and all((case / r).is_file() and (case / r).read_text() == "a user's file\n" for r in rels)


def previous_run_moved_whole(world, case, spec) -> bool:
    """``{case}/run`` (a copy of the world's run, trained again with ``train.new_run``) holds the world's run,
    every file byte for byte, in one ``superseded-*`` folder, and a new ``adapter-final``."""
    run, theirs = case / "run", Path(world.paths["run"])

    def files(root: Path) -> dict[str, bytes]:  # the run's record stays in the folder: it is still a run
        every = {f.relative_to(root).as_posix(): f for f in root.rglob("*") if f.is_file()}
        return {rel: f.read_bytes() for rel, f in every.items() if rel != ".frod-ds-output"}

    moved = [p for p in run.iterdir() if p.name.startswith("superseded-")]
    return len(moved) == 1 and files(moved[0]) == files(theirs) and (run / "adapter-final").is_dir()


def decoy_kept(world, case, spec) -> bool:
    """``{case}/decoy.txt``, a user's file a preparer linked into the output, has the content it was given."""
    return (case / "decoy.txt").read_text() == "a user's file\n"


def same_output(world, case, spec) -> bool:
    """The files ``compare`` names under ``output`` are bitwise those of the same command run uninterrupted in a
    fresh directory (run once per distinct command and cached), and no temporary sibling of ``output`` is left."""
    out = Path(spec["output"].format(**_subs(world, case)))
    argv = [str(a) for a in spec["cmd"]]
    key = json.dumps(argv)
    if key not in world._refs:
        ref_case = world.root / f"reference-{len(world._refs)}"
        ref_case.mkdir()
        res = world.run(_argv(world, argv, _subs(world, ref_case)))
        if res.returncode:
            raise RuntimeError(f"the uninterrupted reference run failed: {res.stderr[-1500:]}")
        world._refs[key] = Path(spec["output"].format(**_subs(world, ref_case)))
    ref = world._refs[key]
    ours, theirs = _hashes(out, spec["compare"]), _hashes(ref, spec["compare"])
    litter = list(out.parent.glob(f".{out.name}.tmp-*"))  # what the killed build left, swept by the re-run
    return bool(theirs) and ours == theirs and not litter


def store_left_as_it_was(world, case, spec) -> bool:
    """``case/store`` (a copy of the world's complete store) holds the world store's files byte for byte, its
    manifest and the record of the run that built it included."""
    return _hashes(case / "store", ["*"]) == _hashes(Path(world.paths["store"]), ["*"])


def _hashes(root: Path, patterns: list[str]) -> dict[str, str]:
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_file() and any(fnmatch.fnmatch(rel, pat) for pat in patterns):
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


STEPS: dict[str, Callable] = {
    f.__name__: f
    for f in (
        bad_yaml,
        decoy_file,
        peft_import_edited,
        yaml_list,
        yaml_empty,
        yaml_typo_key,
        yaml_typo_section,
        yaml_bad_value,
        ds_clip,
        ds_typo,
        ds_stage9,
        ds_list,
        ds_torn,
        ds_empty,
        ds_batch,
        ds_micro,
        ds_fp16,
        ds_lr_sched,
        ds_duplicate,
        ds_string_bool,
        ds_negative_bucket,
        ds_offload_gpu,
        ds_steps_word,
        ds_stage3_keys,
        ds_offload_optimizer,
        data_surrogate,
        data_one_choice,
        data_same_choices,
        data_label_range,
        data_label_bool,
        data_answer_elsewhere,
        data_empty_answer,
        model_config_no_layers,
        model_config_unknown_type,
        model_config_tied_own_head,
        model_config_gpt2,
        model_config_bert_arch,
        model_config_bad_dtype,
        model_config_heads_split,
        model_config_dir,
        model_config_fifo,
        model_config_dangling,
        mirror_same_options,
        data_build_edited,
        data_build_long_eval_row,
        data_build_future_format,
        data_build_linked,
        data_build_fifo,
        data_build_forged_list,
        data_build_train_edited,
        export_edited,
        store_edited,
        run_without_checkpoints,
        model_config_bad_act,
        model_config_short_context,
        model_index_gone,
        mirror_control_char,
        mirror_blank_question,
        mirror_test_in_train,
        mirror_bom,
        out_link,
        out_link_loop,
        data_fifo,
        data_loop,
        model_config_layers,
        model_config_billion_layers,
        model_config_zero_hidden,
        model_config_kv,
        model_huge_k,
        model_tiny_q,
        model_zero_q,
        model_max_q,
        model_huge_q,
        peft_dir,
        yaml_alias_bomb,
        a_fifo,
        mirror_gzipped,
        data_build_manifest_folder,
        a_link_loop,
        eval_one_choice,
        eval_same_choices,
        mirror_repeat,
        mirror_surrogate,
        mirror_repeat_and_surrogate,
        data_empty,
        data_not_json,
        data_deep,
        ds_deep,
        ds_deep_900,
        yaml_deep,
        model_config_deep,
        model_config_dup_key,
        mirror_deep,
        data_missing_answer,
        data_missing_prompt,
        data_number_answer,
        data_dup_id,
        data_latin1,
        data_torn,
        data_array,
        data_blank_lines,
        data_huge_row,
        data_dir_no_train,
        data_dir_empty,
        small_vocab,
        nan_norm,
        foreign_dir,
        a_file,
        empty_dir,
        other_model_store,
        index_missing_member,
        model_torn_shard,
        model_no_config,
        model_bad_config,
        model_no_weights,
        model_empty_shard,
        store_copy,
        store_flip_manifest,
        store_unmarked,
        store_torn_manifest,
        store_no_manifest,
        store_torn_factor,
        store_torn_unmarked,
        store_tmp_link,
        store_record_link,
        eval_tmp_link,
        eval_tmp_fifo,
        store_flip_factor,
        store_missing_factor,
        store_interrupted,
        adapter_copy,
        adapter_no_config,
        adapter_bad_config,
        adapter_torn,
        adapter_flip,
        adapter_empty_weights,
        adapter_nan,
        adapter_no_crc,
        adapter_sparsity_edited,
        store_float64,
        peft_export_changed,
        peft_config_array,
        run_ckpt_link_latest,
        run_ckpt_hardlink_latest,
        run_ckpt_hardlink_script,
        run_tmp_link_plot,
        run_ckpt_link_script,
        run_ckpt_link_pointer,
        run_ckpt_link_step,
        run_fifo_metrics,
        run_fifo_latest,
        peft_config_no_type,
        run_copy,
        ckpt_no_seal,
        ckpt_missing_file,
        ckpt_torn_file,
        ckpt_foreign_pickle,
        metrics_torn_row,
        metrics_whole_line,
        demo_user_entry,
        run_copy_other_tokenizer,
        run_copy_other_config,
        export_copy,
        export_torn,
        export_no_tokenizer,
        eval_missing_field,
        eval_not_json,
        eval_empty,
        eval_no_dir,
        eval_bad_label,
        eval_flipped_label,
        mirror_copy,
        mirror_torn,
        mirror_empty_task,
        la_copy,
        la_torn,
        la_not_list,
        la_missing_field,
        test_json_only,
        data_build_copy,
        data_build_tmp_folder,
        data_build_unstamped_edited,
        dead_builders_shape,
        home_copies,
        run_users_tmp,
        store_users_tmp,
        data_build_flip,
        data_build_no_manifest,
        gguf_torn,
        gguf_not,
        gguf_cut,
        gguf_blocks_past,
        small_disk,
        page_disk,
        grow_disk,
        read_only,
        ro_export,
        ro_data,
        ro_store,
        export_copy_foreign,
        data_build_copy_foreign,
        store_copy_foreign,
        results_json_foreign,
        live_lease_new,
        live_lease_run,
        dead_lease_new,
        stale_lease_new,
        remove_checkpoints,
        noop,
    )
}
CHECKS: dict[str, Callable] = {
    f.__name__: f
    for f in (
        new_has_umask_mode,
        verify_store,
        verify_store_in_case,
        verify_new_store,
        verify_new_store_of_case_model,
        has_new,
        same_output,
        decoy_kept,
        previous_run_moved_whole,
        users_tmp_kept,
        store_left_as_it_was,
        counts_repeat_and_surrogate,
    )
}
PLACEHOLDERS = (
    "model",
    "store",
    "data",
    "train_jsonl",
    "model2",
    "store2",
    "data2",
    "ds",
    "ds3",
    "ds0",
    "repo",
    "fixtures",
    "run",
    "adapter",
    "export",
    "case",
    "new",
    "base",
)


def _unmount(case: Path) -> None:
    for name in ("disk", "ro"):
        if (case / name).is_dir() and os.path.ismount(case / name):
            subprocess.run(["umount", "-l", str(case / name)], check=False)


# ------------------------------------------------------------------------------------------ the corpus


def expand(raw: list[dict]) -> list[dict]:
    """One case per entry of each ``each`` list: its keys fill ``{key}`` in every string of the case, and a
    prepare step reads them as ``spec["vars"]``."""
    cases = []
    for spec in raw:
        variants = spec.get("each") or [{}]
        for var in variants:
            case = {k: _fill(v, var) for k, v in spec.items() if k != "each"}
            cases.append({**case, "vars": var})
    return cases


def _fill(value, var: dict):
    if isinstance(value, str) and value.startswith("{") and value.endswith("}") and value[1:-1] in var:
        return var[value[1:-1]]  # a whole value: may be a list (a command) or a number
    if isinstance(value, str):
        for k, v in var.items():
            value = value.replace("{" + k + "}", str(v))
        return value
    if isinstance(value, list):  # a whole-value list inside a list is spliced in: [plan, "{flags}"]
        out: list = []
        for v in value:
            r = _fill(v, var)
            out += r if isinstance(v, str) and isinstance(r, list) else [r]
        return out
    if isinstance(value, dict):
        return {k: _fill(v, var) for k, v in value.items()}
    return value


def validate(cases: list[dict]) -> list[str]:
    """Problems of the (expanded) corpus: unknown keys, classes, steps, tools or placeholders, repeated names."""
    import string

    problems = []
    names = Counter(c.get("name") for c in cases)
    problems += [f"case name {n!r} is used {k} times" for n, k in names.items() if k > 1]
    for c in cases:
        name = c.get("name", "?")
        problems += [f"{name}: unknown key {k!r}" for k in set(c) - CASE_KEYS - {"vars"}]
        if c.get("class") not in CLASSES:
            problems.append(f"{name}: unknown class {c.get('class')!r} (one of {', '.join(CLASSES)})")
        for key, table in (("prepare", STEPS), ("fix", STEPS), ("check", CHECKS)):
            if c.get(key) is not None and c[key] not in table:
                problems.append(f"{name}: unknown {key} step {c[key]!r}")
        cmd = c.get("cmd") or []
        if not cmd or (cmd[0] not in FROD and cmd[0] not in OLD_FORMS and cmd[0] not in LAUNCHERS):
            problems.append(f"{name}: unknown tool {cmd[:1]!r}")
        for s in [*map(str, cmd), c.get("output", "")]:
            for _, fieldname, _, _ in string.Formatter().parse(s):
                if fieldname is not None and fieldname not in PLACEHOLDERS:
                    problems.append(f"{name}: unknown placeholder {{{fieldname}}}")
        if c.get("class") == "exact-recovery" and not (c.get("fix") or c.get("interrupt")):
            problems.append(f"{name}: an exact-recovery case needs a fix or an interrupt")
        if c.get("check") == "same_output" and not (c.get("output") and c.get("compare")):
            problems.append(f"{name}: check same_output needs output and compare")
        sig = (c.get("interrupt") or {}).get("signal")
        if c.get("interrupt") and sig not in ("KILL", "TERM", "INT"):
            problems.append(f"{name}: interrupt signal {sig!r} is not KILL, TERM or INT")
    return problems


def load(path: Path) -> list[dict]:
    return expand(yaml.safe_load(path.read_text()))


# ------------------------------------------------------------------------------------------ classification


def _contents(*dirs: Path) -> dict[str, str]:
    """Every file's sha256 (the world is small): what another command's output holds, not when it was touched."""
    out = {}
    for top in dirs:
        for p in sorted(top.rglob("*")):
            if p.is_file() and not p.is_symlink():
                out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _snapshot(*dirs: Path) -> dict[str, tuple[int, int]]:
    out = {}
    for top in dirs:
        for root, subdirs, files in os.walk(top):
            for f in files:
                p = Path(root) / f
                try:
                    st = p.lstat()
                except FileNotFoundError:
                    continue
                out[str(p)] = (st.st_size, st.st_mtime_ns)
            if root != str(top):
                out.setdefault(root + "/", (0, 0))
    return out


def _changed(before: dict, after: dict) -> list[str]:
    return sorted({k for k, _ in set(before.items()) ^ set(after.items())})


ERROR_LINE = re.compile(r"^(?:[\w./-]+(?: [\w./-]+)*: )?error: ")  # "error: ..." or argparse's "frod eval: error: ..."


def _clear_error(res: subprocess.CompletedProcess, code: int) -> str | None:
    """None when ``res`` is a clear error with exit ``code``, else why not."""
    errors = [line for line in res.stderr.splitlines() if ERROR_LINE.match(line)]
    if "Traceback" in res.stderr:
        return f"exit {res.returncode}, traceback: {_last(res)}"
    if res.returncode != code:
        return f"exit {res.returncode}: {_last(res)}"
    if len(errors) != 1:
        return f"{len(errors)} error lines: {_last(res)}"
    return None


def _last(res) -> str:
    lines = [x for x in (res.stderr or "").strip().splitlines() if x.strip()]
    return (lines[-1] if lines else "(no output)")[:240]


def _argv(world: World, cmd: list, subs: dict[str, str]) -> list[str]:
    """The case's command with its placeholders filled; an argument ``{base}`` stands for the world's training
    overrides (what the ``train`` tool puts first by itself)."""
    out: list[str] = []
    for a in map(str, cmd):
        out += world.base if a == "{base}" else [a.format(**subs)]
    return out


def _subs(world: World, case: Path) -> dict[str, str]:
    return {**world.paths, "case": str(case), "new": str(case / "new")}


def _run_interrupted(
    world: World, argv: list[str], case: Path, spec: dict, env: dict[str, str]
) -> tuple[int | None, str]:
    """Start ``argv``, wait until the ``when`` glob exists under the case directory (or ``after_s``), send the
    signal to its process group; (exit code, stderr). None: it finished before the signal took effect."""
    it = spec["interrupt"]
    proc = subprocess.Popen(
        [sys.executable, *argv],
        cwd=world.repo,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    start, deadline = time.monotonic(), time.monotonic() + float(it.get("within_s", 600))
    fired = False
    while proc.poll() is None and time.monotonic() < deadline:
        if (it.get("when") and any(case.glob(it["when"]))) or (
            it.get("after_s") is not None and time.monotonic() - start >= float(it["after_s"])
        ):
            if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                break  # it exited as the file appeared (a zombie until reaped): a signal now would reach no one
            os.killpg(proc.pid, getattr(signal, f"SIG{it['signal']}"))
            fired = True
            break
        time.sleep(0.05)
    if proc.poll() is None and not fired:
        os.killpg(proc.pid, signal.SIGKILL)
    _, err = proc.communicate(timeout=600)
    try:  # children the signal left running (a launcher's workers): the group this runner started, only it
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    # exit 0 after the signal: the command had finished its work and was exiting as the signal went out (its last
    # handler already gone); nothing was interrupted, as when it finished before the signal
    return (proc.returncode if fired and proc.returncode != 0 else None), err


def run_case(world: World, spec: dict, case: Path) -> dict:
    expected = spec["class"]
    case.mkdir(parents=True)
    subs = _subs(world, case)
    argv = command(world, _argv(world, spec["cmd"], subs))
    env = {**world.env, **{k: str(v).format(**subs) for k, v in spec.get("env", {}).items()}}  # the first run's
    timeout = float(spec.get("timeout", DEFAULT_TIMEOUT))
    world_dirs = [world.root / "world", world.root / "world2"]
    result = {"name": spec["name"], "expected": expected, "cmd": [str(a) for a in spec["cmd"]]}
    t0 = time.monotonic()
    try:
        if spec.get("prepare"):
            STEPS[spec["prepare"]](world, case, spec)
        if spec.get("edit"):
            _json_edit(world, case, spec["edit"])
        before_world = _contents(*world_dirs)
        before = _snapshot(case)
        if spec.get("interrupt"):
            rc, err = _run_interrupted(world, argv, case, spec, env)
            res = subprocess.CompletedProcess(argv, rc if rc is not None else 0, "", err)
            if rc is None:
                raise Skip("the command finished before the interrupt fired")
        else:
            res = world.python(*argv, timeout=timeout, env=env)
        observed, why = _classify(world, spec, case, argv, res, before, timeout)
        # a command writes only where its arguments point: a change of the world under a path this case named is
        # this case's doing (cases run in parallel, so another change may be another case's)
        named = [a.split("=", 1)[-1] for a in argv]
        lost = [
            p
            for p in _changed(before_world, _contents(*world_dirs))
            if any(
                p.startswith(n.rstrip("/") + "/") or p.rstrip("/") == n.rstrip("/")
                for n in named
                if n.startswith(str(world.root))
            )
        ]
        if lost:
            observed, why = "data-loss", f"changed another command's output: {lost[0]}"
        result.update(
            observed=observed,
            why=why,
            rc=res.returncode,
            error=next((x for x in res.stderr.splitlines() if ERROR_LINE.match(x)), "")[:400],
        )
    except subprocess.TimeoutExpired:
        result.update(observed="hang", why=f"no exit within {timeout:.0f} s")
    except Skip as e:
        result.update(observed="skipped", why=str(e))
    finally:
        _unmount(case)
    result["seconds"] = round(time.monotonic() - t0, 1)
    return result


def _classify(world, spec, case, argv, res, before, timeout) -> tuple[str, str | None]:
    expected = spec["class"]
    if expected == "success":
        if res.returncode != 0:
            return "unclear-failure", f"exit {res.returncode}: {_last(res)}"
        if "Traceback" in res.stderr:
            return "unclear-failure", "exit 0 with a traceback"
        if spec.get("check") and not CHECKS[spec["check"]](world, case, spec):
            return "wrong-result", f"check {spec['check']} failed"
        return "success", None
    if res.returncode == 0 and not spec.get("interrupt"):
        return "wrong-result", "exit 0 where an error was due"
    if expected in ("clear-error", "failed-check"):
        why = _clear_error(res, 2 if expected == "clear-error" else 1)
        if why is None:
            changed = _changed(before, _snapshot(case))
            why = f"left behind / changed: {Path(changed[0]).relative_to(case)}" if changed else None
        return (expected, None) if why is None else ("unclear-failure", why)
    # exact-recovery: a killed run may die any way; an error must be clear (what it leaves, it resumes from)
    if spec.get("interrupt"):
        sig = spec["interrupt"]["signal"]
        if sig == "TERM" and res.returncode != 143:  # every command stops on SIGTERM with its one line
            return "unclear-failure", f"SIGTERM gave exit {res.returncode}: {_last(res)}"
        if sig == "TERM":  # and gives back its lease (a kill -9 leaves one for the next run to take over)
            left = sorted(p.name for p in case.rglob("*.frod-ds-lease"))
            if left:
                return "unclear-failure", f"SIGTERM left the lease {left[0]} behind"
    else:
        why = _clear_error(res, 2)
        if why:
            return "unclear-failure", why
    if spec.get("fix"):
        STEPS[spec["fix"]](world, case, spec)
    again = world.python(*argv, timeout=timeout)
    if again.returncode != 0:
        return "unclear-failure", f"the same command again: exit {again.returncode}: {_last(again)}"
    if spec.get("check") and not CHECKS[spec["check"]](world, case, spec):
        return "wrong-result", f"after recovery, check {spec['check']} failed"
    return "exact-recovery", None


# ------------------------------------------------------------------------------------------ results and report


def _versions(repo: Path) -> dict[str, str]:
    def git(*a: str) -> str:
        r = subprocess.run(["git", "-C", str(repo), *a], capture_output=True, text=True)
        return r.stdout.strip()

    out = {"commit": git("rev-parse", "--short", "HEAD"), "python": platform.python_version()}
    for mod in ("torch", "deepspeed", "transformers", "peft"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - a missing package is recorded as such
            out[mod] = "missing"
    return out


def summarise(results: list[dict]) -> dict:
    by_expected: dict[str, Counter] = {c: Counter() for c in CLASSES}
    for r in results:
        by_expected[r["expected"]][r["observed"]] += 1
    ran = [r for r in results if r["observed"] != "skipped"]
    return {
        "cases": len(results),
        "ran": len(ran),
        "as_expected": sum(r["observed"] == r["expected"] for r in ran),
        "observed": dict(Counter(r["observed"] for r in results)),
        "by_expected": {c: dict(v) for c, v in by_expected.items()},
        "mismatches": [r for r in ran if r["observed"] != r["expected"]],
    }


HEADER = [
    "| run | commit | date | cases run (of the corpus) | as expected | unclear-failure | wrong-result | data-loss "
    "| hang | skipped |",
    "|---|---|---|---|---|---|---|---|---|---|",
]


def report(runs: dict[str, dict]) -> str:
    """Markdown of results JSONs (label -> results): per run the counts over the cases it ran, then every run's
    counts over the cases all of them ran (a run cut short is compared on what it reached), then the mismatches."""
    common = set.intersection(*({r["name"] for r in d["results"]} for d in runs.values()))
    lines = [
        "# Failure corpus results",
        "",
        "Generated by `python -m tests.failure_corpus.run --report` from the JSON files beside this one; the corpus is "
        "`tests/failure_corpus/corpus.yaml`, the policy [docs/failure-policy.md](../../../docs/failure-policy.md).",
        "",
        *HEADER,
    ]

    def row(label: str, d: dict, results: list[dict]) -> str:
        s, o = summarise(results), Counter(r["observed"] for r in results)
        return (
            f"| {label} | {d['versions']['commit']} | {d['date'][:10]} | {s['cases']} ({d.get('corpus_cases', '?')}) "
            f"| {s['as_expected']} | {o['unclear-failure']} | {o['wrong-result']} | {o['data-loss']} | {o['hang']} "
            f"| {o['skipped']} |"
        )

    lines += [row(label, d, d["results"]) for label, d in runs.items()]
    if len(runs) > 1:
        lines += ["", f"On the {len(common)} cases every run reached:", "", *HEADER]
        lines += [row(label, d, [r for r in d["results"] if r["name"] in common]) for label, d in runs.items()]
    for label, d in runs.items():
        lines += [
            "",
            f"## {label}: expected class -> observed",
            "",
            f"{d.get('note', '')}",
            "",
            "| expected | " + " | ".join(OBSERVED) + " |",
            "|---" * (len(OBSERVED) + 1) + "|",
        ]
        for c, counts in summarise(d["results"])["by_expected"].items():
            lines.append(f"| {c} | " + " | ".join(str(counts.get(o, 0)) for o in OBSERVED) + " |")
        mism = summarise(d["results"])["mismatches"]
        lines += ["", f"### {label}: {len(mism)} mismatches", ""]
        lines += [
            f"- **{m['name']}** (expected {m['expected']}, got {m['observed']}): {m.get('why') or ''}".replace(
                "|", "\\|"
            )
            for m in mism
        ]
        skipped = [r for r in d["results"] if r["observed"] == "skipped"]
        if skipped:
            lines += ["", f"### {label}: {len(skipped)} skipped", ""] + [f"- {r['name']}: {r['why']}" for r in skipped]
    return "\n".join(lines) + "\n"


LOG_LINE = re.compile(r"^\s*\d+/\d+\s+(ok|MISMATCH)\s+(\S+) -> (\S+)\s+(.*)$")


def collect(path: Path, cases: list[dict]) -> list[dict]:
    """The results of a run that did not finish: its ``.partial.jsonl``, or the lines it printed (a runner
    without the partial file), each completed with the case's command from the corpus."""
    by_name = {c["name"]: c for c in cases}
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    out = []
    for line in path.read_text().splitlines():
        m = LOG_LINE.match(line)
        if not m:
            continue
        mark, expected, observed, rest = m.groups()
        name, _, why = rest.partition("  (") if mark == "MISMATCH" else (rest.strip(), "", "")
        name = name.strip()
        out.append(
            {
                "name": name,
                "expected": expected,
                "observed": observed,
                "why": why[:-1] if why else None,
                "cmd": by_name.get(name, {}).get("cmd"),
            }
        )
    return out


def run_all(repo: Path, cases: list[dict], jobs: int, tmp: Path, partial: Path | None = None) -> list[dict]:
    world = build_world(repo, tmp)
    print(f"world built in {tmp}", flush=True)
    slots = itertools.count()

    def one(item):
        i, spec = item
        r = run_case(world, spec, tmp / f"case{i:03d}")
        mark = "ok" if r["observed"] in (r["expected"], "skipped") else "MISMATCH"
        if partial is not None:  # a run cut short still counts what it ran
            with open(partial, "a") as f:
                f.write(json.dumps(r) + "\n")
        print(
            f"{next(slots) + 1:>4}/{len(cases)} {mark:>8}  {r['expected']:>14} -> {r['observed']:<15} {r['name']}"
            + (f"  ({r['why']})" if r.get("why") and mark != "ok" else ""),
            flush=True,
        )
        return r

    # interrupted and disk cases run alone (their timing and mounts must not depend on the other jobs), and first:
    # a run cut short has the cases most likely to lose data
    serial = [
        (i, c) for i, c in enumerate(cases) if c.get("interrupt") or c.get("prepare") in ("small_disk", "page_disk")
    ]
    parallel = [(i, c) for i, c in enumerate(cases) if (i, c) not in serial]
    results = {i: one((i, c)) for i, c in serial}
    # the prepare steps' imports, made here: transformers' lazy module can fail a name two threads import at once
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: F401

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        results.update(zip([i for i, _ in parallel], pool.map(one, parallel)))
    return [results[i] for i in range(len(cases))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repo", type=Path, default=HERE, help="frod-ds checkout whose commands run (default: this one)")
    ap.add_argument("--corpus", type=Path, default=CORPUS, help="the case list (YAML)")
    ap.add_argument("--only", default=None, help="run only the cases whose name holds this (several: a|b)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--jobs", type=int, default=1, help="cases run at once (default 1)")
    ap.add_argument("--validate", action="store_true", help="check the corpus file and exit (no command runs)")
    ap.add_argument(
        "--report",
        type=Path,
        nargs="+",
        default=None,
        metavar="JSON",
        help="print the Markdown report of results JSONs (e.g. before.json after.json) and exit",
    )
    ap.add_argument(
        "--collect",
        type=Path,
        default=None,
        metavar="PARTIAL",
        help="write --json from a run cut short: its .partial.jsonl or its printed lines",
    )
    ap.add_argument("--note", default=None, help="--collect: a note on the run kept in the JSON and the report")
    args = ap.parse_args(argv)
    if args.report:
        print(report({p.stem: json.loads(p.read_text()) for p in args.report}), end="")
        return 0
    cases = load(args.corpus)
    if args.collect:
        results = collect(args.collect, cases)
        doc = {
            "command": f"python -m tests.failure_corpus.run --repo {args.repo} (cut short; collected from "
            f"{args.collect.name})",
            "date": datetime.datetime.fromtimestamp(args.collect.stat().st_mtime, datetime.UTC).isoformat(
                timespec="seconds"
            ),
            "versions": _versions(args.repo.resolve()),
            "corpus_cases": len(cases),
            "note": args.note or "",
            "summary": summarise(results),
            "results": results,
        }
        (args.json or Path("/dev/stdout")).write_text(json.dumps(doc, indent=1) + "\n")
        return 0
    problems = validate(cases)
    if problems or args.validate:
        print("\n".join(problems) or f"{len(cases)} cases, all valid")
        return 1 if problems else 0
    cases = [c for c in cases if not args.only or any(o in c["name"] for o in args.only.split("|"))]
    repo = args.repo.resolve()
    date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    with tempfile.TemporaryDirectory(prefix="frod-failure-corpus-") as tmp:
        partial = args.json.with_suffix(".partial.jsonl") if args.json else None
        results = run_all(repo, cases, args.jobs, Path(tmp), partial)
    summary = summarise(results)
    print(
        "per expected class:",
        "; ".join(
            f"{c}: " + ", ".join(f"{o} {n}" for o, n in sorted(v.items()))
            for c, v in summary["by_expected"].items()
            if v
        ),
    )
    print(
        f"as expected: {summary['as_expected']}/{summary['ran']}; mismatches: {len(summary['mismatches'])}; "
        f"skipped: {summary['observed'].get('skipped', 0)}"
    )
    if args.json:
        cmdline = ["python", "-m", "tests.failure_corpus.run", *(argv if argv is not None else sys.argv[1:])]
        args.json.write_text(
            json.dumps(
                {
                    "command": " ".join(cmdline),
                    "date": date,
                    "versions": _versions(repo),
                    "corpus_cases": len(cases),
                    "summary": summary,
                    "results": results,
                },
                indent=1,
            )
            + "\n"
        )
    return 1 if summary["mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())
