"""Distributed HJD stage (spec §1, "Distributed HJD"): checkpoint shards in, factor store out.

Per category, with ``P`` ranks and ``L`` members (contiguous blocks of members per rank, any ``P``,
also ``P > L``: a rank without members still takes part in every collective)::

    rank p, block b of its members:  W_b = Q_b R_b               thin_qr, W_b (m_b, n) read from the shards
    rank p:   [R_1; …; R_B] = Q̂ R⁽ᵖ⁾                              tsqr_combine (skipped for one block)
    rank 0:   [R⁽¹⁾; …; R⁽ᴾ⁾] = Q̃ R                               gather_rows, tsqr_combine, scatter_rows
    member i: Q_i = Q_b[i] Q̂_b Q̃_p                               (m_i, k)
    T_pi = (1/L) Σ_i (Q_iᵀQ_i + πI)⁻¹                             local sums + one all-reduce
    rank 0:   V, Z = shared_basis(R, T_pi)                         broadcast to all
    member i: U_i, σ_i = member_factors(Q_i, Z, n)                 written by the rank that owns it

Blocks bound the working memory: a rank never stacks more than ``block_bytes`` of weights at once; the
``Q_b`` wait between the passes on the device up to ``device_cache_bytes`` and in host memory beyond.
Peak device memory ≈ min(local Q, cache) + ~3 blocks + a few (n, n). The math is ``frod_ds.hjd``; this
module decides who computes what, reads and writes, and checks.
"""

from __future__ import annotations

import json
import math
import random
import re
import resource
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import Tensor
from tqdm import tqdm

from frod_ds import distributed as D
from frod_ds.apply import DEFAULT_TARGETS
from frod_ds.hf_checkpoint import HFCheckpoint, resolve_model_dir
from frod_ds.hjd import member_factors, no_tf32, reconstruction_error, shared_basis, t_pi_term, thin_qr, tsqr_combine
from frod_ds.store import (
    FINGERPRINT_METHOD,
    FORMAT_VERSION,
    MANIFEST,
    FactorStore,
    atomic_write_json,
    check_store_matches,
    dtype_name,
    fsync_dir,
    is_store_file,
    part_file,
    save_tensors_atomic,
    sigma_key,
    u_key,
    v_file,
    v_key,
    weights_fingerprint,
)

__all__ = ["StageConfig", "plan_categories", "split_counts", "make_blocks", "run_stage", "verify_store"]

GiB = 2**30
U_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
CONFIG_KEYS = ("format_version", "fingerprint", "targets", "pi", "hjd_dtype")
T = TypeVar("T")


@dataclass
class StageConfig:
    """What ``launch/hjd.py`` was asked to do; validated on construction."""

    model: str
    out: Path
    targets: tuple[str, ...] = DEFAULT_TARGETS
    pi: float = 1e-3
    dtype: torch.dtype = torch.float32
    block_gb: float = 4.0
    device_cache_gb: float = 16.0
    device: str = "auto"
    overwrite: bool = False
    fsync: bool = True

    def __post_init__(self) -> None:
        problems = []
        self.out = Path(self.out)
        self.targets = tuple(self.targets)
        if not self.targets or len(set(self.targets)) != len(self.targets) or any(not t or "." in t for t in self.targets):
            problems.append(f"--targets must be distinct module names without dots, got {list(self.targets)}")
        if not (isinstance(self.pi, (int, float)) and math.isfinite(self.pi) and self.pi > 0):
            problems.append(f"--pi must be a finite number > 0, got {self.pi!r}")
        if self.dtype not in (torch.float32, torch.float64):
            problems.append(f"--dtype must be float32 or float64, got {self.dtype}")
        if not self.block_gb > 0:
            problems.append(f"--block-gb must be > 0, got {self.block_gb}")
        if not self.device_cache_gb >= 0:
            problems.append(f"--device-cache-gb must be >= 0, got {self.device_cache_gb}")
        if self.device not in ("auto", "cpu", "cuda"):
            problems.append(f"--device must be auto, cpu or cuda, got {self.device!r}")
        if problems:
            raise ValueError("; ".join(problems))


