"""Recipe parsing, DeepSpeed config resolution, training tokenisation and batch plans (no processes)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from frod_ds.config.ds_config import DSConfigError, batch_sizes, resolve_ds_config
from frod_ds.config.recipe import Recipe, RecipeError, load_recipe
from frod_ds.train.data import IGNORE_INDEX, BatchPlan, DataError, collate, encode_examples, read_training_rows
from frod_ds.train.schedule import lr_lambda

REPO = Path(__file__).resolve().parents[2]
REQUIRED = ["model.base=m", "model.factor_store=f", "data.train=t.jsonl"]


def test_paper_recipe_loads_with_paper_hyperparameters():
    r = load_recipe(REPO / "recipes" / "llama2_7b_cs170k.yaml")
    assert (r.train.lr_sigma, r.train.lr_s, r.model.sparsity) == (1e-4, 1e-5, 0.02)
    assert r.train.schedule == "cosine" and r.train.warmup_ratio == 0.1 and r.train.epochs == 3
    assert batch_sizes(r, 8).total == 32, "the paper's batch size 32 on 8 GPUs"
    assert r.model.targets == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"]


def test_demo_recipe_loads():
    assert load_recipe(REPO / "recipes" / "demo_tiny.yaml").model.dtype == "float32"


def test_real_model_recipe_loads_with_paper_ratio_and_batch():
    r = load_recipe(REPO / "recipes" / "smollm2_135m_llm_adapters.yaml")
    assert (
        r.train.lr_sigma == pytest.approx(10 * r.train.lr_s, rel=1e-12) and batch_sizes(r, 1).total == 32
    )  # 10:1 in binary floats


def test_overrides_take_precedence_and_are_typed(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text(
        yaml.safe_dump(
            {"model": {"base": "x", "factor_store": "f"}, "data": {"train": "t"}, "train": {"lr_sigma": 1e-4}}
        )
    )
    r = load_recipe(
        p, ["train.lr_sigma=2e-4", "train.max_steps=10", "model.targets=q_proj,v_proj", "data.train_on_inputs=true"]
    )
    assert r.train.lr_sigma == 2e-4 and r.train.max_steps == 10
    assert r.model.targets == ["q_proj", "v_proj"] and r.data.train_on_inputs is True


@pytest.mark.parametrize(
    "bad, needle",
    [
        (["train.lr=1"], "unknown key 'train.lr'"),
        (["nope.x=1"], "unknown key 'nope'"),
        (["train.max_steps=ten"], "train.max_steps: expected an integer"),
        (["model.sparsity=1.5"], "model.sparsity must be in (0, 1)"),
        (["train.schedule=step"], "train.schedule"),
        (["model.dtype=float16"], "model.dtype"),
        (["train.lr_sigma"], "must look like section.key=value"),
        # numbers the optimizer would take silently or fail on with a traceback (the failure corpus)
        (["train.max_steps=1", "train.epochs=-1"], "train.epochs must be > 0"),
        (["train.seed=-1"], "train.seed and model.seed must be >= 0, got -1 and 0"),  # Random(-1) is Random(1)
        (["model.seed=-2"], "train.seed and model.seed must be >= 0, got 42 and -2"),
        (["train.betas=[0.9,1.5]"], "train.betas must be two numbers in [0, 1)"),
        (["train.betas=[-0.1,0.9]"], "train.betas must be two numbers in [0, 1)"),
        (["train.max_grad_norm=-1"], "train.max_grad_norm must be >= 0"),
        (["train.weight_decay=-0.1"], "train.weight_decay must be >= 0"),
        (["train.eval_every=2"], "train.eval_every 2 needs data.eval (held-out rows)"),  # it scored nothing silently
    ],
)
def test_bad_recipes_raise_one_error_naming_the_problem(bad, needle):
    with pytest.raises(RecipeError, match=None) as e:
        load_recipe(None, REQUIRED + bad)
    assert needle in str(e.value)


def test_a_value_that_is_no_number_gets_that_rule_alone():
    """``model.sparsity=nan`` was told two rules (the range and finiteness) for one value."""
    with pytest.raises(RecipeError) as e:
        load_recipe(None, [*REQUIRED, "model.sparsity=nan"])
    assert "model.sparsity must be a finite number, got nan" in str(e.value)
    assert "(0, 1)" not in str(e.value)


def test_an_override_given_twice_takes_the_last_with_a_note(capfd):
    """A script's defaults then the user's (launch/slurm/train.sbatch): the last value is used and a note names
    both; the same value twice says nothing."""
    r = load_recipe(None, [*REQUIRED, "train.lr_sigma=1e-3", "train.lr_sigma=2e-3"])
    assert r.train.lr_sigma == 2e-3
    err = capfd.readouterr().err
    assert err == "note: train.lr_sigma is given twice on the command line (1e-3, then 2e-3); using 2e-3\n", err
    load_recipe(None, [*REQUIRED, "train.max_steps=3", "train.max_steps=3"])
    assert capfd.readouterr().err == ""


def test_missing_required_fields_are_all_reported():
    with pytest.raises(RecipeError) as e:
        load_recipe(None, [])
    msg = str(e.value)
    assert "model.base" in msg and "model.factor_store" in msg and "data.train" in msg


def _recipe(**train) -> Recipe:
    r = load_recipe(None, REQUIRED)
    for k, v in train.items():
        setattr(r.train, k, v)
    return r


def test_ds_config_autos_resolved_from_recipe():
    cfg = json.loads((REPO / "ds_configs" / "zero3.json").read_text())
    out = resolve_ds_config(cfg, _recipe(micro_batch_size=4, grad_accum=8), world_size=1)
    assert (out["train_micro_batch_size_per_gpu"], out["gradient_accumulation_steps"], out["train_batch_size"]) == (
        4,
        8,
        32,
    )
    assert out["gradient_clipping"] == 1.0 and out["bf16"]["enabled"] is True
    assert "auto" not in json.dumps(out)


@pytest.mark.parametrize(
    "name",
    [
        "zero3.json",
        "zero3_offload.json",
        "zero3_nvme.json",
        "zero2.json",
        "zero0.json",
        "zero3_cpu_fp32.json",
        "zero2_cpu_fp32.json",
    ],
)
def test_every_shipped_ds_config_resolves(name):
    cfg = json.loads((REPO / "ds_configs" / name).read_text())
    r = _recipe()
    r.model.dtype = "float32" if "fp32" in name else "bfloat16"
    out = resolve_ds_config(cfg, r, world_size=8, nvme_path="/scratch/nvme" if "nvme" in name else None)
    assert "auto" not in json.dumps(out)
    if "nvme" in name:
        assert out["zero_optimization"]["offload_param"]["nvme_path"] == "/scratch/nvme"
    else:  # --nvme-path with a config that offloads nothing to NVMe would change nothing: refused, not ignored
        with pytest.raises(DSConfigError, match="--nvme-path is given, but this DeepSpeed config offloads nothing"):
            resolve_ds_config(cfg, r, world_size=8, nvme_path="/scratch/nvme")


def test_a_recipe_that_is_not_utf8_is_one_error_naming_the_byte(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_bytes(b"train:\n  max_steps: 3\n# caf\xe9 (Latin-1)\n")
    with pytest.raises(RecipeError, match=r"r.yaml is not UTF-8 text \(byte 27\); save it as UTF-8"):
        load_recipe(path, paths=False)


def test_nvme_buffers_must_hold_the_largest_partition():
    """DeepSpeed asserts mid-build when a parameter partition exceeds offload_param.buffer_size; the shipped
    NVMe config holds LLaMA-2-70B's embeddings (32000 x 8192) on one GPU, and a smaller buffer is one line."""
    from frod_ds.config.ds_config import DSConfigError
    from frod_ds.config.nvme import check_nvme_buffer

    cfg = json.loads((REPO / "ds_configs" / "zero3_nvme.json").read_text())
    check_nvme_buffer(cfg, 32000 * 8192, world_size=1)
    check_nvme_buffer(json.loads((REPO / "ds_configs" / "zero3.json").read_text()), 10**12, world_size=1)  # no NVMe
    cfg["zero_optimization"]["offload_param"]["buffer_size"] = 100_000_000
    check_nvme_buffer(cfg, 32000 * 8192, world_size=4)  # 65.5M per rank
    with pytest.raises(
        DSConfigError,
        match=r"buffer_size is 100,000,000 elements.*131,072,000 = 262,144,000 over 2 "
        r"rank\(s\)\); set buffer_size to at least 131072000",
    ):
        check_nvme_buffer(cfg, 32000 * 8192, world_size=2)


