"""Shared K/V stores: block records, the one-host LMDB store, Mooncake Store across hosts, and
the connector a runtime hands to its ``CacheManager``."""
