"""The store across hosts: Mooncake Store (what vLLM's and SGLang's Mooncake connectors use).

A ``mooncake_master`` keeps the directory; every client process contributes memory (its
global segment) and reads and writes any segment over the transfer engine (TCP here, RDMA
where the host has it). Install with ``pip install 'prefixcache[mooncake]'`` (the CPU build,
``mooncake-transfer-engine-non-cuda``; it needs ``apt-get install -y libibverbs1 librdmacm1
libnuma1``) and start a master, e.g. on one host::

    mooncake_master --rpc_port=50051 --enable_http_metadata_server=true \\
        --http_metadata_server_port=8080

then ``MooncakeBlockStore("MASTER:50051", "http://MASTER:8080/metadata")`` in each runtime, or
``open_store("mooncake://MASTER:50051?metadata=http://MASTER:8080/metadata")`` (from_url.py).

**Where the segment is.** A client registers its segment under ``local_hostname``, and every
other client reads it there: it must be this host's address as the other hosts reach it.
Unset, it is the address this host reaches the master from (the route's source address; no
packet is sent), or 127.0.0.1 when the master is on loopback; a loopback ``local_hostname``
with a master elsewhere is refused (other hosts would read their own loopback and load
nothing). Set it (``&local_hostname=`` in a URL) on a host with several networks, to the one
the other hosts use. The transfer engine's RPC listens on the same address
(``MC_TCP_BIND_ADDRESS``, unless set).

How it behaves, as measured on Mooncake 0.3.13: keys are strings (``pckv/`` then the digest in
hex); a ``put`` of a key held already keeps the old value (equal digests, equal K/V); a read
takes a lease (10 s by default) during which a plain remove is refused, so removals force;
when the store is full the master evicts the oldest keys in the background and puts are
refused meanwhile (dropped here). Keys live in the segment of the client that holds them: they
go when that process does. A killed master makes every call wait about 4 s and fail; a stalled
one, ``MC_RPC_TIMEOUT_MS`` (set to 3 s here unless given); ``health_check`` answers at once, so
each operation asks it first and fails fast. A restarted master is found again by the clients
on their own, empty. A client must not be used once closed (the library crashes): closing is
guarded: calls after ``close`` fail as unavailable.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
import urllib.request
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np

from prefixcache.errors import ConfigError
from prefixcache.store.backend import (
    BlockPlace,
    KVBlockStore,
    StoreUnavailableError,
    import_client,
)

NOT_FOUND = -704
BUFFER_TOO_SMALL = -600
STORE_FULL = -200
MIB = 1 << 20


def _is_loopback(host: str) -> bool:
    """Whether every address ``host`` names is a loopback one (an unresolvable name: no)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def segment_address(master: str, local_hostname: str | None) -> str:
    """The address this process registers its segment under, where every other client reads
    it: ``local_hostname`` as given, unless it is loopback while the master ``HOST:PORT`` is
    not (ConfigError: other hosts could not reach it); unset, 127.0.0.1 for a master on
    loopback, else the address this host reaches the master from."""
    host, _, port = master.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit():
        raise ConfigError(f"the Mooncake master is HOST:PORT, got {master!r}")
    master_local = _is_loopback(host)
    if local_hostname is not None:
        if not master_local and _is_loopback(local_hostname):
            raise ConfigError(
                f"local_hostname {local_hostname!r} is a loopback address but the Mooncake "
                f"master {master} is not: other hosts would read their own loopback and load "
                "nothing; pass this host's address as they reach it, or leave local_hostname "
                "unset to take the address this host reaches the master from"
            )
        return local_hostname
    if master_local:
        return "127.0.0.1"
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, int(port), type=socket.SOCK_DGRAM)[
            0
        ]
        with socket.socket(family, kind, proto) as probe:
            probe.connect(addr)  # a datagram socket's connect only picks the route
            return str(probe.getsockname()[0])
    except OSError as exc:
        raise ConfigError(
            f"cannot tell this host's address toward the Mooncake master {master} ({exc}): "
            "pass local_hostname"
        ) from None


def _mooncake() -> Any:
    client = import_client(
        "mooncake.store",
        "Mooncake Store needs its client: pip install 'prefixcache[mooncake]' (and "
        "apt-get install -y libibverbs1 librdmacm1 libnuma1)",
    )
    return client.MooncakeDistributedStore


