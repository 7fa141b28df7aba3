"""The planner's step-time model (frod_ds/plan/step_time.py): its parts against hand-computed values, its predictions
against every committed measured step (bench/time_model_check.py), and the decisions built on it."""

import dataclasses
import json
from pathlib import Path

import pytest

from frod_ds.plan.memory import frozen_tensors, plan_memory
from frod_ds.plan.recommend import predicted_seconds, recommend
from frod_ds.plan.shapes import GiB, TrainShape, model_shape_from_config, shipped_engines
from frod_ds.plan.step_time import (
    CHECK_GOAL,
    CPU_OPTIMIZER_PARAM_S,
    EFFICIENCY,
    HOST_LAYER_PASS_S,
    ZERO3_FROZEN_TENSOR_PASS_S,
    ZERO3_LAYER_PASS_S,
    ZERO3_NVTX_LAYER_PASS_S,
    ZERO_CHECK_TENSOR_S,
    ZERO_STEP_HOST_S,
    ZERO_TENSOR_HOST_S,
    Link,
    step_time,
)
from tests.support.model_shapes import LLAMA2_7B, LLAMA2_70B

REPO = Path(__file__).resolve().parents[2]


def _engines():
    """The shipped engines by short name; ``zero3ds``: ``zero3.json`` under DeepSpeed's own stage 3
    (``train.zero3_partition=deepspeed``), ``zero3``: its layer partition (the default)."""
    e = {e.name.removeprefix("ds_configs/").removesuffix(".json"): e for e in shipped_engines()}
    return {**e, "zero3ds": dataclasses.replace(e["zero3"], layers=False)}


def test_the_cpu_optimizer_term_is_per_trainable_parameter_of_a_rank_and_its_threads():
    """offload_optimizer: each rank steps its 1/N of σ and S on the CPU after the backward, in a part no thread
    shortens and one its OpenMP threads divide (rank 0's optimizer phase: 2.42e-9 s per value at one thread, 4.4e-10
    at 16). torchrun gives a lone rank every core and several ranks one thread each, the default here."""
    from frod_ds.plan.memory import trainable_numel
    from frod_ds.plan.step_time import CPU_OPTIMIZER_THREAD_PARAM_S, LONE_RANK_THREADS

    model, train = model_shape_from_config(LLAMA2_7B), TrainShape(micro_batch=4, seq_len=256, checkpointing=True)
    e = _engines()
    assert e["zero3_offload"].offload_optimizer and not e["zero3"].offload_optimizer
    n = trainable_numel(model, train)
    per_value = {t: CPU_OPTIMIZER_PARAM_S + CPU_OPTIMIZER_THREAD_PARAM_S / t for t in (1, LONE_RANK_THREADS)}
    assert per_value[1] == pytest.approx(2.42e-9, rel=0.02) and per_value[16] == pytest.approx(4.4e-10, rel=0.02)
    for gpus in (1, 2, 4):
        t = step_time(model, train, e["zero3_offload"], gpus)
        launcher_threads = LONE_RANK_THREADS if gpus == 1 else 1
        assert t.parts["CPU optimizer"] == pytest.approx(n / gpus * per_value[launcher_threads])
        one = step_time(model, train, e["zero3_offload"], gpus, Link(cpu_threads=1))
        assert one.parts["CPU optimizer"] == pytest.approx(n / gpus * per_value[1])
    two = step_time(model, train, e["zero3_offload"], 2).parts
    denser = step_time(model, dataclasses.replace(train, sparsity=0.05), e["zero3_offload"], 2).parts
    assert denser["CPU optimizer"] == pytest.approx(
        trainable_numel(model, dataclasses.replace(train, sparsity=0.05)) / 2 * per_value[1]
    )
    assert denser["CPU optimizer"] > 2 * two["CPU optimizer"]
    assert "CPU optimizer" not in step_time(model, train, e["zero3"], 2).parts