def test_nvme_offload_refuses_an_arch_list_deepspeed_cannot_parse():
    """DeepSpeed 0.19's op builder reads TORCH_CUDA_ARCH_LIST entries as int.int[+PTX]; Hopper images set 9.0a,
    which stops the async_io build that NVMe offload needs (seen on an H100): one line before the run instead."""
    from frod_ds.config.ds_config import DSConfigError
    from frod_ds.config.nvme import check_aio_build_env

    nvme = json.loads((REPO / "ds_configs" / "zero3_nvme.json").read_text())
    offload = json.loads((REPO / "ds_configs" / "zero3_offload.json").read_text())
    for ok in ("", "9.0", "8.0;9.0+PTX", "8.6 9.0"):
        check_aio_build_env(nvme, {"TORCH_CUDA_ARCH_LIST": ok})
    check_aio_build_env(offload, {"TORCH_CUDA_ARCH_LIST": "9.0a"})  # CPU offload builds no CUDA op
    with pytest.raises(DSConfigError, match=r"cannot parse TORCH_CUDA_ARCH_LIST entry '9.0a'.*\(e.g. '9.0'\)"):
        check_aio_build_env(nvme, {"TORCH_CUDA_ARCH_LIST": "8.0;9.0a"})


@pytest.mark.parametrize(
    "edit, needle",
    [
        ({"train_batch_size": 64}, "train_batch_size=64"),
        ({"gradient_accumulation_steps": 3}, "gradient_accumulation_steps=3"),
        ({"gradient_accumulation_steps": "auto "}, 'gradient_accumulation_steps="auto " in'),  # the space shows
        ({"optimizer": {"type": "AdamW"}}, 'remove the "optimizer" block'),
        ({"scheduler": {"type": "WarmupLR"}}, 'remove the "scheduler" block'),
        ({"zero_optimization": {"stage": 3, "sub_group_size": "auto"}}, "zero_optimization.sub_group_size"),
        ({"bf16": {"enabled": False}}, "bf16.enabled=False"),
    ],
)
def test_ds_config_conflicts_raise(edit, needle):
    cfg = json.loads((REPO / "ds_configs" / "zero3.json").read_text())
    cfg.update(edit)
    with pytest.raises(DSConfigError) as e:
        resolve_ds_config(cfg, _recipe(), world_size=1)
    assert needle in str(e.value)


