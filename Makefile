PYTHON ?= python3

.PHONY: install demo replay test lint bench

install:  ## torch first (pinned: the CPU build here), then the package with its test extras
	$(PYTHON) -m pip install -q "torch==2.13.0"
	$(PYTHON) -m pip install -q -e ".[dev]"

demo:
	$(PYTHON) -m prefixcache demo

test:
	$(PYTHON) -m pytest

lint:
	ruff check . && ruff format --check .

bench:
	$(PYTHON) bench/hash_throughput.py
	$(PYTHON) bench/manager_loop.py
