"""`record_trace` / `serve --record-trace`: every routed request as a Mooncake trace line (block
hash ids, never token ids), rotated by size, sampled by first block; `prefixcache replay` of the
recorded trace gives the hit rate the live curve estimates."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from prefixcache.cli import main
from prefixcache.errors import ConfigError
from prefixcache.fleet.service.configuration.config_file import parse_config
from prefixcache.fleet.whatif.trace_recorder import TraceRecordConfig, TraceRecorder
from tests.fleet.service.serve_harness import round_robin_app

MODEL = "m"
BLOCK = 4
CAPACITY = 40


def _prompts(n: int = 300) -> list[list[int]]:
    rng = np.random.default_rng(11)
    systems = [rng.integers(1, 9_000, BLOCK * int(rng.integers(3, 12))).tolist() for _ in range(25)]
    return [
        systems[int(rng.integers(0, 25))] + rng.integers(1, 9_000, int(rng.integers(1, 9))).tolist()
        for _ in range(n)
    ]


def _serve(tmp_path: Path, prompts: list[list[int]], record: dict) -> dict:
    app = round_robin_app(tmp_path, BLOCK, CAPACITY, whatif={"rate": 1.0}, record_trace=record)
    with TestClient(app) as client:
        for p in prompts:
            assert client.post("/v1/route", json={"model": MODEL, "tokens": p}).status_code == 200
        curves: dict = client.get("/v1/whatif").json()
    return curves


def test_the_recorded_trace_replays_to_the_live_curve(tmp_path: Path):
    prompts = _prompts()
    curves = _serve(tmp_path, prompts, {"path": "routed.jsonl"})  # relative to the config
    lines = [json.loads(x) for x in (tmp_path / "routed.jsonl").read_text().splitlines()]
    assert len(lines) == len(prompts)
    for line, prompt in zip(lines, prompts, strict=True):
        assert set(line) == {"timestamp", "input_length", "hash_ids"}  # no tokens, no tenant
        assert line["input_length"] == len(prompt)
        assert len(line["hash_ids"]) == -(-len(prompt) // BLOCK)
    stamps = [line["timestamp"] for line in lines]
    assert stamps == sorted(stamps) and stamps[0] == 0
    # equal prefixes, equal ids: a prompt of the same system prompt shares its leading ids
    assert lines[0]["hash_ids"][0] in {x["hash_ids"][0] for x in lines[1:]}

    fleet = next(p for p in curves["fleet"]["points"] if p["factor"] == 1.0)
    out = tmp_path / "replayed"
    args = ["replay", str(tmp_path / "routed.jsonl"), "--trace-block-size", str(BLOCK)]
    args += ["--blocks", str(fleet["blocks"]), "--out", str(out), "--no-progress"]
    assert main(args) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["requests"] == len(prompts)
    assert report["token_hit_rate"] == pytest.approx(fleet["token_hit_rate"], abs=0.02)


def test_rotation_keeps_the_newest_files(tmp_path: Path):
    rec = TraceRecorder(TraceRecordConfig(str(tmp_path / "t.jsonl"), max_mib=600 / 2**20, keep=2))
    digests = [bytes([i]) * 16 for i in range(1, 9)]
    for _ in range(60):
        rec.record(digests, 8 * BLOCK, BLOCK)
    rec.close()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["t.jsonl", "t.jsonl.1", "t.jsonl.2"]
    total = sum(len(p.read_text().splitlines()) for p in tmp_path.iterdir())
    assert total < 60 and rec.written == 60  # the oldest rotated out
    for p in tmp_path.iterdir():
        assert p.stat().st_size <= 600 + 200  # rotated once past the size (one line over)


def test_a_sample_by_first_block_keeps_prompts_that_share_it_together(tmp_path: Path):
    prompts = _prompts()
    _serve(tmp_path, prompts, {"path": str(tmp_path / "half.jsonl"), "rate": 0.5})
    lines = [json.loads(x) for x in (tmp_path / "half.jsonl").read_text().splitlines()]
    assert 0 < len(lines) < len(prompts)
    kept = {line["hash_ids"][0] for line in lines}
    full = tmp_path / "full"
    full.mkdir()
    _serve(full, prompts, {"path": str(full / "all.jsonl")})
    every = [json.loads(x) for x in (full / "all.jsonl").read_text().splitlines()]
    # every routed request whose first block was kept is in the sampled trace
    assert len(lines) == sum(1 for line in every if line["hash_ids"][0] in kept)


def test_bad_record_settings_are_refused(tmp_path: Path):
    base = {"replicas": [{"name": "a", "model": MODEL, "block_size": BLOCK}]}
    for record, where in (
        ({"path": "x", "rate": 2}, "record_trace.rate"),
        ({"path": "x", "keep": -1}, "record_trace.keep"),
        ({"path": 3}, "record_trace.path"),
        ({"paht": "x"}, "paht"),
    ):
        with pytest.raises(ConfigError, match=where):
            parse_config({**base, "record_trace": record}, "fleet.yaml", tmp_path)
