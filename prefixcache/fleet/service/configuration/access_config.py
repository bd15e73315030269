"""The service's access and transport configuration: API keys and per-key limits (``auth``),
connection and read limits (``server``) and TLS (``tls``), validated like the rest of the file.

Keys never sit in the config itself: ``auth.keys_file`` names a YAML file and ``auth.keys_env``
an environment variable, each holding a mapping ``<key>: {tenant: NAME, role: tenant|operator,
name: LABEL}`` (``<key>: NAME`` is short for a tenant key). Only the SHA-256 digest of each key
is kept.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from prefixcache.fleet.service.configuration.config_reader import ConfigReader

TENANT = "tenant"
OPERATOR = "operator"
MIN_KEY_CHARS = 16
_TENANT_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")  # no ':': the tenant salt stays unambiguous
_LABEL = re.compile(r"[A-Za-z0-9._-]{1,64}")
AUTH_KEYS = (
    "keys_file", "keys_env", "upstream_key_env", "max_in_flight_per_key", "rate_per_s", "burst",
)  # fmt: skip
SERVER_KEYS = (
    "header_timeout_s", "body_timeout_s", "keep_alive_s", "max_connections", "max_header_bytes",
    "http", "max_requests_per_client",
)  # fmt: skip
HTTP_PARSERS = ("auto", "h11", "httptools")
TLS_KEYS = ("certfile", "keyfile")
_ENTRY_KEYS = ("tenant", "role", "name")


@dataclass(frozen=True)
class ApiKey:
    """One accepted key: the SHA-256 of its text, who holds it and what it may do."""

    digest: bytes
    label: str  # names the key in metrics and logs (never the key itself)
    tenant: str | None  # the namespace its requests see; None: an operator's unscoped view
    role: str  # TENANT or OPERATOR


@dataclass(frozen=True)
class AccessConfig:
    """API keys (none: the service is open) and the limits each key (or, without keys, every
    caller together) gets."""

    keys: tuple[ApiKey, ...] = ()
    upstream_key: str | None = None  # sent to the replicas as a Bearer token in proxy mode
    max_in_flight_per_key: int | None = None  # request ids routed and not released
    rate_per_s: float | None = None  # lookups, routes and proxied requests per second
    burst: int | None = None  # bucket size of the rate limit (default: one second's worth)

    @property
    def enabled(self) -> bool:
        """Whether requests need a key."""
        return bool(self.keys)


@dataclass(frozen=True)
class ServerConfig:
    """Limits on connections and on the time a client may take to send a request, and TLS."""

    header_timeout_s: float = 10.0  # a connection that sends no complete head by then is closed
    body_timeout_s: float = 30.0  # a body not fully received by then gets a 408
    keep_alive_s: float = 5.0  # an idle keep-alive connection is closed after this
    max_connections: int | None = 1000  # beyond: 503 (uvicorn's limit_concurrency)
    max_header_bytes: int = 16 * 1024  # request line and headers
    certfile: str | None = None
    keyfile: str | None = None
    http: str = "auto"  # the HTTP/1.1 parser: httptools when installed ("auto"), or h11
    # requests in progress per client address; beyond: 429 and the connection is closed
    # (None: half of max_connections, see ``connection_budget``)
    max_requests_per_client: int | None = None

    @property
    def tls(self) -> bool:
        """Whether the service answers HTTPS."""
        return self.certfile is not None


def key_digest(key: str | bytes) -> bytes:
    """The digest a key is stored and looked up by."""
    return hashlib.sha256(key.encode("utf-8") if isinstance(key, str) else key).digest()


def parse_keys(r: ConfigReader, text: str, where: str) -> list[ApiKey]:
    """The keys of a keys file or variable (YAML ``<key>: {tenant, role, name}``)."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        raise r.fail(where, "not valid YAML (expected a mapping of key to tenant)") from None
    if not isinstance(data, dict) or not data:
        raise r.fail(where, "expected a non-empty mapping of key to {tenant, role, name}")
    keys = []
    for position, (key, entry) in enumerate(data.items()):
        at = f"{where}: entry {position + 1}"  # never the key itself: it is a secret
        if not isinstance(key, str) or len(key) < MIN_KEY_CHARS or key != key.strip():
            raise r.fail(at, f"a key must be a string of at least {MIN_KEY_CHARS} characters")
        if isinstance(entry, str):
            entry = {"tenant": entry}
        m = r.mapping(entry, at, _ENTRY_KEYS)
        role = m.get("role", TENANT)
        if role not in (TENANT, OPERATOR):
            raise r.fail(f"{at}.role", f"expected {TENANT!r} or {OPERATOR!r}, got {role!r}")
        tenant = m.get("tenant")
        if tenant is None and role == TENANT:
            raise r.fail(at, "a tenant key needs a 'tenant'")
        if tenant is not None and (
            not isinstance(tenant, str) or not _TENANT_NAME.fullmatch(tenant)
        ):
            raise r.fail(
                f"{at}.tenant",
                f"expected a name of [A-Za-z0-9._-], 1-64 characters, got {tenant!r}",
            )
        digest = key_digest(key)
        label = m.get("name", f"{tenant or role}-{digest.hex()[:8]}")
        if not isinstance(label, str) or not _LABEL.fullmatch(label):
            raise r.fail(
                f"{at}.name", f"expected a name of [A-Za-z0-9._-], 1-64 characters, got {label!r}"
            )
        keys.append(ApiKey(digest, label, tenant, role))
    return keys


