"""The HTTP service: the FastAPI app, its route handlers, the proxy, the YAML settings, metrics and
the CLI, all built from a config by one call (``assembly.build_service``).
"""
