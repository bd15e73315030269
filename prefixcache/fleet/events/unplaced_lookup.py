"""What a router asks a subscriber about blocks stored under parents it never saw (``unplaced``).

``match`` answers a lookup for a replica whose engine hashes are reproducible
(``ReplicaEndpoint.engine_hash``): the prompt's engine hashes against the blocks the replica
holds, placed or not; the blocks found are placed in the index under the prompt's digests, so
later lookups (and other routers sharing the index) find them there. ``note_route`` remembers a
prompt routed to a replica without engine hashes: a block it then stores of that prompt under an
unknown parent places the parent as the prompt's block before it.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from prefixcache.blocks.namespace import Namespace
from prefixcache.fleet.events.engine_keys import BlockKey, EngineHasher, EngineHashSpec
from prefixcache.fleet.events.index_writer import EventApplier
from prefixcache.fleet.events.replica_stream import ReplicaStream
from prefixcache.fleet.events.unplaced import engine_match
from prefixcache.fleet.index.interface import ReplicaMatch

MAX_REMEMBERED = 1_000_000  # engine hashes of blocks looked up, per engine hashing


class UnplacedLookup:
    """A subscriber's answers about unplaced blocks (``Router(held=...)``); thread-safe."""

    def __init__(
        self, replicas: dict[str, ReplicaStream], lock: threading.RLock, events: EventApplier
    ) -> None:
        self._replicas = replicas
        self._lock = lock
        self._events = events
        self._last = threading.local()  # a lookup's engine hashes, shared by its replicas
        # per engine hashing: prefixcache digest -> (engine digest, its event form)
        self._memo: dict[tuple[Any, ...], dict[bytes, tuple[bytes, BlockKey]]] = {}

    def use_engine_hashes(self, specs: Mapping[str, EngineHashSpec]) -> None:
        """Compute these replicas' engine hashes (by name; others keep theirs): for a subscriber
        whose endpoints were made without them (one the service builds has them already)."""
        with self._lock:
            for name, spec in specs.items():
                rep = self._replicas.get(name)
                if rep is not None and (rep.engine is None or rep.engine.spec != spec):
                    rep.engine = EngineHasher(spec, rep.ep.block_size)

    def match(
        self, replica: str, namespace: Namespace, tokens: np.ndarray, digests: Sequence[bytes]
    ) -> ReplicaMatch | None:
        """What ``replica`` holds of a prompt (its token ids, its digests), blocks stored under
        parents never seen included, found by its engine hashes; None when it has no engine
        hashes or no such blocks (the index answers alone)."""
        rep = self._replicas.get(replica)
        if rep is None or rep.engine is None or not rep.unplaced or not digests:
            return None
        if not rep.engine.supports(namespace.adapter, namespace.extra):
            return None
        hashes, held = self._engine_hashes(rep.engine, namespace, tokens, digests)
        if not rep.unplaced.concerns(held):
            return None  # none of the prompt's blocks is unplaced: the index knows the rest
        with self._lock:
            if self._replicas.get(replica) is not rep:
                return None
            found = engine_match(rep.blocks, rep.unplaced, hashes)
            if found.blocks:
                self._events.place(rep, hashes[: found.blocks], digests, found.media)
        return ReplicaMatch(replica, found.blocks, found.gpu_blocks)

    def _engine_hashes(
        self,
        engine: EngineHasher,
        namespace: Namespace,
        tokens: np.ndarray,
        digests: Sequence[bytes],
    ) -> tuple[list[BlockKey], frozenset[BlockKey]]:
        """The prompt's engine hashes (a list and a set): the last prompt's again (every
        replica of one lookup asks), else the blocks seen before (by their digests) and the
        rest computed."""
        key = engine.key
        # SGLang's EAGLE pages hash the token after them too, which no digest of ours covers:
        # the last lookup's hashes are reused only for the same next token, and none is memoized
        eagle = engine.spec.eagle
        after = -1
        if eagle:
            at = len(digests) * engine.block_size
            after = int(tokens[at]) if at < len(tokens) else -2  # -2: no token after it
        last = getattr(self._last, "hashes", None)
        if last is not None and last[0] == key and last[1] == digests[-1] and last[4] == after:
            return last[2], last[3]
        memo = self._memo.setdefault(key, {}) if not eagle else {}
        known: list[tuple[bytes, BlockKey]] = []
        for d in digests:
            got = memo.get(d)
            if got is None:
                break
            known.append(got)
        if len(known) < len(digests):
            more = engine.digests(
                tokens,
                adapter=namespace.adapter,
                salt=namespace.salt,
                limit=len(digests),
                start=len(known),
                parent=known[-1][0] if known else None,
            )
            if len(memo) + len(more) > MAX_REMEMBERED:
                memo.clear()
            form = engine.event_form
            fresh = [(d, form(d)) for d in more]
            memo.update(zip(digests[len(known) :], fresh, strict=False))
            known += fresh
        hashes = [h for _, h in known]
        held = frozenset(hashes)
        self._last.hashes = (key, digests[-1], hashes, held, after)
        return hashes, held

    def note_route(
        self, replica: str, namespace: Namespace, tokens: np.ndarray, digests: Sequence[bytes]
    ) -> None:
        """A prompt (its token ids, its digests) was routed to ``replica``."""
        rep = self._replicas.get(replica)
        if rep is None or rep.engine is not None or not digests:
            return
        body = tokens[: len(digests) * rep.ep.block_size].tobytes()
        with self._lock:
            rep.routes.note(body, list(digests), namespace.adapter)