def _secret_env(r: ConfigReader, name: Any, where: str) -> str:
    var = r.string(name, where, optional=False)
    assert var is not None
    value = os.environ.get(var)
    if not value:
        raise r.fail(where, f"environment variable {var!r} is not set")
    return value


def parse_access(r: ConfigReader, raw: Any, base_dir: Path | None) -> AccessConfig:
    """The ``auth`` section: keys from a file and/or a variable, and the per-key limits."""
    m = r.mapping(raw, "auth", AUTH_KEYS)
    keys: list[ApiKey] = []
    if m.get("keys_file") is not None:
        name = r.string(m.get("keys_file"), "auth.keys_file", optional=False)
        path = Path(name or "")
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise r.fail("auth.keys_file", f"cannot read {str(path)!r}: {exc}") from None
        keys += parse_keys(r, text, "auth.keys_file")
    if m.get("keys_env") is not None:
        keys += parse_keys(r, _secret_env(r, m["keys_env"], "auth.keys_env"), "auth.keys_env")
    seen_digests: set[bytes] = set()
    seen_labels: set[str] = set()
    for key in keys:
        if key.digest in seen_digests:
            raise r.fail("auth", f"the key of {key.label!r} is listed twice")
        if key.label in seen_labels:
            raise r.fail("auth", f"two keys are named {key.label!r}")
        seen_digests.add(key.digest)
        seen_labels.add(key.label)
    upstream = None
    if m.get("upstream_key_env") is not None:
        upstream = _secret_env(r, m["upstream_key_env"], "auth.upstream_key_env")
    cap = m.get("max_in_flight_per_key")
    rate = m.get("rate_per_s")
    burst = m.get("burst")
    if burst is not None and rate is None:
        raise r.fail("auth.burst", "a burst needs a rate_per_s")
    return AccessConfig(
        tuple(keys),
        upstream,
        None if cap is None else r.integer(cap, "auth.max_in_flight_per_key", 1),
        None if rate is None else r.number(rate, "auth.rate_per_s"),
        None if burst is None else r.integer(burst, "auth.burst", 1),
    )


def parse_server(r: ConfigReader, raw: Any, raw_tls: Any, base_dir: Path | None) -> ServerConfig:
    """The ``server`` section (read and connection limits) and the ``tls`` section."""
    m = r.mapping(raw, "server", SERVER_KEYS)
    d = ServerConfig()
    conns = m.get("max_connections", d.max_connections)
    per_client = m.get("max_requests_per_client")
    http = m.get("http", d.http)
    if http not in HTTP_PARSERS:
        raise r.fail("server.http", f"expected one of {', '.join(HTTP_PARSERS)}, got {http!r}")
    t = r.mapping(raw_tls, "tls", TLS_KEYS)
    files: list[str | None] = []
    for name in TLS_KEYS:
        value = r.string(t.get(name), f"tls.{name}")
        if value is not None:
            value = str(r.existing_file(value, f"tls.{name}", base_dir))
        files.append(value)
    if (files[0] is None) != (files[1] is None):
        raise r.fail("tls", "give both 'certfile' and 'keyfile'")
    return ServerConfig(
        r.number(m.get("header_timeout_s", d.header_timeout_s), "server.header_timeout_s"),
        r.number(m.get("body_timeout_s", d.body_timeout_s), "server.body_timeout_s"),
        r.number(m.get("keep_alive_s", d.keep_alive_s), "server.keep_alive_s"),
        None if conns is None else r.integer(conns, "server.max_connections", 1),
        r.integer(m.get("max_header_bytes", d.max_header_bytes), "server.max_header_bytes", 1024),
        files[0],
        files[1],
        http,
        None if per_client is None else r.integer(per_client, "server.max_requests_per_client", 1),
    )
