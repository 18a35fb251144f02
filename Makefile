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
# With ccache installed, every compile goes through it (the libraries' C++ and nvcc, the sanitizer build,
# the CMake and torch.utils.cpp_extension builds of the tests): a cache keyed by the preprocessed source
# and the flags, relative to the checkout (CCACHE_BASEDIR), so a fresh clone recompiles only what changed.
# .ci/run installs ccache when it can; without it nothing changes.
CCACHE := $(shell command -v ccache 2>/dev/null)
ifneq ($(CCACHE),)
export CCACHE_DIR ?= $(HOME)/.cache/rope_ext/ccache
export CCACHE_BASEDIR := $(CURDIR)
export CCACHE_NOHASHDIR := 1
CCACHE_BIN := $(CURDIR)/build/ccache-bin
export CC := $(CCACHE_BIN)/cc
export CXX := $(CCACHE_BIN)/c++
ifneq ($(CUDA_HOME),)
export PYTORCH_NVCC := $(CCACHE) $(CUDA_HOME)/bin/nvcc
endif
# ccache run under a compiler's name runs that compiler (the next one on PATH) through the cache.
$(shell mkdir -p $(CCACHE_BIN) && ln -sf $(CCACHE) $(CCACHE_BIN)/cc && ln -sf $(CCACHE) $(CCACHE_BIN)/c++)
endif
# The in-place build is the test build: it adds the test-only ops (ROPE_EXT_TESTING, see setup.py).
export ROPE_EXT_TESTING := 1
SOURCES := setup.py $(wildcard csrc/*/*.h csrc/*/*.cpp csrc/*/*.cu csrc/*/*.cuh csrc/rope/*/*)
EXT_STAMP := build/.ext-stamp
CXX_FILES = $(wildcard csrc/*/*.h csrc/*/*.cpp csrc/*/*.cu csrc/*/*.cuh csrc/*/*/* tests/native/*.cpp)
PY_DIRS := rope_ext tests benchmarks examples setup.py

.PHONY: install build test test-quick test-sanitize bench lint format clean

install: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml constraints.txt
	@echo "== $(VENV): a virtual environment with torch (a CUDA build, several GB on first install) and the tools"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PIP) torch ninja setuptools wheel build
	$(PIP) pytest pytest-xdist hypothesis transformers diffusers expecttest mpmath numpy matplotlib tqdm rich ruff clang-format \
		onnx onnxscript onnxruntime openvino
	touch $@

# The libraries (CPU, CUDA, test-only) build side by side (--parallel), each with ninja inside.
build: $(EXT_STAMP)
$(EXT_STAMP): $(VENV)/.installed $(SOURCES)
	@mkdir -p build
	@echo "== building the extension in place (a few minutes the first time; compiler lines in build/build.log)"
	@$(PY) setup.py -q build_ext --inplace --parallel 3 > build/build.log 2>&1 || { tail -40 build/build.log; exit 1; }
	@grep -E ": (warning|error):" build/build.log | head -20 || true
	@echo "== installing the tree into $(VENV) in editable mode (import rope_ext and rope-bench from anywhere)"
	@ROPE_EXT_METADATA_ONLY=1 $(PY) -m pip install -q -e . --no-build-isolation --no-deps >> build/build.log 2>&1 \
		|| { tail -20 build/build.log; exit 1; }
	@rm -f build/.ext-stamp*  # the other configuration's libraries (with or without CUDA) are replaced
	touch $@

# Test files run side by side, PYTEST_WORKERS at a time (pytest-xdist; a file stays on one worker, so
# its fixtures are built once), in the order tests/conftest.py gives them (the multi-minute files first);
# 0 runs them in this process.
PYTEST_WORKERS ?= 2

test: build
	ROPE_EXT_ISA_RERUNS=1 $(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder --hypothesis-profile=ci \
		--durations=20 tests $(PYTEST_ARGS)
	$(MAKE) --no-print-directory test-sanitize

# The edit loop: the CPU kernels and ops on this CPU's best instruction set against the references (the
# emulated CUDA bodies: pytest -k emu tests/test_ops.py); no builds, no compiles, no process groups, 25
# hypothesis draws per property. `make test` runs all of it and more.
QUICK_TESTS := tests/test_ops.py tests/test_cpu_vector_paths.py tests/test_property.py \
	tests/test_serving_cache.py tests/test_serving_fp8.py tests/test_serving_norm.py tests/test_positions_rule.py \
	tests/test_errors.py tests/test_error_classes.py tests/test_fast_path_parity.py tests/test_inplace_safety.py \
	tests/test_bit_equal.py tests/test_cache.py tests/test_scaling.py tests/test_mrope.py \
	tests/test_rotary_offset.py tests/test_varlen_positions.py tests/test_reference_serving.py \
	tests/test_regressions.py

test-quick: build
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --hypothesis-profile=quick \
		-k "not compile and not opcheck and not emu" $(QUICK_TESTS) $(PYTEST_ARGS)

# The sanitizer build: the CPU library and the host emulation of the CUDA bodies built with AddressSanitizer
# and UndefinedBehaviorSanitizer in build/sanitize, beside a copy of the Python package; the op, property and
# fuzz tests run on it (every report is fatal; --capture=sys leaves the reports on stderr). The in-place
# build is left as it is. libstdc++ is preloaded after libasan so that ASan's interceptor of C++ throws finds
# the real one. `make test` runs it after the suite.
SAN := build/sanitize
SAN_TESTS ?= tests/test_hostile_integers.py tests/test_fuzz_ops.py tests/test_crash_fuzz.py tests/test_positions_rule.py \
	tests/test_error_classes.py tests/test_ops.py tests/test_property.py tests/test_serving_cache.py \
	tests/test_serving_fp8.py tests/test_serving_norm.py tests/test_inplace_safety.py tests/test_serving_mla.py \
	tests/test_serving_mla_checks.py tests/test_rerotate.py tests/test_rerotate_checks.py \
	tests/test_page_table.py tests/test_table_free.py
# Tests whose code differs per CPU instruction set run again on each set below the best (capped by
# ROPE_EXT_CPU_ISA), without the emulated CUDA bodies (no CPU kernel in them); tests/test_hostile_integers.py
# and tests/test_fuzz_ops.py walk every set themselves; tests/test_cpu_isa.py's per-set matrix leaves
# tests/test_ops.py to these reruns under `make test` (ROPE_EXT_ISA_RERUNS=1). A request larger than memory
# (a hostile shape) returns null to torch, which raises, instead of stopping the process.
SAN_ISA_TESTS ?= tests/test_crash_fuzz.py tests/test_ops.py tests/test_positions_rule.py \
	tests/test_serving_cache.py tests/test_serving_fp8.py tests/test_serving_norm.py
SAN_RUNS := all scalar avx2 avx512
SAN_ENV := ASAN_OPTIONS=detect_leaks=0:halt_on_error=1:allocator_may_return_null=1 \
	UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 ROPE_EXT_EXPECT_PACKAGE=$(SAN) \
	LD_PRELOAD="$$($(CXX) -print-file-name=libasan.so) $$($(CXX) -print-file-name=libstdc++.so)"
SAN_PYTEST := $(VENV)/bin/pytest -q --capture=sys -p no:cacheprovider -o pythonpath=$(SAN) \
	--hypothesis-profile=short

test-sanitize: install
	$(PY) -c "import shutil; shutil.copytree('rope_ext', '$(SAN)/rope_ext', dirs_exist_ok=True, \
		ignore=shutil.ignore_patterns('*.so', '__pycache__'))"
	@echo "== the sanitizer build in $(SAN) (compiler lines in $(SAN)/build.log)"
	@ROPE_EXT_SANITIZE=1 ROPE_EXT_CPU_ONLY=1 $(PY) setup.py -q build_ext --parallel 2 -b $(SAN) -t $(SAN)/temp \
		> $(SAN)/build.log 2>&1 || { tail -40 $(SAN)/build.log; exit 1; }
	@# The suite on the best set (two workers) and the reruns on each set below it (one process each) run
	@# side by side, each into its own log ($(SAN)/<run>.log), summed up when all are done.
	@for run in $(SAN_RUNS); do \
		if [ $$run = all ]; then cap=; set -- -n $(PYTEST_WORKERS) --dist loadfile $(SAN_TESTS); \
		else cap=ROPE_EXT_CPU_ISA=$$run; set -- -k "not emu" $(SAN_ISA_TESTS); fi; \
		( $(SAN_ENV) env $$cap $(SAN_PYTEST) "$$@" $(PYTEST_ARGS) > $(SAN)/$$run.log 2>&1; echo $$? > $(SAN)/$$run.rc ) & \
	done; wait; status=0; \
	for run in $(SAN_RUNS); do \
		echo "sanitizer build, $$run: $$(tail -n 1 $(SAN)/$$run.log)"; \
		if [ "$$(cat $(SAN)/$$run.rc)" != 0 ]; then tail -n 100 $(SAN)/$$run.log; status=1; fi; \
	done; exit $$status

# Without an NVIDIA GPU, `make bench` builds the CPU libraries only (make test and CI still build CUDA).
GPU := $(shell nvidia-smi -L 2>/dev/null | head -1)
bench: install
	@$(MAKE) --no-print-directory build $(if $(GPU),,ROPE_EXT_CPU_ONLY=1 EXT_STAMP=build/.ext-stamp-cpu)
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
