"""``frod demo``: the whole pipeline on a tiny local Llama, data → HJD (2 ranks) → ZeRO-3 training (2 ranks) → eval.

Everything is local: a random tiny Llama, a SentencePiece tokenizer trained on the demo text and synthetic
BoolQ/PIQA-schema rows in the paper's templates. CPU ranks use gloo and fp32 (``ds_configs/zero3_cpu_fp32.json``),
GPUs NCCL and bf16 (``ds_configs/zero3.json``). Prints loss start → end and held-out accuracy against chance.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from frod_ds.runtime.cli_parser import Parser, input_path
from frod_ds.runtime.launch_env import without_launcher

EXAMPLES = """examples:
  make demo                                   # creates .venv, then runs frod demo
  frod demo --out runs/demo --ranks 2
"""
# The stages import this very frod_ds (a checkout or site-packages) whether or not another one is installed.
SRC = Path(__file__).resolve().parents[2]
TASKS = "boolq,piqa"
DEMO_FILES = ("demo.log", "raw/", "tokenizer/", "model/", "data/", "factors/", "run/", "eval_base/", "eval/")  # its own
DEMO_FOLDERS = tuple(name for name in DEMO_FILES if name.endswith("/"))  # sealed from the start (tree_stamps)


def _frod(launcher: str = "") -> list[str]:
    """How a stage starts ``frod`` under ``launcher`` (torchrun, deepspeed or none), as docs/commands.md shows:
    the ``frod`` program beside this interpreter, else (not installed) the ``frod_ds`` module in this one."""
    program = Path(sys.executable).parent / "frod"
    if program.is_file():
        return {"torchrun": ["--no-python"], "deepspeed": ["--no_python"]}.get(launcher, []) + [str(program)]
    return {"torchrun": ["-m"], "deepspeed": ["--module"]}.get(launcher, [sys.executable, "-m"]) + ["frod_ds"]


def _run(cmd: list[str], what: str, log: Path, env: dict[str, str] | None = None) -> None:
    """Run a stage; ``env``: the environment to start it in (default: this process's)."""
    print(f"\n== {what}\n$ {' '.join(cmd)}", flush=True)
    t0 = time.time()
    env = without_launcher(os.environ if env is None else env)  # an outer torchrun's rank 0 runs the demo
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH")]))
    with open(log, "a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        # its own process group: a stop of the demo (SIGTERM, Ctrl-C) stops the stage's ranks too, never orphans them
        proc = subprocess.Popen(cmd, cwd=SRC, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        guard = _guard(proc.pid)  # a demo killed outright (SIGKILL) cannot: its guard stops the stage then
        try:
            proc.wait()
        except BaseException:
            _stop_group(proc)
            raise
        finally:
            guard.kill()  # SIGKILL: its handler, which would signal the stage's (now reusable) group id, never runs
            guard.wait()
    if proc.returncode != 0:
        tail = log.read_text().splitlines()[-25:]
        print("\n".join(tail), file=sys.stderr)
        raise SystemExit(f"demo: {what} failed (exit {proc.returncode}); full log in {log}")
    print(f"   done in {time.time() - t0:.1f} s", flush=True)


# The guard of a stage's process group: once its parent (the demo) is gone, SIGTERM to the group, SIGKILL after 20 s.
GUARD = """
import os, sys, time
group, parent = int(sys.argv[1]), int(sys.argv[2])  # the demo's pid: it may be gone before this line runs


def alive():  # a process of the group that is not a zombie (an exited one no parent reaped)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            state, _, pgrp = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue
        if int(pgrp) == group and state not in "ZX":
            return True
    return False


while os.getppid() == parent:
    time.sleep(0.5)
for sig, wait in ((15, 20.0), (9, 0.0)):
    try:
        os.killpg(group, sig)
    except ProcessLookupError:
        break
    end = time.monotonic() + wait
    while time.monotonic() < end and alive():
        time.sleep(0.2)
    if not alive():
        break
"""


def _guard(group: int) -> subprocess.Popen:
    """A process that outlives nothing: it waits for this demo to end and, if the demo ends without stopping the
    stage's process group ``group`` (killed outright, hung up, quit), stops that group. In a session of its own, so
    that what ends the demo's group (a terminal's hang-up, a kill of the group) does not end it too."""
    quiet = subprocess.DEVNULL
    cmd = [sys.executable, "-c", GUARD, str(group), str(os.getpid())]
    return subprocess.Popen(cmd, stdin=quiet, stdout=quiet, stderr=quiet, start_new_session=True)


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to ``proc``'s process group (the launcher and its ranks), SIGKILL after 20 s."""
    import signal

    for sig, wait in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
            return
        except (ProcessLookupError, subprocess.TimeoutExpired):
            continue


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare(out: Path, log: Path, env: dict[str, str]) -> None:
    """Synthetic rows → ``frod data build`` → tokenizer trained on the rendered text → tiny Llama. ``env``: the
    demo's lease handed on, so that its stage may write inside the demo's output."""
    from frod_ds.formats.sibling_names import owned_sibling
    from frod_ds.formats.tree_stamps import nest, publish_sealed
    from frod_ds.testing.toy import train_sentencepiece_tokenizer, write_synthetic_tasks, write_tiny_llama

    def build(name: str) -> Path:  # written beside, published sealed: a stopped demo guards what it finished
        return owned_sibling(out / name, "tmp")

    raw = build("raw")
    write_synthetic_tasks(raw, n_train=600, n_eval=200, seed=0)
    publish_sealed(out, "raw", raw)
    nest(out, "data")
    _run(
        [
            *_frod(),
            "data",
            "build",
            "--source",
            str(out / "raw"),
            "--tasks",
            TASKS,
            "--out",
            str(out / "data"),
        ],
        "frod data build (paper templates)",
        log,
        env,
    )
    texts = []
    for path in [out / "data" / "train.jsonl", *sorted((out / "data" / "eval").glob("*.jsonl"))]:
        for line in path.read_text().splitlines():
            row = json.loads(line)
            texts.append(row["prompt"] + "\nAnswer: " + row["answer"])
    tok_dir = build("tokenizer")
    train_sentencepiece_tokenizer(tok_dir, texts, vocab_size=700)
    publish_sealed(out, "tokenizer", tok_dir)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out / "tokenizer"))
    model = build("model")
    write_tiny_llama(model, vocab_size=len(tok), seed=0, max_shard_size="200KB")
    tok.save_pretrained(str(model))
    publish_sealed(out, "model", model)
    print(f"   tiny Llama ({len(tok)} tokens vocab) and tokenizer in {out / 'model'}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = Parser(
        allow_abbrev=False,
        prog="frod demo",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--out", default="runs/demo", help="output directory (replaced only if an earlier demo wrote it)")
    ap.add_argument("--ranks", type=int, default=2, help="processes for HJD, training and eval")
    ap.add_argument("--recipe", type=input_path, default="recipes/demo_tiny.yaml", help="training recipe")
    return ap.parse_args(argv)


def _check_args(args: argparse.Namespace, gpu: bool) -> Path:
    """The recipe to train with, once ``--ranks`` and ``--recipe`` are known to be usable: checked before anything
    is written, so that a mistake is one line, not a failed stage minutes later with the output half made. ``gpu``:
    the stages run on GPUs (otherwise on CPU ranks, no more than the CPUs)."""
    from frod_ds.config.recipe import load_recipe
    from frod_ds.runtime.errors import FrodError
    from frod_ds.runtime.shipped import user_file

    if args.ranks < 1:
        raise FrodError(f"--ranks {args.ranks}: pass 1 or more processes")
    cpus = len(os.sched_getaffinity(0))
    if args.ranks > max(2, cpus) and not gpu:  # each CPU rank is a process with its own copy of the model
        raise FrodError(f"--ranks {args.ranks}: this machine gives the demo {cpus} CPUs; pass at most {max(2, cpus)}")
    recipe = user_file(args.recipe, "recipes").resolve()
    if not recipe.is_file():
        raise FrodError(f"--recipe {args.recipe}: no such file; pass a YAML recipe (e.g. recipes/demo_tiny.yaml)")
    load_recipe(str(recipe), ["model.base=m", "model.factor_store=f", "data.train=t"])  # what the demo sets itself
    return recipe


def demo(args: argparse.Namespace) -> int:
    import torch

    from frod_ds.formats.lease import holding
    from frod_ds.formats.sibling_names import literal_home
    from frod_ds.runtime.errors import FrodError
    from frod_ds.runtime.paths import file_before_dots

    gpu = torch.cuda.is_available()
    recipe = _check_args(args, gpu)
    home = literal_home(Path(args.out), "--out")  # before resolving: a literal ~ folder is never what was meant
    if home is not None:
        raise FrodError(home)
    through = file_before_dots(args.out)
    if through is not None:  # resolve() would step out of the file, which the kernel refuses
        raise FrodError(f"cannot create {args.out}: {through} is a file, not a directory; choose another --out")
    out = Path(args.out).resolve()
    with holding(out, "demo", "--out") as lease:  # every stage writes inside out under this lease
        return _demo(out, args, recipe, lease.child_env(), gpu=gpu)


def _demo(out: Path, args: argparse.Namespace, recipe: Path, env: dict[str, str], gpu: bool) -> int:
    """The stages, into ``out`` (its lease held): an earlier demo's files removed, the demo's own recorded."""
    import torch

    from frod_ds.formats.ownership import mark_dir, remove_owned
    from frod_ds.formats.tree_stamps import nest, seal_folders, stamp_tree
    from frod_ds.runtime.shipped import shipped_file

    remove_owned(out, "demo")  # only what an earlier demo wrote, never the repo or cwd, nothing put there since
    out.mkdir(parents=True, exist_ok=True)
    mark_dir(out, "demo", DEMO_FILES)
    seal_folders(out, DEMO_FOLDERS)  # a stopped demo deletes only its own
    log = out / "demo.log"
    ranks = min(args.ranks, torch.cuda.device_count()) if gpu else args.ranks
    env_note = f"{ranks} GPU rank(s), NCCL, bf16" if gpu else f"{ranks} CPU ranks, gloo, fp32"
    print(f"frod-ds demo: {env_note}; output in {out}")
    t0 = time.time()

    prepare(out, log, env)
    nest(out, "factors")
    _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={ranks}",
            *_frod("torchrun"),
            "hjd",
            "--model",
            str(out / "model"),
            "--out",
            str(out / "factors"),
        ],
        "HJD (tall-skinny QR across ranks) → factor store",
        log,
        env,
    )
    ds_config = str(shipped_file("ds_configs", "zero3.json" if gpu else "zero3_cpu_fp32.json"))
    dtype = "bfloat16" if gpu else "float32"
    launcher = shutil.which("deepspeed") or str(Path(sys.executable).parent / "deepspeed")
    nest(out, "run")
    _run(
        [
            launcher,
            "--num_nodes",
            "1",
            "--num_gpus",
            str(ranks),
            "--master_port",
            str(_free_port()),
            *_frod("deepspeed"),
            "train",
            "--config",
            ds_config,
            "--recipe",
            str(recipe),
            f"model.base={out / 'model'}",
            f"model.factor_store={out / 'factors'}",
            f"model.dtype={dtype}",
            f"data.train={out / 'data' / 'train.jsonl'}",
            f"output_dir={out / 'run'}",  # beside its inputs: a run's folder never holds them
        ],
        "ZeRO-3 training of the FRoD adapters (deepspeed launcher)",
        log,
        env,
    )
    evals = {}
    for name, model_args in (
        ("eval_base", ["--model", str(out / "model")]),
        ("eval", ["--checkpoint", str(out / "run" / "adapter-final")]),
    ):
        nest(out, name)
        _run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={ranks}",
                *_frod("torchrun"),
                "eval",
                *model_args,
                "--data",
                str(out / "data"),
                "--tasks",
                TASKS,
                "--output",
                str(out / name),
            ],
            f"eval ({'untrained base' if name == 'eval_base' else 'FRoD adapter'})",
            log,
            env,
        )
        evals[name] = json.loads((out / name / "results.json").read_text())

    stamp_tree(out)  # finished: a later demo into out refuses a user's edit anywhere in it
    rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    first, last = rows[0]["loss"], rows[-1]["loss"]
    print(f"\n== result ({time.time() - t0:.0f} s)")
    print(f"loss: {first:.4f} → {last:.4f} over {rows[-1]['step']} steps")
    for task in TASKS.split(","):
        base = evals["eval_base"]["tasks"][task]["accuracy"]
        tuned = evals["eval"]["tasks"][task]["accuracy"]
        print(f"{task:>8}: held-out accuracy {tuned:.3f} (base model {base:.3f}, chance 0.500)")
    print(
        f"outputs: {out / 'run' / 'metrics.jsonl'}, {out / 'run' / 'adapter-final'}, {out / 'eval' / 'results.json'}, "
        f"{out / 'run' / 'loss.png'}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from frod_ds.runtime import entry

    return entry.run(lambda: demo(args), init_group=False)  # every stage runs in processes of its own


if __name__ == "__main__":  # as `frod demo` runs
    from frod_ds.cli.main import module_main

    module_main("demo")
