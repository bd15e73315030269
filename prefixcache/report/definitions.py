"""What each figure in a report means. Every renderer takes its definitions from here."""

from __future__ import annotations

from typing import NamedTuple


class Definition(NamedTuple):
    key: str
    term: str
    text: str


_ALL = (
    Definition(
        "config_sha256",
        "Config digest",
        "SHA-256 of the replay configuration in canonical JSON; equal digests, equal runs.",
    ),
    Definition(
        "trace_sha256", "Workload digest", "SHA-256 of the scenario or trace file replayed."
    ),
    Definition(
        "capacity",
        "Capacity",
        "Physical KV blocks in the GPU cache (per replica in a fleet); bytes = blocks × bytes per "
        "block of the model. While "
        "a request's partial last block is in flight it holds one private block, so a cache "
        "of N blocks keeps at most N − 1 reusable (shared, full) blocks for it.",
    ),
    Definition(
        "continuations",
        "Multi-turn continuations",
        "Mooncake traces name blocks by hash id, and the next turn's copy of a block the last "
        "turn's output filled gets a new id. On, a request whose ids and length extend an "
        "earlier request's prompt plus output gets that request's decoded tokens there, so it "
        "can hit the blocks the earlier request wrote as it decoded; off, every block is "
        "synthesized from its id and no replay can hit them.",
    ),
    Definition(
        "replay_speed",
        "Replay speed",
        "Requests replayed per second of wall-clock time on this machine.",
    ),
    Definition(
        "hit_tokens",
        "Hit tokens",
        "Prompt tokens whose K/V a request did not compute: tokens of full blocks found in "
        "the cache plus slots copied from a partially matched block. The last prompt token "
        "is always computed (its logits are needed), so a fully cached prompt costs one "
        "token.",
    ),
    Definition(
        "token_hit_rate", "Token hit rate", "Hit tokens / prompt tokens, over all requests."
    ),
    Definition(
        "block_hit_rate",
        "Block hit rate",
        "Full prompt blocks served from the cache / full prompt blocks.",
    ),
    Definition(
        "upper_bound",
        "Upper bound",
        "The hit rate of the same workload with an infinite cache and the same block size: "
        "every whole block whose prefix was seen before in the namespace, less the one token "
        "always computed; slots this run copied from partially matching blocks count too, so "
        "the bound can move slightly with capacity when partial copies are on, and it can "
        "exceed 'prefixcache analyze', whose infinite-cache figure counts whole blocks only. "
        "The gap to it is capacity misses.",
    ),
    Definition(
        "achieved",
        "Achieved / upper bound",
        "Hit rate divided by its upper bound; 100% means capacity costs nothing.",
    ),
    Definition(
        "request_hit_ratio",
        "Per-request hit ratio",
        "A request's hit tokens / its prompt tokens. Percentiles are nearest-rank: pN is "
        "the smallest ratio with at least N% of requests at or below it.",
    ),
    Definition("zero_hit_requests", "Requests with zero hits", "Requests with no hit tokens."),
    Definition(
        "misses",
        "Miss tokens",
        "Prompt tokens − hit tokens. Each is assigned to exactly one cause below; the "
        "causes add up to all misses.",
    ),
    Definition(
        "miss_cold",
        "Cold miss",
        "The block (these tokens after this prefix, in this namespace) was never cached.",
    ),
    Definition(
        "miss_capacity",
        "Capacity miss",
        "The block had been cached but was evicted before the request came.",
    ),
    Definition(
        "miss_isolation",
        "Isolation miss",
        "The same tokens after the same prefix are cached, but in another namespace "
        "(model, adapter or tenant salt); blocks never match across namespaces.",
    ),
    Definition(
        "miss_tail",
        "Tail miss",
        "Tokens of the partial last block, which is never shared, and the final prompt "
        "token, which is always computed.",
    ),
    Definition(
        "miss_routing",
        "Routing miss",
        "The block is cached on a replica other than the one the request was sent to.",
    ),
    Definition(
        "prefill_tokens_saved",
        "Prefill tokens saved",
        "Prompt tokens not run through prefill; equal to hit tokens.",
    ),
    Definition(
        "flops_saved",
        "FLOPs saved (estimate)",
        "First-order estimate: 2 × model parameters × hit tokens, plus the attention each hit "
        "token would have done against every token before it (QK and AV, all layers and "
        "heads). Ignores how efficiently real kernels run.",
    ),
    Definition(
        "gpu_seconds_saved",
        "GPU time saved (estimate)",
        "FLOPs saved ÷ (the GPU's dense BF16 peak × its compute efficiency): the prefill time "
        "the hits spared, on one GPU of the kind the note under Savings names.",
    ),
    Definition(
        "kv_bytes_not_recomputed",
        "KV bytes not recomputed",
        "Hit tokens × the model's K/V bytes per token: the K/V that the cache supplied instead "
        "of prefill writing it again.",
    ),
    Definition(
        "logical_blocks",
        "Logical blocks (peak)",
        "Most blocks referenced by requests at one time, a shared block counted once per "
        "request: what the cache would need without sharing.",
    ),
    Definition(
        "physical_blocks",
        "Physical blocks (peak)",
        "Most distinct physical blocks in use at one time.",
    ),
    Definition(
        "sharing_factor",
        "Sharing factor",
        "Logical / physical blocks, each at its peak; 1.0 means no block was shared.",
    ),
    Definition(
        "kv_bytes_saved",
        "KV bytes saved by sharing",
        "(Logical − physical blocks, each at its peak) × bytes per block: KV memory that "
        "sharing avoided.",
    ),
    Definition(
        "fragmentation",
        "Internal fragmentation",
        "Allocated slots holding no token (the unused end of each sequence's last block), at "
        "the moment physical blocks in use peaked.",
    ),
    Definition(
        "rejected_requests",
        "Rejected requests",
        "Requests whose prompt needs more blocks than the whole cache holds; never admitted, "
        "they count with no hits.",
    ),
    Definition(
        "truncated_outputs",
        "Truncated outputs",
        "Sampled outputs cut short because the cache ran out of blocks while writing them.",
    ),
    Definition(
        "cow_copies",
        "Copy-on-write copies",
        "Shared blocks copied to a private block before a write (fork, or a fully cached "
        "prompt whose last token is recomputed).",
    ),
    Definition(
        "partial_copy_tokens",
        "Partially copied tokens",
        "Slots copied from a partially matched cached block instead of being recomputed; "
        "they count as hit tokens.",
    ),
    Definition("evicted_blocks", "Evicted blocks", "Cached blocks freed to make room for others."),
    Definition(
        "peak_blocks_in_use",
        "Peak blocks in use",
        "Most blocks referenced by requests at one time.",
    ),
    Definition(
        "block_states",
        "Active / cached / free blocks",
        "Active: referenced by a request. Cached: unreferenced, content kept, evictable. "
        "Free: no content. They add up to the capacity at every moment.",
    ),
    Definition(
        "rolling_hit_rate",
        "Rolling hit rate",
        "Token hit rate over a trailing window of recent requests; a low start is the "
        "cache warming up.",
    ),
    Definition(
        "warm_up",
        "Warm-up",
        "How far into the run (requests replayed, or simulated seconds in serving mode) the "
        "rolling hit rate first reaches 90% of its final value.",
    ),
    Definition(
        "ttft",
        "Time to first token (estimate)",
        "Simulated queueing plus prefill of the missed tokens under the replay's cost model; "
        "'no cache' prefills every prompt token. An estimate, not a measurement.",
    ),
    Definition(
        "benchmark",
        "Throughput and latency (estimate)",
        "The figures of vLLM's and SGLang's serving benchmarks, simulated: request and token "
        "throughput over the duration (first arrival to last finish); TTFT; TPOT = (end-to-end "
        "− TTFT) / (output tokens − 1), which here equals the mean inter-token latency (ITL); "
        "end-to-end latency from arrival to the last token. 'No cache' replays the same "
        "requests with prefix caching off. 'Better by' is the ratio in the cache's favour.",
    ),
    Definition(
        "offered_load",
        "Offered load",
        "GPU busy time (sum of simulated step times) / arrival span (first to last arrival). "
        "A GPU with any request in flight is busy, however few it decodes, so this can pass 1 "
        "with no queue. OVERLOADED: above 1 and the queue grew (the last tenth of the arrivals "
        "waited for their first token longer than the first tenth, by more than 5% of the "
        "span): requests arrive faster than the GPU serves them and TTFT measures queueing. "
        "'Rate scale at full load' is about the --rate-scale at which busy time equals the "
        "arrival span. A fleet shows the mean per replica and the busiest replica's load; the "
        "busiest one decides.",
    ),
    Definition(
        "roofline",
        "Serving cost model",
        "Each step takes the slower of compute (2 × layer parameters per computed token, "
        "2 × hidden × vocab per sampled position, attention per query-key pair; divided by "
        "peak FLOPs × GPUs × compute efficiency) and memory (weights once plus the K/V read; "
        "divided by bandwidth × GPUs × bandwidth efficiency), plus a fixed overhead. Tensor "
        "parallelism splits weights and KV over the GPUs and multiplies compute and bandwidth; "
        "its communication is not modelled.",
    ),
    Definition(
        "preemptions",
        "Preemptions",
        "Requests paused and restarted because the GPU cache ran out of blocks.",
    ),
    Definition(
        "top_prefixes",
        "Top shared prefixes",
        "Cached prefixes ranked by the tokens they saved; shown by id and depth in blocks, "
        "never by prompt text.",
    ),
    Definition(
        "miss_ratio_curve",
        "Miss-ratio curve",
        "Hit rate of the same workload at each capacity; miss ratio = 1 − hit rate.",
    ),
    Definition(
        "knee",
        "Knee",
        "The capacity where the hit-rate curve lies furthest above the straight line "
        "joining its ends (on the plot's axes); past it, more capacity buys little.",
    ),
    Definition(
        "consistency",
        "Consistency checks",
        "Totals of requests.csv and timeline.csv recomputed and compared with report.json.",
    ),
    Definition(
        "tenants",
        "Tenants",
        "Figures per tenant (a cache salt). A share guarantees a tenant a number of cached GPU "
        "blocks that other tenants' allocations leave it, and a cap past which it evicts its "
        "own blocks before growing. A neighbour's misses are capacity misses whose blocks "
        "another tenant's allocation evicted; with shares, the same workload is replayed "
        "without them for comparison.",
    ),
    Definition(
        "tier_hits",
        "Hit tokens by tier",
        "Where each prompt token's K/V came from: matched in the GPU cache, loaded from the "
        "host-memory tier, loaded from the pool shared by all replicas, or computed. A block a "
        "lower tier served counts as a hit of that tier, not as a miss; the four add up to the "
        "prompt tokens.",
    ),
    Definition(
        "tier_transfer",
        "Transfer time",
        "Seconds to load the host blocks at the host bandwidth and the pooled blocks at the "
        "pool bandwidth (K and V of every layer).",
    ),
    Definition(
        "tier_net_saved",
        "Prefill time saved net of transfers",
        "Hit tokens × the prefill compute time of one token (2 × layer parameters at the "
        "recompute MFU of peak FLOPs), minus the transfer time.",
    ),
)

DEFINITIONS: dict[str, Definition] = {d.key: d for d in _ALL}
