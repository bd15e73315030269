"""SGLang with prefixcache's store: the HiCache backend inside SGLang 0.5.23's own code, run
from its published wheel with vLLM's interpreter (``in_sglang/``; a full SGLang server needs a
GPU, its host memory pool and storage calls do not).

They run with the other real-engine tests (``make test-vllm``, ``PREFIXCACHE_REAL_VLLM=1``),
which build the environment they use; the plain ``python -m pytest`` skips them, naming the
target.
"""

from __future__ import annotations

import os

import pytest

ENABLED = os.environ.get("PREFIXCACHE_REAL_VLLM") == "1"
SKIPPED = (
    "SGLang's HiCache with prefixcache's store (SGLang's wheel in vLLM's environment): "
    "`make test-vllm` runs them, after `make vllm-env`"
)
collect_ignore = ["in_sglang"]  # run with vLLM's interpreter by test_hicache_in_sglang.py


def pytest_runtest_setup(item: pytest.Item) -> None:
    if not ENABLED:
        pytest.skip(SKIPPED)
