"""The NVMe swap-buffer preflight (``frod_ds.config.nvme.check_nvme_buffer_count``) against counts worked out
by hand for LLaMA-2-7B and 70B with FRoD on q/k/v/o/gate/up, one rank, bf16: a decoder layer swaps 7 parameters (six U
and down_proj; the norms are under 1 MiB), the six shared V are 6 more, the embeddings/head 1 more: 14."""

from __future__ import annotations

import json

import pytest

from frod_ds.config.ds_config import DSConfigError
from frod_ds.config.nvme import NvmeParams, check_nvme_buffer_count, nvme_buffers_needed
from tests.support.train_env import REPO


def llama(hidden: int, inter: int, kv: int, layers: int, vocab: int = 32000, s: float = 0.02) -> NvmeParams:
    u = [hidden * hidden, kv * hidden, kv * hidden, hidden * hidden, inter * hidden, inter * hidden]
    layer = u + [hidden * inter, hidden, hidden]  # six U (the targets' shapes), down_proj, two norms
    trainable = [hidden, round(s * hidden * hidden)] * 6  # σ (n) and S (s·n²) per target; V is hidden × hidden
    return NvmeParams(
        [layer] * layers, [hidden * hidden] * 6, [vocab * hidden, vocab * hidden, hidden], [trainable] * layers
    )


L7B, L70B = llama(4096, 11008, 4096, 32), llama(8192, 28672, 1024, 80)


def cfg(count: int, reuse: int = 0, prefetch: int = 0, block: int = 1048576) -> dict:
    return {
        "zero_optimization": {
            "stage": 3,
            "stage3_max_reuse_distance": reuse,
            "stage3_prefetch_bucket_size": prefetch,
            "offload_param": {"device": "nvme", "buffer_count": count},
        },
        "aio": {"block_size": block},
    }


def test_counts_by_hand():
    assert nvme_buffers_needed(cfg(5), L7B, 1, 2) == 7 + 6 + 1
    assert nvme_buffers_needed(cfg(5), L70B, 1, 2) == 7 + 6 + 1
    # a 1e9-element reuse window may keep ceil(1e9 / 4096^2) = 60 more 7B parameters gathered
    assert nvme_buffers_needed(cfg(5, reuse=10**9), L7B, 1, 2) == 14 + 60
    # 8 ranks: 70B's k/v U partitions (1024*8192/8 * 2 bytes = 2 MiB) still swap; a 4 MiB aio block drops them
    assert nvme_buffers_needed(cfg(5), L70B, 8, 2) == 14
    assert nvme_buffers_needed(cfg(5, block=4 << 20), L70B, 8, 2) == 12


def test_trainable_partitions_beyond_max_in_cpu_need_buffers_too():
    """70B, s=0.02, 2 ranks: per rank 80·6·(8192 + 1,342,177)/2 ≈ 324M trainable elements stay in host memory under
    the shipped max_in_cpu (1e9); under 1e6 they spill to NVMe and each S partition (671,089 bf16 elements, 1.34 MB
    ≥ 1 MiB) takes a buffer: 6 more per layer. σ (8 KiB per rank) is never swapped."""
    c = cfg(5)
    assert nvme_buffers_needed(c, L70B, 2, 2) == 14
    c["zero_optimization"]["offload_param"]["max_in_cpu"] = 10**6
    assert nvme_buffers_needed(c, L70B, 2, 2) == 20
    assert nvme_buffers_needed(c, L70B, 4, 2) == 14, "on 4 ranks an S partition (0.67 MB) is under 1 MiB"


def test_too_few_buffers_is_one_line_naming_the_key_and_value():
    with pytest.raises(DSConfigError) as e:
        check_nvme_buffer_count(cfg(5), L7B, 1, 2)
    msg = str(e.value)
    assert "\n" not in msg and "offload_param.buffer_count is 5" in msg and "at least 14" in msg
    check_nvme_buffer_count(cfg(14), L7B, 1, 2)
    check_nvme_buffer_count(cfg(14), L70B, 1, 2)


def test_prefetch_with_shared_nvme_parameters_is_refused():
    with pytest.raises(DSConfigError, match="set stage3_prefetch_bucket_size to 0$"):
        check_nvme_buffer_count(cfg(14, prefetch=50_000_000), L7B, 1, 2)


def test_no_nvme_no_check():
    c = cfg(1)
    c["zero_optimization"]["offload_param"]["device"] = "cpu"
    check_nvme_buffer_count(c, L7B, 1, 2)


def test_shipped_nvme_config_is_enough_for_7b_and_70b():
    c = json.loads((REPO / "ds_configs" / "zero3_nvme.json").read_text())
    for model in (L7B, L70B):
        check_nvme_buffer_count(c, model, 1, 2)
    op = c["zero_optimization"]["offload_param"]
    assert op["buffer_count"] * op["buffer_size"] * 2 <= 9e9  # pinned host memory of the swap buffers


def test_nvme_params_match_the_built_frod_model_with_or_without_targeted_weights(tmp_path):
    """``preflight.nvme_params`` (config-free: checkpoint tensor sizes, a ``U`` per targeted weight, a ``V`` per
    category) against the parameters of the FRoD model ``build_frod_model`` builds; the same from a checkpoint
    without the targeted weights (as the 70B chain keeps it once HJD has run)."""
    import torch

    from frod_ds.io.hf_checkpoint import HFCheckpoint
    from frod_ds.model.build import build_frod_model, make_supports
    from frod_ds.model.store_reader import FactorStore
    from frod_ds.train.preflight import nvme_params
    from launch.hjd import main
    from tests.support.helpers_ckpt import strip_checkpoint, write_tiny_llama

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"]
    model_dir = write_tiny_llama(tmp_path / "model")
    assert (
        main(
            [
                "--model",
                str(model_dir),
                "--out",
                str(tmp_path / "store"),
                "--targets",
                ",".join(targets),
                "--device",
                "cpu",
                "--no-fsync",
            ]
        )
        == 0
    )
    store = FactorStore.open(tmp_path / "store")
    model = build_frod_model(model_dir, store, make_supports(store, targets, 0.1, 0), torch.float32)
    uses: dict[int, int] = {}
    for layer in model.model.layers:
        for p in layer.parameters():
            uses[id(p)] = uses.get(id(p), 0) + 1
    shared = {i for i, n in uses.items() if n > 1}
    want_layers = [
        sorted(p.numel() for p in layer.parameters() if not p.requires_grad and id(p) not in shared)
        for layer in model.model.layers
    ]
    want_shared = sorted(p.numel() for p in model.parameters() if id(p) in shared)
    layer_ids = {id(p) for layer in model.model.layers for p in layer.parameters()}
    want_other = sorted(p.numel() for p in model.parameters() if id(p) not in layer_ids and not p.requires_grad)
    want_trainable = [sorted(p.numel() for p in layer.parameters() if p.requires_grad) for layer in model.model.layers]
    stripped = strip_checkpoint(model_dir, tmp_path / "stripped", targets)
    for d in (model_dir, stripped):
        got = nvme_params(HFCheckpoint(d), store, targets, 0.1)
        assert [sorted(x) for x in got.layers] == want_layers, d
        assert [sorted(x) for x in got.trainable] == want_trainable, d
        assert sorted(got.shared) == want_shared and sorted(got.other) == want_other, d
