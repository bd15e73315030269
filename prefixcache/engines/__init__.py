"""Engine integrations: running real inference engines beside the service (``vllm/``).

This package sits above the core and the store; nothing in the core imports it.
"""
