"""The fleet-wide prefix index: the interface, the in-memory and Redis backends (the Redis one in
modules of its own: key layout and scripts, sync and resync, engine map, connecting), and opening
one by URL.
"""
