"""Shared fixtures: tiny LLaMA models built from ``LlamaConfig`` (no hub access); the check that no test leaves
process-wide state behind (``tests/support/leftovers.py``); the test order (``FROD_TEST_ORDER``)."""

from __future__ import annotations

import gc
import os
import random
import sys
import time
from typing import TYPE_CHECKING

import pytest

from frod_ds.runtime.errors import forget_notes
from tests.support import pace
from tests.support.leftovers import clean_env, launcher_vars, listening_sockets

if TYPE_CHECKING:
    import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# One intra-op thread, as every process the tests start runs (clean_env: OMP_NUM_THREADS=1), whatever the shell
# says: tests compare in-process results with subprocess and worker results bit for bit or to 1e-5. torch reads it
# when first imported; this file does not import torch, so a nested pytest of a torch-free test starts in a second.
os.environ["OMP_NUM_THREADS"] = "1"
if "torch" in sys.modules:
    sys.modules["torch"].set_num_threads(1)


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    kw = dict(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    kw.update(overrides)
    return LlamaConfig(**kw)


def tiny_llama(seed: int = 0, dtype: torch.dtype | None = None, **overrides):
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(**overrides)).to(dtype or torch.float32)
    return model.eval()


@pytest.fixture
def llama_factory():
    return tiny_llama


@pytest.fixture(autouse=True)
def no_process_wide_leftovers():
    """Fail a test that leaves launcher variables, a live process group, a listening socket, another torch thread
    count, a replaced ``torch.nn.functional.linear`` or DeepSpeed's NVTX ranges switched off behind (each makes later
    tests depend on the order they run in), after restoring what it can so the next test starts clean."""
    env_before = launcher_vars()
    sockets_before = listening_sockets()
    torch = sys.modules.get("torch")  # imported by a test module, if any: until then nothing of it can change
    threads_before = torch.get_num_threads() if torch else int(os.environ["OMP_NUM_THREADS"])
    nvtx_before = _deepspeed_nvtx()
    forget_notes()  # a note printed once per process: each test sees its own
    yield
    problems = []
    nvtx_after, nvtx_expected = _deepspeed_nvtx(), True if nvtx_before is None else nvtx_before
    if nvtx_after is not None and nvtx_after != nvtx_expected:
        problems.append("deepspeed.utils.nvtx.enable_nvtx was left switched (frod_ds.runtime.distributed.destroy)")
        sys.modules["deepspeed.utils.nvtx"].enable_nvtx = nvtx_expected
    torch = sys.modules.get("torch")
    if torch is not None and torch.nn.functional.linear is not torch._C._nn.linear:
        # deepspeed.zero.Init's memory_efficient_linear replacement
        problems.append("torch.nn.functional.linear was replaced (DeepSpeed's memory_efficient_linear)")
        torch.nn.functional.linear = torch._C._nn.linear
    if torch is not None and torch.get_num_threads() != threads_before:  # later tests' floats depend on it
        problems.append(f"torch's intra-op thread count changed: {threads_before} -> {torch.get_num_threads()}")
        torch.set_num_threads(threads_before)
    env_after = launcher_vars()
    if env_after != env_before:
        changed = sorted(k for k in env_before.keys() | env_after.keys() if env_before.get(k) != env_after.get(k))
        problems.append(f"launcher variables changed: {', '.join(changed)}")
        for k in changed:
            if k in env_before:
                os.environ[k] = env_before[k]
            else:
                os.environ.pop(k, None)
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        problems.append("a torch.distributed process group is still initialized")
        dist.destroy_process_group()
    new = listening_sockets() - sockets_before
    if new:
        gc.collect()
        new = listening_sockets() - sockets_before
        if new:
            problems.append(f"listening sockets left open: {', '.join(sorted(new))}")
    if problems:
        pytest.fail("test left process-wide state behind: " + "; ".join(problems), pytrace=False)


def _deepspeed_nvtx() -> bool | None:
    """DeepSpeed's NVTX switch, None while DeepSpeed is not imported (its import sets it to True)."""
    module = sys.modules.get("deepspeed.utils.nvtx")
    return None if module is None else module.enable_nvtx


def _order_key(item) -> str:
    return item.nodeid.split("::", 1)[0]


