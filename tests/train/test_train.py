"""DeepSpeed training (CPU, gloo, 2 ranks): loss, partitioning, applied LRs, adapter round trip, ZeRO-2 = ZeRO-3,
exact resume after kill -9, SIGTERM checkpoint, and bad inputs refused before training."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.support import pace
from tests.support.helpers_ckpt import hjd_in_process
from tests.support.train_env import (
    CPU_ZERO2,
    CPU_ZERO3,
    REPO,
    build_env,
    env_vars,
    metrics,
    run_train,
    train_cmd,
    train_in_process,
)

pytestmark = pytest.mark.slow
PROBE = REPO / "tests" / "support" / "train_probe.py"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return build_env(tmp_path_factory.mktemp("trainenv"))


@pytest.fixture(scope="module")
def probe(env, tmp_path_factory):
    """One uninterrupted 2-rank run under DeepSpeed's own ZeRO-3 with constant LR, inspected from inside
    (train_probe.py); the layer partition zero3.json gets by default: tests/train/test_zero3_layers.py."""
    out = tmp_path_factory.mktemp("probe")
    res = run_train(
        CPU_ZERO3,
        env.overrides(
            out,
            **{
                "train.max_steps": 8,
                "train.schedule": "constant",
                "train.warmup_ratio": 0.0,
                "train.save_every": 4,
                "train.rotation_every": 4,
                "train.eval_every": 4,
                "train.zero3_partition": "deepspeed",
                "data.eval": env.data / "eval" / "boolq.jsonl",
            },
        ),
        script=PROBE,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return out, [json.loads((out / f"probe_rank{r}.json").read_text()) for r in (0, 1)]


def test_zero3_training_loss_decreases(probe):
    out, _ = probe
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(2, 9)), "metrics.jsonl: one row per logged step"
    first, last = rows[0]["loss"], rows[-1]["loss"]
    assert last < first - 0.2, (first, last)
    for key in ("loss", "lr_sigma", "lr_s", "grad_norm", "tokens_per_s", "peak_mem_gb"):
        assert all(isinstance(r[key], float) for r in rows), key
    with_rot = [r for r in rows if "tan_alpha" in r]
    assert [r["step"] for r in with_rot] == [4, 8]
    assert set(with_rot[-1]["tan_alpha"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"}
    assert all(v > 0 for v in with_rot[-1]["tan_alpha"].values())
    assert (out / "loss.png").stat().st_size > 1000
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in evals] == [4, 8]


def test_frozen_factors_partitioned_without_grad_or_optimizer_state(probe):
    _, reports = probe
    for rep in reports:
        assert rep["zero3"]
        for name, p in rep["partition"].items():
            assert 0 < p["U_local"] < p["U_full"], (name, p)
            assert 0 < p["V_local"] < p["V_full"], (name, p)
            assert p["V_persist"], f"{name}: the shared V is held whole on every rank (build.replicate_shared_v)"
        assert rep["leaf_decoder_layers"] == rep["decoder_layers"] > 0 and rep["leaf_other"] == 0, (
            "each decoder layer, and nothing else, is one ZeRO-3 fetch unit (build.fetch_per_layer)"
        )
        assert rep["u_parameters"] == rep["decoder_layers"], "one frozen U Parameter per decoder layer (FRoDFrozen)"
        assert rep["fixed_walks"] == {
            "modules": rep["decoder_layers"] + 1,
            "used": rep["decoder_layers"] + 1,
            "same": True,
        }, "DeepSpeed's parameter walks replayed, and still right after fit"
        assert rep["shared_v"]
        assert rep["frozen_grads_none"]
        assert not rep["frozen_in_optimizer"]
        assert rep["trainable_leaves"] == ["frod_s", "frod_sigma"]
        assert rep["param_dtypes"] == ["torch.float32"], "model.dtype=float32 must hold under zero.Init"


def test_applied_learning_rates_are_the_recipes(probe):
    """AdamW's first step moves each entry by lr·g/(|g|+eps) ≈ lr: recover each group's applied LR."""
    _, reports = probe
    first = reports[0]["first_step"]
    assert first["logged_lr_sigma"] == pytest.approx(1e-2) and first["logged_lr_s"] == pytest.approx(1e-3)
    assert first["median_abs_dsigma"] == pytest.approx(1e-2, rel=1e-3)
    assert first["median_abs_ds"] == pytest.approx(1e-3, rel=1e-3)
    assert first["frac_sigma_moved"] > 0.9


def test_adapter_checkpoint_content_and_round_trip(probe, env):
    """Saved σ/S are the trained values (not empty ZeRO-3 shards); a fresh model loads them to the same logits."""
    from frod_ds.model.adapter import load_frod_model, read_adapter

    out, _ = probe
    assert (out / "adapter-4").is_dir() and (out / "adapter-final").is_dir()
    tensors, cfg = read_adapter(out / "adapter-final")
    store_init = load_file(str(next((env.store).glob("q_proj.rank*.safetensors"))))
    assert cfg.step == 8 and cfg.base_model == str(env.model)
    sigmas = {k: v for k, v in tensors.items() if k.endswith(".frod_sigma")}
    s_vals = {k: v for k, v in tensors.items() if k.endswith(".frod_s")}
    assert len(sigmas) == len(s_vals) == 2 * 6
    assert all(v.numel() == 32 for v in sigmas.values())
    nnz = round(0.1 * 32 * 32)
    assert all(v.numel() == nnz and v.abs().sum() > 0 for v in s_vals.values()), "S values trained, not empty"
    k0 = "model.layers.0.self_attn.q_proj"
    if f"{k0}.sigma" in store_init:
        assert not torch.equal(sigmas[f"{k0}.frod_sigma"], store_init[f"{k0}.sigma"].float()), "σ moved"
    assert tensors["q_proj.support"].shape == (2, nnz)

    model, _ = load_frod_model(out / "adapter-final")
    ids = torch.arange(3, 3 + 2 * 12).reshape(2, 12) % model.config.vocab_size
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    assert torch.allclose(logits, torch.load(out / "probe_logits.pt"), atol=1e-5, rtol=1e-5)

    # The held-out loss logged at the last step, recomputed with plain forwards of the loaded model.
    from frod_ds.train.data import collate, encode_examples, read_training_rows

    tok = __import__("transformers").AutoTokenizer.from_pretrained(str(env.model))
    examples = encode_examples(tok, read_training_rows(env.data / "eval" / "boolq.jsonl"), 64, False)
    total = count = 0.0
    with torch.no_grad():
        for ex in examples:
            b = collate([ex], tok.pad_token_id or 0)
            n = float((b["labels"][:, 1:] != -100).sum())
            total += float(model(**b).loss) * n
            count += n
    logged = [r for r in metrics(out) if "eval_loss" in r][-1]["eval_loss"]
    assert logged == pytest.approx(total / count, rel=1e-4)


ONE_STEP = {"train.max_steps": 1, "train.schedule": "constant", "train.warmup_ratio": 0.0}


@pytest.fixture(scope="module")
def one_step_zero3(env, tmp_path_factory):
    """One step under zero3.json's layer partition on 2 ranks, told they have a GPU (no hint is printed without
    one), the DeepSpeed config the planner's hint was given kept as ``hint_config`` (rank 0's), and the base
    factor store's U_i each rank's build read as ``u_read``."""
    from frod_ds.cli import train
    from frod_ds.plan import recommend
    from frod_ds.train import trainer

    out, seen = tmp_path_factory.mktemp("z3"), tmp_path_factory.mktemp("spies")
    hint, build = recommend.train_hint, trainer.build_layer_partitioned

    def spy_hint(recipe, ds_config, *args, **kwargs):
        if os.environ.get("RANK") == "0":
            (seen / "config.json").write_text(json.dumps(ds_config))
        return hint(recipe, ds_config, *args, **kwargs)

    def spy_build(ckpt, store, *args, **kwargs):
        names: list[str] = []
        load_u = store.load_U
        store.load_U = lambda name: names.append(name) or load_u(name)  # this store object only
        model = build(ckpt, store, *args, **kwargs)
        (seen / f"read{os.environ['RANK']}").write_text(json.dumps(names))
        return model

    with pytest.MonkeyPatch.context() as mp:  # the ranks are forked from this process (tests/support/ranks.py)
        mp.setattr(train, "gpu_memory", lambda: 80 * 2**30)
        mp.setattr(recommend, "train_hint", spy_hint)
        mp.setattr(trainer, "build_layer_partitioned", spy_build)
        res = run_train(CPU_ZERO3, env.overrides(out, **ONE_STEP))
    assert res.returncode == 0, res.stderr[-3000:]
    read = [json.loads((seen / f"read{r}").read_text()) for r in (0, 1)]
    hint_config = json.loads((seen / "config.json").read_text())
    return {**metrics(out)[0], "hint_config": hint_config, "u_read": read, "stdout": res.stdout}


def test_each_rank_reads_about_its_share_of_the_frozen_factors(one_step_zero3, env):
    """Under the layer partition a rank keeps 1/N of each decoder layer's frozen tensors and reads only those its
    span touches (it read them all, then kept its share): on 2 ranks each U_i is read by one rank, but for one
    per layer that straddles their spans; together they read every one."""
    from frod_ds.model.store_reader import FactorStore

    store = FactorStore.open(env.store)
    every = {f"{m}" for c in store.categories for m in store.categories[c]}
    read = one_step_zero3["u_read"]
    assert all(len(r) == len(set(r)) for r in read), read
    assert set(read[0]) | set(read[1]) == every, (read, every)
    layers = 2  # the env's; a U_i straddling the two ranks' spans of a layer is read by both
    assert len(read[0]) + len(read[1]) <= len(every) + layers, (read, len(every))


def test_the_gather_line_names_the_groups_backend(one_step_zero3):
    """CPU ranks gather over gloo, whatever the run was told about GPUs (the line said NCCL)."""
    assert "frozen weights: 1/2 per rank by decoder layer, gathered by gloo all-gathers" in one_step_zero3["stdout"]


def test_zero3_hint_plans_the_layer_partition(one_step_zero3):
    """The trainer runs σ and S under a stage-2 engine, but its hint plans what the user's zero3.json does, as
    ``frod plan`` does: frozen weights partitioned by decoder layer (it planned them replicated, and at 70B on 4
    GPUs said "likely out of memory")."""
    from frod_ds.plan.shapes import engine_from_ds_config

    engine = engine_from_ds_config(one_step_zero3["hint_config"])
    assert (engine.stage, engine.layers) == (3, True)


FOUR_STEPS = {**ONE_STEP, "train.max_steps": 4}


@pytest.fixture(scope="module")
def zero2_four_steps(env, tmp_path_factory):
    """Four constant-LR steps under ZeRO-2 on 2 ranks, the reference of the ZeRO-3 comparisons. Its first step is
    a one-step run's: the batch order does not depend on ``max_steps`` (``BatchPlan``) and the LR is constant."""
    out = tmp_path_factory.mktemp("z2")
    res = run_train(CPU_ZERO2, env.overrides(out, **FOUR_STEPS))
    assert res.returncode == 0, res.stderr[-3000:]
    return [r for r in metrics(out) if "loss" in r]


