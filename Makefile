# Two set-up commands: `make demo` and `make test`. Both create .venv in the repo if missing.
PY       ?= python3
VENV     := .venv
VPY      := $(VENV)/bin/python
STAMP    := $(VENV)/.installed
export DS_ACCELERATOR ?= cpu
export OMP_NUM_THREADS ?= 1
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions
export PYTHONPATH := $(CURDIR)
export TOKENIZERS_PARALLELISM := false
export FROD_TEST_ORDER ?= normal
# xdist workers for make test (0: one process): the Slurm tests run on one worker while the others run the rest; a
# third worker on 2 cores fills the time the first two spend waiting on daemons, launched ranks and barriers.
TEST_WORKERS ?= 3

.PHONY: venv demo lint format test clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	# torch first and pinned: the local CPU build; anything unpinned would pull a CUDA build.
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/frod demo

# ruff (pinned in pyproject.toml's test extra): lint and format are checked by make test, fixed by make format.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# The suite starts ~300 interpreters: bytecode caching stays on for it even where the environment turns it off
# (PYTHONDONTWRITEBYTECODE), or each would compile the project's modules again (~0.5 CPU-s apiece on 2 cores).
test: $(STAMP) lint
	env -u PYTHONDONTWRITEBYTECODE $(VPY) -m pytest -q --durations=15 -n $(TEST_WORKERS) tests

clean:
	rm -rf runs .pytest_cache
