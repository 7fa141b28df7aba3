"""The one result format: a JSON per configuration at ``<results>/<suite>/<device>/<config>.json`` (a chain's: one
per stage, ``<config>.<stage>.json``).

Every record carries what is needed to trust and reproduce it: the configuration's settings, the command, the
device, the date, the package versions, the commit, and the runner call it came from (``call``: ratios between
results are taken only inside one call). ``status`` is ``ok``, ``failed`` or ``timeout``; a failed record keeps
the tail of its log instead of metrics.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from frod_ds.runtime.atomic import atomic_write_text

__all__ = ["SCHEMA", "Record", "device_key", "device_facts", "versions", "commit", "read_records", "record_path"]

SCHEMA = 1
RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class Record:
    suite: str
    config: str
    settings: dict[str, Any]
    status: str  # ok | failed | timeout
    call: str  # the runner call that produced it: "<UTC start>@<host>"
    device: dict[str, Any]
    command: list[str]
    date: str
    versions: dict[str, str]
    commit: str
    wall_s: float
    metrics: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    series: int = 1  # the same configurations measured again in a later call: its own record beside the first
    schema: int = SCHEMA
    stage: str = ""  # a chain configuration's stage (bench/kinds/chain.py), "" for the other kinds

    def write(self, results: Path) -> Path:
        path = record_path(results, self.suite, self.device["key"], self.config, self.series, self.stage)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(asdict(self), indent=1, sort_keys=True) + "\n")
        return path

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Record:
        if doc.get("schema") != SCHEMA:
            raise ValueError(f"result schema {doc.get('schema')!r}, this runner reads {SCHEMA}")
        return cls(**doc)


def record_path(results: Path, suite: str, device: str, config: str, series: int = 1, stage: str = "") -> Path:
    name = config + (f".{stage}" if stage else "") + ("" if series == 1 else f".s{series}")
    return Path(results) / suite / device / f"{name}.json"


def read_records(results: Path, suite: str, device: str | None = None) -> list[Record]:
    """Every record of ``suite`` (of one device folder, or all), in path order."""
    pattern = f"{suite}/{device or '*'}/*.json"
    return [Record.from_json(json.loads(p.read_text())) for p in sorted(Path(results).glob(pattern))]


def device_facts() -> dict[str, Any]:
    """The machine's accelerators: name, count, memory, and the folder key (``h200x2``, ``cpu``)."""
    import torch

    if not torch.cuda.is_available():
        return {"name": f"CPU ({os.cpu_count()} cores)", "count": 0, "memory_gib": None, "key": "cpu"}
    name = torch.cuda.get_device_name(0)
    n = torch.cuda.device_count()
    model = re.search(r"\b([A-Z]+\d+[A-Za-z]*)\b", name.replace("NVIDIA", ""))
    key = f"{(model.group(1) if model else 'gpu').lower()}x{n}"
    mem = torch.cuda.get_device_properties(0).total_memory / 2**30
    return {"name": name, "count": n, "memory_gib": round(mem, 1), "key": key}


def device_key() -> str:
    return device_facts()["key"]


def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("torch", "deepspeed", "transformers", "peft", "frod-ds"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    import torch

    out["cuda"] = str(torch.version.cuda)
    return out


def commit() -> str:
    """The checkout's commit (``BENCH_COMMIT`` where the tree was copied without its history), ``+dirty`` when the
    tracked files differ from it."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "-uno"], cwd=root, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
