"""Blocks a replica holds that the subscriber cannot place yet: stored under a parent it never saw.

A router that joins a stream late, restarts past the replay buffer, or clears a replica after an
unfillable gap sees ``BlockStored`` events whose parent hash it does not know. Their blocks are
held by the engine all the same, so they are kept here (``UnplacedBlocks``), by engine hash, with
their parent's hash, their tokens, their media and when they were stored (the replica's event
count), until something places them in a chain:

- a later event stores their parent (the chain continues from a known block): they are placed
  under it (``EventApplier``);
- a lookup of a replica with engine keys (``engine_keys``) computes the prompt's engine hashes
  and finds them held (``engine_match``), then places the matched blocks under the prompt's own
  digests;
- a prompt routed to the replica (``RecentRoutes``) whose blocks ``j..`` the event stores: its
  parent is the prompt's block ``j-1`` on that replica.

A stored block vouches for its ancestors: the engine computed it for a request whose earlier
blocks were all in its cache (its parent is remembered as ``vouched``, which outlives the
block). So an ancestor never seen stored counts as held when a held block below it was stored
after the ancestor's last removal (``gone``, kept while unplaced blocks exist, bounded: past
``max_gone`` the oldest removals are forgotten and ``floor`` says up to which event removals
may be unknown, so older vouchers vouch for nothing). No block counts as held after its
removal was seen; vLLM frees a request's blocks tail first, so a held block's ancestors are
held, and the answer is the engine's own prefix match.

Memory: at most ``max_blocks`` unplaced blocks per replica (more are counted as overflow and
not kept), each with its block's tokens, as many vouched parents and ``max_gone`` removals.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from prefixcache.fleet.events.wire import BlockHash

_GPU_BIT = 1  # a block's media mask (``ReplicaStream.blocks``): bit 1 is the GPU


class EngineMatch(NamedTuple):
    """What a replica holds of a prompt's engine hashes."""

    blocks: int  # leading blocks held on any medium
    gpu_blocks: int  # leading blocks held on GPU
    media: list[int]  # the media mask each matched block is placed with


@dataclass
class UnplacedBlocks:
    """A replica's blocks kept by engine hash until they can be placed (module docstring)."""

    max_blocks: int = 262_144
    max_gone: int = 262_144
    # engine hash -> [parent hash, token bytes, media mask, event count when stored, lora name]
    entries: dict[BlockHash, list[Any]] = field(default_factory=dict)
    children: dict[BlockHash, list[BlockHash]] = field(default_factory=dict)  # by parent hash
    gone: dict[BlockHash, int] = field(default_factory=dict)  # hash -> event count when removed
    # a parent named by a stored block: held then (event count), and its ancestors with it
    vouched: dict[BlockHash, int] = field(default_factory=dict)
    # a removed block that vouched (stored, or named a parent): the event count it vouched at,
    # and whether on GPU; its ancestors were held then, and still are unless removed since
    lapsed: dict[BlockHash, tuple[int, bool]] = field(default_factory=dict)
    floor: int = -1  # removals up to this event count may have been forgotten

    def __len__(self) -> int:
        return len(self.entries)

    def __bool__(self) -> bool:
        return bool(self.entries or self.vouched or self.lapsed)

    def concerns(self, hashes: frozenset[BlockHash]) -> bool:
        """Whether any of ``hashes`` is kept, vouched for or a lapsed voucher (``engine_match``
        has something to say about a prompt with these engine hashes)."""
        return not (
            hashes.isdisjoint(self.entries)
            and hashes.isdisjoint(self.vouched)
            and hashes.isdisjoint(self.lapsed)
        )

    def clear(self) -> None:
        """The replica holds nothing any more."""
        self.entries.clear()
        self.children.clear()
        self.gone.clear()
        self.vouched.clear()
        self.lapsed.clear()
        self.floor = -1

    def keep(
        self,
        hashes: Sequence[BlockHash],
        parent: BlockHash,
        body: bytes,
        block_bytes: int,
        bit: int,
        now: int,
        lora_name: str | None,
    ) -> int:
        """Keep a run of blocks stored under ``parent``; how many did not fit."""
        entries, children, vouched = self.entries, self.children, self.vouched
        vouched.pop(parent, None)
        vouched[parent] = now  # the engine held it when it stored the run (latest last)
        if len(vouched) > self.max_blocks:
            del vouched[next(iter(vouched))]
        for k, h in enumerate(hashes):
            entry = entries.get(h)
            if entry is not None:
                if entry[0] == parent:
                    entry[2] |= bit
                    entry[3] = now
                    parent = h
                    continue
                self.pop(h)  # the same hash under another parent: the new one stands
            if len(entries) >= self.max_blocks:
                return len(hashes) - k
            block = body[k * block_bytes : (k + 1) * block_bytes]
            entries[h] = [parent, block, bit, now, lora_name]
            children.setdefault(parent, []).append(h)
            self.gone.pop(h, None)
            parent = h
        return 0

    def pop(self, h: BlockHash) -> list[Any] | None:
        """Take ``h`` out (placed, or held nowhere any more); its entry."""
        entry = self.entries.pop(h, None)
        if entry is not None:
            siblings = self.children.get(entry[0])
            if siblings is not None:
                siblings.remove(h)
                if not siblings:
                    del self.children[entry[0]]
        return entry

    def removed(self, h: BlockHash, bits: int, now: int) -> None:
        """The replica dropped ``h`` from the media ``bits``."""
        if not self.entries and not self.vouched and not self.lapsed:
            if self.gone:  # nothing left to vouch for: no removal matters any more
                self.gone.clear()
            return
        # what it vouched for outlives it: the engine frees a request's blocks tail first, so
        # its ancestors stay held unless their own removal is seen
        vouch = self.vouched.pop(h, -1)  # removed since it was named a parent
        gpu = vouch >= 0
        entry = self.entries.get(h)
        if entry is not None:
            entry[2] &= ~bits
            if entry[3] > vouch:
                vouch, gpu = entry[3], bool(entry[2] & _GPU_BIT) or bool(bits & _GPU_BIT)
            if not entry[2]:
                self.pop(h)
        if vouch >= 0:
            lapsed = self.lapsed
            lapsed.pop(h, None)
            lapsed[h] = (vouch, gpu)
            if len(lapsed) > self.max_blocks:  # forgetting one only under-reports
                del lapsed[next(iter(lapsed))]
        gone = self.gone
        gone.pop(h, None)
        gone[h] = now
        if len(gone) > self.max_gone:  # forget the oldest removal: older vouchers lapse
            oldest = next(iter(gone))
            self.floor = max(self.floor, gone.pop(oldest))


