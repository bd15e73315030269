"""Where a cached block lives: the medium names of block events, as KV events carry them.

The values are plain strings, the ones vLLM's KV events send in their ``medium`` field
(``MEDIUM_GPU``, ``MEDIUM_CPU`` and ``MEDIUM_STORAGE`` of ``vllm/distributed/kv_events.py``) and
the one prefixcache adds for a shared K/V store (``STORE``), so events built here encode byte
for byte as vLLM's and compare equal to what is decoded off the wire. Media that other engines
name otherwise (SGLang's ``CPU_PINNED``, Mooncake's ``cpu``) are read by the fleet
(``fleet/events/index_writer.py``), as plain strings.
"""

from __future__ import annotations

from typing import Final, Literal

Medium = Literal["GPU", "CPU", "STORAGE", "STORE"]

GPU: Final = "GPU"  # the engine's paged KV cache
CPU: Final = "CPU"  # host memory: the host tier, an engine's CPU offload; the index's "off GPU"
STORAGE: Final = "STORAGE"  # an engine's own storage tier below host memory (vLLM's name)
STORE: Final = "STORE"  # a shared K/V store (LMDB, Mooncake Store), outside any one replica
