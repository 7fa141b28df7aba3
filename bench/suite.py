"""A benchmark suite: a TOML file in ``bench/suites/`` declaring configurations, expanded and validated here.

A suite names its ``kind`` (the measurement every configuration runs, ``bench/kinds/``: ``step`` times training
steps, ``chain`` runs FRoD on a synthetic model from generation to a resumed run), ``defaults`` shared by
its configurations, and ``[[configs]]`` tables; a list value in a table expands to one configuration per item
(the product over every listed key), so ``method = ["frod", "lora"]`` with ``gpus = [1, 2]`` declares four.
Each configuration gets a stable name from its settings, and its result lives at
``<results>/<suite>/<device>/<name>.json`` (``bench/record.py``).
"""

from __future__ import annotations

import itertools
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["SUITES", "BenchError", "Config", "Suite", "kind_keys", "load_suite", "suite_names", "with_defaults"]

SUITES = Path(__file__).resolve().parent / "suites"
KINDS = ("step", "chain")
# what each key of a step configuration means, with its default (a key not here is a mistake)
STEP_KEYS: dict[str, Any] = {
    "method": None,  # frod | lora
    "engine": None,  # plain | ddp | zero0 | zero2 | zero3 | z3layers | fshard | fsdp2 (bench/kinds/step.py)
    "gpus": 1,
    "shape": "7b",  # bench/kinds/shapes.py
    "batch": 4,  # micro-batch per GPU
    "seq": 512,
    "warmup": 3,
    "steps": 10,  # timed steps per window
    "repeats": 3,  # timed windows
    "gc": False,  # gradient checkpointing (the trainer's, non-reentrant), both methods
    "sparsity": 0.02,  # FRoD density of S
    "lora_r": 16,
    "quant": "none",  # frozen weights: none | nf4 | int8 (FRoD's U_i, LoRA's targeted base linears)
    "quantize_base": False,  # with quant: the untargeted decoder linears too (for LoRA: QLoRA)
    "ds_set": {},  # DeepSpeed JSON overrides: dotted key from the top -> value
    "ddp": {},  # DistributedDataParallel keyword overrides (bucket_cap_mb, static_graph, ...)
    # fshard / z3layers: how a unit's frozen shards are gathered (frozen_shards.GATHERS); frod train's auto is peer
    # on one machine's GPUs
    "gather": "collective",
    "profile": 0,  # steps profiled after the timed ones (bench/kinds/profile.py), per rank; 0: none
    "leaf_modules": False,  # LoRA under ZeRO-3: each decoder layer one fetch unit
    # LoRA's base: from_pretrained on every rank, or direct: built without weights, each rank reading its share
    # straight from the files (bench/kinds/direct_load.py)
    "load": "from_pretrained",
    "tag": "",  # a name suffix for a variant the other keys do not name
    "timeout_s": 240,  # a configuration still running after this is killed and recorded as timed out
}


class BenchError(ValueError):
    """A mistake in a suite or a runner argument; one line saying what to change."""


@dataclass(frozen=True)
class Config:
    """One configuration of a suite: its name and every setting (defaults filled in)."""

    name: str
    settings: dict[str, Any] = field(hash=False)

    def __getitem__(self, key: str) -> Any:
        return self.settings[key]


@dataclass(frozen=True)
class Suite:
    name: str
    description: str
    kind: str
    configs: tuple[Config, ...]
    path: Path

    def config(self, name: str) -> Config:
        for c in self.configs:
            if c.name == name:
                return c
        raise BenchError(f"suite {self.name!r} has no configuration {name!r} (python -m bench list {self.name})")


def kind_keys(kind: str) -> dict[str, Any]:
    """The keys of a ``kind``'s configurations, with their defaults."""
    if kind == "chain":
        from bench.kinds.chain import CHAIN_KEYS

        return CHAIN_KEYS
    return STEP_KEYS


def with_defaults(settings: dict[str, Any], kind: str = "step") -> dict[str, Any]:
    """A record's settings as today's runner reads them: a key added since the record was written takes its default
    (every key is added with the default that is what ran before it existed)."""
    return {**kind_keys(kind), **settings}


def suite_names() -> list[str]:
    return sorted(p.stem for p in SUITES.glob("*.toml"))


def _expand(table: dict[str, Any]) -> list[dict[str, Any]]:
    keys = [k for k, v in table.items() if isinstance(v, list)]
    fixed = {k: v for k, v in table.items() if k not in keys}
    return [{**fixed, **dict(zip(keys, combo))} for combo in itertools.product(*(table[k] for k in keys))]


def config_name(s: dict[str, Any]) -> str:
    """``frod-zero3-2g`` and, past the defaults, what differs: ``-gc``, ``-r64``, ``-nf4base``, ``-direct``,
    ``-<tag>``."""
    parts = [s["method"], s["engine"], f"{s['gpus']}g"]
    if s["shape"] != STEP_KEYS["shape"]:
        parts.insert(0, s["shape"])
    if s["gc"]:
        parts.append("gc")
    if s["method"] == "lora" and s["lora_r"] != STEP_KEYS["lora_r"]:
        parts.append(f"r{s['lora_r']}")
    if s["quant"] != "none":
        parts.append(s["quant"] + ("base" if s["quantize_base"] else ""))
    if s["gather"] != STEP_KEYS["gather"]:
        parts.append(s["gather"])
    if s["load"] != STEP_KEYS["load"]:
        parts.append(s["load"])
    if s["profile"]:
        parts.append("prof")
    if s["tag"]:
        parts.append(s["tag"])
    return "-".join(str(p) for p in parts)


