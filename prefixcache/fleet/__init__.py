"""The fleet side of prefixcache: KV events on the wire, a fleet-wide prefix index and routing."""
