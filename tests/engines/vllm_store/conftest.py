"""vLLM with prefixcache's store: the connector in vLLM's own scheduler (``in_vllm/``, run with
vLLM's interpreter), and real vLLM servers sharing prefixes through LMDB and Mooncake Store and
behind ``prefixcache serve``.

Like the other real-engine tests they take minutes and need vLLM's virtualenv, so the plain
``python -m pytest`` skips them, naming the make target: ``make test-vllm`` runs them
(``PREFIXCACHE_REAL_VLLM=1``); with the variable set and the environment absent (or without the
connector's packages in it) they skip naming ``make vllm-env``. Servers that start with the
connector get this checkout's package through ``PYTHONPATH`` (``store_support.py``).
"""

from __future__ import annotations

import os

import pytest
from store_support import connector_missing_reason

ENABLED = os.environ.get("PREFIXCACHE_REAL_VLLM") == "1"
SKIPPED = (
    "vLLM with prefixcache's store (real servers, minutes): `make test-vllm` runs them, after "
    "building vLLM's environment with `make vllm-env`"
)
collect_ignore = ["in_vllm"]  # run with vLLM's interpreter by test_connector_in_vllm.py


def pytest_runtest_setup(item: pytest.Item) -> None:
    if not ENABLED:
        pytest.skip(SKIPPED)
    also = ("pytest",) if item.name.endswith("in_vllms_scheduler") else ()
    reason = connector_missing_reason(also=also)
    if reason is not None:
        pytest.skip(reason)