class MooncakeBlockStore(KVBlockStore):
    """A Mooncake Store client: ``master`` is the master's ``HOST:PORT``, ``metadata`` its
    HTTP metadata URL; this process contributes ``segment_bytes`` of memory to the store and
    moves values through a ``buffer_bytes`` local buffer (at least one record), registered at
    ``local_hostname`` (``segment_address``: by default this host's address toward the
    master). ``metrics_url`` (the master's ``/metrics``) lets ``evicted()`` read the master's
    count."""

    name = "mooncake"

    def __init__(
        self,
        master: str,
        metadata: str,
        *,
        local_hostname: str | None = None,
        segment_bytes: int = 256 * MIB,
        buffer_bytes: int = 64 * MIB,
        protocol: str = "tcp",
        device: str = "",
        metrics_url: str | None = None,
        key_prefix: str = "pckv/",
    ) -> None:
        for label, value in (("segment_bytes", segment_bytes), ("buffer_bytes", buffer_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{label} must be an int >= 0, got {value!r}")
        client_class = _mooncake()
        address = segment_address(master, local_hostname)
        try:
            ipaddress.ip_address(address)
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", address)  # else it offers eth0
        except ValueError:
            pass  # a host name: the transfer engine resolves it
        self.local_hostname = address
        os.environ.setdefault("MC_RPC_TIMEOUT_MS", "3000")
        os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "2")
        self.master, self.metadata, self.metrics_url = master, metadata, metrics_url
        self.prefix = key_prefix
        self._client = client_class()
        rc = self._client.setup(
            address, metadata, segment_bytes, buffer_bytes, protocol, device, master
        )
        if rc != 0:
            raise ConfigError(
                f"cannot join Mooncake Store at master {master} (metadata {metadata}): setup "
                f"returned {rc}; is mooncake_master running there?"
            )
        self._closed = False
        self._lock = threading.Lock()  # buffer registrations and closing
        # the client serves the step's reads and the writer thread's puts at once; the caller
        # closes it only once both have stopped (the connector's close does)
        self._registered: set[tuple[int, int]] = set()

    def _key(self, digest: bytes) -> str:
        return self.prefix + digest.hex()

    def _ready(self) -> Any:
        """The client, when it is open and the master answers; else StoreUnavailableError."""
        if self._closed:
            raise StoreUnavailableError("the Mooncake client is closed")
        state = self._client.health_check()
        if state != 0:
            raise StoreUnavailableError(f"Mooncake master {self.master} unreachable ({state})")
        return self._client

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        codes = self._ready().batch_is_exist([self._key(k) for k in keys])
        if any(c < 0 for c in codes):
            raise StoreUnavailableError(f"Mooncake batch_is_exist failed: {min(codes)}")
        return [c == 1 for c in codes]

    def get_into(self, key: bytes, out: memoryview) -> int | None:
        target = np.frombuffer(out, dtype=np.uint8)
        ptr, size = int(target.ctypes.data), target.nbytes
        client = self._ready()
        if (ptr, size) not in self._registered:
            with self._lock:
                client.register_buffer(ptr, size)
                self._registered.add((ptr, size))
        n = int(client.get_into(self._key(key), ptr, size))
        if n == BUFFER_TOO_SMALL:
            n = int(client.get_size(self._key(key)))
        if n == NOT_FOUND:
            return None
        if n < 0:
            raise StoreUnavailableError(f"Mooncake get_into failed: {n}")
        return n

    def put_many(
        self,
        items: Sequence[tuple[bytes, bytes | memoryview]],
        *,
        places: Mapping[bytes, BlockPlace] | None = None,
        replace: Collection[bytes] = (),
    ) -> int:
        stored = 0
        client = self._ready()
        for key, value in items:
            if key in replace:  # a put keeps a held value: drop the bad one first
                self.remove(key)
            rc = client.put(self._key(key), value)
            if rc == 0:
                stored += 1
            elif rc != STORE_FULL:  # full: the master is evicting, this one is dropped
                raise StoreUnavailableError(f"Mooncake put failed: {rc}")
        return stored

    def remove(self, key: bytes) -> None:
        rc = self._ready().remove(self._key(key), True)  # forced: a read's lease holds it
        if rc not in (0, NOT_FOUND):
            raise StoreUnavailableError(f"Mooncake remove failed: {rc}")

    def evicted(self) -> int:
        """The master's ``master_evicted_key_count`` (0 without ``metrics_url``)."""
        if self.metrics_url is None:
            return 0
        try:
            with urllib.request.urlopen(self.metrics_url, timeout=2) as answer:
                text = answer.read().decode()
        except OSError as exc:
            raise StoreUnavailableError(f"Mooncake metrics: {exc}") from exc
        for line in text.splitlines():
            if line.startswith("master_evicted_key_count "):
                return int(float(line.split()[1]))
        return 0

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for ptr, _ in self._registered:
                self._client.unregister_buffer(ptr)
            self._client.close()
