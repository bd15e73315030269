"""The fleet index in Redis, shared by router instances: ``RedisFleetIndex`` (shared_index),
the key layout and Lua scripts that write and read it (scripts), the write queue, outages and
resyncs (sync), the shared engine map (engine_map), and connecting to a server or a Redis
Cluster (connect)."""
