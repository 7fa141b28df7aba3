"""The typed training recipe: dataclass defaults ← YAML ← dotted CLI overrides, validated.

    recipe = load_recipe("recipes/llama2_7b_cs170k.yaml", ["train.lr_sigma=2e-4", "train.max_steps=100"])

Unknown keys are rejected (with the valid ones listed); every problem found is reported in one
``RecipeError``. Engine settings (ZeRO stage, offload, precision switches) live only in the DeepSpeed JSON;
the recipe holds what the method and the data need. Defaults are the paper's (spec §3).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from frod_ds.core.names import DEFAULT_TARGETS, QUANT_KINDS
from frod_ds.runtime.errors import FrodError, note
from frod_ds.runtime.paths import file_problem
from frod_ds.runtime.shipped import user_file
from frod_ds.runtime.strict_json import MAX_DEPTH, expanded_size, nesting_depth
from frod_ds.runtime.validate import sparsity_problem, targets_problem

__all__ = [
    "RecipeError",
    "ModelCfg",
    "DataCfg",
    "TrainCfg",
    "Recipe",
    "load_recipe",
    "recipe_from_tree",
    "recipe_to_dict",
    "recipe_tree",
    "sets",
]


class RecipeError(FrodError):
    """A recipe that cannot run; the message lists every problem found."""


@dataclass
class ModelCfg:
    base: str = ""  # HF id or local dir of the base checkpoint
    factor_store: str = ""  # directory written by frod hjd
    tokenizer: str | None = None  # defaults to `base`
    targets: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    sparsity: float = 0.02  # density s of S
    seed: int = 0  # seed of the S supports
    init_adapter: str | None = None  # start from this adapter's supports, σ and S (e.g. frod export --from-peft)
    dtype: str = "bfloat16"  # parameter dtype: bfloat16 | float32 (must agree with the DeepSpeed JSON)
    gradient_checkpointing: bool = False  # per layer, non-reentrant (trainer.enable_gradient_checkpointing)
    frozen_quant: str = "none"  # none | int8 | nf4: every U_i held quantized (bitsandbytes), V/σ/S in dtype
    quantize_base: bool = False  # also quantize the untargeted linears of the layers (down_proj, …), as QLoRA


@dataclass
class DataCfg:
    train: str = ""  # train.jsonl of `frod data build`, or its output dir
    eval: str | None = None  # a held-out JSONL scored for loss every eval_every steps
    cutoff_len: int = 256  # tokens per example, longer ones are truncated
    train_on_inputs: bool = False  # false: loss on the answer tokens and EOS only
    limit: int | None = None  # use only the first N training rows (quick runs)


@dataclass
class TrainCfg:
    lr_sigma: float = 1e-4
    lr_s: float = 1e-5
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    schedule: str = "cosine"  # cosine | linear | constant (all with linear warmup)
    warmup_ratio: float = 0.1
    epochs: float = 3.0
    max_steps: int | None = None  # optimizer steps; overrides epochs when set
    micro_batch_size: int = 4  # per rank
    grad_accum: int = 8
    max_grad_norm: float = 1.0
    seed: int = 42  # data order and dropout
    log_every: int = 1
    save_every: int = 200  # adapter + engine checkpoint interval (optimizer steps); 0 = only at the end
    eval_every: int = 0  # 0 = never
    rotation_every: int = 50  # tan α per category (gathers U, V); 0 = never
    keep_checkpoints: int = 2  # engine checkpoints kept for resume
    tensorboard: bool = False
    max_nonfinite_steps: int = 3  # this many consecutive steps with a non-finite loss or gradient stop the run
    new_run: bool = False  # output_dir holds another run: move it aside (output_dir/superseded-*) and start anew
    zero3_partition: str = "auto"  # under a ZeRO-3 JSON: layers | deepspeed | auto (frod_ds.config.zero3_layout)
    zero3_gather: str = "auto"  # the layer partition's gathers: peer | collective | auto (frozen_shards.open_bank)
    # each logged row also has rank 0's forward, backward and optimizer seconds (the device synchronized at each
    # boundary, which costs a little): where a step's time goes
    phase_times: bool = False
    # this optimizer step (1-based; 0: none) runs under Python's cProfile on every rank, each writing
    # profile/step-<k>.rank<r>.txt: where the host's time goes, the waits on the device and on other ranks included
    profile_step: int = 0


@dataclass
class Recipe:
    model: ModelCfg = field(default_factory=ModelCfg)
    data: DataCfg = field(default_factory=DataCfg)
    train: TrainCfg = field(default_factory=TrainCfg)
    output_dir: str = "runs/frod"

    def problems(self, paths: bool = True) -> list[str]:
        """Every problem found; ``paths=False`` leaves out the required paths (for the memory planner)."""
        p = []
        m, d, t = self.model, self.data, self.train
        if paths and not m.base:
            p.append("model.base is required (HF id or local checkpoint dir)")
        if paths and not m.factor_store:
            p.append("model.factor_store is required (the directory written by `frod hjd`)")
        if paths and not str(self.output_dir).strip():  # "output_dir=" (an unset shell variable) reads as "."
            p.append("output_dir is empty; set it to the directory the run writes (e.g. output_dir=runs/frod)")
        p += [
            x
            for x in (targets_problem(m.targets, "model.targets"), sparsity_problem(m.sparsity, "model.sparsity"))
            if x
        ]
        if m.dtype not in ("bfloat16", "float32"):
            p.append(f"model.dtype must be bfloat16 or float32, got {m.dtype!r}")
        if m.frozen_quant not in QUANT_KINDS:
            p.append(f"model.frozen_quant must be one of {', '.join(QUANT_KINDS)}, got {m.frozen_quant!r}")
        elif m.quantize_base and m.frozen_quant == "none":
            p.append("model.quantize_base=true needs model.frozen_quant nf4 or int8 (the kind it uses)")
        if paths and not d.train:
            p.append("data.train is required (train.jsonl from `frod data build`)")
        if d.cutoff_len < 8:
            p.append(f"data.cutoff_len must be >= 8, got {d.cutoff_len}")
        if d.limit is not None and d.limit < 1:
            p.append(f"data.limit must be >= 1 (rows to use), or null for every row; got {d.limit}")
        if t.lr_sigma <= 0 or t.lr_s < 0:
            p.append(f"train.lr_sigma must be > 0 and train.lr_s >= 0, got {t.lr_sigma}, {t.lr_s}")
        if t.schedule not in ("cosine", "linear", "constant"):
            p.append(f"train.schedule must be cosine, linear or constant, got {t.schedule!r}")
        if not 0 <= t.warmup_ratio < 1:
            p.append(f"train.warmup_ratio must be in [0, 1), got {t.warmup_ratio}")
        if t.max_steps is None and t.epochs <= 0:
            p.append("set train.epochs > 0 or train.max_steps")
        elif t.epochs < 0:  # unused beside max_steps (0 there is how other trainers say so), but -1 is a typo
            p.append(f"train.epochs must be > 0, got {t.epochs}")
        if t.seed < 0 or m.seed < 0:  # random.Random(-n) is Random(n): two recorded seeds, one run
            p.append(f"train.seed and model.seed must be >= 0, got {t.seed} and {m.seed}")
        if t.max_steps is not None and t.max_steps <= 0:
            p.append(f"train.max_steps must be > 0, got {t.max_steps}")
        if t.micro_batch_size <= 0 or t.grad_accum <= 0:
            p.append("train.micro_batch_size and train.grad_accum must be > 0")
        if len(t.betas) != 2 or not all(0 <= b < 1 for b in t.betas):  # AdamW's own check is a traceback
            p.append(f"train.betas must be two numbers in [0, 1), got {t.betas}")
        for name in ("max_grad_norm", "weight_decay"):  # 0 turns each off; below 0 it would be taken silently
            if getattr(t, name) < 0:
                p.append(f"train.{name} must be >= 0, got {getattr(t, name)}")
        for name in ("log_every", "save_every", "eval_every", "rotation_every", "profile_step"):
            if getattr(t, name) < 0:
                p.append(f"train.{name} must be >= 0")
        if t.log_every == 0:
            p.append("train.log_every must be >= 1")
        if t.eval_every > 0 and not self.data.eval:  # it would score nothing, without a word
            p.append(f"train.eval_every {t.eval_every} needs data.eval (held-out rows); set it, or train.eval_every=0")
        if t.keep_checkpoints < 1:
            p.append("train.keep_checkpoints must be >= 1")
        if t.zero3_partition not in ("auto", "layers", "deepspeed"):
            p.append(f"train.zero3_partition must be auto, layers or deepspeed, got {t.zero3_partition!r}")
        if t.zero3_gather not in ("auto", "peer", "collective"):
            p.append(f"train.zero3_gather must be auto, peer or collective, got {t.zero3_gather!r}")
        if t.max_nonfinite_steps < 1:
            p.append(f"train.max_nonfinite_steps must be >= 1, got {t.max_nonfinite_steps}")
        for section in ("model", "data", "train"):
            for f in dataclasses.fields(getattr(self, section)):
                v = getattr(getattr(self, section), f.name)
                key = f"{section}.{f.name}"
                for x in v if isinstance(v, (list, tuple)) else [v]:
                    if isinstance(x, float) and not math.isfinite(x):
                        p[:] = [q for q in p if not q.startswith(f"{key} ")]  # one rule for one value: this one
                        p.append(f"{key} must be a finite number, got {x}")
        return p


def _field_types(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _coerce(value: Any, tp: Any, where: str, problems: list[str]) -> Any:
    """Check/convert a YAML value to the field's type; record a problem instead of raising."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], where, problems)
    if origin is list:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            problems.append(f"{where}: expected a list, got {value!r}")
            return value
        return [_coerce(v, args[0], f"{where}[{i}]", problems) for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        problems.append(f"{where}: expected true/false, got {value!r}")
        return value
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
        digits = len(str(abs(value)))
        problems.append(f"{where}: a {digits}-digit number is beyond any setting (at most {MAX_INT}); fix it")
        return value
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        problems.append(f"{where}: expected a number, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        problems.append(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is str:
        if isinstance(value, str):
            return value
        problems.append(f"{where}: expected a string, got {value!r}")
        return value
    return value


def _build(cls, data: dict, prefix: str, problems: list[str]):
    types = _field_types(cls)
    kwargs = {}
    for key, value in data.items():
        where = f"{prefix}{key}"
        if key not in types:
            problems.append(f"unknown key {where!r} (valid: {', '.join(sorted(prefix + k for k in types))})")
            continue
        tp = types[key]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                problems.append(f"{where}: expected a mapping")
                continue
            kwargs[key] = _build(tp, value, f"{where}.", problems)
        else:
            kwargs[key] = _coerce(value, tp, where, problems)
    return cls(**kwargs)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise RecipeError(f"override {dotted!r}: {k!r} is not a section")
    node[keys[-1]] = value


# The largest integer a recipe number may be: every integer up to it is exact as a float, which the planner and
# the trainer compute with (a larger one is no setting, and float() of a 400-digit one overflows).
MAX_INT = 2**53

# Values a recipe file may hold, its YAML aliases expanded: the recipes have a few dozen, a billion-laughs file
# (aliases of aliases) billions, which any walk over it would visit one by one.
MAX_VALUES = 10_000


class _HugeIntegerError(yaml.constructor.ConstructorError):
    """A YAML integer with more digits than Python converts (``sys.get_int_max_str_digits``)."""


class _ScalarLoader(yaml.SafeLoader):
    """``yaml.safe_load``'s loader, refusing an integer too long for ``int`` as a ``YAMLError`` at its position
    (PyYAML lets ``int``'s plain ``ValueError`` through)."""

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        limit = sys.get_int_max_str_digits()
        try:
            value = super().construct_yaml_int(node)
        except ValueError as e:
            if "integer string conversion" not in str(e) and "Exceeds the limit" not in str(e):
                raise yaml.constructor.ConstructorError(
                    None, None, f"{node.value!r} is no integer ({e})", node.start_mark
                ) from None
            value = None
        if value is not None and not (limit and abs(value) >= 10**limit):  # a hex one is read, but never printed
            return value
        raise _HugeIntegerError(
            None,
            None,
            f"an integer of more than {limit} digits; no setting needs one this long",
            node.start_mark,
        )


_ScalarLoader.add_constructor("tag:yaml.org,2002:int", _ScalarLoader.construct_yaml_int)


class _UniqueKeyLoader(_ScalarLoader):
    """``_ScalarLoader``, refusing a key given twice in one mapping (YAML keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # ``<<: *anchor``: its keys may be overridden here
                continue
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, typing.Hashable) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"key {key!r} is given twice in one mapping (YAML keeps only the last value); remove one",
                    key_node.start_mark,
                )
            if isinstance(key, typing.Hashable):
                seen.add(key)
        return super().construct_mapping(node, deep)


def load_recipe(path: str | Path | None, overrides: list[str] = (), paths: bool = True) -> Recipe:
    """defaults ← YAML file ← ``key.sub=value`` overrides (values parsed as YAML scalars). ``paths=False``: the
    model, factor store and data paths may be missing (``frod plan``)."""
    return recipe_from_tree(recipe_tree(path, overrides), paths)


def sets(tree: dict, dotted: str) -> bool:
    """Whether the file or an override of ``tree`` (``recipe_tree``) gives ``dotted`` (``model.dtype``) itself."""
    node: Any = tree
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return False
        node = node[key]
    return True


def recipe_tree(path: str | Path | None, overrides: list[str] = ()) -> dict:
    """What the YAML file and the overrides give, before defaults (a mapping of sections)."""
    tree: dict = {}
    if path is not None:
        from frod_ds.runtime.paths import input_path

        p = user_file(input_path(str(path)), "recipes")  # a shipped recipe by name also outside a checkout
        if not p.is_file():  # a named pipe or a link loop is said as such, not "not found"
            raise RecipeError(f"recipe file {file_problem(p) if p.is_symlink() or p.exists() else f'{p} not found'}")
        too_deep = f"recipe {p} nests lists or mappings more than {MAX_DEPTH} deep; fix the file"
        try:
            loaded = yaml.load(p.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader) or {}
        except UnicodeDecodeError as e:
            raise RecipeError(f"recipe {p} is not UTF-8 text (byte {e.start}); save it as UTF-8") from None
        except RecursionError:  # the YAML parser is recursive: lists or mappings nested thousands deep
            raise RecipeError(too_deep) from None
        except yaml.YAMLError as e:  # the parser's own position (line, column) says where to look
            where = getattr(e, "problem_mark", None)
            at = f" at line {where.line + 1}, column {where.column + 1}" if where is not None else ""
            what = "" if isinstance(e, _HugeIntegerError) else " is not valid YAML"
            raise RecipeError(f"recipe {p}{what}{at}: {getattr(e, 'problem', None) or e}; fix the file") from None
        if not isinstance(loaded, dict):
            raise RecipeError(f"recipe {p} must be a YAML mapping")
        if expanded_size(loaded, MAX_VALUES) > MAX_VALUES:  # before any walk over it, which would expand it
            raise RecipeError(
                f"recipe {p} holds more than {MAX_VALUES} values once its YAML aliases (*name) are expanded, or an "
                "alias inside the value it names; a recipe has a few dozen: write the values out"
            )
        if nesting_depth(loaded) > MAX_DEPTH:
            raise RecipeError(too_deep)
        tree = loaded
    given: dict[str, str] = {}
    for item in overrides:
        if "=" not in item:
            raise RecipeError(f"override {item!r} must look like section.key=value (e.g. train.lr_sigma=2e-4)")
        key, raw = item.split("=", 1)
        key = key.strip()
        if given.get(key, raw) != raw:  # a script's defaults, then the user's: the last wins, said once
            note(f"{key} is given twice on the command line ({given[key]}, then {raw}); using {raw}")
        given[key] = raw
        try:
            value = yaml.load(raw, Loader=_ScalarLoader) if raw != "" else ""
        except _HugeIntegerError as e:
            raise RecipeError(f"override {key}=...: {e.problem}; give a smaller value") from None
        except (yaml.YAMLError, RecursionError):
            raise RecipeError(f"override {item!r}: the value is not a YAML scalar; quote it") from None
        if expanded_size(value, MAX_VALUES) > MAX_VALUES:
            raise RecipeError(f"override {key}=...: the value holds more than {MAX_VALUES} values; give a scalar")
        _set_dotted(tree, key, value)
    return tree


# the recipe's inputs: a leading ~ is expanded as a shell would (output_dir is an output: never expanded)
INPUT_PATHS = (("model", "base"), ("model", "factor_store"), ("model", "tokenizer"), ("model", "init_adapter"))
INPUT_PATHS += (("data", "train"), ("data", "eval"))


def recipe_from_tree(tree: dict, paths: bool = True) -> Recipe:
    """The recipe ``tree`` (``recipe_tree``) gives over the defaults, checked (``load_recipe``); its input paths
    with ``~`` expanded (``runtime.paths.input_path``)."""
    from frod_ds.runtime.paths import input_path, output_path

    problems: list[str] = []
    recipe = _build(Recipe, tree, "", problems)
    for section, key in INPUT_PATHS if not problems else ():
        value = getattr(getattr(recipe, section), key)
        if isinstance(value, str):
            setattr(getattr(recipe, section), key, input_path(value))
    if not problems and isinstance(recipe.output_dir, str) and recipe.output_dir.strip():
        recipe.output_dir = output_path(recipe.output_dir)  # its .. resolved (runtime.paths.output_path)
    if not problems:
        problems = recipe.problems(paths)
    if problems:
        raise RecipeError("invalid recipe: " + "; ".join(problems))
    return recipe


def recipe_to_dict(recipe: Recipe) -> dict:
    return dataclasses.asdict(recipe)
