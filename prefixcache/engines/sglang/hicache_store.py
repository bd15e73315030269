"""SGLang's HiCache reads and writes pages through prefixcache's store: a storage backend SGLang
builds by module path.

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
      --hicache-storage-backend dynamic --hicache-storage-backend-extra-config '{
        "backend_name": "prefixcache",
        "module_path": "prefixcache.engines.sglang.hicache_store",
        "class_name": "PrefixcacheHiCacheStorage", "interface_v1": 1,
        "store": "lmdb:///dev/shm/prefixcache-kv?capacity=4GiB"}'

Keys are SGLang's own: the hex SHA-256 it chains per page (its cache salt and extra key seed the
chain). The store key of a page is the xxh3-128 of that key under the backend's namespace
(``model``: SGLang's model name unless set; ``weights``, the exact weights when named;
``extra``; the tensor-parallel rank and size, as each rank holds its own heads), so two models,
two sets of weights or two ranks never share a record. A record
holds the page in the store's one order (hicache_pages.py) with the store's header: a page read
back is checked (digest, namespace fingerprint, layout, length, checksum) before one byte of it
reaches SGLang's host pool; a refused record is removed from the store, counted and logged, and
SGLang computes the page. Writes say where each page sits in its chain when SGLang passes the
pages before them, and reads tell the store their pages were used (a store that evicts by use
keeps chains whole, tails first).

``interface_v1: 1`` makes SGLang use the zero-copy calls (``batch_get_v1`` / ``batch_set_v1``
on host indices); without it, its older ones (``batch_get`` / ``batch_set`` of flat pages) are
served too. A store that fails is left alone for ``retry_after`` seconds (reads find nothing,
writes fail), counted. ``counters()`` gives the counts; ``get_stats()`` hands SGLang's storage
metrics (``--enable-storage-metrics``) the pages and bandwidth of each interval.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch
import xxhash
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from prefixcache.blocks.namespace import Namespace
from prefixcache.engines.sglang.hicache_pages import HostPages
from prefixcache.engines.store_access import acquire_store, release_store
from prefixcache.engines.store_tally import StoreTally
from prefixcache.errors import ConfigError
from prefixcache.store.backend import BlockPlace, StoreGate, StoreUnavailableError, leading_held
from prefixcache.store.block_record import (
    Refusal,
    encode_header,
    namespace_fingerprint,
    payload_checksum,
)
from prefixcache.store.from_url import check_store_url

log = logging.getLogger("prefixcache.engines.sglang")
_OURS = ("store", "model", "weights", "extra", "retry_after")
_SGLANGS = ("backend_name", "module_path", "class_name", "interface_v1")


@dataclass
class StoreInterval:
    """One interval's traffic, in the fields SGLang's storage metrics read."""

    prefetch_pgs: list[int] = field(default_factory=list)
    backup_pgs: list[int] = field(default_factory=list)
    prefetch_bandwidth: list[float] = field(default_factory=list)
    backup_bandwidth: list[float] = field(default_factory=list)


class PrefixcacheHiCacheStorage(HiCacheStorage):
    """A HiCache storage backend over a prefixcache ``KVBlockStore``."""

    def __init__(self, storage_config: Any, kwargs: Mapping[str, Any] | None = None) -> None:
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        unknown = sorted(set(extra) - set(_OURS) - set(_SGLANGS))
        if unknown:
            raise ConfigError(f"prefixcache HiCache store: unknown setting(s) {unknown}")
        url = extra.get("store")
        if not isinstance(url, str) or not url:
            raise ConfigError(
                "prefixcache HiCache store: the extra config needs 'store': lmdb:///PATH or "
                "mooncake://MASTER:PORT?metadata=URL"
            )
        check_store_url(url)
        if getattr(storage_config, "is_mla_model", False):
            raise ConfigError("prefixcache HiCache store serves MHA models, not MLA")
        model = extra.get("model") or getattr(storage_config, "model_name", None) or ""
        keys = extra.get("extra", [])
        if not isinstance(keys, list | tuple) or not all(isinstance(k, str) for k in keys):
            raise ConfigError(f"'extra' must be a list of strings, got {keys!r}")
        retry_after = extra.get("retry_after", 2.0)
        if isinstance(retry_after, bool) or not isinstance(retry_after, int | float):
            raise ConfigError(f"'retry_after' must be seconds, got {retry_after!r}")
        weights = extra.get("weights")
        if weights is not None and (not isinstance(weights, str) or not weights):
            raise ConfigError(f"'weights' must be a non-empty string, got {weights!r}")
        rank = f"tp{storage_config.tp_rank}-of-{storage_config.tp_size}"
        self.namespace = Namespace(model=str(model), extra=("sglang", rank, *keys), weights=weights)
        self.fingerprint = namespace_fingerprint(self.namespace)
        self._seed = b"prefixcache/sglang-page\x00" + self.fingerprint
        self.url = url
        self.store = acquire_store(url)
        self.tally = StoreTally()
        self.gate = StoreGate(float(retry_after), "HiCache backend", log)
        self.pages: HostPages | None = None
        self._local = threading.local()  # one record buffer per calling thread
        self._interval = StoreInterval()
        self._interval_lock = threading.Lock()

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Take SGLang's host pool (its layout is checked)."""
        super().register_mem_pool_host(mem_pool_host)
        self.pages = HostPages(mem_pool_host)

    def store_key(self, key: str) -> bytes:
        """The store's key of SGLang's page key ``key``."""
        return xxhash.xxh3_128_digest(self._seed + key.encode())

    # ---- reads -------------------------------------------------------------------------
    def _buffer(self) -> np.ndarray:
        pages = self._pages()
        buf = getattr(self._local, "record", None)
        if buf is None:
            buf = self._local.record = np.empty(pages.layout.record_bytes, np.uint8)
        return buf

    def _pages(self) -> HostPages:
        if self.pages is None:
            raise ConfigError("SGLang registers its host pool before using the store")
        return self.pages

    def _fetch(self, key: str) -> torch.Tensor | None:
        """The payload of page ``key``, checked (a view of this thread's buffer), or None."""
        pages, buf = self._pages(), self._buffer()
        digest = self.store_key(key)
        reason = self.gate.read_checked(self.store, digest, buf, self.fingerprint, pages.layout)
        if reason is None:
            self.tally.add("loaded_pages")
            header = pages.layout.header_bytes
            return pages.payload(torch.from_numpy(buf[header:]))
        self.tally.add(f"refused_{reason.value}")
        if reason not in (Refusal.MISSING, Refusal.ERROR):
            log.warning("store record of page %s refused (%s): computed", key, reason.value)
            with contextlib.suppress(StoreUnavailableError):
                self.store.remove(digest)
        return None

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """Load each page into the host pool at its indices; True for each loaded (the pages
        after the first that is not are not read)."""
        pages, start = self._pages(), time.monotonic()
        out = [False] * len(keys)
        for i, key in enumerate(keys):
            payload = self._fetch(key)
            if payload is None:
                break
            pages.write(int(host_indices[i * pages.page_size]), payload)
            out[i] = True
        self._touch(keys[: sum(out)])
        self._note("prefetch", sum(out), start)
        return out

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        """Page ``key`` as a flat page (into ``target_location`` when given), or None."""
        pages = self._pages()
        payload = self._fetch(key)
        if payload is None:
            return None
        out = target_location
        if not isinstance(out, torch.Tensor):
            out = self.mem_pool_host.get_dummy_flat_data_page()
        pages.to_flat(payload, out)
        return out

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """``get`` of each key; the pages after the first missing one are not read."""
        start = time.monotonic()
        out: list[torch.Tensor | None] = [None] * len(keys)
        for i, key in enumerate(keys):
            target = target_locations[i] if target_locations is not None else None
            out[i] = self.get(key, target)
            if out[i] is None:
                break
        self._touch(keys[: sum(x is not None for x in out)])
        self._note("prefetch", sum(x is not None for x in out), start)
        return out

    def exists(self, key: str) -> bool:
        """Whether the store holds page ``key`` now."""
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many of ``keys``, from the first, the store holds (one query)."""
        self.tally.add("queries")
        if not keys:
            return 0
        held = self.gate.ask(partial(self.store.exists, [self.store_key(k) for k in keys]))
        if held is None:
            self.tally.add("query_errors")
            return 0
        n = leading_held(held)
        self.tally.add("found_pages", n)
        return n

    def _touch(self, keys: list[str]) -> None:
        """The pages just read are in use: a store that evicts by use keeps them longer."""
        if keys and self.gate.is_open():
            with contextlib.suppress(StoreUnavailableError):
                self.store.touch([self.store_key(k) for k in keys])

    # ---- writes ------------------------------------------------------------------------
    def _places(self, keys: list[str], extra_info: Any) -> dict[bytes, BlockPlace] | None:
        """Where each page sits in its chain, when SGLang says which pages precede them."""
        before = getattr(extra_info, "prefix_keys", None)
        if before is None:
            return None
        chain = [*before, *keys]
        first = len(before)
        return {
            self.store_key(key): BlockPlace(
                self.store_key(chain[first + i - 1]) if first + i else None, first + i
            )
            for i, key in enumerate(keys)
        }

    def _put(
        self, keys: list[str], fill: Any, places: dict[bytes, BlockPlace] | None = None
    ) -> list[bool]:
        """Write one record per key, ``fill(i, payload)`` copying page ``i`` in; all True
        when the store took them (held already or new)."""
        pages = self._pages()
        layout = pages.layout
        header = layout.header_bytes
        records = np.empty((len(keys), layout.record_bytes), np.uint8)
        items = []
        for i, key in enumerate(keys):
            fill(i, pages.payload(torch.from_numpy(records[i, header:])))
            digest = self.store_key(key)
            head = encode_header(
                digest, self.fingerprint, layout, payload_checksum(records[i, header:])
            )
            records[i, :header] = np.frombuffer(head, np.uint8)
            items.append((digest, records[i].data))
        if not items:
            return []
        if not self.gate.is_open():
            self.tally.add("dropped_pages", len(items))
            return [False] * len(items)
        try:
            stored = self.store.put_many(items, places=places)
        except StoreUnavailableError as exc:
            self.gate.failed(exc)
            self.tally.add("write_errors", len(items))
            return [False] * len(items)
        self.tally.add("written_pages", stored)
        self.tally.add("evicted_pages", len(self.store.take_evicted_keys()))
        return [True] * len(items)

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """Write each page from the host pool at its indices."""
        pages, start = self._pages(), time.monotonic()
        done = self._put(
            keys,
            lambda i, out: pages.read(int(host_indices[i * pages.page_size]), out),
            self._places(keys, extra_info),
        )
        self._note("backup", sum(done), start)
        return done

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        """Write flat page ``value`` under ``key``."""
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Write flat pages ``values``; True when the store took every one."""
        if values is None or len(values) != len(keys):
            raise ConfigError("batch_set needs one flat page per key")
        pages, start = self._pages(), time.monotonic()
        done = self._put(keys, lambda i, out: pages.from_flat(values[i], out))
        self._note("backup", sum(done), start)
        return all(done)

    # ---- what it did -------------------------------------------------------------------
    def _note(self, kind: str, n: int, start: float) -> None:
        if not n:
            return
        seconds = max(time.monotonic() - start, 1e-9)
        gib = n * self._pages().layout.payload_bytes / (1 << 30)
        with self._interval_lock:
            getattr(self._interval, f"{kind}_pgs").append(n)
            getattr(self._interval, f"{kind}_bandwidth").append(gib / seconds)

    def get_stats(self) -> StoreInterval:
        """The pages and bandwidth (GiB/s) of each read and write since the last call."""
        with self._interval_lock:
            out, self._interval = self._interval, StoreInterval()
        return out

    def counters(self) -> dict[str, int]:
        """Every count since the backend started: ``queries``, ``query_errors``,
        ``found_pages``, ``loaded_pages``, ``refused_<reason>``, ``written_pages``,
        ``dropped_pages``, ``write_errors``, ``evicted_pages``."""
        return self.tally.totals()

    def close(self) -> None:
        """Let go of the store (SGLang detaching the backend)."""
        if self.url:
            release_store(self.url)
            self.url = ""