def engine_match(
    blocks: dict[BlockHash, list[Any]], unplaced: UnplacedBlocks, hashes: Sequence[BlockHash]
) -> EngineMatch:
    """The leading blocks of a prompt (its engine hashes ``hashes``) the replica holds, as the
    engine's own prefix match finds them: placed blocks (``blocks``: hash -> [digest, position,
    media]) and unplaced ones, and ancestors vouched for by a held block stored after their last
    removal (module docstring)."""
    entries, vouched, lapsed = unplaced.entries, unplaced.vouched, unplaced.lapsed
    n = len(hashes)
    media = [0] * n
    stored = [-1] * n  # when an unplaced block was stored: it vouches for its ancestors
    was: list[tuple[int, bool] | None] = [None] * n  # a removed block's vouch for its ancestors
    deepest = held_deepest = -1
    for i, h in enumerate(hashes):
        e = blocks.get(h)
        if e is not None:
            media[i], deepest = e[2], i
            continue
        o = entries.get(h)
        if o is not None and o[2]:
            media[i], stored[i], deepest = o[2], o[3], i
        elif h in vouched and vouched[h] > max(unplaced.floor, unplaced.gone.get(h, -1)):
            # held when a block was stored under it, and not removed since
            media[i], stored[i], deepest = _GPU_BIT, vouched[h], i
        elif h in lapsed:
            was[i], held_deepest = lapsed[h], i
    deepest = max(deepest, held_deepest)
    fail_any = fail_gpu = deepest + 1
    vouch_any = vouch_gpu = -1
    gone, floor = unplaced.gone, unplaced.floor
    for i in range(deepest, -1, -1):
        m = media[i]
        w = was[i]
        if w is not None:  # gone itself, but its ancestors were held when it vouched
            vouch_any = max(vouch_any, w[0])
            if w[1]:
                vouch_gpu = max(vouch_gpu, w[0])
        if m:
            vouch_any = max(vouch_any, stored[i])
            if m & _GPU_BIT:
                vouch_gpu = max(vouch_gpu, stored[i])
        since = max(floor, gone.get(hashes[i], -1))
        if not m:
            if vouch_any > since:
                media[i] = _GPU_BIT if vouch_gpu > since else 2
            else:
                fail_any = i
        if not media[i] & _GPU_BIT:
            fail_gpu = i
    return EngineMatch(fail_any, min(fail_gpu, fail_any), media[:fail_any])


class RecentRoutes:
    """The last prompts routed to a replica (token bytes of their full blocks, their digests,
    their adapter), to link blocks stored under an unknown parent (module docstring)."""

    def __init__(self, size: int = 64) -> None:
        self.routes: deque[tuple[bytes, list[bytes], str | None]] = deque(maxlen=size)

    def note(self, body: bytes, digests: list[bytes], adapter: str | None) -> None:
        """A prompt (``body``: its full blocks' tokens as bytes) was routed to the replica."""
        self.routes.append((body, digests, adapter))

    def find(
        self, body: bytes, block_bytes: int, adapter: str | None
    ) -> tuple[bytes, list[bytes], int] | None:
        """The most recent routed prompt whose blocks ``j..`` are ``body`` (``j`` >= 1):
        (its token bytes, its digests, ``j``), or None."""
        for prompt, digests, routed_adapter in reversed(self.routes):
            if routed_adapter != adapter or len(prompt) < len(body) + block_bytes:
                continue
            at = prompt.find(body, block_bytes)
            while at != -1:
                if at % block_bytes == 0:
                    return prompt, digests, at // block_bytes
                at = prompt.find(body, at + 1)
        return None
