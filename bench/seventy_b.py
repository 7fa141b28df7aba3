"""FRoD on a synthetic LLaMA-2-70B on 2 GPUs (NF4 U_i), in steps of under 10 minutes that resume from files.

The bf16 70B checkpoint (128.5 GiB) never exists at once: the untargeted tensors (down_proj, embeddings, norms:
36.6 GiB) stay on disk, each targeted category is generated, decomposed into the NF4 factor store and deleted.
Every tensor is generated from a seed derived from its name (``bench/synthetic_llama.py``), so regenerating a
category (for QLoRA, or after a lost machine) gives the same weights on the same kind of device.

    W=/tmp/work/70b; O=$OUT; L="torchrun --standalone --nproc_per_node 2"
    $L bench/seventy_b.py gen-untargeted --work $W --out $O --data ../shared/data/llm_adapters   # ~1-2 min
    $L bench/seventy_b.py category q_proj k_proj v_proj o_proj --work $W --out $O  # generate → HJD → delete, each
    $L bench/seventy_b.py category gate_proj up_proj --work $W --out $O
    python bench/seventy_b.py train --work $W --out $O          # deepspeed launch/train.py, ZeRO-3 + checkpointing,
                                                                # NF4 U_i, recipe batches (cutoff 256);
                                                                # killed at step 18
    python bench/seventy_b.py train-resume --work $W --out $O   # resumed from step 12's checkpoint to 24; losses 13-18
                                                                # vs the killed run's; planner prediction vs peak
    python bench/seventy_b.py step --work $W --out $O           # FRoD step time, bench/train_step.py harness
    python bench/seventy_b.py qlora --work $W --out $O          # QLoRA r=16 (NF4 base) in the same harness; its
                                                                # targeted weights regenerated into /dev/shm,
                                                                # deleted after
    python bench/seventy_b.py report --work $W --out $O         # the table: step, tok/s, MFU, peak, plan, FLOPs
    # rehearsals: --shape 7b on one GPU (nproc_per_node 1, --gpus 1); --tiny (= --shape tiny) on CPU, 2 gloo ranks

``gen-untargeted``, ``category`` run under a launcher (each rank writes its share and HJD runs over the launcher's
ranks); the others start their own (``--gpus``, default every visible GPU, 2 on CPU). A step already done is
skipped; a category is done when it is complete in the store. Records: ``WORK/chain.json`` (shape, seed, device
kind, what is done), one JSON per step in ``WORK/results`` (copied to ``--out``, e.g. each call's $OUT) and
the logs of the drivers' children in ``--out/logs``. User mistakes: one ``error:`` line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.synthetic_llama import (  # noqa: E402
    SHAPES,
    TARGETS,
    add_to_index,
    category_names,
    index_files,
    remove_from_index,
    split_files,
    untargeted_names,
    write_shard,
)
from frod_ds.runtime.errors import FrodError  # noqa: E402

GiB = 2**30
FILE_BYTES = 4 * GiB  # one generated safetensors file at most
ENV = dict(
    NCCL_NVLS_ENABLE="0",
    TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
    NVSHMEM_DISABLE_NVLS="1",
    HF_HUB_OFFLINE="1",
    TOKENIZERS_PARALLELISM="false",
    PYTHONUNBUFFERED="1",
)
TASKS = "boolq,obqa,arc_easy,arc_challenge"


class ChainError(FrodError):
    """A step of the chain asked for out of order, or on a work dir of another shape, seed or device kind."""


# ---- shared ---------------------------------------------------------------------------------------------------------


def _paths(args) -> dict[str, Path]:
    w = Path(args.work)
    return {
        "work": w,
        "model": w / "model",
        "store": w / "store",
        "data": w / "data",
        "recipe": w / "recipe.yaml",
        "chain": w / "chain.json",
        "res": w / "results",
        "out": Path(args.out) if args.out else w / "results",
    }


def _chain(p: dict) -> dict:
    return json.loads(p["chain"].read_text()) if p["chain"].is_file() else {}


def _save_chain(p: dict, chain: dict) -> None:
    from frod_ds.runtime.atomic import atomic_write_text

    atomic_write_text(p["chain"], json.dumps(chain, indent=1) + "\n")


def _result(p: dict, name: str, payload: dict) -> Path:
    """``seventy_b_<name>.json`` in ``WORK/results`` (what ``report`` reads, across calls) and in ``--out``."""
    from bench.common import write_result

    path = write_result(f"seventy_b_{name}", payload, str(p["res"]))
    _copy_out(p, path)
    return path


def _copy_out(p: dict, path: Path) -> None:
    if p["out"].resolve() != p["res"].resolve():
        p["out"].mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, p["out"] / path.name)


def _shape(args):
    import dataclasses

    shape = SHAPES[args.shape]
    return dataclasses.replace(shape, layers=args.layers) if args.layers else shape


def _gpus(args) -> int:
    import torch

    return args.gpus or (torch.cuda.device_count() if torch.cuda.is_available() else 2)


def _env(args) -> dict:
    import torch

    env = dict(os.environ, **ENV, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    if not torch.cuda.is_available():
        env.setdefault("DS_ACCELERATOR", "cpu")
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_chain(args, p: dict, device_type: str) -> dict:
    """``chain.json``, created if absent; ``ChainError`` when the work dir was made for another shape, seed or
    device kind (a CPU generator draws other numbers than a CUDA one)."""
    chain = _chain(p)
    mine = {"shape": _shape(args).as_dict(), "seed": args.seed, "device_type": device_type}
    for k, v in mine.items():
        if k in chain and chain[k] != v:
            raise ChainError(
                f"--work {p['work']} was generated with {k} {chain[k]!r}, this run has {v!r}; use another "
                "--work or the same settings"
            )
    return {**mine, **chain}


# ---- under the launcher: generation and HJD -------------------------------------------------------------------------


def _my_layers(layers: int, rank: int, world: int) -> list[int]:
    from frod_ds.hjd.sharding import my_members

    return my_members(list(range(layers)), rank, world)


def _generate(p: dict, prefix: str, names, seed: int, device) -> dict[str, str]:
    """Write ``names`` into ``model/<prefix>-<j>.safetensors`` files; returns ``{tensor: file}``."""
    weight_map = {}
    for j, group in enumerate(split_files(names, FILE_BYTES)):
        fname = f"{prefix}-{j:03d}.safetensors"
        write_shard(p["model"] / fname, group, seed, device)
        weight_map.update({n: fname for n, _ in group})
    return weight_map


def gen_untargeted(args) -> None:
    """Every rank writes its layers' down_proj and norms (rank 0 also embeddings, final norm, lm_head); rank 0
    lists them in the index, writes config.json, the data (data_prep), a tokenizer trained on it and the recipe."""
    from frod_ds.runtime import distributed as D

    p, shape = _paths(args), _shape(args)
    device = D.local_device()
    chain = D.on_main(lambda: _check_chain(args, p, device.type))
    if chain.get("untargeted"):
        D.print0(f"gen-untargeted: done already ({p['model']})")
        return
    D.on_main(lambda: _prepare_model_dir(args, p, shape))
    t0 = time.perf_counter()
    rank, world = D.get_rank(), D.get_world_size()
    names = untargeted_names(shape, _my_layers(shape.layers, rank, world), globals_=rank == 0)
    maps = D.all_gather_object(_generate(p, f"model-base-r{rank}", names, args.seed, device))
    gen_s = time.perf_counter() - t0

    def finish() -> None:
        add_to_index(p["model"], {k: v for m in maps for k, v in m.items()})
        size = sum((p["model"] / f).stat().st_size for f in index_files(p["model"]))
        chain["untargeted"] = {"seconds": round(gen_s, 1), "gib": round(size / GiB, 2), "world_size": world}
        _save_chain(p, chain)
        _result(p, "gen_untargeted", {"shape": shape.as_dict(), **chain["untargeted"]})
        print(f"gen-untargeted: {size / GiB:.2f} GiB in {gen_s:.1f} s over {world} rank(s)", flush=True)

    D.on_main(finish)


def _prepare_model_dir(args, p: dict, shape) -> None:
    """config.json, data, tokenizer and recipe (rank 0; each skipped when present)."""
    p["model"].mkdir(parents=True, exist_ok=True)
    (p["model"] / "config.json").write_text(json.dumps(shape.config(), indent=1) + "\n")
    if not (p["data"] / "train.jsonl").is_file():
        if args.data and (Path(args.data) / "train.jsonl").is_file():
            shutil.copytree(args.data, p["data"])
        elif args.data and Path(args.data).is_dir():
            res = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "data_prep",
                    "build",
                    "--source",
                    f"llm-adapters:{args.data}",
                    "--out",
                    str(p["data"]),
                    "--tasks",
                    TASKS,
                    "--template",
                    "llm-adapters",
                ],
                cwd=REPO,
                env=_env(args),
                capture_output=True,
                text=True,
            )
            if res.returncode != 0:
                raise ChainError(f"data_prep failed on --data {args.data}: {res.stderr.strip().splitlines()[-1:]}")
        else:
            raise ChainError(
                f"--data {args.data!r} is not a directory: pass LLM-Adapters' dataset folder "
                "(../shared/data/llm_adapters) or a data_prep output (with train.jsonl)"
            )
    if not (p["model"] / "tokenizer_config.json").is_file():
        from frod_ds.testing.toy import train_sentencepiece_tokenizer

        rows = [json.loads(line) for line in (p["data"] / "train.jsonl").read_text().splitlines()[:3000]]
        texts = [r["prompt"] + r.get("separator", "\nAnswer: ") + r["answer"] for r in rows]
        tok_dir = train_sentencepiece_tokenizer(p["work"] / "tokenizer", texts, vocab_size=min(8000, shape.vocab))
        for f in tok_dir.iterdir():
            shutil.copy2(f, p["model"] / f.name)
    write_recipe(args, p)


def write_recipe(args, p: dict) -> None:
    """The training recipe of the chain: FRoD s=0.02 on the six targets, NF4 U_i, bf16, gradient checkpointing,
    cutoff 256 (the paper's), the paper's LRs, micro-batch 4, ``--steps`` optimizer steps, a checkpoint every
    ``--save-at``."""
    import yaml

    recipe = {
        "model": {
            "base": str(p["model"]),
            "factor_store": str(p["store"]),
            "targets": list(TARGETS),
            "sparsity": 0.02,
            "seed": 0,
            "dtype": "bfloat16",
            "gradient_checkpointing": True,
            "frozen_quant": args.quant,
            "quantize_base": False,
        },
        "data": {"train": str(p["data"] / "train.jsonl"), "cutoff_len": 256, "train_on_inputs": False},
        "train": {
            "lr_sigma": 1e-4,
            "lr_s": 1e-5,
            "schedule": "cosine",
            "warmup_ratio": 0.1,
            "max_steps": args.steps,
            "micro_batch_size": args.batch,
            "grad_accum": 1,
            "max_grad_norm": 1.0,
            "log_every": 1,
            "save_every": args.save_at,
            "rotation_every": 0,
            "keep_checkpoints": 2,
        },
        "output_dir": str(p["work"] / "train"),
    }
    p["recipe"].write_text(yaml.safe_dump(recipe, sort_keys=False))


def category(args) -> None:
    """Per category: every rank generates its members (HJD's split) → the index lists them → HJD over the
    launcher's ranks adds the category to the NF4 store → the weights are deleted."""
    from frod_ds.cli import hjd
    from frod_ds.hjd.sharding import my_members
    from frod_ds.runtime import distributed as D

    p, shape = _paths(args), _shape(args)
    device = D.local_device()
    chain = D.on_main(lambda: _check_chain(args, p, device.type))
    if not chain.get("untargeted"):
        raise D.CollectiveError(f"run gen-untargeted on --work {p['work']} first")
    unknown = [c for c in args.names if c not in TARGETS]
    if unknown:
        raise D.CollectiveError(f"category {unknown[0]!r} is not one of {', '.join(TARGETS)}")
    rank, world = D.get_rank(), D.get_world_size()
    for c in args.names:
        prefix = f"model-{c}-r"
        done = D.on_main(lambda: _store_has(p, c))
        if done:
            D.on_main(
                lambda: remove_from_index(p["model"], {f for f in index_files(p["model"]) if f.startswith(prefix)})
            )
            D.print0(f"{c}: in the store already")
            continue
        t0 = time.perf_counter()
        names = category_names(shape, c)
        mine = [names[i] for i in my_members(list(range(len(names))), rank, world)]
        maps = D.all_gather_object(_generate(p, f"{prefix}{rank}", mine, args.seed, device))
        D.on_main(lambda: add_to_index(p["model"], {k: v for m in maps for k, v in m.items()}))
        t_gen = time.perf_counter() - t0
        hjd_args = [
            "--model",
            str(p["model"]),
            "--out",
            str(p["store"]),
            "--targets",
            ",".join(TARGETS),
            "--categories",
            c,
            "--quant",
            args.quant,
        ] + (["--device", "cpu"] if device.type == "cpu" else [])
        hjd.build(hjd.parse_args(hjd_args))
        t_hjd = time.perf_counter() - t0 - t_gen
        D.barrier()
        D.on_main(lambda: remove_from_index(p["model"], {f for m in maps for f in m.values()}))
        record = {
            "generate_s": round(t_gen, 1),
            "hjd_s": round(t_hjd, 1),
            "delete_s": round(time.perf_counter() - t0 - t_gen - t_hjd, 1),
            "world_size": world,
        }

        def note() -> None:
            chain.setdefault("categories", {})[c] = record
            _save_chain(p, chain)
            _result(p, f"category_{c}", {"category": c, **record, "store": _store_summary(p, c)})
            print(f"{c}: generated in {record['generate_s']} s, HJD {record['hjd_s']} s, deleted", flush=True)

        D.on_main(note)


def _store_has(p: dict, c: str) -> bool:
    from frod_ds.formats.factor_store import MANIFEST, Manifest

    path = p["store"] / MANIFEST
    return path.is_file() and c in Manifest.read(path).completed_categories


def _store_summary(p: dict, c: str) -> dict:
    from frod_ds.formats.factor_store import MANIFEST, Manifest

    m = Manifest.read(p["store"] / MANIFEST)
    r = m.categories[c]
    return {
        "members": len(r.members),
        "width": r.width,
        "method": r.method,
        "max_error": r.max_error,
        "max_stored_error": r.max_stored_error,
        "seconds": r.seconds,
        "store_complete": m.complete,
        "peak_gpu_gib": max((x.peak_device_gib or 0 for x in m.run.ranks), default=None) if m.run else None,
    }


# ---- drivers: training, step times, QLoRA ---------------------------------------------------------------------------


def _launch(cmd: list[str], env: dict, log: Path, stop=None, timeout: float = 1e9) -> tuple[int, float]:
    """Run ``cmd`` (its own process group) with output to ``log``; ``stop()`` true → SIGKILL the group (the
    kill of the chain). Returns (exit code, seconds); 124 on ``timeout``, -9 when stopped."""
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with log.open("a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        while proc.poll() is None:
            if stop is not None and stop():
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return -9, time.perf_counter() - t0
            if time.perf_counter() - t0 > timeout:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return 124, time.perf_counter() - t0
            time.sleep(0.2)
    return proc.returncode, time.perf_counter() - t0


def _train_cmd(args, p: dict) -> list[str]:
    return [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--num_gpus",
        str(_gpus(args)),
        "--master_port",
        str(_free_port()),
        "launch/train.py",
        "--config",
        args.config,
        "--recipe",
        str(p["recipe"]),
    ]


def _metrics(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


def _need_store(p: dict) -> None:
    from frod_ds.model.store_reader import FactorStore

    FactorStore.open(p["store"])  # one line when missing or incomplete


def plan_prediction(args, p: dict, gpu_bytes: float | None) -> dict:
    """The memory planner's per-GPU prediction for the chain's training (config.json, recipe, DeepSpeed JSON)."""
    from frod_ds.config.ds_config import load_ds_config
    from frod_ds.config.recipe import load_recipe
    from frod_ds.plan.memory import plan_memory
    from frod_ds.plan.shapes import GiB as PG
    from frod_ds.plan.shapes import engine_from_ds_config, load_model_shape, train_shape_from_recipe

    recipe = load_recipe(p["recipe"], [], paths=False)
    plan = plan_memory(
        load_model_shape(str(p["model"])),
        train_shape_from_recipe(recipe),
        engine_from_ds_config(load_ds_config(args.config), args.config),
        _gpus(args),
        gpu_bytes or 79.1 * PG,
    )
    return {
        "allocated_gib": plan.allocated / PG,
        "needed_gib": plan.needed / PG,
        "fits": plan.fits,
        "parts_gib": {k: v / PG for k, v in plan.parts.items()},
    }


def _gpu_bytes() -> float | None:
    import torch

    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None


def train(args) -> None:
    """The run to ``--steps`` with a checkpoint at ``--save-at``, SIGKILLed once it has logged ``--kill-at``."""
    p = _paths(args)
    _need_store(p)
    write_recipe(args, p)
    out = p["work"] / "train"
    if (out / "killed.json").is_file():
        print(
            f"train: killed at step {json.loads((out / 'killed.json').read_text())['killed_after_step']} already; "
            "next: train-resume"
        )
        return
    ckpt = out / "checkpoints" / "latest_complete"

    def stop() -> bool:
        logged = max((r["step"] for r in _metrics(out)), default=0)
        return logged >= args.kill_at and ckpt.is_file() and ckpt.read_text().strip() == f"step{args.save_at:08d}"

    rc, s = _launch(_train_cmd(args, p), _env(args), p["out"] / "logs" / "train.log", stop, args.timeout_s)
    rows = _metrics(out)
    if rc != -9:
        raise ChainError(
            f"train: the run ended with exit {rc} before it was killed at step {args.kill_at} (logged "
            f"{len(rows)} steps; log {p['out'] / 'logs' / 'train.log'}); rerun train to go on"
        )
    (out / "metrics_before_kill.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    record = {"killed_after_step": max(r["step"] for r in rows), "wall_s": round(s, 1), "checkpoint": args.save_at}
    (out / "killed.json").write_text(json.dumps(record) + "\n")
    _result(p, "train_killed", {**record, "metrics": rows, "planner": plan_prediction(args, p, _gpu_bytes())})
    print(f"train: killed after step {record['killed_after_step']} ({s:.0f} s); checkpoint at step {args.save_at}")


def train_resume(args) -> None:
    """The killed run resumed (same command) to the end; its losses after the checkpoint against the killed run's,
    and the planner's prediction next to the measured peak."""
    p = _paths(args)
    out = p["work"] / "train"
    if not (out / "killed.json").is_file():
        raise ChainError("run train first (it is killed after its checkpoint; this resumes it)")
    rc, s = _launch(_train_cmd(args, p), _env(args), p["out"] / "logs" / "train_resume.log", None, args.timeout_s)
    if rc != 0:
        raise ChainError(f"train-resume: exit {rc}; log {p['out'] / 'logs' / 'train_resume.log'}")
    before = {r["step"]: r for r in _metrics_file(out / "metrics_before_kill.jsonl")}
    after = {r["step"]: r for r in _metrics(out)}
    overlap = sorted(k for k in before if k > args.save_at and k in after)
    rel = max(abs(after[k]["loss"] - before[k]["loss"]) / abs(before[k]["loss"]) for k in overlap) if overlap else None
    peak = max(r["peak_mem_gb"] for r in after.values())
    pred = plan_prediction(args, p, _gpu_bytes())
    steady = [r for k, r in sorted(after.items()) if k > args.save_at + 1]
    payload = {
        "steps": max(after),
        "resumed_from": args.save_at,
        "compared_steps": overlap,
        "max_rel_loss_diff": rel,
        "within_1e-3": rel is not None and rel <= 1e-3,
        "wall_s": round(s, 1),
        "peak_alloc_gib_rank0": peak,
        "peak_is": "torch.cuda.max_memory_allocated"
        if _gpu_bytes()
        else "host max RSS (CPU run: not comparable with the plan)",
        "planner": pred,
        "peak_over_prediction": peak / pred["allocated_gib"] if _gpu_bytes() else None,
        "step_s_median": _median([r["step_time_s"] for r in steady]),
        "tokens_per_s_per_gpu": _median([r["tokens_per_s"] / _gpus(args) for r in steady]),  # non-pad tokens
        "losses_killed_run": {k: before[k]["loss"] for k in sorted(before)},
        "losses": {k: after[k]["loss"] for k in sorted(after)},
    }
    _result(p, "train_resume", payload)
    print(
        f"train-resume: steps {args.save_at + 1}-{max(after)}; losses of steps {overlap[:1]}..{overlap[-1:]} vs the "
        f"killed run: max relative difference {rel:.2e}; peak {peak:.2f} GiB (rank 0; {payload['peak_is']}), planner "
        f"{pred['allocated_gib']:.2f} GiB allocated"
    )


def _metrics_file(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _median(xs: list[float]) -> float | None:
    import statistics

    return statistics.median(xs) if xs else None


def _step_name(args, method: str) -> str:
    """``seventy_b_step_<method>``, plus what differs from the chain's default run (2 GPUs, ``zero3.json``, U_i
    only): ``_<N>gpu``, ``_<config stem>``, ``_base``. From the arguments only, so the same command names its
    result the same way on any machine."""
    gpus = _gpus(args)
    config = Path(args.config).stem
    return (
        f"seventy_b_step_{method}"
        + (f"_{gpus}gpu" if gpus != 2 else "")
        + (f"_{config}" if config != "zero3" else "")
        + ("_base" if args.quantize_base and method == "frod" else "")
        + ("_bf16" if method == "lora" and args.quant == "none" else "")
    )


def _step_cmd(args, method: str, model: Path, extra: list[str]) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(_gpus(args)),
        "bench/train_step.py",
        "run",
        "--method",
        method,
        "--config",
        args.config,
        "--model",
        str(model),
        "--frozen-quant",
        args.quant,
        "--gc",
        "--batch",
        str(args.batch),
        "--seq",
        "256",
        "--out",
        str(_paths(args)["res"]),
        "--name",
        _step_name(args, method),
        *extra,
    ]
    return cmd + (
        ["--warmup", "1", "--steps", "2", "--repeats", "1"]
        if args.tiny
        else ["--warmup", "2", "--steps", str(args.step_steps), "--repeats", "2"]
    )


def step(args) -> None:
    """FRoD's step time and peak in ``bench/train_step.py`` (the harness QLoRA is timed in): NF4 U_i, ``--config``
    (ZeRO-3 by default), gradient checkpointing, ``--batch`` × 256 random tokens per GPU; ``--gpus 1
    --quantize-base --config ds_configs/zero2.json`` is the whole model on one GPU (its own result file)."""
    p = _paths(args)
    _need_store(p)
    name = _step_name(args, "frod")
    log = p["out"] / "logs" / f"{name.removeprefix('seventy_b_')}.log"
    extra = ["--factors", str(p["store"])] + (["--quantize-base"] if args.quantize_base else [])
    rc, s = _launch(_step_cmd(args, "frod", p["model"], extra), _env(args), log, None, args.timeout_s)
    if rc != 0:
        raise ChainError(f"step: exit {rc}; log {log}")
    _copy_out(p, p["res"] / f"{name}.json")
    print(f"step: FRoD timed in {s:.0f} s: {p['res'] / f'{name}.json'}")


def qlora_gen(args) -> None:
    """Under the launcher: every targeted weight regenerated into ``--shm`` (each rank its layers), and
    ``WORK/qlora-model``: links to the untargeted shards and to these, with their index (a full bf16 checkpoint)."""
    from frod_ds.runtime import distributed as D

    p, shape = _paths(args), _shape(args)
    shm, qdir = Path(args.shm or p["work"] / "qlora-shm"), p["work"] / "qlora-model"
    device = D.local_device()
    D.on_main(lambda: _check_chain(args, p, device.type))
    D.on_main(lambda: shm.mkdir(parents=True, exist_ok=True))
    rank, world = D.get_rank(), D.get_world_size()
    names = [
        n
        for c in TARGETS
        for n in category_names(shape, c)
        if int(n[0].split(".")[2]) in set(_my_layers(shape.layers, rank, world))
    ]
    weight_map = {}
    for j, group in enumerate(split_files(names, FILE_BYTES)):
        fname = f"model-targets-r{rank}-{j:03d}.safetensors"
        write_shard(shm / fname, group, args.seed, device)
        weight_map.update({n: fname for n, _ in group})
    maps = D.all_gather_object(weight_map)

    def assemble() -> None:
        shutil.rmtree(qdir, ignore_errors=True)
        qdir.mkdir(parents=True)
        base = json.loads((p["model"] / "model.safetensors.index.json").read_text())["weight_map"]
        for f in p["model"].iterdir():
            if f.name != "model.safetensors.index.json":
                (qdir / f.name).symlink_to(f.resolve())
        for f in {v for m in maps for v in m.values()}:
            (qdir / f).symlink_to((shm / f).resolve())
        add_to_index(qdir, {**base, **{k: v for m in maps for k, v in m.items()}})
        from frod_ds.io.hf_checkpoint import HFCheckpoint
        from frod_ds.model.store_reader import FactorStore, check_store_matches

        if not (p["store"] / "manifest.json").is_file():  # a QLoRA-only work dir: nothing to check against
            print(
                f"qlora-gen: no factor store in {p['work']}: the weights are regenerated from seed {args.seed}, "
                "not checked against a store",
                flush=True,
            )
            return
        check_store_matches(FactorStore.open(p["store"]), HFCheckpoint(qdir))  # the very weights HJD decomposed
        print(f"qlora-gen: {qdir} holds the weights the factor store was built from (fingerprint matches)", flush=True)

    D.on_main(assemble)


def _lora_step(args, quantize_base: bool) -> None:
    """PEFT LoRA r=16 in the harness FRoD's ``step`` used, on the targeted weights regenerated into ``--shm`` (a
    2-GPU machine's disk cannot hold them beside the rest), then the regenerated weights deleted (unless ``--keep``).
    ``quantize_base``: QLoRA (NF4 base, bitsandbytes' quant_storage bf16); else LoRA on the bf16 base (``--quant
    none``), the like-for-like baseline of a bf16 FRoD run under the same ``--config``."""
    p = _paths(args)
    shm = Path(args.shm or p["work"] / "qlora-shm")
    what = "qlora" if quantize_base else "lora"
    try:
        gen = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(_gpus(args)),
            str(Path(__file__).resolve()),
            "qlora-gen",
            "--work",
            str(p["work"]),
            "--out",
            str(p["out"]),
            "--seed",
            str(args.seed),
            "--shm",
            str(shm),
            "--shape",
            args.shape,
            "--layers",
            str(args.layers),
        ]
        rc, s_gen = _launch(gen, _env(args), p["out"] / "logs" / f"{what}_gen.log", None, args.timeout_s)
        if rc != 0:
            raise ChainError(f"{what}: generating the targeted weights failed (exit {rc}); log {p['out'] / 'logs'}")
        log = p["out"] / "logs" / f"step_{what}.log"
        rc, s = _launch(
            _step_cmd(args, "lora", p["work"] / "qlora-model", ["--quantize-base"] if quantize_base else []),
            _env(args),
            log,
            None,
            args.timeout_s,
        )
        if rc != 0:
            raise ChainError(f"{what}: exit {rc}; log {log}")
        result = p["res"] / f"{_step_name(args, 'lora')}.json"
        _copy_out(p, result)
        print(f"{what}: weights regenerated in {s_gen:.0f} s, timed in {s:.0f} s: {result}")
    finally:
        if not args.keep:
            shutil.rmtree(shm, ignore_errors=True)
            shutil.rmtree(p["work"] / "qlora-model", ignore_errors=True)


def qlora(args) -> None:
    """QLoRA r=16 (NF4 base) in FRoD's ``step`` harness (see ``_lora_step``)."""
    _lora_step(args, quantize_base=True)


def lora(args) -> None:
    """LoRA r=16 on the bf16 base in FRoD's ``step`` harness, under the same ``--config`` (``--quant none`` chains)."""
    if args.quant != "none":
        raise ChainError(
            "lora times LoRA on the bf16 base, the baseline of a --quant none chain; for an NF4 chain run qlora"
        )
    _lora_step(args, quantize_base=False)


def plot_resume(d: dict, png: Path) -> Path:
    """The killed run's losses and the resumed run's, one plot (``train_resume``'s record)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    after = sorted((int(k), v) for k, v in d["losses"].items() if int(k) > d["resumed_from"])
    ax.plot(
        *zip(*sorted((int(k), v) for k, v in d["losses_killed_run"].items())),
        "o-",
        color="0.55",
        label="run killed after its checkpoint",
    )
    ax.plot(*zip(*after), "x-", color="C3", label=f"resumed from step {d['resumed_from']}")
    ax.axvline(d["resumed_from"], color="0.8", lw=1, ls="--")
    rel = d.get("max_rel_loss_diff")
    ax.set(
        xlabel="optimizer step",
        ylabel="training loss",
        title=d.get("device", "") + (f"; resumed vs killed: max rel. diff {rel:.1e}" if rel is not None else ""),
    )
    ax.title.set_fontsize(9)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.legend(frameon=False)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def report(args) -> None:
    """One table of what the chain measured, from the step JSONs in ``WORK/results`` (every call's)."""
    from bench.planner_check import check as check_planner

    p = _paths(args)
    load = {
        f.stem.removeprefix("seventy_b_"): json.loads(f.read_text())
        for f in sorted(p["res"].glob("seventy_b_*.json"))
        if f.stem.removeprefix("seventy_b_").startswith(("step_", "train_resume"))
    }
    rows = [
        "| run | step (median) | tok/s per GPU | peak alloc GiB (highest rank; training: rank 0) "
        "| planner alloc GiB | MFU | GFLOP/token |",
        "|---|---|---|---|---|---|---|",
    ]
    for n in sorted(k for k in load if k.startswith("step_")):
        d = load[n]
        quant = d.get("frozen_quant", "nf4")
        if d.get("method") == "lora":
            label = (
                "QLoRA r=16, NF4 base"
                if d.get("quantize_base")
                else f"LoRA r=16, {'bf16' if quant == 'none' else quant.upper()} base"
            )
        else:
            label = f"FRoD s=0.02, {'bf16' if quant == 'none' else quant.upper()} U_i" + (
                " and base" if d.get("quantize_base") else ""
            )  # the base takes U_i's quantization
        mfu = f"{d['mfu'] * 100:.1f}%" if d.get("mfu") else "n/a"
        peak = f"{d['peak_allocated_gib']:.1f}" if d.get("peak_allocated_gib") else "n/a"
        checked = check_planner({**d, "_file": n}) if d.get("method") == "frod" else None
        planned = f"{checked['predicted_gib']:.1f}" if checked else "–"
        rows.append(
            f"| {label} ({d['engine']}, gc, {d['world_size']} GPU(s), bench/train_step.py) | "
            f"{d['step_s_median'] * 1e3:.0f} ms | {d['tokens_per_s_per_gpu']:,.0f} | {peak} | {planned} | {mfu} "
            f"| {d['flops_per_token']['total'] / 1e9:.4g} |"
        )
    d = load.get("train_resume")
    if d:
        peak = f"{d['peak_alloc_gib_rank0']:.1f}" if "cuda" in d.get("peak_is", "") else "n/a"
        rows.append(
            f"| FRoD training (launch/train.py, recipe batches ≤ 256 tokens) | {d['step_s_median'] * 1e3:.0f} ms "
            f"| {d['tokens_per_s_per_gpu']:,.0f} (non-pad) | {peak} | {d['planner']['allocated_gib']:.1f} | – | – |"
        )
    frod = load.get("step_frod")
    qloras = [d for d in load.values() if d.get("method") == "lora" and frod and d["world_size"] == frod["world_size"]]
    best = min(qloras, key=lambda d: d["step_s_median"]) if qloras else None  # QLoRA's fastest on FRoD's GPUs
    summary = {
        "baseline": (
            ("QLoRA r=16, NF4 base" if best.get("quantize_base") else "LoRA r=16, bf16 base")
            + f", {best['engine']}, {best['world_size']} GPU(s)"
        )
        if best
        else None,
        "qlora_best": {
            "engine": best["engine"],
            "gradient_checkpointing": best["gradient_checkpointing"],
            "layer_passes_per_step": best.get("layer_passes_per_step"),
        }
        if best
        else None,
        "frod_step_over_qlora_best": frod["step_s_median"] / best["step_s_median"] if best else None,
        "flops_frod_over_qlora": frod["flops_per_token"]["total"] / best["flops_per_token"]["total"] if best else None,
        "resume_max_rel_loss_diff": load.get("train_resume", {}).get("max_rel_loss_diff"),
        "train_peak_over_planner": load.get("train_resume", {}).get("peak_over_prediction"),
    }
    table = "\n".join(rows) + "\n"
    if d:
        _copy_out(p, plot_resume(d, p["res"] / "seventy_b_resume_losses.png"))
    _result(p, "report", {"table_md": table, "summary": summary, "chain": _chain(p)})
    print(table + json.dumps(summary, indent=1))


# ---- CLI ------------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    sub = ap.add_subparsers(dest="cmd", required=True)
    cmds = {
        "gen-untargeted": "under a launcher: the untargeted tensors, config, data, tokenizer, recipe",
        "category": "under a launcher: per category, generate → HJD into the NF4 store → delete",
        "train": "deepspeed launch/train.py until killed after its checkpoint",
        "train-resume": "the killed run resumed; losses vs the killed run, planner vs peak",
        "step": "FRoD step time (bench/train_step.py)",
        "qlora": "QLoRA step time in the same harness (targeted weights regenerated into --shm)",
        "lora": "LoRA r=16 on the bf16 base in the same harness and --config (--quant none chains)",
        "qlora-gen": "under a launcher: the targeted weights into --shm (qlora runs it)",
        "report": "the table of the chain's results",
    }
    for name, text in cmds.items():
        s = sub.add_parser(name, help=text, description=text)
        s.add_argument("--work", required=True, help="work dir: model, store, data, recipe, runs, chain.json")
        s.add_argument("--out", default=None, help="results dir (default WORK/results; $OUT on the GPU machine)")
        s.add_argument(
            "--shape",
            choices=list(SHAPES),
            default="70b",
            help="70b: LLaMA-2-70B (80 layers, 8192/28672, 64/8 heads, vocab 32000); 7b: LLaMA-2-7B, the "
            "one-GPU rehearsal; tiny: 4 layers, hidden 64, the CPU rehearsal",
        )
        s.add_argument(
            "--layers",
            type=int,
            default=0,
            help="decoder layers instead of the shape's (e.g. 70B widths on one GPU: --shape 70b --layers 24)",
        )
        s.add_argument("--tiny", dest="shape", action="store_const", const="tiny", help="--shape tiny")
        s.add_argument("--seed", type=int, default=0, help="seed of the generated weights")
        s.add_argument("--quant", choices=["nf4", "int8", "none"], default="nf4", help="U_i in the store and training")
        s.add_argument("--gpus", type=int, default=0, help="ranks for the drivers (default: every GPU; CPU: 2)")
        s.add_argument("--config", default="ds_configs/zero3.json", help="DeepSpeed JSON of train and the step runs")
        s.add_argument("--batch", type=int, default=4, help="micro-batch per GPU")
        s.add_argument("--steps", type=int, default=24, help="optimizer steps of the training run")
        s.add_argument("--save-at", type=int, default=12, help="checkpoint interval (the one resumed from)")
        s.add_argument("--kill-at", type=int, default=18, help="train: SIGKILL once this step is logged")
        s.add_argument("--step-steps", type=int, default=5, help="step/qlora: timed steps per window (2 windows)")
        s.add_argument("--timeout-s", type=float, default=560, help="drivers: kill the child after this long")
        s.add_argument(
            "--shm",
            default=None,
            help="qlora: where the regenerated targeted weights go "
            "(default WORK/qlora-shm; on the 2-GPU machine /dev/shm/...)",
        )
        s.add_argument("--keep", action="store_true", help="qlora: keep the regenerated weights")
        s.add_argument(
            "--quantize-base",
            action="store_true",
            help="step: the untargeted linears in NF4 too (model.quantize_base), e.g. the one-GPU run",
        )
        if name == "gen-untargeted":
            s.add_argument("--data", required=True, help="LLM-Adapters' dataset folder, or a data_prep output dir")
        if name == "category":
            s.add_argument("names", nargs="+", help=f"categories, in this order ({', '.join(TARGETS)})")
    args = ap.parse_args(argv)
    args.tiny = args.shape == "tiny"
    if not 0 < args.save_at < args.kill_at < min(2 * args.save_at, args.steps + 1):
        ap.error(
            f"need 0 < --save-at < --kill-at < min(2 x --save-at, --steps + 1), got {args.save_at}, "
            f"{args.kill_at}, {args.steps}"
        )
    return args


LAUNCHED = {"gen-untargeted": gen_untargeted, "category": category, "qlora-gen": qlora_gen}
DRIVERS = {"train": train, "train-resume": train_resume, "step": step, "qlora": qlora, "lora": lora, "report": report}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.tiny and (args.steps, args.save_at, args.kill_at) == (24, 12, 18):  # the defaults: a shorter run
        args.steps, args.save_at, args.kill_at = 8, 4, 6
    from frod_ds.runtime import entry

    if args.cmd in LAUNCHED:
        return entry.run(lambda: LAUNCHED[args.cmd](args))
    return entry.run(lambda: DRIVERS[args.cmd](args), init_group=False)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Files are written and closed and the process group is gone: skip the interpreter's teardown, where a
    # library thread left joinable (gloo, the tokenizer trainer) can abort the process after a finished step.
    os._exit(code)
