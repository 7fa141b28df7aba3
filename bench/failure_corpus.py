"""Run the failure-policy corpus (bench/failure_corpus.yaml) against a frod-ds checkout and count what happened.

    python bench/failure_corpus.py                         # this checkout
    python bench/failure_corpus.py --repo ../other-checkout --json results.json
    python bench/failure_corpus.py --only "full disk"       # cases whose name contains this

Builds one tiny world (model, tokenizer, data, factor store, a trained adapter) with the checkout's own
commands, then runs every case in its own directory and classifies the outcome: ``success`` (exit 0, its check
holds), ``clear-error`` (exit 2, one ``error:`` line, no traceback, nothing under the case directory changed),
``exact-recovery`` (a clear error that may leave resumable state, the fix, then the same command succeeds and
its check holds); anything else
is ``unclear-failure`` (a traceback, another exit code, several lines, something left behind) or
``wrong-result`` (exit 0 where an error was due, or a failed check). Prints the counts per expected class and
every mismatch; exits 1 when there is one. A case whose preparation cannot run here (mounting a small tmpfs
needs root) is skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parents[1]
CORPUS = Path(__file__).with_suffix(".yaml")
CLASSES = ("clear-error", "success", "exact-recovery")


@dataclass
class World:
    repo: Path
    root: Path
    env: dict[str, str]
    paths: dict[str, str] = field(default_factory=dict)

    def python(self, *argv: str, cwd: Path | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, *argv], cwd=cwd or self.repo, env=self.env, capture_output=True,
                              text=True, timeout=timeout)

    def hjd(self, *argv: str) -> subprocess.CompletedProcess:
        return self.python(str(self.repo / "launch" / "hjd.py"), "--device", "cpu", *argv)


def _env(repo: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                               "MASTER_PORT") and not k.startswith("SLURM_")}
    env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(repo),
               TORCH_EXTENSIONS_DIR=os.environ.get("TORCH_EXTENSIONS_DIR", str(repo / ".cache" / "torch_extensions")))
    return env


def build_world(repo: Path, root: Path) -> World:
    """Model, tokenizer, data and store as the training tests make them (``tests.support.train_env.build_env`` of
    ``repo``), and an adapter from two training steps."""
    world = World(repo, root, _env(repo))
    code = ("import sys; from pathlib import Path; from tests.support.train_env import build_env; "
            "build_env(Path(sys.argv[1]))")
    res = world.python("-c", code, str(root / "world"))
    if res.returncode:
        raise SystemExit(f"building the world failed:\n{res.stderr[-3000:]}")
    w = root / "world"
    world.paths = {"model": str(w / "model"), "store": str(w / "factors"), "data": str(w / "data"),
                   "train_jsonl": str(w / "data" / "train.jsonl")}
    run = train_cmd(world, ["train.max_steps=2", f"output_dir={root / 'adapter-run'}"])
    res = world.python(*run)
    if res.returncode:
        raise SystemExit(f"training the world's adapter failed:\n{res.stderr[-3000:]}")
    world.paths["adapter"] = str(root / "adapter-run" / "adapter-final")
    return world


def train_cmd(world: World, extra: list[str]) -> list[str]:
    p = world.paths
    base = [f"model.base={p['model']}", f"model.factor_store={p['store']}", "model.dtype=float32",
            "model.sparsity=0.1", f"data.train={p['train_jsonl']}", "data.cutoff_len=64", "train.micro_batch_size=4",
            "train.grad_accum=2", "train.log_every=1", "train.rotation_every=0"]
    flags = [a for i, a in enumerate(extra) if a.startswith("--") or (i and extra[i - 1].startswith("--"))]
    overrides = [a for a in extra if a not in flags]
    return [str(world.repo / "launch" / "train.py"), "--config", str(world.repo / "ds_configs" / "zero2_cpu_fp32.json"),
            *flags, *base, *overrides]


def command(world: World, argv: list[str]) -> list[str]:
    tool, rest = argv[0], argv[1:]
    if tool == "train":
        return train_cmd(world, rest)
    if tool == "export":
        return [str(world.repo / "launch" / "export.py"), *rest]
    if tool == "hjd":
        return [str(world.repo / "launch" / "hjd.py"), "--device", "cpu", *rest]
    if tool == "data_prep":
        return ["-m", "data_prep", *rest]
    raise ValueError(f"unknown tool {tool!r} in the corpus")


# ------------------------------------------------------------------------------------------ preparations


class Skip(Exception):
    """This case cannot be prepared here."""


def _copy_model(world: World, dst: Path, edit: Callable[[dict], None]) -> None:
    from safetensors.torch import load_file, save_file

    shutil.copytree(world.paths["model"], dst)
    for shard in dst.glob("*.safetensors"):
        tensors = load_file(shard)
        edit(tensors)
        save_file(tensors, shard, metadata={"format": "pt"})


def _store_of(world: World, model: Path, out: Path, *argv: str) -> None:
    res = world.hjd("--model", str(model), "--out", str(out), *argv)
    if res.returncode:
        raise RuntimeError(f"hjd for the case failed: {res.stderr[-2000:]}")


def bad_yaml(world: World, case: Path) -> None:
    (case / "bad.yaml").write_text("model:\n  base: m\n   factor_store: f\n")


def _ds(world: World, case: Path, **edit) -> None:
    cfg = json.loads((world.repo / "ds_configs" / "zero2_cpu_fp32.json").read_text())
    cfg.update(edit)
    (case / "ds.json").write_text(json.dumps(cfg))


def ds_clip(world: World, case: Path) -> None:
    _ds(world, case, gradient_clipping=0.3)


def ds_typo(world: World, case: Path) -> None:
    _ds(world, case, gradient_cliping=1.0)


def small_vocab(world: World, case: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig.from_pretrained(world.paths["model"])
    cfg.vocab_size = 64
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(str(case / "model"), max_shard_size="60KB")
    _store_of(world, case / "model", case / "store")


def nan_norm(world: World, case: Path) -> None:
    def edit(tensors: dict) -> None:
        name = "model.layers.0.input_layernorm.weight"
        if name in tensors:
            tensors[name][0] = float("nan")

    _copy_model(world, case / "model", edit)
    _store_of(world, case / "model", case / "store")


def foreign_dir(world: World, case: Path) -> None:
    (case / "foreign").mkdir()
    (case / "foreign" / "notes.txt").write_text("not frod-ds output\n")


def other_model_store(world: World, case: Path) -> None:
    _store_of(world, Path(world.paths["model"]), case / "store", "--categories", "q_proj")

    def edit(tensors: dict) -> None:
        for name in tensors:
            if ".q_proj." in name:
                tensors[name] = tensors[name] + 0.05

    _copy_model(world, case / "other", edit)


def index_missing_member(world: World, case: Path) -> None:
    shutil.copytree(world.paths["model"], case / "model")
    index = case / "model" / "model.safetensors.index.json"
    if not index.is_file():
        raise Skip("the world's model is not sharded")
    data = json.loads(index.read_text())
    del data["weight_map"]["model.layers.1.self_attn.q_proj.weight"]
    index.write_text(json.dumps(data))


def test_json_only(world: World, case: Path) -> None:
    fixture = world.repo / "tests" / "fixtures" / "data_prep" / "llm_adapters"
    shutil.copytree(fixture / "boolq", case / "dataset" / "boolq")
    (case / "dataset" / "piqa").mkdir(parents=True)
    shutil.copy(fixture / "piqa" / "test.json", case / "dataset" / "piqa" / "test.json")


def small_disk(world: World, case: Path) -> None:
    (case / "disk").mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(case / "disk")],
                      capture_output=True).returncode:
        raise Skip("cannot mount a small tmpfs here (needs root)")


def grow_disk(world: World, case: Path) -> None:
    subprocess.run(["mount", "-o", "remount,size=16m", str(case / "disk")], check=True)


def verify_store(world: World, case: Path) -> bool:
    res = world.hjd("--verify", str(case / "disk" / "store"), "--model", world.paths["model"])
    return res.returncode == 0 and "OK" in res.stdout


def _unmount(case: Path) -> None:
    if (case / "disk").is_dir() and os.path.ismount(case / "disk"):
        subprocess.run(["umount", str(case / "disk")], check=False)


STEPS: dict[str, Callable] = {f.__name__: f for f in (bad_yaml, ds_clip, ds_typo, small_vocab, nan_norm, foreign_dir,
                                                        other_model_store, index_missing_member, test_json_only,
                                                        small_disk, grow_disk, verify_store)}


# ------------------------------------------------------------------------------------------ classification


def _snapshot(case: Path) -> dict[str, tuple[int, int]]:
    out = {}
    for root, _, files in os.walk(case):
        for f in files:
            p = Path(root) / f
            st = p.lstat()
            out[str(p.relative_to(case))] = (st.st_size, st.st_mtime_ns)
        if root != str(case):
            out.setdefault(str(Path(root).relative_to(case)) + "/", (0, 0))
    return out


def _clear_error(res: subprocess.CompletedProcess, before: dict | None, case: Path) -> str | None:
    """None when ``res`` is a clear error that left nothing behind (``before``: the case directory's snapshot;
    None: what it left is not checked, as for a recovery, which resumes from it), else why not."""
    errors = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
    if res.returncode != 2:
        return f"exit {res.returncode}"
    if "Traceback" in res.stderr:
        return "traceback"
    if len(errors) != 1:
        return f"{len(errors)} error lines"
    changed = [] if before is None else sorted(set(before.items()) ^ set(_snapshot(case).items()))
    if changed:
        return f"left behind / changed: {changed[0][0]}"
    return None


def run_case(world: World, case_spec: dict, case: Path) -> dict:
    expected = case_spec["class"]
    assert expected in CLASSES, f"unknown class {expected!r}"
    case.mkdir(parents=True)
    subs = {**world.paths, "case": str(case), "new": str(case / "new")}
    argv = command(world, [str(a).format(**subs) for a in case_spec["cmd"]])
    try:
        if case_spec.get("prepare"):
            STEPS[case_spec["prepare"]](world, case)
        before = _snapshot(case)
        res = world.python(*argv)
        if expected == "success":
            ok = res.returncode == 0 and (not case_spec.get("check") or STEPS[case_spec["check"]](world, case))
            observed = "success" if ok else ("wrong-result" if res.returncode == 0 else "unclear-failure")
            why = None if ok else (res.stderr.strip().splitlines() or ["(no output)"])[-1][:200]
        else:
            kept = None if expected == "exact-recovery" else before  # a recovery resumes from what is left
            why = _clear_error(res, kept, case) if res.returncode != 0 else "exit 0"
            if why == "exit 0":
                observed = "wrong-result"
            elif why:
                observed = "unclear-failure"
            elif expected == "exact-recovery":
                STEPS[case_spec["fix"]](world, case)
                again = world.python(*argv)
                ok = again.returncode == 0 and (not case_spec.get("check") or STEPS[case_spec["check"]](world, case))
                observed = "exact-recovery" if ok else "unclear-failure"
                why = None if ok else f"after the fix: exit {again.returncode}"
            else:
                observed = "clear-error"
        line = next((x for x in res.stderr.splitlines() if x.startswith("error: ")), "")
    except Skip as e:
        return {"name": case_spec["name"], "expected": expected, "observed": "skipped", "why": str(e)}
    finally:
        _unmount(case)
    return {"name": case_spec["name"], "expected": expected, "observed": observed, "why": why, "error": line[:300]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repo", type=Path, default=HERE, help="frod-ds checkout whose commands run (default: this one)")
    ap.add_argument("--corpus", type=Path, default=CORPUS, help="the case list (YAML)")
    ap.add_argument("--only", default=None, help="run only the cases whose name contains this")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args(argv)
    cases = [c for c in yaml.safe_load(args.corpus.read_text()) if not args.only or args.only in c["name"]]
    repo = args.repo.resolve()
    with tempfile.TemporaryDirectory(prefix="frod-failure-corpus-") as tmp:
        world = build_world(repo, Path(tmp))
        results = []
        for i, spec in enumerate(cases):
            r = run_case(world, spec, Path(tmp) / f"case{i:02d}")
            results.append(r)
            mark = "ok" if r["observed"] in (r["expected"], "skipped") else "MISMATCH"
            print(f"{mark:>8}  {r['expected']:>14} -> {r['observed']:<15} {r['name']}"
                  + (f"  ({r['why']})" if r.get("why") and mark != "ok" else ""), flush=True)
    expected = Counter(r["expected"] for r in results if r["observed"] != "skipped")
    matched = Counter(r["expected"] for r in results if r["observed"] == r["expected"])
    mismatches = [r for r in results if r["observed"] not in (r["expected"], "skipped")]
    print("per class (as expected / cases):", ", ".join(f"{c} {matched[c]}/{expected[c]}" for c in CLASSES))
    print(f"mismatches: {len(mismatches)}; skipped: {sum(r['observed'] == 'skipped' for r in results)}")
    if args.json:
        args.json.write_text(json.dumps({"repo": str(repo), "results": results}, indent=1) + "\n")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