def test_zero2_and_zero3_give_same_first_step_loss(one_step_zero3, zero2_four_steps):
    z2 = zero2_four_steps[0]
    assert z2["step"] == one_step_zero3["step"] == 1
    assert z2["loss"] == pytest.approx(one_step_zero3["loss"], rel=1e-5, abs=1e-6)
    assert z2["grad_norm"] == pytest.approx(one_step_zero3["grad_norm"], rel=1e-4)


@pytest.mark.parametrize("partition", ["deepspeed", "layers", "auto-offload", "auto-offload-optimizer"])
def test_zero3_layout_trains_like_zero2_step_by_step(env, zero2_four_steps, tmp_path, partition):
    """Both ZeRO-3 layouts against ZeRO-2 on the same 2 ranks, fp32, over 4 optimizer steps (so the updates, not only
    the first forward, agree). DeepSpeed's (each decoder layer one fetch unit, every V replicated, and here σ and S
    partitioned too: persistence threshold 0): every step's loss within 1e-6 relative and its gradient norm within
    1e-5. The layer partition (frozen weights gathered by frod-ds, σ and S under ZeRO-2), its shards on the device
    or, with ``offload_param`` to the CPU (which ``auto`` takes into the layer partition), in host memory: the same
    numbers, bitwise. ``zero3_offload.json``'s shape (the optimizer on the CPU too, under ZeRO-2, stepped by torch's
    AdamW on a machine without a GPU): within 1e-6 relative."""
    cfg = json.loads(CPU_ZERO3.read_text())
    cfg["zero_optimization"].update(stage3_param_persistence_threshold=0)
    if partition.startswith("auto-offload"):
        cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    if partition == "auto-offload-optimizer":  # on a GPU-less machine torch's AdamW steps it (no C++ build)
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    z3_config = tmp_path / "zero3_nothing_persistent.json"
    z3_config.write_text(json.dumps(cfg))
    layout = {"train.zero3_partition": partition.split("-")[0]}
    res = run_train(z3_config, env.overrides(tmp_path / "z3", **FOUR_STEPS, **layout))
    assert res.returncode == 0, res.stderr[-3000:]
    host_line = "frozen weights: shards in host memory (offload_param)"
    assert (host_line in res.stdout + res.stderr) == partition.startswith("auto-offload"), res.stderr[-3000:]
    torch_adamw = "note: the offloaded optimizer steps with torch's AdamW"
    assert (torch_adamw in res.stdout + res.stderr) == (partition == "auto-offload-optimizer"), res.stderr[-3000:]
    rows = {"z3": [r for r in metrics(tmp_path / "z3") if "loss" in r], "z2": zero2_four_steps}
    assert [r["step"] for r in rows["z3"]] == [r["step"] for r in rows["z2"]] and len(rows["z3"]) == 4
    for a, b in zip(rows["z3"], rows["z2"]):
        if partition in ("layers", "auto-offload"):
            assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"]), (a, b)
        else:
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-6), (a, b)
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), (a, b)


