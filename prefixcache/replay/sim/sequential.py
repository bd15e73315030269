"""Sequential replay: one request at a time, admitted then released (Mooncake paper, Fig. 9).

Requests with several samples fork after admission and each sample writes its output (copy on
write of the shared last block); a request whose output a later turn reuses writes it too, so
those blocks are cached as a serving engine would cache them. As in serving, a sample's last
token is sampled but never written. Everything else is admit, release.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import NamedTuple

import numpy as np

from prefixcache.blocks.namespace import Namespace
from prefixcache.errors import OutOfBlocksError, RequestTooLargeError
from prefixcache.manager.cache_manager import CacheManager
from prefixcache.manager.results import Admission
from prefixcache.replay.sim.accounting import Accountant
from prefixcache.replay.tiers.admission import TierAdmitter
from prefixcache.replay.workload.request import Request
from prefixcache.replay.workload.synth import TokenTape, stream_key


def run_sequential(
    requests: Iterable[Request],
    mgr: CacheManager,
    acc: Accountant,
    tiers: TierAdmitter | None = None,
) -> int:
    """Replay ``requests``; returns how many sample outputs were cut short for lack of blocks.
    ``tiers``: admit through the host tier and pool it manages."""
    p = mgr.block_size
    release, stats, counts = mgr.release, mgr.stats, mgr.block_counts
    admit: Callable[[Hashable, np.ndarray, Namespace], Admission]
    admit = mgr.admit if tiers is None else tiers.admit
    states = mgr.internals.states
    record, note_usage, timeline = acc.record, acc.note_usage, acc.timeline
    samples = TokenTape(stream_key("sequential-samples"))
    truncated = 0
    i = -1
    for i, req in enumerate(requests):
        tokens, namespace = req.tokens, req.namespace
        try:
            adm = admit(i, tokens, namespace)
        except RequestTooLargeError:
            record(i, req, tokens.tobytes(), 0, False, 0, rejected=True)
            continue
        buf = bytes(states[i].tokens)  # the manager's copy of the token bytes, not a second one
        if tiers is None:
            record(i, req, buf, adm.cached_len, adm.cow, adm.partial_tokens)
        else:
            hit = tiers.split(buf, namespace, adm)
            record(
                i,
                req,
                buf,
                hit.cached_len,
                adm.cow,
                hit.partial_tokens,
                host_tokens=hit.host_tokens,
                pool_tokens=hit.pool_tokens,
            )
        t = len(tokens)
        due = timeline is not None and i % timeline.every == 0  # Timeline.due, inline
        if req.n == 1 and req.output_tokens is None:
            # Alone in the cache, a request uses exactly its table's blocks plus the source of
            # each copy (a partial match, or a fully cached prompt's last block), which it reads
            # as it would a shared block: both counts include the sources. (The manager pins the
            # whole radix node around a source, so its active count would overstate them.)
            table = adm.block_table
            logical = active = len(table) + len(adm.copies)
            if active > acc.physical_peak or logical > acc.logical_peak:
                note_usage(active, logical, len(table) * p - t)
            if due:
                acc.sample_timeline(i, None, counts(), stats.evicted_blocks, final=False)
            release(i)
            continue
        written = _write_outputs(mgr, i, req, buf, acc, samples)
        truncated += written.truncated
        used = counts()
        note_usage(used.active, written.logical_blocks, written.free_slots)
        if due:
            acc.sample_timeline(i, None, used, stats.evicted_blocks, final=False)
        for rid in written.ids:
            release(rid)
    if timeline is not None and i >= 0:
        acc.sample_timeline(i, None, counts(), stats.evicted_blocks, final=True)
    return truncated


class _WrittenOutputs(NamedTuple):
    ids: list[object]  # the request's sequence ids, one per sample
    logical_blocks: int  # blocks of all samples' tables, shared ones counted per sample
    free_slots: int  # unused slots in the samples' last blocks
    truncated: int  # samples cut short for lack of blocks


def _write_outputs(
    mgr: CacheManager, i: int, req: Request, buf: bytes, acc: Accountant, samples: TokenTape
) -> _WrittenOutputs:
    """Fork the samples and append their outputs."""
    p, t = mgr.block_size, len(req.tokens)
    ids: list[object] = [i] + [(i, j) for j in range(1, req.n)]
    for rid in ids[1:]:
        mgr.fork(i, rid)
    lengths, cut = [], 0
    for j, rid in enumerate(ids):
        out = req.output_tokens if j == 0 and req.output_tokens is not None else None
        if out is None:
            out = samples.take(req.output_len)
        out = out[: max(0, req.output_len - 1)]  # the last sampled token's K/V is never written
        written = 0
        if len(out):
            try:
                mgr.append(rid, out, map_slots=False)
                written = len(out)
            except OutOfBlocksError:
                cut += 1
        lengths.append(t + written)
        if j == 0 and req.output_tokens is not None and written:
            acc.note_output(i, req, buf + out.tobytes())
    arr = np.asarray(lengths)
    blocks = -(-arr // p)
    logical = int(blocks.sum())
    # samples that wrote nothing still share the prompt's last block: count its free slots once
    shared = arr == t
    frag = int((blocks * p - arr)[~shared].sum()) + (int(-(-t // p) * p - t) if shared.any() else 0)
    return _WrittenOutputs(ids, logical, frag, cut)