class _Tok:
    """A character-level stand-in tokenizer (BOS=1, EOS=2), independent of the library's boundary logic."""

    bos_token_id, eos_token_id, pad_token_id = 1, 2, 0

    def __call__(self, texts, add_special_tokens=True):
        return {"input_ids": [[1] * add_special_tokens + [3 + ord(c) % 200 for c in t] for t in texts]}


def test_training_labels_cover_answer_and_eos_only():
    ex = encode_examples(_Tok(), [{"prompt": "ab", "answer": "yes"}], cutoff_len=64, train_on_inputs=False)[0]
    text = "ab\nAnswer: yes"
    assert ex.input_ids == [1] + [3 + ord(c) % 200 for c in text] + [2]
    n_ans = len("yes") + 1
    assert ex.labels == [IGNORE_INDEX] * (len(ex.input_ids) - n_ans) + ex.input_ids[-n_ans:]
    ex2 = encode_examples(_Tok(), [{"prompt": "ab", "answer": "yes"}], 64, train_on_inputs=True)[0]
    assert ex2.labels == ex2.input_ids


def test_truncation_keeps_bos_answer_and_eos():
    ex = encode_examples(_Tok(), [{"prompt": "x" * 100, "answer": "no"}], cutoff_len=16, train_on_inputs=False)[0]
    assert len(ex.input_ids) == 16 and ex.input_ids[0] == 1 and ex.input_ids[-1] == 2
    assert [t for t in ex.labels if t != IGNORE_INDEX] == ex.input_ids[-3:]


def test_collate_right_pads():
    exs = encode_examples(_Tok(), [{"prompt": "a", "answer": "b"}, {"prompt": "abcd", "answer": "b"}], 64, False)
    b = collate(exs, pad_id=0)
    assert b["input_ids"].shape == b["labels"].shape == b["attention_mask"].shape
    assert b["attention_mask"][0].sum() == len(exs[0].input_ids)
    assert (b["labels"][0][len(exs[0].input_ids) :] == IGNORE_INDEX).all()


