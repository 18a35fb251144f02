# rope_ext: `make test` and `make bench` install what is missing (a virtual
# environment with torch, the test/bench extras, the extension built in place).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch guesses CUDA_HOME from the nvcc on PATH, which may be a wrapper script.
ifeq ($(CUDA_HOME),)
ifneq ($(wildcard /usr/local/cuda/bin/nvcc),)
export CUDA_HOME := /usr/local/cuda
endif
endif
SOURCES := setup.py $(wildcard csrc/*/*.h csrc/*/*.cpp csrc/*/*.cu csrc/*/*.cuh)
EXT_STAMP := build/.ext-stamp

.PHONY: install build test bench lint format clean

install: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch ninja setuptools wheel
	$(PY) -m pip install -q "pytest>=8" "hypothesis>=6" "transformers>=4.45" expecttest mpmath numpy \
		matplotlib tqdm rich ruff clang-format
	touch $@

build: $(EXT_STAMP)
$(EXT_STAMP): $(VENV)/.installed $(SOURCES)
	$(PY) setup.py -q build_ext --inplace
	mkdir -p build && touch $@

test: build
	$(PY) -m pytest -q tests $(PYTEST_ARGS)

bench: build
	$(PY) -m rope_ext.bench --quick $(BENCH_ARGS)

lint: install
	$(VENV)/bin/ruff check rope_ext tests benchmarks
	$(VENV)/bin/ruff format --check rope_ext tests benchmarks
	$(VENV)/bin/clang-format --dry-run --Werror csrc/*/*.h csrc/*/*.cpp csrc/*/*.cu csrc/*/*.cuh

format: install
	$(VENV)/bin/ruff format rope_ext tests benchmarks
	$(VENV)/bin/clang-format -i csrc/*/*.h csrc/*/*.cpp csrc/*/*.cu csrc/*/*.cuh

clean:
	rm -rf build rope_ext/_C*.so *.egg-info
