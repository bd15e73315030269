"""A fake K/V store that follows a CacheManager exactly as a runtime's forward pass would.

Each slot holds a 64-bit fingerprint of (namespace, every token up to and including its position):
the value real K/V at that slot depends on. A step is planned through the manager (admit / append /
fork / release / abort / pin / evict in any order), then ``forward()`` runs it in the documented
order: every live request's K/V store, then the step's copies in the order they were handed out,
then attention, which here reads every live request back through its block table and demands exactly
its fingerprints. With a host tier, the step's transfers run first (``take_transfers()``: every
offload copies GPU fingerprints to host slots, then every load copies host slots into GPU blocks),
as the documented order says; with a shared store (``FingerprintStore``), its loads run with them,
and a load the store can no longer serve aborts its request, as a runtime would. ``end_step()`` then
tells the manager and writes the step's computed blocks through to the store
(``take_store_writes``), whose contents are checked too. A request dropped by ``abort`` (with its
dependents) takes its stores and copies out of the step, as a runtime takes it out of the batch; its
loads still run (they write only blocks the abort freed, before anything of the step writes them
again).

With a ``PagedKVCache`` (``kv=``, made by ``fingerprint_cache``), the fingerprints live in its
tensors and its own batched copies move them: the step's transfers run through
``start_transfers`` / ``wait_transfers``, store loads through ``write_block_rows`` and the
write-through through ``read_block_rows``. Layer 0's K holds the fingerprints; every other layer's
K and V holds them XORed with its own salt, so after the transfers every layer's K and V, on the
GPU and on host, must agree with layer 0's: a layer, a K or V, a block or a slot moved wrongly
shows.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import xxhash

from prefixcache import CacheManager, Copy, Namespace, PagedKVCache
from prefixcache.manager.block_events import AllBlocksCleared, BlockRemoved, BlockStored, CacheEvent

UNWRITTEN = np.uint64(0)


def prefix_fingerprints(
    namespace: Namespace, tokens: Sequence[int], start: int = 0, prev: int | None = None
) -> list[int]:
    """Fingerprints of positions ``start ..``: fp_i = H(fp_{i-1} || token_i), seeded by the
    namespace; never 0 (0 marks a slot nobody wrote)."""
    if prev is None:
        prev = xxhash.xxh64_intdigest(b"kv-fingerprint\x00" + namespace.canonical_bytes())
    out = []
    for tok in tokens[start:]:
        prev = xxhash.xxh64_intdigest(prev.to_bytes(8, "little") + int(tok).to_bytes(4, "little"))
        out.append(prev or 1)
    return out


@dataclass
class _Live:
    namespace: Namespace
    tokens: list[int]
    fps: list[int]
    writes: list[tuple[np.ndarray, list[int]]] = field(default_factory=list)  # this step


class FingerprintStore:
    """A shared K/V store of fingerprint rows keyed by block digest (``leading_present`` is
    what the manager asks); ``drop`` takes a block out, as another process's eviction would."""

    def __init__(self) -> None:
        self.blocks: dict[bytes, np.ndarray] = {}
        self.found: list[bytes] = []  # what the last query found
        self.queries = 0
        self.loaded = 0
        self.failed = 0

    def leading_present(self, digests: Sequence[bytes]) -> int:
        self.queries += 1
        n = 0
        for d in digests:
            if d not in self.blocks:
                break
            n += 1
        self.found = list(digests[:n])
        return n

    def drop(self, i: int) -> None:
        """Drop a block the last query found (odd ``i``: any block)."""
        keys = [d for d in self.found if d in self.blocks] if i % 2 == 0 else []
        keys = keys or sorted(self.blocks)
        if keys:
            del self.blocks[keys[i % len(keys)]]


def fingerprint_cache(mgr: CacheManager, num_layers: int = 2) -> PagedKVCache:
    """A ``PagedKVCache`` to hold ``mgr``'s fingerprints: int64, one head of one value."""
    host = mgr.host.capacity if mgr.host is not None else 0
    return PagedKVCache(
        num_layers, mgr.num_blocks, mgr.block_size, 1, 1, dtype=torch.int64, host_blocks=host
    )


def _u64(t: torch.Tensor) -> np.ndarray:
    """An int64 tensor [n, p, 1, 1] as a uint64 array [n, p] sharing its memory."""
    return t.numpy().view(np.uint64).reshape(t.shape[0], t.shape[1])


