"""Predicted against delivered: the engine cap, the two directions of the alarm, recovery by
itself, no alarm on a healthy mix, the attribution sums on a fixed trace, and the cached-token
figure read from relayed answers (JSON and server-sent events, cut anywhere)."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from prefixcache.fleet.delivery_check import (
    DeliveryCheck,
    DeliveryConfig,
    Prediction,
    engine_cap,
)
from prefixcache.fleet.service.openai_proxy.usage_reader import UsageReader, cached_tokens_of

B = 16
CFG = DeliveryConfig(window=40, min_requests=20, tolerance=0.5)


def _pred(replica: str, prompt: int, captured: int, available: int | None = None) -> Prediction:
    return Prediction(
        replica, "acme", "m", B, prompt, captured if available is None else available, captured
    )


def test_the_engine_cap_leaves_the_last_token_to_compute():
    assert engine_cap(64, 64, B) == 48  # a fully cached 4-block prompt: the last block recomputed
    assert engine_cap(65, 64, B) == 64
    assert engine_cap(40, 32, B) == 32
    assert engine_cap(0, 0, B) == 0


def test_predicted_hits_not_delivered_degrade_with_a_reason_and_clear_by_themselves(caplog):
    check = DeliveryCheck(CFG)
    caplog.set_level(logging.WARNING, "prefixcache.fleet")
    for _ in range(19):
        check.observe(_pred("a", 100, 64), 0)
    assert not check.state("a").degraded  # fewer than min_requests: no verdict yet
    check.observe(_pred("a", 100, 64), 0)
    state = check.state("a")
    assert state.degraded and state.under == 20 and state.predicted_hits == 20
    assert "predicted 64 cached tokens" in state.reason and "reported 0" in state.reason
    assert "block_size" in state.reason and "engine_hash" in state.reason
    assert check.degraded() == {"a": state.reason}
    assert sum("replica a degraded" in r.getMessage() for r in caplog.records) == 1
    for _ in range(15):  # agreeing again: still degraded while the window holds the misses
        check.observe(_pred("a", 100, 64), 64)
    assert check.state("a").degraded
    for _ in range(20):
        check.observe(_pred("a", 100, 64), 64)
    state = check.state("a")
    assert not state.degraded and state.reason == "" and state.degraded_times == 1
    assert any("replica a recovered" in r.getMessage() for r in caplog.records)


def test_engine_hits_the_index_did_not_know_degrade_naming_the_events():
    check = DeliveryCheck(CFG)
    for _ in range(20):
        check.observe(_pred("b", 100, 0), 80)
    state = check.state("b")
    assert state.degraded and state.over == 20
    assert "did not know" in state.reason and "KV events" in state.reason


def test_a_healthy_mix_never_alarms():
    """Hits predicted and delivered within a block, cold prompts, now and then a request whose
    prefix another request computed between route and prefill, or was evicted meanwhile."""
    check = DeliveryCheck(CFG)
    for i in range(2000):
        if i % 7 == 0:
            check.observe(_pred("a", 100, 0), 32)  # computed by a neighbour request meanwhile
        elif i % 11 == 0:
            check.observe(_pred("a", 100, 64), 0)  # evicted between route and prefill
        elif i % 3 == 0:
            check.observe(_pred("a", 100, 0), 0)
        else:
            check.observe(_pred("a", 96, 96), 80)  # fully cached: the engine's cap
        assert not check.state("a").degraded
    assert check.state("a").degraded_times == 0


def test_attribution_sums_on_a_fixed_trace():
    check = DeliveryCheck(CFG)
    trace = [  # (prompt, available, captured, delivered)
        (100, 64, 64, 64),
        (100, 96, 32, 32),  # routing left 64 tokens on another replica
        (50, 0, 0, 0),
        (80, 48, 48, 32),  # the engine delivered a block less
    ]
    for prompt, available, captured, delivered in trace:
        check.observe(_pred("a", prompt, captured, available), delivered)
    check.observe(_pred("a", 10, 0), None)  # no figure: not summed, counted apart
    ((key, a),) = check.attribution().items()
    assert key == ("acme", "m")
    assert a.requests == 4 and a.prompt_tokens == 330
    assert (a.available_tokens, a.captured_tokens, a.delivered_tokens) == (208, 144, 128)
    assert a.available_tokens >= a.captured_tokens >= a.delivered_tokens
    assert check.unreported == 1


def test_route_api_reports_meet_their_predictions_and_unknown_ids_are_ignored():
    check = DeliveryCheck(DeliveryConfig(window=10, min_requests=5, tolerance=0.5, max_pending=3))
    for i in range(5):
        check.expect(f"r{i}", _pred("a", 100, 64))
    assert not check.report("r0", 64)  # pushed out: only the last three wait
    assert check.report("r4", 64) and not check.report("r4", 64)
    assert check.forget("r3") is not None
    assert check.attribution()[("acme", "m")].requests == 1


# ---- the figure in relayed answers ---------------------------------------------------------


def _usage(cached: int | None) -> dict:
    details = None if cached is None else {"cached_tokens": cached}
    return {"prompt_tokens": 100, "completion_tokens": 3, "prompt_tokens_details": details}


def _feed(reader: UsageReader, data: bytes, step: int) -> int | None:
    for i in range(0, len(data), step):
        reader.feed(data[i : i + step])
    return reader.close()


@pytest.mark.parametrize("step", [1, 7, 4096])
def test_a_json_answer_read_in_any_cut(step):
    body = json.dumps({"id": "x", "choices": [{"text": "abc"}], "usage": _usage(48)}).encode()
    assert _feed(UsageReader("application/json"), body, step) == 48
    no_details = json.dumps({"usage": _usage(None)}).encode()
    assert _feed(UsageReader("application/json"), no_details, step) is None


@pytest.mark.parametrize("step", [1, 5, 64, 100_000])
def test_a_stream_with_its_usage_chunk_read_in_any_cut(step):
    chunks = [{"choices": [{"text": t}]} for t in "abc"]
    chunks.append({"choices": [], "usage": _usage(32)})  # include_usage: the last chunk
    sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    assert _feed(UsageReader("text/event-stream; charset=utf-8"), sse.encode(), step) == 32
    plain = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks[:3]) + "data: [DONE]\n\n"
    assert _feed(UsageReader("text/event-stream"), plain.encode(), step) is None
    # continuous usage stats: every chunk has one; the last counts
    both = f"data: {json.dumps({'usage': _usage(16)})}\r\n\r\n".replace("\r\n\r\n", "\n\n")
    both += f"data: {json.dumps({'usage': _usage(48)})}\n\n"
    assert _feed(UsageReader("text/event-stream"), both.encode(), step) == 48


def test_figures_that_are_not_counts_are_not_taken():
    assert cached_tokens_of({"usage": {"prompt_tokens_details": {"cached_tokens": -1}}}) is None
    assert cached_tokens_of({"usage": {"prompt_tokens_details": {"cached_tokens": True}}}) is None
    assert cached_tokens_of({"usage": {"prompt_tokens_details": {"cached_tokens": 1.5}}}) is None
    assert cached_tokens_of([1]) is None
    assert _feed(UsageReader("application/json"), b"{not json", 3) is None


def test_the_degraded_reason_follows_the_window_not_the_moment_it_tripped(caplog):
    """The reason is the window's as it is now: its counts grow past the report that tripped the
    alarm, and when the fault changes (the engine stops delivering predicted hits, then starts
    serving hits the index never heard of) the reason names the new cause."""
    check = DeliveryCheck(CFG)  # window 40, min 20, tolerance 0.5
    caplog.set_level(logging.WARNING, "prefixcache.fleet")
    for _ in range(20):
        check.observe(_pred("a", 100, 64), 0)
    assert "100% of 20 requests" in check.state("a").reason
    for _ in range(10):  # more of the same, and a few delivered
        check.observe(_pred("a", 100, 64), 0)
    for _ in range(5):
        check.observe(_pred("a", 100, 64), 64)
    state = check.state("a")
    assert state.requests == 35 and state.under == 30
    assert "86% of 35 requests" in state.reason, state.reason
    assert check.degraded() == {"a": state.reason}
    # the fault changes: no predicted hit any more, and the engine serves 80 cached tokens
    for _ in range(40):
        check.observe(_pred("a", 100, 0), 80)
    state = check.state("a")
    assert state.degraded and state.under == 0 and state.over == 40
    assert "did not know" in state.reason and "KV events" in state.reason, state.reason
    assert "100% of 40 requests" in state.reason and "less than predicted" not in state.reason
    assert state.degraded_times == 1  # still the same spell, its cause named anew
    assert any("now" in r.getMessage() and "KV events" in r.getMessage() for r in caplog.records)


def test_a_degraded_replica_on_its_way_back_says_so_with_the_current_share():
    check = DeliveryCheck(CFG)
    for _ in range(40):
        check.observe(_pred("a", 100, 64), 0)
    for _ in range(24):  # 16 of 40 still off: 40%, below the tolerance, above half of it
        check.observe(_pred("a", 100, 64), 64)
    state = check.state("a")
    assert state.degraded and state.under == 16
    assert "40% of 40 requests" in state.reason, state.reason
    assert "clears below 25%" in state.reason, state.reason


def test_an_engine_that_reuses_partial_blocks_reads_as_agreeing():
    """SGLang with ``--page-size 1`` matches a prompt token by token (its radix cache rounds a
    match down to the page size, here 1, and stops one token before the prompt's end), so its
    ``cached_tokens`` runs up to a block past the index's whole blocks. Compared at block
    granularity (the engine's figure rounded down to whole blocks), that is never divergence:
    here the engine is a block ahead of the index on 60% of the requests (its blocks' events
    not yet in when the request was routed, which the tolerance allows) and matches a partial
    block past it on every request."""
    check = DeliveryCheck(CFG)
    rng = np.random.default_rng(4)
    for i in range(400):
        partial = int(rng.integers(1, B))
        ahead = B if i % 5 < 3 else 0
        check.observe(_pred("a", 200, 80), 80 + ahead + partial)
        state = check.state("a")
        assert not state.degraded, state
        assert state.over == 0
    assert check.state("a").degraded_times == 0
    # two whole blocks past the index on every request is still the index missing blocks
    for _ in range(40):
        check.observe(_pred("a", 200, 80), 80 + 2 * B + 5)
    state = check.state("a")
    assert state.degraded and state.over == 40 and "KV events" in state.reason
