"""The shadow made from the cached pass's log (``shadow_feed``) answers what the shadow made in
the pass answers, whichever way the log is read: all at once (this process, when the second one
ended without its answers) or paced with another pass's reading of the workload (the second
process), which then holds a bounded number of requests."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefixcache.replay import ReplayConfig, open_source
from prefixcache.replay.sim.accounting import Accountant, ShadowAnswers
from prefixcache.replay.sim.serving import Simulator
from prefixcache.replay.sim.shadow_feed import (
    ShadowFeed,
    ShadowMaker,
    answer_shadow,
    finish_shadow,
    paced_with_shadow,
)

ROOT = Path(__file__).resolve().parents[2]
TENANTS = ROOT / "scenarios" / "multi_tenant.yaml"  # namespaces: isolation misses
CHAT = ROOT / "tests" / "golden" / "chat_small.yaml"  # outputs reused by later turns


class SentPipe:
    """What a ``FeedPipe`` is sent."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def send(self, data: bytes) -> None:
        self.sent.append(data)


class LoggedPipe:
    """A ``FeedPipe`` as the second process sees it, fed what was sent: a message only when
    waited for (the slowest a cached pass can send)."""

    def __init__(self, batches: list[bytes]) -> None:
        self.batches = batches
        self.ended = False

    def received(self, wait: bool) -> list[bytes]:
        if not wait or self.ended:
            return []
        if not self.batches:
            self.ended = True
            return []
        return [self.batches.pop(0)]


def cached_pass(path: Path, defer: bool) -> tuple[Accountant, ShadowFeed, list]:
    """A one-replica cached pass over ``path`` (llama-3.1-8b, 200 blocks), its shadow made in
    the pass or logged (kept, and sent to a ``SentPipe``); the accountant, the log and the
    workload."""
    cfg = ReplayConfig(mode="serving", model="llama-3.1-8b", capacity_blocks=200).resolve()
    source = open_source(path, cfg.options)
    mgr = cfg.cache_manager()
    acc = Accountant(cfg.options.block_size, mgr.hasher, track_isolation=source.multi_namespace)
    feed = ShadowFeed(SentPipe())  # type: ignore[arg-type]
    if defer:
        acc.defer_shadow(feed, 16)
    Simulator(mgr, cfg, acc).run(iter(source))
    if defer:
        assert acc.deferred is not None
        acc.deferred.flush()
    return acc, feed, list(source)


def rows(acc: Accountant) -> bytes:
    assert acc.log is not None
    return b"".join(ints.tobytes() for ints, _ in acc.log.chunks())


@pytest.mark.parametrize("path", [TENANTS, CHAT], ids=["tenants", "chat"])
@pytest.mark.parametrize("paced", [False, True], ids=["at-once", "paced"])
def test_the_log_answers_as_the_shadow_in_the_pass(path: Path, paced: bool) -> None:
    inline, _, _ = cached_pass(path, defer=False)
    acc, feed, requests = cached_pass(path, defer=True)
    assert len(acc.shadow.seen) == 0 < len(inline.shadow.seen)
    block_size, track = acc.block_size, acc.shadow.track_isolation
    if paced:
        maker = ShadowMaker(block_size, track)
        pipe = LoggedPipe(feed.pipe.sent)  # type: ignore[union-attr]
        ahead = []  # requests read beyond the cached pass (as it last sent)
        for _ in paced_with_shadow(iter(requests), pipe, maker, ahead=8):  # type: ignore[arg-type]
            ahead.append(maker.read - maker.main_read)
        answers = finish_shadow(pipe, maker)  # type: ignore[arg-type]
        assert max(ahead) == 8 + 1  # 8, and the one just read
    else:
        answers = answer_shadow(iter(requests), feed.batches(), block_size, track)
    acc.settle_shadow(answers)
    assert acc.totals == inline.totals
    assert rows(acc) == rows(inline)
    assert acc.top_prefixes() == inline.top_prefixes()


def test_a_log_that_does_not_fit_the_workload_is_refused() -> None:
    acc, feed, requests = cached_pass(TENANTS, defer=True)
    batches = list(feed.batches())
    block_size, track = acc.block_size, acc.shadow.track_isolation
    with pytest.raises(ValueError, match="past the workload's end"):
        answer_shadow(iter(requests[:-5]), batches, block_size, track)
    with pytest.raises(ValueError, match="once too often"):  # a record logged twice
        answer_shadow(iter(requests), [batches[0][:24] * 2], block_size, track)
    with pytest.raises(ValueError, match="records"):  # answers to fewer records
        acc.settle_shadow(ShadowAnswers(b"", 0, 0))
    assert acc.deferred is not None  # nothing settled