def _salt(layer: int, kind: int) -> np.uint64:
    """What layer ``layer``'s K (0) or V (1) XORs the fingerprints with (0 for layer 0's K)."""
    if layer == kind == 0:
        return np.uint64(0)
    return np.uint64(xxhash.xxh64_intdigest(f"salt {layer} {kind}".encode()))


class FingerprintRuntime:
    """Drives a manager and checks every read of K/V against what the tokens demand."""

    def __init__(
        self,
        mgr: CacheManager,
        *,
        track_events: bool = True,
        kv_store: FingerprintStore | None = None,
        kv: PagedKVCache | None = None,
    ) -> None:
        self.mgr = mgr
        self.kv_store = kv_store
        self.kv = kv
        self.requeued: list[Hashable] = []  # aborted because a store load failed
        p = mgr.block_size
        host_slots = mgr.host.capacity if mgr.host is not None else 0
        if kv is None:
            self.store = np.zeros((mgr.num_blocks, p), dtype=np.uint64)
            self.host_store = np.zeros((host_slots, p), dtype=np.uint64)
        else:
            assert kv.k[0].dtype == torch.int64 and kv.k[0].shape[1:] == (p, 1, 1)
            assert (kv.num_blocks, kv.host_blocks) == (mgr.num_blocks, host_slots)
            self.store, self.host_store = _u64(kv.k[0]), _u64(kv.k_host[0])
            self.store[:] = 0
            self.host_store[:] = 0
            self._salted(host=False)
            self._salted(host=True)
        self.transfers = 0  # offloads and loads run
        self.last_transfers: tuple[list, list] = ([], [])  # those of the last forward pass
        self.live: dict[Hashable, _Live] = {}
        self.copies: list[tuple[Hashable, Copy]] = []  # this step, in the order handed out
        self.finished: list[Hashable] = []  # released once the step's forward has run
        self.mirror: set[tuple[Namespace, bytes, str]] | None = None
        self.reads = 0
        if track_events:
            self.mirror = set()
            mgr.add_listener(self._on_event)

    # ---- planning: each call goes to the manager and records the step's work --------------
    def admit(self, rid: Hashable, tokens: Sequence[int], namespace: Namespace, **kw) -> int:
        adm = self.mgr.admit(rid, tokens, namespace, **kw)
        fps = prefix_fingerprints(namespace, tokens)
        live = _Live(namespace, list(tokens), fps)
        live.writes.append((adm.slot_mapping(), fps[adm.cached_len :]))
        self.live[rid] = live
        self.copies += [(rid, c) for c in adm.copies]
        return adm.cached_len

    def append(self, rid: Hashable, new: Sequence[int]) -> None:
        res = self.mgr.append(rid, list(new))
        live = self.live[rid]
        n0 = len(live.tokens)
        live.tokens += list(new)
        live.fps += prefix_fingerprints(live.namespace, live.tokens, n0, live.fps[-1])
        live.writes.append((res.slots, live.fps[n0:]))
        self.copies += [(rid, c) for c in res.copies]

    def fork(self, parent: Hashable, child: Hashable) -> None:
        self.mgr.fork(parent, child)
        src = self.live[parent]
        self.live[child] = _Live(src.namespace, list(src.tokens), list(src.fps))

    def abort(self, rid: Hashable) -> list[Hashable]:
        dropped = self.mgr.abort(rid)
        gone = set(dropped)
        for d in dropped:
            del self.live[d]
        self.copies = [(r, c) for r, c in self.copies if r not in gone]
        return dropped

    def finish(self, rid: Hashable) -> None:
        """The request is done: released now if it has no work in this step, else after it."""
        if self.live[rid].writes:
            self.finished.append(rid)
        else:
            self.release(rid)

    def release(self, rid: Hashable) -> None:
        self.mgr.release(rid)
        del self.live[rid]

    # ---- the forward pass and the end of the step -----------------------------------------
    def forward(self) -> None:
        p = self.mgr.block_size
        offloads, loads, store_loads = self.mgr.take_transfers()  # 0. offloads, then loads
        if self.kv is None:
            for gpu_block, slot in offloads:
                self.host_store[slot] = self.store[gpu_block]
            for slot, gpu_block in loads:
                self.store[gpu_block] = self.host_store[slot]
        else:
            self.kv.start_transfers((offloads, loads))
        failed: list[Hashable] = []
        found: list[tuple[int, np.ndarray]] = []
        for load in store_loads:
            assert self.kv_store is not None
            row = self.kv_store.blocks.get(load.digest)
            if row is None:  # gone since the admission looked: its request is aborted
                self.kv_store.failed += 1
                failed.append(load.request_id)
            else:
                self.kv_store.loaded += 1
                found.append((load.gpu_block, row))
        if self.kv is None:
            for gpu_block, row in found:
                self.store[gpu_block] = row
        else:
            if found:
                self.kv.write_block_rows([b for b, _ in found], self._rows(found), 8)
            for layer in range(self.kv.num_layers):
                self.kv.wait_transfers(layer)
            self._check_layers()
        for rid in failed:
            if rid in self.live:
                self.requeued += self.abort(rid)
        self.transfers += len(offloads) + len(loads)
        self.last_transfers = (offloads, loads)
        written: dict[int, Hashable] = {}
        for rid, live in self.live.items():  # 1. every K/V store of the step
            for slots, values in live.writes:
                for s, v in zip(slots.tolist(), values, strict=True):
                    assert written.setdefault(s, rid) == rid, f"slot {s} written twice"
                    self.store[s // p, s % p] = v
            live.writes = []
        for _, (src, dst, n) in self.copies:  # 2. the copies, in order
            self.store[dst, :n] = self.store[src, :n]
        self.copies = []
        for rid, live in self.live.items():  # 3. attention reads every token through the table
            table = self.mgr.block_table(rid)
            got = [int(self.store[table[i // p], i % p]) for i in range(len(live.tokens))]
            assert got == live.fps, f"request {rid!r} reads K/V that was never written for it"
            self.reads += len(got)
        for rid in self.finished:
            if rid in self.live:
                self.release(rid)
        self.finished = []
        if self.kv is not None:  # the stores and copies went to layer 0's K: salt the rest
            self._salted(host=False)

    def end_step(self) -> None:
        self.mgr.end_step()
        if self.kv_store is not None:  # write-through: copied out before the next call
            writes = self.mgr.take_store_writes()
            if self.kv is not None and writes:
                rows = self.kv.host_rows(len(writes), 8 + self.kv.block_row_bytes)
                self.kv.read_block_rows([w.gpu_block for w in writes], rows, 8)
                payload = rows[:, 8:].numpy().view(np.uint64)
                for write, got in zip(writes, payload, strict=True):
                    got = got.reshape(self.kv.num_layers, 2, -1)
                    for layer, kind in np.ndindex(self.kv.num_layers, 2):
                        want = self.store[write.gpu_block] ^ _salt(layer, kind)
                        assert (got[layer, kind] == want).all(), "a written-through row is wrong"
                    self.kv_store.blocks[write.digest] = got[0, 0].copy()
            else:
                for write in writes:
                    self.kv_store.blocks[write.digest] = self.store[write.gpu_block].copy()
        self.check_cached()

    # ---- the PagedKVCache's other layers ---------------------------------------------------
    def _tensors(self, host: bool) -> list[tuple[np.ndarray, np.uint64]]:
        """Every layer's K and V but layer 0's K, as uint64 arrays [n, p], with its salt."""
        assert self.kv is not None
        kv = self.kv
        ks, vs = (kv.k_host, kv.v_host) if host else (kv.k, kv.v)
        out = []
        for layer in range(kv.num_layers):
            for kind, t in ((0, ks[layer]), (1, vs[layer])):
                if layer or kind:
                    out.append((_u64(t), _salt(layer, kind)))
        return out

    def _salted(self, host: bool) -> None:
        """Set every other layer's K and V from layer 0's K (on host: from its host K)."""
        base = self.host_store if host else self.store
        for arr, salt in self._tensors(host):
            arr[:] = base ^ salt

    def _check_layers(self) -> None:
        """Every layer's K and V, on the GPU and on host, agree with layer 0's K."""
        for host, base in ((False, self.store), (True, self.host_store)):
            for arr, salt in self._tensors(host):
                assert (arr == (base ^ salt)).all(), "a layer's K or V was moved wrongly"

    def _rows(self, found: list[tuple[int, np.ndarray]]) -> torch.Tensor:
        """Store rows of fingerprints as ``write_block_rows`` takes them, after an 8-byte
        header: every layer's K and V salted."""
        assert self.kv is not None
        kv = self.kv
        rows = kv.host_rows(len(found), 8 + kv.block_row_bytes)
        payload = rows[:, 8:].numpy().view(np.uint64).reshape(len(found), kv.num_layers, 2, -1)
        for i, (_, row) in enumerate(found):
            for layer, kind in np.ndindex(kv.num_layers, 2):
                payload[i, layer, kind] = row ^ _salt(layer, kind)
        return rows

    def step(self) -> None:
        self.forward()
        self.end_step()

    # ---- checks ---------------------------------------------------------------------------
    def check_cached(self) -> None:
        """Every block in the index holds the K/V of exactly the prefix it claims."""
        mgr = self.mgr
        pending = mgr.internals.pending_blocks
        p = mgr.block_size
        prefixes: dict[bytes, list[int]] = {}  # digest of an indexed block -> tokens through it
        spaces: dict[bytes, Namespace] = {}  # and its namespace
        for root in list(mgr.index.roots.values()):
            assert root.namespace is not None
            stack = [(root, [])]
            while stack:
                node, prefix = stack.pop()
                tokens = prefix + np.frombuffer(bytes(node.tokens), dtype="<i4").tolist()
                if node.parent is not None and node.blocks:
                    fps = prefix_fingerprints(root.namespace, tokens)
                    if mgr.host is not None or self.kv_store is not None:
                        for k in range(len(node.blocks)):
                            prefixes[node.digest(k)] = tokens[: (node.depth + k + 1) * p]
                            spaces[node.digest(k)] = root.namespace
                    for k, b in enumerate(node.blocks):
                        if b in pending:
                            continue
                        lo = (node.depth + k) * p
                        assert self.store[b].tolist() == fps[lo : lo + p], "cached block is wrong"
                for child in (node.children or {}).values():
                    stack.append((child, tokens))
        if mgr.host is not None:
            self._check_host(prefixes)
        if self.kv_store is not None:  # every stored block the index names holds its K/V
            for digest, row in self.kv_store.blocks.items():
                tokens = prefixes.get(digest)
                if tokens is not None and digest in spaces:
                    fps = prefix_fingerprints(spaces[digest], tokens)
                    assert row.tolist() == fps[len(tokens) - p :], "stored block is wrong"
        if self.mirror is not None:
            indexed = {
                (mgr.index.namespace_of(n), n.digest(i), "GPU")
                for n in mgr.index.iter_nodes()
                for i in range(len(n.blocks))
            }
            if mgr.host is not None:
                indexed |= {(e.namespace, d, "CPU") for d, e in mgr.host.entries.items()}
            assert self.mirror == indexed, "events disagree with the index and the host tier"

    def _check_host(self, prefixes: dict[bytes, list[int]]) -> None:
        """Every host slot in use holds the K/V of exactly the prefix its entry claims."""
        host = self.mgr.host
        assert host is not None
        p = self.mgr.block_size
        todo = dict(host.entries)
        while todo:
            progress = False
            for digest, entry in list(todo.items()):
                before = prefixes.get(entry.parent)
                if before is None and entry.position == 0:
                    before = []
                if before is None:
                    continue
                assert len(before) == entry.position * p, "a host block's parent is misplaced"
                tokens = before + np.frombuffer(entry.tokens, dtype="<i4").tolist()
                fps = prefix_fingerprints(entry.namespace, tokens)
                lo = entry.position * p
                assert self.host_store[entry.slot].tolist() == fps[lo:], "host block is wrong"
                prefixes[digest] = tokens
                del todo[digest]
                progress = True
            assert progress, "a host block's parent is neither indexed nor on host"

    def _on_event(self, event: CacheEvent) -> None:
        assert self.mirror is not None
        if isinstance(event, BlockStored):
            for h in event.block_hashes:
                key = (event.namespace, h, event.medium)
                assert key not in self.mirror, "block stored twice"
                self.mirror.add(key)
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                self.mirror.remove((event.namespace, h, event.medium))
        elif isinstance(event, AllBlocksCleared):
            self.mirror.clear()