def test_gradient_checkpointing_under_zero3_gives_the_same_step(one_step_zero3, env, tmp_path):
    """The trainer's (non-reentrant) checkpointing with frozen U/V: same loss and gradient norm as without it. The
    run also asks for its phase times, and profiles its one step: the times account for the step's time (less the
    metrics' all-reduce), the profile names the engine's calls, and neither changes a number."""
    extra = {"model.gradient_checkpointing": "true", "train.phase_times": "true", "train.profile_step": "1"}
    res = run_train(CPU_ZERO3, env.overrides(tmp_path / "gc", **ONE_STEP, **extra))
    assert res.returncode == 0, res.stderr[-3000:]
    gc = metrics(tmp_path / "gc")[0]
    assert gc["loss"] == pytest.approx(one_step_zero3["loss"], rel=1e-5, abs=1e-6)
    assert gc["grad_norm"] == pytest.approx(one_step_zero3["grad_norm"], rel=1e-4)
    assert gc["grad_norm"] > 0
    phases = ("data_s", "forward_s", "backward_s", "optimizer_s")
    assert not any(k in one_step_zero3 for k in phases)
    assert all(gc[k] > 0 for k in phases) and 0.5 * gc["step_time_s"] < sum(gc[k] for k in phases) <= gc["step_time_s"]
    names = sorted(p.name for p in (tmp_path / "gc" / "profile").iterdir())  # one per rank
    assert names == [f"step-000001.rank{r}.txt" for r in range(len(names))] and len(names) >= 1
    text = (tmp_path / "gc" / "profile" / names[-1]).read_text()
    assert text.startswith(f"rank {len(names) - 1}, optimizer step 1: ")
    assert "by cumulative" in text and "by tottime" in text, text[:3000]
    engine = text.split("=== the engine's forward, backward and step ===")[1]
    assert all("engine.py:" in line for line in engine.splitlines() if "(forward)" in line or "(step)" in line)
    assert "(forward)" in engine and "(backward)" in engine and "(step)" in engine, engine


