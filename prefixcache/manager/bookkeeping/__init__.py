"""The bookkeeping behind ``CacheManager``: argument checks, admission planning, block tables,
indexing, block supply and eviction, the step ledger, the host tier glue, listeners and retention.
Each module does one job; ``cache_manager`` builds them and calls them."""