# -------------------------------------------------------------------------------------------- planning


def _natural_key(name: str) -> list[Any]:
    """``layers.10`` after ``layers.9``: digit runs compare as integers."""
    return [int(s) if s.isdigit() else s for s in re.split(r"(\d+)", name)]


def plan_categories(ckpt: HFCheckpoint, targets: Sequence[str]) -> dict[str, list[str]]:
    """``{target: [member, ...]}`` from the checkpoint's tensor names, members in layer order.

    A member is a module ``<path>.<target>`` with a 2-D floating ``<path>.<target>.weight``; all members
    of a category share the input width. Reads shard headers only (and so reports missing or truncated
    shards holding targeted weights).
    """
    found: dict[str, list[str]] = {t: [] for t in targets}
    for key in ckpt.keys():
        if key.endswith(".weight"):
            module = key[: -len(".weight")]
            leaf = module.rsplit(".", 1)[-1]
            if leaf in found:
                found[leaf].append(module)
    missing = [t for t, members in found.items() if not members]
    if missing:
        leaves = sorted({k[: -len(".weight")].rsplit(".", 1)[-1] for k in ckpt.keys() if k.endswith(".weight")})
        raise ValueError(
            f"no weight '<module>.{missing[0]}.weight' in {ckpt.dir} for --targets {missing}; the checkpoint's "
            f"weight names end in: {', '.join(leaves[:24])}"
        )
    for category, members in found.items():
        members.sort(key=_natural_key)
        widths = set()
        for m in members:
            info = ckpt.info(m + ".weight")
            if len(info.shape) != 2:
                raise ValueError(f"{m}.weight has shape {list(info.shape)}; HJD targets 2-D linear weights")
            if info.dtype not in U_DTYPES:
                raise ValueError(f"{m}.weight has dtype {info.dtype}; HJD needs bf16/fp16/fp32/fp64 weights (dequantize first)")
            widths.add(info.shape[1])
        if len(widths) > 1:
            raise ValueError(f"category {category!r} mixes input widths {sorted(widths)}; members must share n")
        dtypes = {ckpt.dtype(m + ".weight") for m in members}
        if len(dtypes) > 1:
            raise ValueError(f"category {category!r} mixes dtypes {sorted(map(str, dtypes))}; convert the checkpoint to one dtype")
    return found


