"""Proxy mode: OpenAI-compatible requests forwarded to the replica the router chooses, the
pooled client to the replicas, the answers relayed and the engine's cached-token figure read."""