def _check(s: dict[str, Any], where: str) -> None:
    from bench.kinds.shapes import SHAPES
    from bench.kinds.step import ENGINES

    if s["method"] not in ("frod", "lora"):
        raise BenchError(f"{where}: method {s['method']!r} is not frod or lora")
    if s["engine"] not in ENGINES:
        raise BenchError(f"{where}: engine {s['engine']!r} is not one of {', '.join(ENGINES)}")
    if s["shape"] not in SHAPES:
        raise BenchError(f"{where}: shape {s['shape']!r} is not one of {', '.join(SHAPES)}")
    if not isinstance(s["gpus"], int) or s["gpus"] < 1:
        raise BenchError(f"{where}: gpus must be a positive integer, got {s['gpus']!r}")
    if s["engine"] == "z3layers" and s["method"] != "frod":
        raise BenchError(f"{where}: engine z3layers is FRoD's (LoRA's frozen weights partitioned so: fshard)")
    if s["gather"] not in ("auto", "peer", "collective"):
        raise BenchError(f"{where}: gather {s['gather']!r} is not auto, peer or collective")
    if s["gather"] != "collective" and s["engine"] not in ("fshard", "z3layers"):
        raise BenchError(f"{where}: gather is a setting of the fshard and z3layers engines, not {s['engine']}")
    if s["engine"] == "plain" and s["gpus"] != 1:
        raise BenchError(f"{where}: engine plain runs on one GPU (use ddp or a ZeRO engine for {s['gpus']})")
    if s["quant"] not in ("none", "nf4", "int8"):
        raise BenchError(f"{where}: quant {s['quant']!r} is not none, nf4 or int8")
    if s["quantize_base"] and s["quant"] == "none":
        raise BenchError(f"{where}: quantize_base needs quant nf4 or int8")
    if s["load"] not in ("from_pretrained", "direct"):
        raise BenchError(f"{where}: load {s['load']!r} is not from_pretrained or direct")
    direct_engines = ("plain", "ddp", "fsdp2", "zero3")
    if s["load"] == "direct" and (s["method"] != "lora" or s["quant"] != "none" or s["engine"] not in direct_engines):
        raise BenchError(f"{where}: load direct is LoRA's on a bf16 base under {', '.join(direct_engines)}")
    if s["warmup"] < 1 or s["steps"] < 1 or s["repeats"] < 1:
        raise BenchError(f"{where}: warmup, steps and repeats must each be at least 1")
    if s["tag"] and not re.fullmatch(r"[a-z0-9][a-z0-9_.]*", s["tag"]):
        raise BenchError(f"{where}: tag {s['tag']!r} must be lower-case letters, digits, '_' or '.'")


def load_suite(name_or_path: str | Path) -> Suite:
    """The suite ``bench/suites/<name>.toml`` (or a path to a TOML file), expanded and validated."""
    path = Path(name_or_path)
    if path.suffix != ".toml":
        path = SUITES / f"{name_or_path}.toml"
    if not path.is_file():
        raise BenchError(f"no suite {str(name_or_path)!r}: the suites are {', '.join(suite_names())}")
    try:
        doc = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise BenchError(f"{path.name}: not valid TOML ({e})") from None
    unknown = set(doc) - {"description", "kind", "defaults", "configs"}
    if unknown:
        raise BenchError(f"{path.name}: unknown top-level keys {sorted(unknown)}")
    kind = doc.get("kind", "")
    if kind not in KINDS:
        raise BenchError(f"{path.name}: kind {kind!r} is not one of {', '.join(KINDS)}")
    keys = kind_keys(kind)
    check, name_of = _check, config_name
    if kind == "chain":
        from bench.kinds import chain

        check, name_of = chain.check, chain.config_name
    defaults = {**keys, **doc.get("defaults", {})}
    configs: dict[str, Config] = {}
    for i, table in enumerate(doc.get("configs", [])):
        where = f"{path.name} configs[{i}]"
        unknown = set(table) - set(keys)
        if unknown or set(doc.get("defaults", {})) - set(keys):
            bad = sorted(unknown | (set(doc.get("defaults", {})) - set(keys)))
            raise BenchError(f"{where}: unknown keys {bad}; a {kind} configuration takes {', '.join(keys)}")
        for settings in _expand({**defaults, **table}):
            check(settings, where)
            name = name_of(settings)
            if name in configs:
                raise BenchError(f"{where}: configuration {name!r} is declared twice (give one a tag)")
            configs[name] = Config(name, settings)
    if not configs:
        raise BenchError(f"{path.name}: declares no configurations")
    return Suite(path.stem, doc.get("description", ""), kind, tuple(configs.values()), path)