def test_a_slower_host_scales_the_hosts_work_and_nothing_else():
    """``Link.host``: the host's layers, DeepSpeed's host work and the CPU optimizer (the host's Adam) take ``host``
    times as long; the device's compute does not (a chain call's probe sets it: bench/time_model_check.py)."""
    model, train = model_shape_from_config(LLAMA2_7B), TrainShape(micro_batch=4, seq_len=256, checkpointing=True)
    e = _engines()["zero3_offload"]
    one, slow = step_time(model, train, e, 2), step_time(model, train, e, 2, Link(host=1.3))
    assert slow.host == pytest.approx({k: 1.3 * v for k, v in one.host.items()})
    assert slow.parts["CPU optimizer"] == pytest.approx(1.3 * one.parts["CPU optimizer"])
    assert (slow.parts["compute"], slow.parts["recompute"]) == (one.parts["compute"], one.parts["recompute"])
    beyond = sum(slow.host.values()) - one.parts["compute"] - one.parts["recompute"]
    assert slow.parts["host beyond device"] == pytest.approx(beyond)


def test_step_parts_add_up_from_flops_host_work_and_the_link():
    from frod_ds.plan.flops import flops_per_token

    model, train = model_shape_from_config(LLAMA2_7B), TrainShape(micro_batch=4, seq_len=512)
    e = _engines()
    link = Link(busbw=100e9, peak_flops=1e15)
    flops = flops_per_token(LLAMA2_7B, 512, "frod", 2048)["total"]
    compute = 2048 * flops / (1e15 * EFFICIENCY)
    plain = step_time(model, train, e["zero2"], 1, link, plain=True)
    assert plain.host == {"layers": pytest.approx(2 * 32 * HOST_LAYER_PASS_S)}
    assert plain.seconds == pytest.approx(max(compute, 2 * 32 * HOST_LAYER_PASS_S))
    z2 = step_time(model, train, e["zero2"], 1, link)
    # DeepSpeed's host work: its step, and σ and S of each decoder layer (FRoDTrainables) as two tensors per layer
    assert z2.host["DeepSpeed step"] == pytest.approx(ZERO_STEP_HOST_S)
    assert z2.host["DeepSpeed tensors"] == pytest.approx(ZERO_TENSOR_HOST_S * 32 * 2)
    assert z2.seconds == pytest.approx(max(compute, sum(z2.host.values()))), "the host overlaps the device"
    assert "overflow check" not in z2.parts, "the shipped zero2.json skips DeepSpeed's per-gradient bf16 check"
    per_member = dataclasses.replace(train, flat_trainables=False)
    assert step_time(model, per_member, e["zero2"], 1, link).host["DeepSpeed tensors"] == pytest.approx(
        ZERO_TENSOR_HOST_S * 32 * 6 * 2
    ), "σ and S, 6 targets x 32"
    checked = dataclasses.replace(e["zero2"], bf16_overflow_check=True)
    z2c = step_time(model, train, checked, 1, link)
    assert z2c.parts["overflow check"] == pytest.approx(ZERO_CHECK_TENSOR_S * 64)
    assert z2c.seconds == pytest.approx(z2.seconds + ZERO_CHECK_TENSOR_S * 64), "it syncs: added, not overlapped"
    fp32 = TrainShape(micro_batch=4, seq_len=512, dtype="float32")  # DeepSpeed checks no fp32 gradient
    assert "overflow check" not in step_time(model, fp32, checked, 1, link).parts
    z3 = step_time(model, train, e["zero3ds"], 2, link)
    # a decoder layer's six U_i are one frozen Parameter (FRoDFrozen): five tensors fewer per layer and pass; and
    # DeepSpeed's NVTX ranges are off (frod_ds.runtime.distributed)
    fetch = ZERO3_LAYER_PASS_S - ZERO3_NVTX_LAYER_PASS_S
    assert z3.host["ZeRO-3 layer fetch"] == pytest.approx((fetch - 5 * ZERO3_FROZEN_TENSOR_PASS_S) * 64)
    u_per_member = step_time(model, dataclasses.replace(train, zero3_flat_frozen=False), e["zero3ds"], 2, link)
    assert u_per_member.host["ZeRO-3 layer fetch"] == pytest.approx(fetch * 32 * 2)
    nf4 = step_time(model, dataclasses.replace(train, quant="nf4"), e["zero3ds"], 2, link)  # a quantized U: one each
    assert nf4.host["ZeRO-3 layer fetch"] == pytest.approx(fetch * 32 * 2)
    nvtx = step_time(model, dataclasses.replace(train, deepspeed_nvtx=True), e["zero3ds"], 2, link)
    assert nvtx.host["ZeRO-3 layer fetch"] == pytest.approx(
        z3.host["ZeRO-3 layer fetch"] + ZERO3_NVTX_LAYER_PASS_S * 64
    )
    assert step_time(
        model, dataclasses.replace(train, deepspeed_nvtx=True), e["zero2"], 1, link
    ).seconds == pytest.approx(z2.seconds), "ZeRO-2 measured the same either way"
    frozen = sum(b * c for g in frozen_tensors(model, train).values() for b, c, _ in g)
    assert z3.parts["link"] == pytest.approx(1.2 * 2 * frozen / 2 / 100e9), "the half a rank lacks, twice"
    assert z3.seconds == pytest.approx(
        max(compute, sum(z3.host.values())) + z3.parts["link"] + z3.parts["gradient reduce"]
    )
    slow = step_time(model, train, e["zero3ds"], 2, dataclasses.replace(link, host=2.0))
    assert slow.host == {k: pytest.approx(2 * v) for k, v in z3.host.items()}, "host work scales with the host"
    gc = step_time(model, TrainShape(micro_batch=4, seq_len=512, checkpointing=True), e["zero3ds"], 2, link)
    assert gc.parts["recompute"] == pytest.approx(gc.parts["compute"] / 3) and gc.parts["link"] > z3.parts["link"]
    assert gc.host["ZeRO-3 layer fetch"] == pytest.approx(1.5 * z3.host["ZeRO-3 layer fetch"]), "three passes"


