"""SGLang with prefixcache's store: a HiCache storage backend (``hicache_store``) SGLang builds
by module path, over the same store as the vLLM connector."""
