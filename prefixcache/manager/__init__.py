"""The cache manager: CacheManager and what it hands back to a runtime."""