def split_counts(n_items: int, parts: int) -> list[int]:
    """Contiguous split sizes, ``numpy.array_split`` style: the first ``n_items % parts`` get one more."""
    return [n_items // parts + (1 if p < n_items % parts else 0) for p in range(parts)]


def make_blocks(heights: Sequence[int], n: int, itemsize: int, block_bytes: float) -> list[range]:
    """Contiguous member index ranges whose stacks stay under ``block_bytes`` (at least one member each)."""
    blocks: list[range] = []
    start, rows = 0, 0
    for i, m in enumerate(heights):
        if i > start and (rows + m) * n * itemsize > block_bytes:
            blocks.append(range(start, i))
            start, rows = i, 0
        rows += m
    if start < len(heights):
        blocks.append(range(start, len(heights)))
    return blocks


# ---------------------------------------------------------------------------------------------- helpers


def _prefetch(fn: Callable[[Any], T], items: Sequence[Any], pool: ThreadPoolExecutor) -> Iterator[T]:
    """``fn(item)`` for each item, the next one computed in ``pool`` while the caller works on this one."""
    nxt: Future | None = pool.submit(fn, items[0]) if items else None
    for j in range(len(items)):
        assert nxt is not None
        cur = nxt.result()
        nxt = pool.submit(fn, items[j + 1]) if j + 1 < len(items) else None
        yield cur


class _QCache:
    """``Q`` blocks between the passes: on the device up to a byte budget, in host memory beyond."""

    def __init__(self, device: torch.device, budget_bytes: float):
        self.device, self.budget, self.on_device = device, budget_bytes, 0
        self._blocks: dict[int, Tensor] = {}

    def put(self, b: int, t: Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        if t.device.type != "cpu" and self.on_device + nbytes > self.budget:
            t = t.cpu()
        elif t.device.type != "cpu":
            self.on_device += nbytes
        self._blocks[b] = t

    def pop(self, b: int) -> Tensor:
        t = self._blocks.pop(b)
        if t.device.type != "cpu":
            self.on_device -= t.numel() * t.element_size()
            return t
        return t.to(self.device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _agree(error: str | None) -> None:
    """Collective: raise the first rank's ``ValueError`` message on every rank, so all exit together."""
    errors = [e for e in D.all_gather_object(error) if e]
    if errors:
        raise ValueError(errors[0])


def _on_main(fn: Callable[[], T]) -> T:
    """Run ``fn`` on rank 0 and broadcast its result; a ``ValueError`` there is raised on every rank."""
    result, error = None, None
    if D.is_main():
        try:
            result = fn()
        except ValueError as e:
            error = str(e)
    result, error = D.broadcast_object((result, error))
    if error:
        raise ValueError(error)
    return result  # type: ignore[return-value]


def _versions() -> dict[str, str]:
    import safetensors

    import frod_ds

    return {
        "frod_ds": frod_ds.__version__,
        "torch": torch.__version__,
        "safetensors": safetensors.__version__,
        "python": sys.version.split()[0],
    }


def _model_config(model_dir: Path) -> dict[str, Any] | None:
    path = model_dir / "config.json"
    if not path.is_file():
        return None
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
    keys = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "torch_dtype", "dtype")
    return {k: cfg[k] for k in keys if k in cfg}


# ------------------------------------------------------------------------------------------ one category


@dataclass
class _CategoryOut:
    files: dict[str, str]
    error: dict[str, float]
    stored_error: dict[str, float]
    phase_seconds: dict[str, float]


def _run_category(
    ckpt: HFCheckpoint,
    category: str,
    members: list[str],
    cfg: StageConfig,
    device: torch.device,
    writer: ThreadPoolExecutor,
    loader: ThreadPoolExecutor,
) -> _CategoryOut:
    """TSQR-based HJD of one category; every rank calls it. Writes this rank's part files (and V on
    rank 0) and returns what the manifest records."""
    rank, world = D.get_rank(), D.get_world_size()
    dtype, L = cfg.dtype, len(members)
    n = ckpt.shape(members[0] + ".weight")[1]
    u_dtype = ckpt.dtype(members[0] + ".weight")
    counts = split_counts(L, world)
    first = sum(counts[:rank])
    mine = members[first : first + counts[rank]]
    heights = [ckpt.shape(m + ".weight")[0] for m in mine]
    offsets = [0]
    for m in heights:
        offsets.append(offsets[-1] + m)
    blocks = make_blocks(heights, n, torch.finfo(dtype).bits // 8, cfg.block_gb * GiB)
    cache = _QCache(device, cfg.device_cache_gb * GiB)
    phase: dict[str, float] = {}
    bar = tqdm(total=2 * len(mine), desc=f"{category} L={L} n={n}", unit="member", disable=not D.is_main(),
               dynamic_ncols=True, leave=True, file=sys.stderr)

    def read(block: range) -> list[Tensor]:  # in the loader thread: CPU tensors, checkpoint dtype
        return [ckpt.get(mine[i] + ".weight") for i in block]

    def stack(block: range, Ws: list[Tensor]) -> Tensor:
        W_b = torch.empty(offsets[block.stop] - offsets[block.start], n, dtype=dtype, device=device)  # (m_b, n)
        for i, W in zip(block, Ws):
            rows = slice(offsets[i] - offsets[block.start], offsets[i + 1] - offsets[block.start])
            W_b[rows].copy_(W)
            if not torch.isfinite(W_b[rows]).all():
                raise ValueError(f"{mine[i]}.weight in {ckpt.info(mine[i] + '.weight').file} contains NaN or Inf; check the checkpoint")
        return W_b

    t0 = time.perf_counter()
    # Pass 1: local QR per block.
    R_blocks: list[Tensor] = []
    error = None
    try:
        for b, Ws in enumerate(_prefetch(read, blocks, loader)):
            W_b = stack(blocks[b], Ws)
            del Ws
            Q_b, R_b = thin_qr(W_b)  # (m_b, k_b), (k_b, n)
            del W_b
            cache.put(b, Q_b)
            R_blocks.append(R_b)
            del Q_b
            bar.update(len(blocks[b]))
    except ValueError as e:
        error = str(e)
    _agree(error)
    _sync(device)
    phase["read_qr"] = time.perf_counter() - t0

    # Local and global combine.
    t1 = time.perf_counter()
    Q_hat: list[Tensor | None]
    if not R_blocks:
        Q_hat, R_p = [], torch.zeros(0, n, dtype=dtype, device=device)
    elif len(R_blocks) == 1:
        Q_hat, R_p = [None], R_blocks[0]
    else:
        Q_hat_t, R_p = tsqr_combine(R_blocks)  # Q̂_b (k_b, k_p), R⁽ᵖ⁾ (k_p, n)
        Q_hat = list(Q_hat_t)
    del R_blocks
    R_all = D.gather_rows(R_p)  # rank 0: [R⁽¹⁾ … R⁽ᴾ⁾]
    del R_p
    R = Q_tilde = None
    if R_all is not None:
        Q_tilde, R = tsqr_combine(R_all)  # Q̃_p (k_p, k), R (k, n)
        del R_all
    Q_tilde_p = D.scatter_rows(Q_tilde, like=torch.empty(0, dtype=dtype, device=device))  # (k_p, k)
    del Q_tilde
    k = int(Q_tilde_p.shape[1])
    _sync(device)
    phase["combine"] = time.perf_counter() - t1

    # Pass 2: Q_i in the global frame and the T_pi terms.
    t2 = time.perf_counter()
    T_pi = torch.zeros(k, k, dtype=dtype, device=device)
    for b, block in enumerate(blocks):
        M_b = Q_tilde_p if Q_hat[b] is None else Q_hat[b] @ Q_tilde_p  # (k_b, k)
        Q_g = cache.pop(b) @ M_b  # (m_b, k): rows of the global Q
        base = offsets[block.start]
        for i in block:
            Q_i = Q_g[offsets[i] - base : offsets[i + 1] - base]  # (m_i, k)
            T_pi += t_pi_term(Q_i.T @ Q_i, cfg.pi)
        cache.put(b, Q_g)
        del Q_g, M_b
    del Q_hat, Q_tilde_p
    D.all_reduce_sum(T_pi)
    T_pi /= L
    V = torch.empty(n, n, dtype=dtype, device=device)
    Z = torch.empty(k, k, dtype=dtype, device=device)
    if D.is_main():
        V, Z = shared_basis(R, T_pi)  # (n, n), (k, k)
    del R, T_pi
    D.broadcast(Z)
    D.broadcast(V)
    _sync(device)
    phase["t_pi_eigh"] = time.perf_counter() - t2

    # Pass 3: U_i, σ_i per member, reconstruction checked against the weights read again.
    t3 = time.perf_counter()
    V32 = V.float()
    V_stored = V32.to(dtype)  # (n, n): V as the store holds it, in the compute dtype
    exact_store = dtype == torch.float32 and u_dtype == torch.float32
    files: dict[str, str] = {}
    err: dict[str, float] = {}
    stored_err: dict[str, float] = {}
    pending: list[Future] = []
    for b, Ws in enumerate(_prefetch(read, blocks, loader)):
        block = blocks[b]
        Q_g = cache.pop(b)
        base = offsets[block.start]
        tensors: dict[str, Tensor] = {}
        for i, W_cpu in zip(block, Ws):
            member = mine[i]
            W_i = W_cpu.to(device=device, dtype=dtype)  # (m_i, n)
            U_i, sigma_i = member_factors(Q_g[offsets[i] - base : offsets[i + 1] - base], Z, n)  # (m_i, n), (n,)
            err[member] = reconstruction_error(W_i, U_i, sigma_i, V)
            U_s, sigma_s = U_i.to(u_dtype), sigma_i.float()
            stored_err[member] = err[member] if exact_store else reconstruction_error(
                W_i, U_s.to(dtype), sigma_s.to(dtype), V_stored)
            tensors[u_key(member)] = U_s.cpu()
            tensors[sigma_key(member)] = sigma_s.cpu()
            del W_i, U_i, U_s
            bar.update(1)
        del Q_g, Ws
        fname = part_file(category, rank, b)
        for key in tensors:
            files[key] = fname
        while pending:  # at most one write in flight: bounded host memory
            pending.pop().result()
        pending.append(writer.submit(save_tensors_atomic, cfg.out / fname, tensors, cfg.fsync))
        del tensors
    if D.is_main():
        files[v_key(category)] = v_file(category)
        pending.append(writer.submit(save_tensors_atomic, cfg.out / v_file(category), {v_key(category): V32.cpu()}, cfg.fsync))
    for f in pending:
        f.result()
    phase["factors_write"] = time.perf_counter() - t3
    bar.set_postfix_str(f"max err {max(err.values()) if err else 0:.1e}")
    bar.close()
    return _CategoryOut(files, err, stored_err, phase)


# ------------------------------------------------------------------------------------------------ store


def _new_manifest(cfg: StageConfig, fingerprint: str, categories: dict[str, list[str]], ckpt: HFCheckpoint) -> dict[str, Any]:
    cats = {}
    for c, members in categories.items():
        cats[c] = {
            "members": members,
            "shapes": {m: list(ckpt.shape(m + ".weight")) for m in members},
            "width": ckpt.shape(members[0] + ".weight")[1],
            "u_dtype": dtype_name(ckpt.dtype(members[0] + ".weight")),
            "complete": False,
        }
    return {
        "format": "frod-factor-store",
        "format_version": FORMAT_VERSION,
        "complete": False,
        "completed_categories": [],
        "base_model": cfg.model,
        "fingerprint": fingerprint,
        "fingerprint_method": FINGERPRINT_METHOD,
        "model_config": _model_config(ckpt.dir),
        "targets": list(cfg.targets),
        "pi": cfg.pi,
        "hjd_dtype": dtype_name(cfg.dtype),
        "categories": cats,
        "world_size": D.get_world_size(),
        "versions": _versions(),
    }


def _remove_store_files(out: Path, category: str | None = None) -> None:
    for p in out.iterdir():
        if is_store_file(p.name, category) or (category is None and p.name in (MANIFEST, MANIFEST + ".tmp")):
            p.unlink()


def _prepare_store(cfg: StageConfig, fresh: dict[str, Any]) -> dict[str, Any]:
    """Rank 0: create the store directory or resume the one there; returns the manifest to continue."""
    out = cfg.out
    mpath = out / MANIFEST
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; pass a directory")
    out.mkdir(parents=True, exist_ok=True)
    manifest = None
    if mpath.is_file():
        try:
            manifest = json.loads(mpath.read_text())
        except json.JSONDecodeError:
            manifest = {}
        diffs = [k for k in CONFIG_KEYS if manifest.get(k) != fresh[k]]
        if diffs and not cfg.overwrite:
            show = ", ".join(f"{k}: {manifest.get(k)!r} there, {fresh[k]!r} now" for k in diffs if k != "fingerprint")
            if "fingerprint" in diffs:
                show = f"built from {manifest.get('base_model')!r} (another model's weights)" + (f"; {show}" if show else "")
            raise ValueError(
                f"--out {out} holds a factor store with a different configuration ({show}); pass --overwrite to "
                "replace it or choose another --out"
            )
        if diffs or cfg.overwrite:
            _remove_store_files(out)
            manifest = None
    elif any(out.iterdir()):
        if not cfg.overwrite:
            raise ValueError(f"--out {out} exists, is not empty and holds no {MANIFEST}; choose a new or empty directory")
        _remove_store_files(out)
    if manifest is None:
        manifest = fresh
    # A completed category whose files went missing is redone.
    for c in list(manifest["completed_categories"]):
        spec = manifest["categories"][c]
        if not all((out / f).is_file() for f in set(spec.get("files", {}).values())):
            manifest["completed_categories"].remove(c)
            spec["complete"] = False
    manifest["complete"] = len(manifest["completed_categories"]) == len(manifest["categories"])
    manifest["world_size"] = D.get_world_size()
    manifest["versions"] = _versions()
    atomic_write_json(mpath, manifest)
    return manifest


def _finish_category(cfg: StageConfig, manifest: dict[str, Any], category: str, outs: list[_CategoryOut], seconds: float) -> None:
    """Rank 0: check every file is there, then record the category as complete (manifest replaced)."""
    spec = manifest["categories"][category]
    files: dict[str, str] = {}
    error: dict[str, float] = {}
    stored: dict[str, float] = {}
    for o in outs:
        files.update(o.files)
        error.update(o.error)
        stored.update(o.stored_error)
    expected = {v_key(category)} | {u_key(m) for m in spec["members"]} | {sigma_key(m) for m in spec["members"]}
    assert set(files) == expected, f"{category}: keys written differ from the plan"
    absent = sorted(f for f in set(files.values()) if not (cfg.out / f).is_file())
    if absent:
        raise ValueError(
            f"rank 0 cannot see {absent[0]} written by another rank in {cfg.out}; --out must be on a filesystem "
            "shared by all ranks"
        )
    fsync_dir(cfg.out)
    spec.update(
        files=files,
        error={m: error[m] for m in spec["members"]},
        stored_error={m: stored[m] for m in spec["members"]},
        max_error=max(error.values()),
        max_stored_error=max(stored.values()),
        world_size=D.get_world_size(),
        seconds=round(seconds, 3),
        phase_seconds={k: round(v, 3) for k, v in outs[0].phase_seconds.items()},
        complete=True,
    )
    manifest["completed_categories"].append(category)
    atomic_write_json(cfg.out / MANIFEST, manifest)


def _rank_summary(seconds: float, device: torch.device, ckpt: HFCheckpoint) -> dict[str, Any]:
    out = {
        "rank": D.get_rank(),
        "device": str(device),
        "seconds": round(seconds, 3),
        "peak_host_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB, 3),
        "tensors_read": ckpt.tensors_read,
        "bytes_read": ckpt.bytes_read,
    }
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
        out["peak_device_gib"] = round(torch.cuda.max_memory_allocated(device) / GiB, 3)
        out["peak_device_reserved_gib"] = round(torch.cuda.max_memory_reserved(device) / GiB, 3)
    return out


def _device(cfg: StageConfig) -> torch.device:
    if cfg.device == "cpu":
        return torch.device("cpu")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but no CUDA device is visible")
    return D.local_device()


def run_stage(cfg: StageConfig) -> dict[str, Any]:
    """Build (or finish) the factor store ``cfg.out``; every rank calls it. Returns rank 0's manifest
    (``{}`` on other ranks). ``ValueError`` on every rank for user errors."""
    t_start = time.perf_counter()
    device = _device(cfg)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model_dir = _on_main(lambda: str(resolve_model_dir(cfg.model)))  # rank 0 downloads first
    if not D.is_main():
        model_dir = str(resolve_model_dir(cfg.model))
    ckpt = HFCheckpoint(model_dir)
    categories = plan_categories(ckpt, cfg.targets)  # all ranks read the same headers: errors agree
    names = [m + ".weight" for members in categories.values() for m in members]
    fingerprint = _on_main(lambda: weights_fingerprint(ckpt, names))
    manifest = _on_main(lambda: _prepare_store(cfg, _new_manifest(cfg, fingerprint, categories, ckpt)))
    todo = [c for c in categories if c not in manifest["completed_categories"]]
    skipped = [c for c in categories if c not in todo]
    D.print0(f"HJD {cfg.model}: {len(categories)} categories, world size {D.get_world_size()}, {dtype_name(cfg.dtype)} on "
             f"{device.type}" + (f"; resuming, done: {', '.join(skipped)}" if skipped else ""))
    writer = ThreadPoolExecutor(1, thread_name_prefix="hjd-write")
    loader = ThreadPoolExecutor(1, thread_name_prefix="hjd-read")
    try:
        with no_tf32(), torch.no_grad():
            for category in todo:
                t0 = time.perf_counter()
                _on_main(lambda: _remove_store_files(cfg.out, category))  # leftovers of a killed run
                out = _run_category(ckpt, category, categories[category], cfg, device, writer, loader)
                outs = D.all_gather_object(out)
                _on_main(lambda: _finish_category(cfg, manifest, category, outs, time.perf_counter() - t0))
    finally:
        writer.shutdown(wait=True)
        loader.shutdown(wait=True)
    ranks = D.all_gather_object(_rank_summary(time.perf_counter() - t_start, device, ckpt))

    def finish() -> dict[str, Any]:
        manifest["run"] = {"seconds": round(time.perf_counter() - t_start, 3), "world_size": D.get_world_size(),
                           "categories_done": todo, "categories_skipped": skipped, "ranks": ranks}
        manifest["complete"] = len(manifest["completed_categories"]) == len(manifest["categories"])
        atomic_write_json(cfg.out / MANIFEST, manifest)
        return manifest

    manifest = _on_main(finish)
    return manifest if D.is_main() else {}


# ----------------------------------------------------------------------------------------------- verify


def verify_store(
    store_dir: str | Path, model: str, samples: int = 2, seed: int = 0, tol: float | None = None,
    device: torch.device | None = None,
) -> list[str]:
    """Re-check a store against a checkpoint; returns the problems found (empty: verified).

    Checks the weights fingerprint, that every listed file holds its keys with the manifest's shapes,
    and, for ``samples`` members per category (seeded), ``‖W_i − U_i diag(σ_i) Vᵀ‖/‖W_i‖`` from the stored
    tensors against ``tol`` (default by U's dtype: 2e-2 bf16, 5e-3 fp16, 1e-4 fp32, 1e-8 fp64).
    ``ValueError`` for a missing store or model (user errors); an incomplete store is a problem.
    """
    device = device or torch.device("cpu")
    store = FactorStore.open(store_dir, allow_incomplete=True)
    ckpt = HFCheckpoint(resolve_model_dir(model))
    problems: list[str] = []
    if not store.complete:
        problems.append(f"factor store {store.path} is incomplete (done: {store.manifest.get('completed_categories')})")
    try:
        check_store_matches(store, ckpt)
    except ValueError as e:
        return problems + [str(e)]
    from safetensors import safe_open

    rng = random.Random(seed)
    for category, members in store.categories.items():
        if category not in store.manifest.get("completed_categories", []):
            continue
        files = store.manifest["categories"][category]["files"]
        n = store.width(category)
        before = len(problems)
        for fname in sorted(set(files.values())):
            path = store.path / fname
            if not path.is_file():
                problems.append(f"{category}: file {fname} is missing")
                continue
            with safe_open(str(path), framework="pt") as f:
                have = set(f.keys())
                for key in (k for k, v in files.items() if v == fname):
                    if key not in have:
                        problems.append(f"{category}: {fname} lacks {key}")
                        continue
                    shape = list(f.get_slice(key).get_shape())
                    want = [n, n] if key == v_key(category) else (
                        list(store.member_shape(key[: -len(".U")])) if key.endswith(".U") else [n])
                    if shape != want:
                        problems.append(f"{category}: {key} has shape {shape}, manifest says {want}")
        if len(problems) > before:
            continue
        V = store.load_V(category, torch.float64, device)
        for member in rng.sample(members, min(samples, len(members))):
            U = store.load_U(member, device=device)
            limit = tol if tol is not None else {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4}.get(U.dtype, 1e-8)
            W = ckpt.get(member + ".weight", device).double()
            e = reconstruction_error(W, U.double(), store.load_sigma(member, torch.float64, device), V)
            if not e <= limit:
                problems.append(f"{member}: reconstruction error {e:.3e} > tolerance {limit:.1e}")
    return problems
