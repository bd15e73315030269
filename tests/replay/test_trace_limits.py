"""Trace lines and prompts over their limits are rejected early, with one error line that names
the line number."""

from __future__ import annotations

import io
import json
import tracemalloc
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from prefixcache.cli import main
from prefixcache.replay.workload.input_errors import TraceFormatError
from prefixcache.replay.workload.traces import TraceOptions, read_trace

GOOD = {"timestamp": 0, "input_length": 1000, "output_length": 4, "hash_ids": [1, 2]}


def _trace(path: Path, *records: dict) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def run_cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


def test_a_huge_mooncake_line_is_rejected_before_its_tokens_are_built(tmp_path: Path) -> None:
    n = 400_000  # a 3 MB line; its tokens would take 800 MB
    huge = {"timestamp": 1, "input_length": n * 512, "output_length": 4, "hash_ids": list(range(n))}
    trace = _trace(tmp_path / "t.jsonl", GOOD, huge)
    tracemalloc.start()
    try:
        with pytest.raises(TraceFormatError, match=r":2: prompt of 204,800,000 tokens"):
            list(read_trace(trace))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 100_000_000
    code, out, err = run_cli("replay", str(trace), "--blocks", "100", "--out", str(tmp_path / "r"))
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "t.jsonl:2: prompt of" in err and "--max-prompt-tokens" in err


def test_line_limit(tmp_path: Path) -> None:
    line = json.dumps(GOOD)
    trace = _trace(tmp_path / "t.jsonl", GOOD, GOOD, {**GOOD, "pad": "x" * 500})
    exact = TraceOptions(max_line_bytes=len(line))  # a line of exactly the limit is read
    with pytest.raises(TraceFormatError, match=r"t.jsonl:3: line longer than"):
        list(read_trace(trace, exact))
    assert len(list(read_trace(trace, TraceOptions(max_line_bytes=len(line) + 600)))) == 3
    code, _, err = run_cli("analyze", str(trace), "--max-line-bytes", "100", "--format", "json")
    assert code == 2 and err.strip().endswith("(raise the limit with --max-line-bytes)")
    assert ":3: line longer than 100 bytes" in err


def test_prompt_limit_on_token_traces(tmp_path: Path) -> None:
    trace = _trace(tmp_path / "t.jsonl", {"token_ids": [1] * 10}, {"token_ids": [1] * 11})
    options = TraceOptions(max_prompt_tokens=10)
    with pytest.raises(TraceFormatError, match=r":2: prompt of 11 tokens, over the limit of 10"):
        list(read_trace(trace, options))
    err = io.StringIO()
    with redirect_stderr(err), pytest.raises(SystemExit) as exit_:
        main(["replay", str(trace), "--blocks", "10", "--max-prompt-tokens", "0"])
    assert exit_.value.code == 2 and "expected a positive integer: '0'" in err.getvalue()


def test_a_raised_line_limit_holds_for_detecting_the_format(tmp_path: Path) -> None:
    # a first line over the default 16 MiB: --max-line-bytes raised lets it through everywhere,
    # choosing the block size from the detected format included
    big = {**GOOD, "pad": "x" * (17 << 20)}
    trace = _trace(tmp_path / "t.jsonl", big, GOOD)
    args = ["replay", str(trace), "--blocks", "10", "--no-progress", "--out", str(tmp_path / "r")]
    code, _, err = run_cli(*args)
    assert code == 2 and "--max-line-bytes" in err
    code, _, err = run_cli(*args, "--max-line-bytes", str(18 << 20))
    assert code == 0, err