def test_the_committed_check_is_what_the_model_gives_and_hides_no_point():
    """Deterministic: the committed step JSONs against the model; the committed report is what it gives, its
    verdict is computed over every configuration, each configuration is the median of exactly the held points the
    model cannot tell apart, and a point is left out only for a declared reason (its own windows' spread, or a
    listed form the model lacks). Whether the goal is met is the report's verdict on measurements, not an
    assertion here."""
    import statistics

    from bench.time_model_check import NOISY_SPREAD, OUTSIDE, PROBED, _kind, check, render

    doc = check()
    assert len(doc["rows"]) >= 12

    def phase_timed(r: dict) -> bool:  # a chain record run with train.phase_times (its device synchronized)
        path = REPO / r["file"]
        return path.suffix == ".json" and json.loads(path.read_text()).get("settings", {}).get("phase_times", False)

    timed = [r for r in doc["rows"] if phase_timed(r)]
    assert len(timed) >= 6
    for r in doc["rows"]:
        declared = (
            r["window_spread"] > NOISY_SPREAD
            or any(r["file"] == str(p.relative_to(REPO)) for p in OUTSIDE)
            or phase_timed(r)
        )
        assert bool(r.get("outside")) == declared, r["file"]
    read = doc["cpu_optimizer"]["per_rank_param_s"]
    assert sorted(read) == sorted(r["file"] for r in timed)
    cpu = doc["cpu_optimizer"]
    assert set(cpu["median_by_threads"]) == {1, 16}  # the constants' two readings: one thread and a lone rank's 16
    for t, median in cpu["median_by_threads"].items():
        assert median == statistics.median(v for f, v in read.items() if cpu["threads"][f] == t)
        assert cpu["model_by_threads"][t] == pytest.approx(median, rel=0.02)
    held = {r["file"]: r for r in doc["rows"] if not r.get("outside")}
    grouped = [f for g in doc["configs"] for f in g["files"]]
    assert sorted(grouped) == sorted(held), "every held point in exactly one configuration"
    for g in doc["configs"]:
        members = [held[f] for f in g["files"]]
        # one prediction per configuration at its machine kind's host; each call's own at its probed host
        assert len({round(m["predicted_at_kind_ms"], 6) for m in members}) == 1
        for m in members:
            assert (m["host_from"] == PROBED) == (m["host"] != doc["host_factors"][_kind(m["device"])])
            assert m["error"] == pytest.approx(m["predicted_ms"] / m["measured_ms"] - 1)
        assert g["measured_ms"] == statistics.median(m["measured_ms"] for m in members)
        assert g["error"] == statistics.median(m["error"] for m in members)
        assert g["probed_calls"] == sum(m["host_from"] == PROBED for m in members)
    assert doc["worst_error"] == max(abs(g["error"]) for g in doc["configs"])
    assert doc["within_goal"] == all(abs(g["error"]) <= CHECK_GOAL for g in doc["configs"])
    assert doc["host_factors"]["H200"] == 1.0 and doc["host_factors"]["H100"] > 1.0, "the H100 machine's host is slower"
    assert (REPO / "bench" / "results" / "time_model_check.md").read_text() == render(doc)
    committed = json.loads((REPO / "bench" / "results" / "time_model_check.json").read_text())
    assert committed["rows"] == json.loads(json.dumps(doc["rows"]))
    assert committed["configs"] == json.loads(json.dumps(doc["configs"]))


