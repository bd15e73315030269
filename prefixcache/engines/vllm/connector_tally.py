"""What the vLLM store connector counts (``StoreTally`` names), and the logger it writes on.

Both roles keep counts: queries on the scheduler's side; loads, refusals and writes on the
worker's. ``refused_<reason>`` counts records refused on load by reason (missing, checksum,
layout, namespace, digest, truncated, not_a_record, error).
"""

from __future__ import annotations

# under vLLM's logger, so the lines come out with vLLM's own (its handler is on "vllm")
LOGGER = "vllm.prefixcache_store"

COUNTERS = (
    "queries",  # existence queries (one per request, batched)
    "query_errors",  # queries the store failed to answer (nothing found)
    "queried_blocks",  # blocks asked about
    "found_blocks",  # leading blocks the queries found
    "loaded_blocks",  # blocks loaded into vLLM's cache, checked
    "load_failed_blocks",  # blocks reported to vLLM to recompute (refused or not loaded)
    "skipped_blocks",  # computed blocks not written: their request's load failed in the step
    "queued_blocks",  # computed blocks handed to the background writer
    "written_blocks",  # blocks the store took as new
    "dropped_blocks",  # blocks not written: the write queue was full or the store down
    "write_errors",  # blocks not written: the store failed the write
    "evicted_blocks",  # blocks the store evicted to take this process's writes
    "unannounced_removals",  # blocks that left the store whose vLLM hash was not known here
)
