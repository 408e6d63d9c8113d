# mambafuse — the two commands of the README, and the developer targets behind them.
#   make demo   on a fresh machine: the runtime dependencies and the build tools, the library, then fuse the
#               bundled default model and print the report (nothing the demo does not use)
#   make test   on a fresh machine: the same, plus the test dependencies (torch, transformers, mobius,
#               onnxruntime-genai, olive, pytest; the apt cross compiler and qemu), then the test suite
# Both create (or reuse) the virtualenv .venv in the repository root.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
STAMPS := $(VENV)/.stamps
NATIVE_SOURCES := $(shell find contrib_ops -type f \( -name '*.cc' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' \
                    -o -name '*.mm' -o -name '*.metal' -o -name '*.cmake' -o -name CMakeLists.txt \) 2>/dev/null)
PYTEST_ARGS ?=
# The editable install maps each module of the packages it installs to its file: a module added, moved or removed
# needs a new install. $(STAMPS)/modules holds the list of those files and changes only when the list does.
PY_MODULES := $(sort $(shell find fusion contrib_ops -name '*.py' 2>/dev/null))
$(shell mkdir -p $(STAMPS) 2>/dev/null; echo '$(PY_MODULES)' | cmp -s - $(STAMPS)/modules 2>/dev/null \
  || echo '$(PY_MODULES)' > $(STAMPS)/modules)
# pyproject.toml's dependencies, plus the optional-dependency groups named in $(1), as pip arguments.
requirements = $$($(PY) -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
  print(' '.join(repr(d) for d in p['dependencies'] + [d for g in '$(1)'.split() for d in p['optional-dependencies'][g]]))" \
  | tr -d "'")

.PHONY: demo test build deps deps-runtime deps-test sanitize lint compat clean

# A .venv set up before the dependency stamps were split had one stamp, "deps", for everything: when it is
# current it stands for both (dated like it, so that the library is not rebuilt for it).
ifneq ($(wildcard $(STAMPS)/deps),)
$(shell [ $(STAMPS)/deps -nt pyproject.toml ] && for s in deps-runtime deps-test; do \
  [ -e $(STAMPS)/$$s ] || touch -r $(STAMPS)/deps $(STAMPS)/$$s; done)
endif

# What the library's build and the fusion need: the runtime dependencies (onnxruntime, onnx, onnx-ir,
# onnxscript, numpy, ml_dtypes) and the build backend and tools (scikit-build-core, cmake, ninja, and Eigen's
# headers from cmeel-eigen for MambaChunkScan's kernel), so that rebuilding the library needs no isolated build
# environment. Re-run when pyproject.toml changes.
$(STAMPS)/deps-runtime: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install "scikit-build-core>=0.10" "cmake>=3.24" ninja "cmeel-eigen>=3.4,<3.5"
	$(PIP) install $(call requirements,)
	@mkdir -p $(STAMPS) && touch $@

# What the tests add: the test, models and olive extras, resolved together with the runtime dependencies
# (torch's CPU build re-exports models in the slow test tier; olive-ai, whose own torch requirement is
# unpinned, is resolved together with the models extra's torch==2.13.0), and the AArch64 cross compiler
# and qemu-user of tests/test_kernel_arm64.py.
$(STAMPS)/deps-test: $(STAMPS)/deps-runtime pyproject.toml contrib_ops/tests/install_cross_tools.sh
	sh contrib_ops/tests/install_cross_tools.sh
	$(PIP) install $(call requirements,test models olive)
	@touch $@

# The package in editable mode; scikit-build-core builds the custom-op library into it (incrementally,
# in build/<wheel tag>), whenever a native source changes.
$(STAMPS)/library: $(STAMPS)/deps-runtime $(NATIVE_SOURCES) pyproject.toml $(STAMPS)/modules
	$(PIP) install --no-build-isolation --no-deps -e .
	$(PY) -c "import contrib_ops; print('mambafuse library:', contrib_ops.library_path())"
	@touch $@

deps-runtime: $(STAMPS)/deps-runtime
deps-test deps: $(STAMPS)/deps-test
build: $(STAMPS)/library

test: $(STAMPS)/deps-test build
	$(PY) -m pytest $(PYTEST_ARGS)

demo: build
	$(PY) -m fusion.demo

# The kernel tests against a library built with AddressSanitizer + UndefinedBehaviorSanitizer.
sanitize: $(STAMPS)/deps-test
	$(VENV)/bin/cmake -S contrib_ops -B build/sanitize -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DMAMBAFUSE_SANITIZE=ON -DMAMBAFUSE_WERROR=ON -DMAMBAFUSE_CUDA=OFF -DCMAKE_MAKE_PROGRAM=$(abspath $(VENV)/bin/ninja) > /dev/null
	$(VENV)/bin/cmake --build build/sanitize
	LD_PRELOAD="$$($(CXX) -print-file-name=libasan.so) $$($(CXX) -print-file-name=libubsan.so)" \
	ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
	MAMBAFUSE_LIBRARY=$(abspath build/sanitize/libmambafuse_ops.so) \
	  $(PY) -m pytest -q -p no:cacheprovider tests/test_kernel_cpu.py tests/test_causal_conv1d_update_kernel.py tests/test_selective_state_update_kernel.py \
	  tests/test_mamba_chunk_scan_kernel.py tests/test_causal_conv1d_kernel.py tests/test_prefill_ops_placement.py \
	  tests/test_squared_relu_kernel.py

lint: $(STAMPS)/deps-runtime
	$(PIP) install ruff
	$(VENV)/bin/ruff check fusion contrib_ops models tests benchmarks
	$(VENV)/bin/ruff format --check fusion contrib_ops models tests benchmarks

clean:
	rm -rf build $(VENV)

# The library against another onnxruntime release, in a throwaway venv (default: the oldest supported).
ORT_VERSION ?= 1.23.2
compat: build
	rm -rf build/compat-venv && $(PYTHON) -m venv build/compat-venv
	build/compat-venv/bin/pip --disable-pip-version-check -q install "onnxruntime==$(ORT_VERSION)" \
	  "$$($(PY) -c 'import numpy; print("numpy==" + numpy.__version__)')" ml_dtypes onnx pytest
	MAMBAFUSE_LIBRARY=$$($(PY) -c "import contrib_ops; print(contrib_ops.library_path())") PYTHONPATH=. \
	  build/compat-venv/bin/python -m pytest -q -p no:cacheprovider tests/test_kernel_cpu.py