# Files that share a machine-wide resource (Slurm daemons, munge, the namespaces' bridge) run on one xdist worker,
# one after the other, as one unit; every other file is a unit of its own, so its module fixtures are built once.
# files run by one worker, one after the other: the Slurm files; the two tests that each start several ranks for a
# minute (the demo's stages, the chain's), which on 2 cores at once took twice that and passed their limits
XDIST_UNITS = {
    "tests/slurm/test_slurm_multinode.py": "slurm",
    "tests/cli/test_demo.py": "rank-heavy",
    "tests/bench/test_chain.py": "rank-heavy",
}
# Handed out first, in this order: the longest units (minutes each on 2 cores), so that none starts near the end
# and leaves the other workers idle while it runs. Then the other files with multi-process (slow) tests, then the
# quick ones.
XDIST_FIRST = (
    "slurm",
    "tests/train/test_train.py",
    "tests/train/test_elastic_resume.py",
    "tests/hjd/test_store_by_category.py",
)


def _requested_order(config) -> str:
    """The order for this run; an xdist worker takes the controller's (with the seed it drew), since every
    worker must collect the same tests in the same order."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None and "frod_order" in workerinput:
        return workerinput["frod_order"]
    order = os.environ.get("FROD_TEST_ORDER", "normal")
    if order == "shuffle":
        order = f"shuffle:{random.SystemRandom().randrange(10**6)}"
    if not (order in ("normal", "reverse") or (order.startswith("shuffle:") and order.partition(":")[2].isdigit())):
        # here, before xdist starts workers: a worker's usage error would end the run as an xdist internal error
        raise pytest.UsageError(f"FROD_TEST_ORDER={order!r}: use normal, reverse, shuffle or shuffle:SEED")
    return order


def pytest_configure(config):
    config._frod_order = _requested_order(config)
    config._frod_probe_s = None
    if os.environ.get(pace.ENV):
        try:
            pace.parse(os.environ[pace.ENV])
        except ValueError as e:
            raise pytest.UsageError(str(e)) from None
    elif not hasattr(config, "workerinput"):
        # once per run, before xdist starts its workers: they (and every process a test starts) inherit it
        config._frod_probe_s = pace.measure(clean_env())
        os.environ[pace.ENV] = f"{pace.from_probe(config._frod_probe_s):.2f}"
        os.environ[pace.MEASURED] = os.environ[pace.ENV]  # measured, not given: a test past it measures again


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """xdist (controller side): hand each worker the resolved order."""
    node.workerinput["frod_order"] = node.config._frod_order


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist (controller side): whole files (XDIST_UNITS: some together) go to one worker each, in the
    order of the collection (``pytest_collection_modifyitems``). (xdist's own ``--dist loadgroup`` marks nothing under
    pytest 9, whose node ids it can no longer rename, and its ``loadfile`` reorders files by test count.)"""
    from xdist.scheduler import LoadScopeScheduling

    class FileUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = nodeid.split("::", 1)[0]
            return XDIST_UNITS.get(file, file)

    config.option.loadscopereorder = False  # the files' order is FROD_TEST_ORDER's, not xdist's by test count
    return FileUnits(config, log)


def pytest_collection_modifyitems(session, config, items):
    """``FROD_TEST_ORDER``: unset or ``normal`` (collection order), ``reverse`` (test files in reverse order),
    or ``shuffle:SEED`` (files shuffled, and the tests inside each file, with that seed; ``shuffle`` alone picks
    a seed). Tests of one file stay together, so module fixtures are built once whatever the order. Under xdist
    each file is handed to one worker whole, in this order (``pytest_xdist_make_scheduler``)."""
    order = config._frod_order
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(_order_key(item), []).append(item)
    names = list(files)
    if order == "normal":
        pass
    elif order == "reverse":
        names.reverse()
    else:  # shuffle:SEED (checked by _requested_order)
        rng = random.Random(int(order.partition(":")[2]))
        rng.shuffle(names)
        for name in names:
            rng.shuffle(files[name])
    items[:] = [item for name in names for item in files[name]]
    if hasattr(config, "workerinput"):
        # under xdist this is the order files are handed out: XDIST_FIRST, then the files with multi-process (slow)
        # tests, then the quick ones (each group in the order above), so the last files to start are short
        def rank(item) -> tuple[int, int]:
            file = _order_key(item)
            unit = XDIST_UNITS.get(file, file)
            if unit in XDIST_FIRST:
                return 0, XDIST_FIRST.index(unit)
            return (1 if any(i.get_closest_marker("slow") for i in files[file]) else 2), 0

        items.sort(key=rank)  # stable


def pytest_report_header(config):
    limit = f"{TEST_LIMIT_S:g} s" if TEST_LIMIT_S else "none"
    probe = config._frod_probe_s
    measured = f"the import probe took {probe:.1f} s against {pace.REFERENCE_S:g}" if probe else "given"
    return [
        f"test order: FROD_TEST_ORDER={config._frod_order} (re-run the same order with FROD_TEST_ORDER=<this value>)",
        f"time limit per test and per shared fixture's set-up: {limit} (FROD_TEST_LIMIT_S)",
        f"this machine's pace: {pace.factor():g} ({measured}; FROD_TEST_PACE), the time limits are scaled by it",
    ]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if config._frod_order != "normal":
        terminalreporter.write_line(f"test order: FROD_TEST_ORDER={config._frod_order}")
    if TEST_LIMIT_S:  # the header's line, which -q leaves out
        terminalreporter.write_line(pytest_report_header(config)[-1])