def test_batch_plan_global_batches_do_not_depend_on_world_size():
    """world × accum × micro fixed at 8: the union of all ranks' examples per step is the same set."""

    def step_sets(world, accum):
        plans = [BatchPlan(50, 8 // (world * accum), accum, world, r, seed=3) for r in range(world)]
        return [sorted(i for p in plans for mb in p.micro_batches(s) for i in mb) for s in range(12)]

    assert step_sets(1, 1) == step_sets(2, 1) == step_sets(2, 2) == step_sets(4, 2)


def test_batch_plan_covers_each_epoch_without_repeats_and_reshuffles():
    p = BatchPlan(40, 2, 2, 2, 0, seed=0)
    q = BatchPlan(40, 2, 2, 2, 1, seed=0)
    epoch0 = [i for s in range(p.steps_per_epoch) for pl in (p, q) for mb in pl.micro_batches(s) for i in mb]
    assert sorted(epoch0) == list(range(40))
    assert p.micro_batches(0) != p.micro_batches(p.steps_per_epoch)


def test_batch_plan_too_small_dataset_is_a_clear_error():
    with pytest.raises(DataError, match="fewer than one global batch"):
        BatchPlan(3, 4, 1, 1, 0, 0).steps_per_epoch


def test_read_training_rows_errors_name_file_and_line(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"prompt": "a", "answer": "b"}\nnot json\n')
    with pytest.raises(DataError, match="line 2: not valid JSON"):
        read_training_rows(p)
    p.write_text('{"prompt": 3, "answer": "b"}\n')
    with pytest.raises(DataError, match="line 1: field 'prompt'"):
        read_training_rows(p)
    with pytest.raises(DataError, match="not found"):
        read_training_rows(tmp_path / "missing.jsonl")


GOOD_MC = {"prompt": "p", "answer": "yes", "choices": ["yes", "no"], "label": 0}


@pytest.mark.parametrize(
    "row, says",
    [
        ({**GOOD_MC, "choices": ["yes"]}, "fewer than two choices"),
        ({**GOOD_MC, "choices": ["yes", "yes"]}, "duplicate choices"),
        ({**GOOD_MC, "label": 5}, "label 5 out of range for 2 choices"),
        ({**GOOD_MC, "label": True}, "field 'label' must be int, got bool"),
        ({**GOOD_MC, "answer": "maybe"}, "answer 'maybe' is not choices"),
        ({**GOOD_MC, "choices": "yes"}, "field 'choices' must be a non-empty list of strings"),
        ({"prompt": "p", "answer": "yes", "label": 0}, "field 'choices' must be a non-empty list of strings"),
        ({"prompt": "p", "answer": " "}, "field 'answer' is empty"),
    ],
)
def test_training_refuses_a_row_the_data_build_would_drop(tmp_path, row, says):
    """Training reads any JSONL with the build's row rules: a multiple-choice row whose choices or label contradict
    its answer, or an empty answer, is refused naming the file and line (it was trained on without a word)."""
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps(GOOD_MC) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(DataError, match=f"t.jsonl line 2: {re.escape(says)}"):
        read_training_rows(p)


def test_training_reads_rows_with_or_without_choices(tmp_path):
    p = tmp_path / "t.jsonl"
    rows = [GOOD_MC, {"prompt": "p", "answer": "free text"}, {**GOOD_MC, "label": 1, "answer": "no"}]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert read_training_rows(p) == rows


def test_lr_schedule_warmup_then_cosine_to_zero():
    fn = lr_lambda("cosine", warmup_steps=10, total_steps=110)
    assert fn(0) == pytest.approx(0.1) and fn(9) == pytest.approx(1.0)
    assert fn(60) == pytest.approx(0.5) and fn(110) == pytest.approx(0.0, abs=1e-12)
    assert lr_lambda("constant", 0, 10)(5) == 1.0
    assert lr_lambda("linear", 0, 10)(5) == pytest.approx(0.5)


@pytest.mark.parametrize("stage", ["three", 4, None, True])
def test_zero_stage_must_be_0_to_3(stage):
    from frod_ds.config.ds_config import DSConfigError, resolve_ds_config, zero_stage

    cfg = {"zero_optimization": {"stage": stage}}
    with pytest.raises(DSConfigError, match=r"zero_optimization.stage must be 0, 1, 2 or 3, got"):
        zero_stage(cfg)
    with pytest.raises(DSConfigError, match="zero_optimization.stage"):
        resolve_ds_config(cfg, load_recipe(None, ["model.base=m", "model.factor_store=f", "data.train=t"]), 1)
    assert zero_stage({}) == 0 and zero_stage({"zero_optimization": {"stage": 3}}) == 3
    with pytest.raises(DSConfigError, match=r"zero_optimization must be an object \(\{\"stage\": 2, ...\}\), got '2'"):
        zero_stage({"zero_optimization": "2"})


def test_a_recipe_key_given_twice_is_refused_naming_its_line(tmp_path):
    """YAML keeps the last of a key given twice; the recipe names it instead (a merge key's overrides still work)."""
    from frod_ds.config.recipe import RecipeError, load_recipe

    bad = tmp_path / "r.yaml"
    bad.write_text("model:\n  sparsity: 0.1\n  sparsity: 0.5\n")
    with pytest.raises(RecipeError, match=r"at line 3, column 3: key 'sparsity' is given twice in one mapping"):
        load_recipe(bad, paths=False)
    import yaml

    from frod_ds.config.recipe import _UniqueKeyLoader

    merged = "base: &b {lr_sigma: 0.001, lr_s: 0.0001}\ntrain:\n  <<: *b\n  lr_sigma: 0.002\n"
    assert yaml.load(merged, Loader=_UniqueKeyLoader)["train"] == {"lr_sigma": 0.002, "lr_s": 0.0001}


@pytest.mark.parametrize("key", ["data.cutoff_len", "train.micro_batch_size", "train.lr_sigma"])
def test_a_number_past_any_setting_is_refused_before_the_arithmetic_overflows(key):
    """A 401-digit integer (int or float field): the planner's float arithmetic raised OverflowError on it."""
    from frod_ds.config.recipe import MAX_INT

    with pytest.raises(RecipeError, match=f"{key}: a 401-digit number is beyond any setting \\(at most {MAX_INT}\\)"):
        load_recipe(None, [f"{key}=1{'0' * 400}"], paths=False)
    assert load_recipe(None, [f"data.cutoff_len={MAX_INT}"], paths=False).data.cutoff_len == MAX_INT


def test_a_recipe_whose_aliases_expand_past_any_recipe_is_refused_at_once(tmp_path):
    """Billion laughs: nine levels of nine aliases in 300 bytes; refused before anything walks it (a walk took
    minutes), as is an alias inside the value it names. A recipe's ordinary aliases still load."""
    import time

    from frod_ds.config.recipe import MAX_VALUES

    text = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
    for i in range(1, 9):
        text += f"{chr(97 + i)}: &{chr(97 + i)} [{','.join(['*' + chr(96 + i)] * 9)}]\n"
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(text + "model: {sparsity: 0.1, bomb: *i}\n")
    t0 = time.perf_counter()
    with pytest.raises(RecipeError, match=f"holds more than {MAX_VALUES} values once its YAML aliases"):
        load_recipe(bomb, paths=False)
    assert time.perf_counter() - t0 < 5
    loop = tmp_path / "loop.yaml"
    loop.write_text("model: &m {sparsity: 0.1, x: *m}\n")
    with pytest.raises(RecipeError, match="or an alias inside the value it names"):
        load_recipe(loop, paths=False)
    with pytest.raises(RecipeError, match=f"override train.x=...: the value holds more than {MAX_VALUES} values"):
        load_recipe(None, ["train.x=[&a [" + ",".join("1" * 20) + "], [" + ",".join(["*a"] * 600) + "]]"])
    ok = tmp_path / "ok.yaml"
    ok.write_text("train: {lr_sigma: &lr 0.002, lr_s: *lr}\n")
    assert load_recipe(ok, paths=False).train.lr_s == 0.002


@pytest.mark.parametrize("value", [""])
def test_an_empty_output_dir_is_named_as_empty(value):
    """``output_dir=$UNSET`` gives an empty value, which paths read as "." (the repository): say it is empty."""
    with pytest.raises(RecipeError, match="output_dir is empty"):
        load_recipe(REPO / "recipes" / "demo_tiny.yaml", [f"output_dir={value}"])
