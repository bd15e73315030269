"""Opening the index the service config names: ``memory`` or ``redis://host:port/db``.

Each backend lives in its own module of ``prefixcache.fleet`` and exposes
``open_index(url: str) -> FleetIndex``; this module only maps the URL scheme to that module, so
the service never imports a backend it does not use (nor its client library).
"""

from __future__ import annotations

import importlib
from urllib.parse import urlsplit

from prefixcache.errors import ConfigError
from prefixcache.fleet.fleet_index import FleetIndex
from prefixcache.fleet.service_config import check_index_url

BACKENDS = {
    "memory": "prefixcache.fleet.memory_index",
    "redis": "prefixcache.fleet.redis_index",
    "rediss": "prefixcache.fleet.redis_index",
}


def open_index(url: str) -> FleetIndex:
    """The index ``url`` names; ConfigError when the URL or its backend is not usable here."""
    url = check_index_url(url)
    scheme = "memory" if url == "memory" else urlsplit(url).scheme
    module_name = BACKENDS[scheme]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"index {url!r} needs {module_name}, which cannot be imported here ({exc})"
        ) from None
    opener = getattr(module, "open_index", None)
    if opener is None:
        raise ConfigError(f"{module_name} has no open_index(url) function")
    index: FleetIndex = opener(url)
    return index