def test_a_step_is_the_slower_of_host_and_device():
    """At 7B widths a quantized step is host-bound (dequantization's host calls exceed the GPU's short layers); at 70B
    widths the GPU is the slower and dequantization costs its device time only; a slower host moves only the first."""
    from frod_ds.plan.step_time import DEQUANT_DEVICE_S, HOST_DEQUANT_CALL_S, HOST_LAYER_PASS_S

    e = _engines()
    seven = model_shape_from_config({**LLAMA2_7B, "num_hidden_layers": 8})
    train = TrainShape(micro_batch=4, seq_len=512, quant="nf4")
    t = step_time(seven, train, e["zero2"], 1, Link(), plain=True)
    device = t.parts["compute"] + t.parts["dequantize"]
    host = 2 * 8 * (HOST_LAYER_PASS_S + 6 * HOST_DEQUANT_CALL_S)
    assert host > device and t.seconds == pytest.approx(host)
    assert t.parts["dequantize"] == pytest.approx(
        DEQUANT_DEVICE_S["nf4"] * 2 * 8 * (4 * 4096 * 4096 + 2 * 11008 * 4096)
    )
    slow = step_time(seven, train, e["zero2"], 1, Link(host=2.0), plain=True)
    assert slow.seconds == pytest.approx(2 * host)
    bf16 = step_time(seven, TrainShape(micro_batch=4, seq_len=512), e["zero2"], 1, Link(), plain=True)
    assert bf16.parts["host beyond device"] == 0.0, "a bf16 7B layer keeps the GPU the slower"
    seventy = model_shape_from_config({**LLAMA2_70B, "num_hidden_layers": 20})
    q = TrainShape(micro_batch=4, seq_len=256, quant="nf4", quantize_base=True, checkpointing=True)
    t70 = step_time(seventy, q, e["zero2"], 1, Link(), plain=True)
    assert t70.parts["host beyond device"] == 0.0
    assert step_time(seventy, q, e["zero2"], 1, Link(host=1.25), plain=True).seconds == pytest.approx(t70.seconds)


def test_recommendations_follow_the_recipes_precision_and_the_predicted_step():
    model = model_shape_from_config(LLAMA2_70B)
    h200 = 139 * GiB
    # 70B in bf16 on 2 H200s: ZeRO-2 does not fit, ZeRO-3 does (the partitioned bf16 model)
    rec = recommend(model, TrainShape(micro_batch=4, seq_len=256), 2, h200)
    assert (rec.engine.name, rec.quant) == ("ds_configs/zero3.json", "none")
    # 70B with an NF4 base on one or two H200s: ZeRO-2 where it fits (no gathers)
    for gpus in (1, 2):
        rec = recommend(model, TrainShape(micro_batch=4, seq_len=256, quant="nf4", quantize_base=True), gpus, h200)
        assert (rec.engine.name, rec.quant, rec.quantize_base) == ("ds_configs/zero2.json", "nf4", True)
    # among the set-ups that fit at one precision, the least predicted time wins, whatever the shipped order
    small = model_shape_from_config(LLAMA2_7B)
    train = TrainShape(micro_batch=4, seq_len=512)
    rec = recommend(small, train, 1, 79.1 * GiB)
    fitting = [p for p in rec.tried if p.fits]
    assert rec.seconds == min(predicted_seconds(small, p) for p in fitting) and rec.engine.name.endswith("zero2.json")
    assert not rec.checkpointing, "checkpointing recomputes a forward: slower when memory allows"


