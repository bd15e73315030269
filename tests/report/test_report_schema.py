"""report.json schema: the shipped schema, the validator, and how loading reports bad input."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from test_report_runs import write_run

from prefixcache.report import ReportSchemaError, RunDirError, load_run, load_schema
from prefixcache.report.run_dir import schema_problems, validate_report


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    run = write_run(tmp_path_factory.mktemp("run"), sweep="full")
    return json.loads((run / "report.json").read_text())


def _set(doc: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    *parents, last = path.split(".")
    node = doc
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if value is _DELETE:
        del node[last]
    else:
        node[int(last) if isinstance(node, list) else last] = value
    return doc


_DELETE = object()

BAD = [
    ("schema_version", 2, "$.schema_version: 2 is not one of [1]"),
    ("token_hit_rate", 1.5, "$.token_hit_rate: 1.5 > maximum 1"),
    ("token_hit_rate", float("nan"), "$.token_hit_rate: nan is not a finite number"),
    ("hit_tokens", -1, "$.hit_tokens: -1 < minimum 0"),
    ("hit_tokens", 3.5, "$.hit_tokens: expected integer, got float"),
    ("requests", True, "$.requests: expected integer, got bool"),
    ("config_sha256", "abc", "$.config_sha256: 'abc' does not match ^[0-9a-f]{64}$"),
    ("misses.routing", _DELETE, "$.misses: missing key 'routing'"),
    ("config.partial_copy", "no", "$.config.partial_copy: expected boolean, got str"),
    ("savings.flops_saved_estimate", "many", "$.savings.flops_saved_estimate: expected number"),
    ("top_prefixes.0.depth_blocks", None, "$.top_prefixes[0].depth_blocks: expected integer"),
    ("sweep.3.capacity_blocks", 0, "$.sweep[3].capacity_blocks: 0 < minimum 1"),
    ("serving", [], "$.serving: expected object or null, got list"),
]


def test_synthetic_report_is_valid(report: dict[str, Any]) -> None:
    assert schema_problems(report) == []
    validate_report(report)


@pytest.mark.parametrize("path,value,message", BAD, ids=[b[0] for b in BAD])
def test_each_mismatch_is_reported_by_path(
    report: dict[str, Any], path: str, value: Any, message: str
) -> None:
    problems = schema_problems(_set(report, path, value))
    assert any(p.startswith(message) for p in problems), problems
    with pytest.raises(ReportSchemaError, match="does not match its schema"):
        validate_report(_set(report, path, value))


def test_extra_keys_and_nulls_allowed_where_documented(report: dict[str, Any]) -> None:
    doc = _set(report, "sweep.0.replicas", 4)
    doc = _set(doc, "future_field", {"anything": [1, 2]})
    doc = _set(doc, "serving", None)
    doc = _set(doc, "sweep", None)
    doc = _set(doc, "config.model", None)
    assert schema_problems(doc) == []


def test_schema_agrees_with_jsonschema(report: dict[str, Any]) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = load_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    for path, value, _ in [("none", None, ""), *BAD]:
        doc = report if path == "none" else _set(report, path, value)
        if isinstance(value, float) and value != value:
            continue  # JSON has no NaN; only this validator rejects it
        assert bool(schema_problems(doc)) == (not validator.is_valid(doc)), path


def test_load_run_rejects_broken_directories(tmp_path: Path) -> None:
    with pytest.raises(RunDirError, match=r"report\.json not found"):
        load_run(tmp_path)
    run = write_run(tmp_path / "run", n=20, sweep="none")
    (run / "report.json").write_text("{not json")
    with pytest.raises(RunDirError, match="not valid JSON"):
        load_run(run)
    run = write_run(tmp_path / "cols", n=20, sweep="none")
    text = (run / "requests.csv").read_text().replace("hit_tokens,", "hits,", 1)
    (run / "requests.csv").write_text(text)
    with pytest.raises(RunDirError, match="lacks column"):
        load_run(run)
    run = write_run(tmp_path / "ragged", n=20, sweep="none")
    with (run / "timeline.csv").open("a") as f:
        f.write("1,2,3\n")
    with pytest.raises(RunDirError, match="row 22 has 3 cells"):
        load_run(run)
    run = write_run(tmp_path / "text", n=20, sweep="none")
    lines = (run / "requests.csv").read_text().splitlines()
    cells = lines[1].split(",")
    cells[3] = "many"
    (run / "requests.csv").write_text("\n".join([lines[0], ",".join(cells), *lines[2:]]) + "\n")
    with pytest.raises(RunDirError, match="'prompt_tokens' is not numeric"):
        load_run(run)


def test_tier_blocks_are_in_the_schema(tmp_path: Path) -> None:
    """A run with a host tier and a write-through pool validates, and its ``tiers`` objects
    (the figures and the config's settings) are checked, not just allowed."""
    from prefixcache.cli import main

    chat = Path(__file__).resolve().parents[1] / "golden" / "chat_small.yaml"
    out = tmp_path / "run"
    argv = ["replay", str(chat), "--model", "llama-3.1-8b", "--blocks", "200"]
    argv += ["--host-memory", "1GiB", "--pool-memory", "1GiB", "--pool-write", "through"]
    assert main([*argv, "--out", str(out), "--no-progress"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert schema_problems(report) == []
    for path, value, message in [
        ("tiers.pool.write", "sometimes", "$.tiers.pool.write: 'sometimes' is not one of"),
        ("tiers.host_token_hit_rate", 2, "$.tiers.host_token_hit_rate: 2 > maximum 1"),
        ("tiers.host.loaded_blocks", -1, "$.tiers.host.loaded_blocks: -1 < minimum 0"),
        ("tiers.transfer_seconds", _DELETE, "$.tiers: missing key 'transfer_seconds'"),
        ("config.tiers.pool_write", None, "$.config.tiers.pool_write: expected string"),
    ]:
        problems = schema_problems(_set(report, path, value))
        assert any(p.startswith(message) for p in problems), (path, problems)
