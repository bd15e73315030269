"""The block structures under the cache manager: digests, namespaces, token arrays, the radix
index, the pool, eviction order and the host tier.
"""