def test_hint_names_a_faster_engine_with_both_predictions():
    from frod_ds.plan.recommend import hint

    small, e = model_shape_from_config(LLAMA2_7B), _engines()
    train = TrainShape(micro_batch=4, seq_len=512)
    line = hint(small, train, e["zero3ds"], 2, 79.1 * GiB)
    z2 = predicted_seconds(small, plan_memory(small, train, e["zero2"], 2, 79.1 * GiB))
    z3 = predicted_seconds(small, plan_memory(small, train, e["zero3ds"], 2, 79.1 * GiB))
    assert (
        line.startswith("hint: ds_configs/zero2.json fits") and f"predicted {z2 * 1e3:.0f} vs {z3 * 1e3:.0f} ms" in line
    )
    assert hint(small, train, e["zero2"], 2, 79.1 * GiB) is None, "nothing predicted faster"
    one = [predicted_seconds(small, plan_memory(small, train, e[k], 1, 79.1 * GiB)) for k in ("zero2", "zero3ds")]
    assert one[1] > one[0] / (1 - 0.15), "one GPU, 7B in bf16: ZeRO-3's layer fetches make it the slower by more"
    assert hint(small, train, e["zero3ds"], 1, 79.1 * GiB).startswith("hint: ds_configs/zero2.json fits")


def test_the_layer_partition_costs_its_exposed_gathers_and_no_deepspeed_fetches():
    """zero3.json's layer partition: ZeRO-2's terms for σ and S (its overflow check where the JSON keeps it on), no
    per-layer fetch host work, and on N GPUs the frozen bytes but V and the final norm gathered twice per step
    (forward, backward; a checkpointed layer's recompute reuses the backward's), LAYERS_LINK_EXPOSED of the floor,
    PEER_LINK_EXPOSED with the gathers copied out of peers' shards (the default, one machine)."""
    from frod_ds.plan.step_time import LAYERS_LINK_EXPOSED, PEER_LINK_EXPOSED

    model, e, link = model_shape_from_config(LLAMA2_7B), _engines(), Link(busbw=100e9)
    assert e["zero3"].layers and not e["zero3ds"].layers and not e["zero2"].layers
    train = TrainShape(micro_batch=4, seq_len=512)
    frozen = frozen_tensors(model, train)
    gathered = sum(b * c for g in frozen.values() for b, c, _ in g) - sum(b * c for b, c, _ in frozen["frozen V"])
    gathered -= model.hidden * train.e  # the final norm
    for checkpointing in (False, True):
        t = dataclasses.replace(train, checkpointing=checkpointing)
        two = step_time(model, t, e["zero3"], 2, link)
        assert "ZeRO-3 layer fetch" not in two.host
        assert two.parts["link"] == pytest.approx(PEER_LINK_EXPOSED * 2 * gathered * 0.5 / 100e9)
        nccl = step_time(model, t, dataclasses.replace(e["zero3"], peer=False), 2, link)
        assert nccl.parts["link"] == pytest.approx(LAYERS_LINK_EXPOSED * 2 * gathered * 0.5 / 100e9)
        assert step_time(model, t, e["zero3"], 4, link).parts["link"] == pytest.approx(two.parts["link"] * 1.5)
    one = step_time(model, train, e["zero3"], 1, link)
    assert "link" not in one.parts and one.seconds < step_time(model, train, e["zero3ds"], 1, link).seconds
    # one GPU and two at 7B: zero2.json is not predicted faster by the hint's margin
    from frod_ds.plan.recommend import hint

    for gpus in (1, 2):
        assert hint(model, train, e["zero3"], gpus, 139 * GiB) is None