def test_a_profile_step_past_the_run_is_named_and_profiles_nothing(env, tmp_path):
    """Then the same command on the finished run: its line says no step is profiled, and it draws loss.png where
    the run was stopped while drawing it (round 23: the run stayed without its plot for good)."""
    res = run_train(CPU_ZERO3, env.overrides(tmp_path / "p", **ONE_STEP, **{"train.profile_step": "3"}))
    assert res.returncode == 0, res.stderr[-3000:]
    said = "train.profile_step 3 is not among the steps this run takes (1 to 1): no step is profiled"
    assert said in res.stderr and not (tmp_path / "p" / "profile").exists()
    # the same command on the finished run: no step runs, which the finished-run line says of the profile; a plot
    # the run was stopped while drawing (its temporary left, no loss.png) is drawn now
    (tmp_path / "p" / "loss.png").unlink()
    (tmp_path / "p" / "loss.png.frod-tmp").write_bytes(b"")
    again = run_train(CPU_ZERO3, env.overrides(tmp_path / "p", **ONE_STEP, **{"train.profile_step": "1"}))
    assert again.returncode == 0, again.stderr[-3000:]
    said = "adapter-final left as it is; no step runs, so train.profile_step 1 profiles none"
    assert said in again.stdout + again.stderr and not (tmp_path / "p" / "profile").exists()
    assert (tmp_path / "p" / "loss.png").read_bytes()[:4] == b"\x89PNG" and not (
        tmp_path / "p" / "loss.png.frod-tmp"
    ).exists()


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 240) -> None:
    t0 = time.time()
    while not path.exists():
        assert proc.poll() is None, "training ended before the checkpoint appeared"
        assert time.time() - t0 < pace.scaled(timeout), f"{path} did not appear"
        time.sleep(0.05)


