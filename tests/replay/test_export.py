"""``prefixcache export``: Mooncake traces and OpenAI batch JSONL that real benchmarks read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefixcache.cli import main
from prefixcache.replay import ReplayConfig, open_source

SCENARIO = "scenarios/shared_system_prompt.yaml"


def test_mooncake_export_has_the_trace_fields_and_shares_ids_by_prefix(tmp_path: Path) -> None:
    out = tmp_path / "trace.jsonl"
    assert main(["export", SCENARIO, "--format", "mooncake", "--out", str(out), "--seed", "3"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    requests = list(open_source(SCENARIO, ReplayConfig(seed=3)))
    assert len(rows) == len(requests)
    for row, req in zip(rows[:200], requests[:200], strict=True):
        assert set(row) == {"timestamp", "input_length", "output_length", "hash_ids"}
        assert row["input_length"] == len(req.tokens)
        assert row["output_length"] == req.output_len
        assert row["timestamp"] == round(req.arrival_s * 1000)
        assert len(row["hash_ids"]) == -(-len(req.tokens) // 512)
    # the shared system prompt gives every request the same leading ids
    assert len({tuple(r["hash_ids"][:2]) for r in rows}) == 1
    # and the exported trace replays with the scenario's reuse
    run = tmp_path / "run"
    assert main(["replay", str(out), "--blocks", "2000", "--out", str(run), "--no-progress"]) == 0
    report = json.loads((run / "report.json").read_text())
    assert report["config"]["block_size"] == 512 and report["token_hit_rate"] > 0.8


def test_openai_export_is_a_batch_of_completion_requests(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["export", SCENARIO, "--format", "openai-jsonl", "--model-name", "m"]) == 0
    lines = capsys.readouterr().out.splitlines()
    first = json.loads(lines[0])
    assert first["method"] == "POST" and first["url"] == "/v1/completions"
    assert first["custom_id"] == "req-0-t0"
    body = first["body"]
    assert body["model"] == "m" and body["max_tokens"] > 0
    assert all(isinstance(t, int) and 0 <= t < 32000 for t in body["prompt"])


def test_export_applies_the_trace_guards(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # --max-prompt-tokens stops an over-long prompt as replay does
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"token_ids": list(range(50))}) + "\n")
    args = ["export", str(trace), "--format", "mooncake", "--out", str(tmp_path / "o.jsonl")]
    assert main([*args, "--max-prompt-tokens", "10"]) == 2
    err = capsys.readouterr().err
    assert "t.jsonl:1" in err and "Traceback" not in err
    assert main(args) == 0


def test_mooncake_export_writes_one_line_per_parallel_sample(tmp_path: Path) -> None:
    # the Mooncake format has no n: a request with n samples is n equal lines, as a benchmark
    # must send it to get n completions
    scenario = "scenarios/parallel_sampling.yaml"
    requests = list(open_source(scenario, ReplayConfig(seed=1)))
    assert any(r.n > 1 for r in requests)
    out = tmp_path / "samples.jsonl"
    args = ["export", scenario, "--format", "mooncake", "--out", str(out), "--seed", "1"]
    assert main(args) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == sum(r.n for r in requests)
    i = 0
    for req in requests:
        group = rows[i : i + req.n]
        assert all(row == group[0] for row in group)
        assert group[0]["timestamp"] == round(req.arrival_s * 1000)
        assert group[0]["output_length"] == req.output_len
        i += req.n
