"""Multi-turn continuations in Mooncake traces: a later turn hits the blocks an earlier turn's
decode filled, as a serving engine caching blocks while it decodes would.

The traces use 16-token trace blocks (and a 16-token cache block), so every hit rate below is
worked out by hand: a turn writes its prompt and all but the last of its output tokens, and only
full blocks are reused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from prefixcache.errors import ConfigError
from prefixcache.replay import ReplayConfig, replay_path
from prefixcache.replay.workload.continuations import plan_continuations
from prefixcache.replay.workload.traces import TraceOptions, _lines, read_trace

B = 16


def _trace(tmp_path: Path, rows: list[dict], name: str = "t.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _turn(t_s: float, input_length: int, output_length: int, ids: list[int]) -> dict:
    return {
        "timestamp": int(t_s * 1000),
        "input_length": input_length,
        "output_length": output_length,
        "hash_ids": ids,
    }


# turn 1: 40 tokens (two full blocks and 8 tokens), 10 out; it writes 40 + 9 = 49 tokens, so its
# blocks 0-2 are full (block 2: 8 prompt tokens, then 8 of its output).
# turn 2: 80 tokens = turn 1's 40 + its 10 output + 30 new; ids 1, 2 shared, then new ids (block
# 2 now holds output, so its prefix hash changed). 5 out: it writes 84 tokens, blocks 0-4 full.
# turn 3: ends turn 2's 80 aligned tokens with its 5 outputs and 15 new: 100 tokens, 7 ids.
TWO_TURNS = [_turn(0, 40, 10, [1, 2, 3]), _turn(100, 80, 5, [1, 2, 4, 5, 6])]
THREE_TURNS = [*TWO_TURNS, _turn(200, 100, 4, [1, 2, 4, 5, 6, 7, 8])]


def _rate(path: Path, continuations: bool | None, **options: object) -> float:
    settings: dict[str, object] = {"capacity_blocks": 1000, **options}
    config = ReplayConfig(
        block_size=B,
        trace_block_size=B,
        partial_copy=False,
        continuations=continuations,
        **settings,  # type: ignore[arg-type]
    )
    result = replay_path(path, config, progress=False)
    tot = result.acc.totals
    return tot.hit_tokens / tot.prompt_tokens


@pytest.mark.parametrize("mode", ["sequential", "serving"])
def test_two_turns_hit_the_block_the_first_decoded(tmp_path: Path, mode: str) -> None:
    path = _trace(tmp_path, TWO_TURNS)
    # on: turn 2 hits blocks 0-2 (48 tokens; block 3 holds turn 1's last, unwritten output
    # token); off: blocks 0-1 only (32). Prompts: 40 + 80 tokens.
    assert _rate(path, True, mode=mode) == pytest.approx(48 / 120)
    assert _rate(path, False, mode=mode) == pytest.approx(32 / 120)
    assert _rate(path, None, mode=mode) == pytest.approx(32 / 120)  # the default: off


def test_a_chain_of_turns_aligned_and_not(tmp_path: Path) -> None:
    path = _trace(tmp_path, THREE_TURNS)
    # turn 3 continues turn 2 (aligned: all of turn 2's ids lead its own) and hits turn 2's
    # 80 prompt tokens; turn 2 hits 48 as above. Off: 32 + 80. Prompts: 40 + 80 + 100.
    assert _rate(path, True) == pytest.approx((48 + 80) / 220)
    assert _rate(path, False) == pytest.approx((32 + 80) / 220)


def test_tokens_of_a_continued_turn(tmp_path: Path) -> None:
    path = _trace(tmp_path, THREE_TURNS)
    one, two, three = read_trace(path, TraceOptions(trace_block_size=B, continuations=True))
    assert one.output_tokens is not None and len(one.output_tokens) == 10
    assert np.array_equal(two.tokens[:40], one.tokens)
    assert np.array_equal(two.tokens[40:50], one.output_tokens)
    assert two.output_tokens is not None
    assert np.array_equal(three.tokens[:80], two.tokens)
    assert np.array_equal(three.tokens[80:85], two.output_tokens)
    assert three.output_tokens is None  # nothing continues it: it writes no output
    plain = list(read_trace(path, TraceOptions(trace_block_size=B)))
    assert all(r.output_tokens is None for r in plain)
    assert np.array_equal(plain[0].tokens, one.tokens)  # the first turn is unchanged
    # a later request naming a rebuilt id gets the rebuilt block (ids name prefixes)
    again = _trace(tmp_path, [*THREE_TURNS, _turn(300, 48, 1, [1, 2, 4])], "again.jsonl")
    rows = list(read_trace(again, TraceOptions(trace_block_size=B, continuations=True)))
    assert np.array_equal(rows[3].tokens, rows[1].tokens[:48])


def test_what_is_not_a_continuation(tmp_path: Path) -> None:
    rows = [
        _turn(0, 40, 10, [1, 2, 3]),
        _turn(1, 40, 10, [1, 2, 9]),  # a branch from blocks 1-2: they are a shared prefix
        _turn(2, 80, 5, [1, 2, 4, 5, 6]),  # could extend either: neither
        _turn(3, 48, 10, [20, 21, 22]),
        _turn(4, 50, 5, [20, 21, 22, 23]),  # shorter than 48 + 10: not the next turn
        _turn(5, 30, 2, [30, 31]),
        _turn(6, 60, 2, [32, 33, 34, 35]),  # shares no full block with the one before
    ]
    path = _trace(tmp_path, rows)
    plan = plan_continuations(_lines(str(path)), B)
    assert plan.parent == {}
    assert _rate(path, True) == _rate(path, False)


def test_the_option_is_for_mooncake_traces_and_is_reported(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.jsonl"
    tokens.write_text(json.dumps({"token_ids": [1, 2, 3]}) + "\n")
    with pytest.raises(ConfigError, match="--continuations"):
        replay_path(tokens, ReplayConfig(capacity_blocks=100, continuations=True), progress=False)
    path = _trace(tmp_path, TWO_TURNS)
    base = ReplayConfig(block_size=B, trace_block_size=B, capacity_blocks=100)
    on = replay_path(path, base.with_(continuations=True), progress=False).to_report_dict()
    off = replay_path(path, base, progress=False).to_report_dict()
    assert on["config"]["continuations"] is True
    assert "continuations" not in off["config"]  # off: the config (and its digest) as before
    assert on["config_sha256"] != off["config_sha256"]
    plain = replay_path(tokens, ReplayConfig(capacity_blocks=100), progress=False).to_report_dict()
    assert "continuations" not in plain["config"]


@pytest.mark.parametrize("mode", ["sequential", "serving"])
def test_the_report_says_whether_turns_were_linked(
    tmp_path: Path, mode: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from prefixcache.cli import main

    path = _trace(tmp_path, TWO_TURNS)
    args = ["--block-size", "16", "--trace-block-size", "16", "--blocks", "100", "--mode", mode]
    shown = {}
    for flag in ("on", "off"):
        out = tmp_path / flag
        argv = ["replay", str(path), *args, "--continuations", flag, "--no-progress"]
        assert main([*argv, "--out", str(out)]) == 0
        capsys.readouterr()
        assert main(["report", str(out)]) == 0
        text = " ".join(capsys.readouterr().out.split())
        shown[flag] = text
    assert "Multi-turn continuations on: later turns can hit" in shown["on"]
    assert "Multi-turn continuations off: every block is synthesized" in shown["off"]
