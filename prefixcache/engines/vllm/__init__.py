"""Real vLLM beside the service: its own virtualenv and a tiny model (``install``), and servers
started, waited for and stopped (``launcher``). ``tiny_model.py`` is a script run with vLLM's
interpreter, never imported here."""

from prefixcache.engines.vllm.install import (
    VLLMInstall,
    VLLMUnavailableError,
    find_vllm,
    vllm_missing_reason,
)
from prefixcache.engines.vllm.launcher import (
    ServerStartError,
    VLLMFleet,
    VLLMServer,
    VLLMServerSpec,
    free_port,
)

__all__ = [
    "ServerStartError",
    "VLLMFleet",
    "VLLMInstall",
    "VLLMServer",
    "VLLMServerSpec",
    "VLLMUnavailableError",
    "find_vllm",
    "free_port",
    "vllm_missing_reason",
]