def test_host_shard_copies_hide_pass_by_pass_behind_the_longer_of_host_and_device_work():
    """zero3_offload.json's layer partition: the side stream's copies of the host shards overlap the device's and
    the host's work alike, but only within a pass: the forward's copies behind the forward (a third of the compute,
    a third of the host's layer work), the backward's behind the rest. So each pass is the longest of its three, a
    step whose copies match its device time overall still waits in the forward, and a larger micro-batch is never
    predicted faster."""
    from frod_ds.plan.step_time import HOST_SHARD_BYTES_PER_S

    model, e, link = model_shape_from_config(LLAMA2_7B), _engines(), Link(busbw=100e9)
    off = e["zero3_offload"]
    assert off.layers and off.offload_param and not off.param_on_disk
    frozen = frozen_tensors(model, TrainShape())
    moved = 2 * (sum(b * c for g in frozen.values() for b, c, _ in g) - sum(b * c for b, c, _ in frozen["frozen V"]))
    moved -= 2 * model.hidden * 2  # the final norm, bf16
    prev, exposed_in_forward = 0.0, 0
    for mb in (1, 2, 4, 8, 12, 16):
        t = step_time(model, TrainShape(micro_batch=mb, seq_len=256, checkpointing=True), off, 2, link)
        device = t.parts["compute"] + t.parts["recompute"]
        side = moved / 2 / HOST_SHARD_BYTES_PER_S + moved * 0.5 / 100e9
        forward, host_forward = t.parts["compute"] / 3, t.host["layers"] / 3
        passes = max(side / 2, forward, host_forward) + max(
            side / 2, device - forward, sum(t.host.values()) - host_forward
        )
        serial = t.seconds - device - t.parts["host beyond device"] - t.parts.get("offload", 0.0)
        assert t.seconds - serial == pytest.approx(passes)
        assert t.seconds - serial >= max(device, sum(t.host.values()), side) - 1e-12
        exposed_in_forward += side / 2 > max(forward, host_forward) and device > side
        assert t.seconds >= prev - 1e-12
        prev = t.seconds
    assert exposed_in_forward  # a micro-batch whose whole-step overlap would hide every copy


def test_nvme_offload_reads_every_frozen_byte_from_disk_each_pass_as_measured():
    """zero3_nvme.json (DeepSpeed's coordinator swapping the frozen weights in from disk): the model's step for the
    committed 1-GPU 7B chain is within the check's goal of the step its train run measured."""
    from bench.kinds import synthetic
    from bench.kinds.chain import shape_of
    from frod_ds.plan.shapes import engine_from_ds_config
    from frod_ds.plan.step_time import DISK_BYTES_PER_S

    cfg = json.loads((REPO / "ds_configs" / "zero3_nvme.json").read_text())
    engine = engine_from_ds_config(cfg, "zero3_nvme.json")
    assert engine.param_on_disk and not engine.layers  # NVMe runs under DeepSpeed's coordinator
    rec = json.loads((REPO / "bench/results/nvme-7b-train-1gpu/h200x2/7b-1g.train.json").read_text())
    fig, s = rec["metrics"]["figures"], rec["settings"]
    model = model_shape_from_config(synthetic.config_json(shape_of(s)))
    train = TrainShape(micro_batch=fig["micro_batch"], seq_len=s["seq"], checkpointing=True)
    t = step_time(model, train, engine, 1)
    frozen = sum(b * c for g in frozen_tensors(model, train).values() for b, c, _ in g)
    assert t.parts["offload"] == pytest.approx(3 * frozen / DISK_BYTES_PER_S)
    assert abs(t.seconds / fig["step_s_median"] - 1) <= CHECK_GOAL
    on_host = step_time(model, train, dataclasses.replace(engine, param_on_disk=False), 1)
    assert on_host.seconds < t.seconds / 10  # the same weights from pinned host memory
