# rope_ext: `make test` and `make bench` install what is missing (a virtual
# environment with torch, the test/bench extras, the extension built in place).
# Versions come from constraints.txt, the one place they are pinned.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q -c constraints.txt
# torch guesses CUDA_HOME from the nvcc on PATH, which may be a wrapper script.
ifeq ($(CUDA_HOME),)
ifneq ($(wildcard /usr/local/cuda/bin/nvcc),)
export CUDA_HOME := /usr/local/cuda
endif
endif
# The in-place build is the test build: it adds the test-only ops (ROPE_EXT_TESTING, see setup.py).
export ROPE_EXT_TESTING := 1
SOURCES := setup.py $(wildcard csrc/*/*.h csrc/*/*.cpp csrc/*/*.cu csrc/*/*.cuh)
EXT_STAMP := build/.ext-stamp
CXX_FILES = $(wildcard csrc/*/*.h csrc/*/*.cpp csrc/*/*.cu csrc/*/*.cuh tests/native/*.cpp)
PY_DIRS := rope_ext tests benchmarks setup.py

.PHONY: install build test bench lint format clean

install: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PIP) torch ninja setuptools wheel build
	$(PIP) pytest pytest-xdist hypothesis transformers expecttest mpmath numpy matplotlib tqdm rich ruff clang-format
	touch $@

build: $(EXT_STAMP)
$(EXT_STAMP): $(VENV)/.installed $(SOURCES)
	$(PY) setup.py -q build_ext --inplace
	mkdir -p build && touch $@

# Test files run side by side, PYTEST_WORKERS at a time (pytest-xdist; a file stays on one worker, so
# its fixtures are built once), in the order tests/conftest.py gives them (the multi-minute files first);
# 0 runs them in this process.
PYTEST_WORKERS ?= 2

test: build
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder tests $(PYTEST_ARGS)

bench: build
	$(PY) -m rope_ext.bench --quick $(BENCH_ARGS)

lint: install
	$(VENV)/bin/ruff check $(PY_DIRS)
	$(VENV)/bin/ruff format --check $(PY_DIRS)
	$(VENV)/bin/clang-format --dry-run --Werror $(CXX_FILES)

format: install
	$(VENV)/bin/ruff check --fix $(PY_DIRS)
	$(VENV)/bin/ruff format $(PY_DIRS)
	$(VENV)/bin/clang-format -i $(CXX_FILES)

clean:
	rm -rf build rope_ext/_C*.so *.egg-info