def _wait_until_reaped(group: int, timeout: float = 30) -> None:
    """Until no process of process group ``group`` is left, zombies included: the orphaned ranks of a killed
    launcher are reaped by init, not by this process."""
    t0 = time.time()
    while True:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return
        assert time.time() - t0 < pace.scaled(timeout), f"process group {group} still has processes after kill -9"
        time.sleep(0.05)


def test_resume_after_kill9_equals_uninterrupted(env, tmp_path):
    """kill -9 of the launcher and both ranks after a checkpoint; the same command resumes from it (warm-up and
    cosine schedule, optimizer and data order restored) and ends with the uninterrupted run's adapter, bitwise."""
    common = {"train.max_steps": 6, "train.save_every": 2, "train.warmup_ratio": 0.25, "train.schedule": "cosine"}
    ref = run_train(CPU_ZERO3, env.overrides(tmp_path / "ref", **common))
    assert ref.returncode == 0, ref.stderr[-3000:]

    out = tmp_path / "killed"
    cmd = train_cmd(CPU_ZERO3, env.overrides(out, **common))
    proc = subprocess.Popen(
        cmd, env=env_vars(), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    _wait_for(out / "checkpoints" / "latest_complete", proc)
    os.killpg(proc.pid, signal.SIGKILL)  # kill -9 the launcher and both ranks
    proc.wait()
    _wait_until_reaped(proc.pid)  # until then rank 0 still holds the output's lease (the resume would be refused)
    assert not (out / "adapter-final").exists()
    killed_at = (out / "checkpoints" / "latest_complete").read_text()
    adapter = f"adapter-{int(killed_at.removeprefix('step'))}"
    shutil.rmtree(out / adapter, ignore_errors=True)  # killed before the save published it, after the seal
    res = run_train(CPU_ZERO3, env.overrides(out, **common))  # the same command line, its ranks forked from here
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"resumed from {killed_at}" in res.stdout + res.stderr, killed_at
    assert f"{out / adapter} is missing" in res.stderr, res.stderr[-3000:]
    for name in (adapter, "adapter-final"):  # the resume wrote the missing one, as the uninterrupted run did
        got, want = (load_file(str(d / name / "adapter.safetensors")) for d in (out, tmp_path / "ref"))
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got), name

    steps = [r["step"] for r in metrics(out)]
    assert steps == list(range(1, 7)), "rows of replayed steps are dropped on resume"
    a = load_file(str(tmp_path / "ref" / "adapter-final" / "adapter.safetensors"))
    b = load_file(str(out / "adapter-final" / "adapter.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs after resume (bitwise)"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_sigterm_writes_checkpoint_then_exits(env, tmp_path, sig):
    """SIGTERM (what Slurm sends before preemption) and Ctrl-C: a checkpoint and an adapter at the step reached,
    then exit 128 + the signal, with a line saying so (Ctrl-C printed a traceback and saved nothing)."""
    out = tmp_path / "term"
    cmd = train_cmd(CPU_ZERO3, env.overrides(out, **{"train.max_steps": 400, "train.save_every": 0}))
    proc = subprocess.Popen(
        cmd,
        env=env_vars(),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    _wait_for(out / "metrics.jsonl", proc)
    os.killpg(proc.pid, sig)
    _, err = proc.communicate(timeout=pace.scaled(120))
    assert proc.returncode == 128 + sig, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    tag = (out / "checkpoints" / "latest_complete").read_text()
    step = int(tag.removeprefix("step"))
    assert 0 < step < 400
    assert (out / f"adapter-{step}" / "adapter.safetensors").is_file()
    assert (out / "checkpoints" / tag / "COMPLETE").is_file()
    # the stop line on stderr, where every command's goes, naming the step of the checkpoint written
    assert f"{signal.Signals(sig).name}: checkpoint saved at step {step}; re-run" in err, err[-3000:]


# ---- bad inputs: a clear one-line error and exit 2, before any training ------------------------------


def _bad_run(env, tmp_path, config=CPU_ZERO3, **extra):
    out = tmp_path / "bad"
    return train_in_process(config, env.overrides(out, **extra)), out


def _assert_refused(res, out, *needles):
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    err_lines = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(err_lines) == 1, res.stderr[-2000:]
    for needle in needles:
        assert needle in err_lines[0], err_lines[0]
    assert not (out / "metrics.jsonl").exists() and not (out / "adapter-final").exists()


def test_unknown_recipe_key_is_refused(env, tmp_path):
    res, out = _bad_run(env, tmp_path, **{"train.learning_rate": 1e-4})
    _assert_refused(res, out, "unknown key 'train.learning_rate'", "train.lr_sigma")


def test_unresolved_auto_is_refused(env, tmp_path):
    cfg = json.loads(CPU_ZERO3.read_text())
    cfg["zero_optimization"]["reduce_bucket_size"] = "auto"
    path = tmp_path / "auto.json"
    path.write_text(json.dumps(cfg))
    res, out = _bad_run(env, tmp_path, config=path)
    _assert_refused(res, out, 'unresolved "auto"', "zero_optimization.reduce_bucket_size")


def test_batch_size_conflict_is_refused(env, tmp_path):
    cfg = json.loads(CPU_ZERO3.read_text())
    cfg["train_batch_size"] = 999
    path = tmp_path / "bs.json"
    path.write_text(json.dumps(cfg))
    res, out = _bad_run(env, tmp_path, config=path)
    _assert_refused(res, out, "train_batch_size=999", "micro_batch_size=4 x grad_accum=2 x world_size=1")


def test_factor_store_of_another_model_is_refused(env, tmp_path):
    other = build_env(tmp_path / "other", seed=1)
    res, out = _bad_run(env, tmp_path, **{"model.factor_store": other.store})
    _assert_refused(res, out, "fingerprint", "frod hjd")


def test_data_rows_missing_fields_are_refused(env, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "p", "answer": "true"}\n{"prompt": "q"}\n')
    res, out = _bad_run(env, tmp_path, **{"data.train": bad})
    _assert_refused(res, out, "line 2", "'answer'")


def test_resume_on_a_factor_store_rebuilt_with_another_pi_is_refused(probe, env, tmp_path):
    """output_dir holds a run trained on one store; the same command on a store rebuilt from the same base
    model with another π is refused before anything is built (the checkpoint records its store)."""
    import shutil

    trained, _ = probe
    out = tmp_path / "bad"
    tag = (trained / "checkpoints" / "latest_complete").read_text().strip()
    shutil.copytree(trained / "checkpoints" / tag, out / "checkpoints" / tag)
    shutil.copy(trained / "checkpoints" / "latest_complete", out / "checkpoints")
    other = tmp_path / "store-pi"
    assert hjd_in_process(["--model", str(env.model), "--out", str(other), "--pi", "0.01"]).returncode == 0
    res = train_in_process(CPU_ZERO3, env.overrides(out, **{"model.factor_store": other}))
    _assert_refused(res, out, "trained on another factor store", "pi 0.001 there, 0.01 here")


def test_step_peak_is_reset_before_each_step_on_gpus(monkeypatch):
    """On CUDA, peak_mem_gb is the step's own peak: the allocator's peak counter is reset before the step."""
    from frod_ds.train import metrics

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: calls.append("reset"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 3 * 2**30)
    metrics.reset_peak_mem()
    assert calls == ["reset"] and metrics.peak_mem_gb() == 3.0