# No test takes longer than this: its own set-up and call, and no shared fixture's set-up either. On a 2-core machine
# with nothing else running `make test` stays within minutes only so. FROD_TEST_LIMIT_S changes it (0: no limit) on
# a machine shared with other work, where wall times say little; the report's header says which limit a run has.
TEST_LIMIT_S = float(os.environ.get("FROD_TEST_LIMIT_S", "120"))
_SETUP_S = pytest.StashKey[float]()
_BUILDING: list[float] = []  # per fixture being set up, the set-up time of the fixtures it requested inside it
_SHARED: list[tuple[str, str, float]] = []  # the module/class/session fixtures built in this test: name, scope, s


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    """Time each fixture's own set-up (less the fixtures it requested inside it) and note the shared ones."""
    _BUILDING.append(0.0)
    t0 = time.perf_counter()
    try:
        yield
    finally:
        total = time.perf_counter() - t0
        own = total - _BUILDING.pop()
        if _BUILDING:
            _BUILDING[-1] += total
        if fixturedef.scope != "function":
            _SHARED.append((fixturedef.argname, fixturedef.scope, own))


def _limit(spent: float) -> tuple[float, str]:
    """The limit for a test that took ``spent`` s, and how to say it. Past the run's pace, a measured pace is taken
    again: a shared host can slow down for minutes after the run began, and a test is judged at the pace it ran."""
    factor = pace.factor()
    if spent > TEST_LIMIT_S * factor and os.environ.get(pace.MEASURED) == os.environ.get(pace.ENV):
        factor = max(factor, pace.from_probe(pace.measure(clean_env())))
    limit = TEST_LIMIT_S * factor
    at = f" ({limit:.0f} s at pace {factor:.2f})" if factor > 1 else ""
    return limit, f"the {TEST_LIMIT_S:g} s a test may take{at}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test whose own set-up and call together take longer than ``TEST_LIMIT_S`` fails, and so does one during
    whose set-up a shared (module, class or session) fixture took longer than that to build. A shared fixture's
    set-up is the fixture's, not the test's that happened to build it: charged to that test, whether a test passes
    would depend on the order the tests run in (CI shuffles it). A test that grows past the limit is a bug: make it
    smaller, or make what several tests share cheaper."""
    outcome = yield
    report = outcome.get_result()
    if not TEST_LIMIT_S or report.when == "teardown" or not report.passed:
        return
    if report.when == "setup":
        item.stash[_SETUP_S] = report.duration - sum(s for _, _, s in _SHARED)
        limit, allowed = _limit(max((s for _, _, s in _SHARED), default=0.0))
        over = [f"fixture '{n}' ({scope}) took {s:.1f} s to set up" for n, scope, s in _SHARED if s > limit]
        if over:
            report.outcome = "failed"
            report.longrepr = f"{item.nodeid}: {'; '.join(over)}, over {allowed} (FROD_TEST_LIMIT_S): make it smaller"
            return
    setup = item.stash.get(_SETUP_S, 0.0)
    spent = setup + (report.duration if report.when == "call" else 0.0)
    limit, allowed = _limit(spent)
    if spent > limit:
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} took {spent:.1f} s (its own set-up {setup:.1f} s), over {allowed} (FROD_TEST_LIMIT_S): "
            "make it smaller"
        )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """``FROD_TEST_CPU=FILE``: append one JSON line per test with its wall time and the CPU seconds it used, its own
    and its finished subprocesses' (setup, call and teardown together): on 2 cores the suite is CPU-bound, so this,
    not the wall time under load, says which tests cost the suite its minutes."""
    _SHARED.clear()  # the shared fixtures this test builds (pytest_runtest_makereport)
    path = os.environ.get("FROD_TEST_CPU")
    if not path:
        yield
        return
    import json
    import resource

    def cpu() -> tuple[float, float]:
        me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime

    t0, (s0, c0) = time.monotonic(), cpu()
    yield
    s1, c1 = cpu()
    with open(path, "a") as f:
        f.write(
            json.dumps(
                {
                    "test": item.nodeid,
                    "wall_s": round(time.monotonic() - t0, 2),
                    "self_cpu_s": round(s1 - s0, 2),
                    "children_cpu_s": round(c1 - c0, 2),
                }
            )
            + "\n"
        )
