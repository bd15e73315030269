"""The run directory a replay writes and a report reads: one definition of its file contract.

``report.json`` carries ``schema_version``; ``requests.csv`` has one row per request and
``timeline.csv`` one row per sample, with these columns in this order.
"""

SCHEMA_VERSION = 1

REQUEST_COLUMNS = (
    "request_id",
    "arrival_s",
    "namespace",
    "prompt_tokens",
    "hit_tokens",
    "prompt_blocks",
    "hit_blocks",
    "miss_cold",
    "miss_capacity",
    "miss_isolation",
    "miss_tail",
    "miss_routing",
    "output_tokens",
    "ttft_s",
    "ttft_nocache_s",
)

TIMELINE_COLUMNS = (
    "t",  # request index in sequential mode, simulated seconds in serving mode
    "blocks_active",
    "blocks_cached",
    "blocks_free",
    "evicted_blocks_cum",
    "prompt_tokens_cum",
    "hit_tokens_cum",
    "rolling_token_hit_rate",
)
