"""Tenant shares planned in the replay: the shipped noisy-neighbour trace, a steady tenant next
to a bursty one, with and without a guarantee; per-tenant figures in report.json and the report;
bad --shares refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefixcache.cli import main
from prefixcache.errors import ConfigError
from prefixcache.replay.share_specs import ShareSpec, parse_shares, resolve_shares, shares_text

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "scenarios" / "traces" / "noisy_neighbour.jsonl"


def _replay(tmp_path: Path, trace: Path, *args: str) -> dict:
    out = tmp_path / f"run{len(list(tmp_path.glob('run*')))}"
    code = main(["replay", str(trace), "--blocks", "64", "--out", str(out), *args])
    assert code == 0
    return json.loads((out / "report.json").read_text())


def _rows(report: dict) -> dict:
    return {row["tenant"]: row for row in report["tenants"]["rows"]}


def test_a_guarantee_keeps_the_steady_tenant_as_if_alone(tmp_path):
    alone_trace = tmp_path / "steady_only.jsonl"
    lines = TRACE.read_text().splitlines()
    alone_trace.write_text(
        "".join(line + "\n" for line in lines if json.loads(line)["salt"] == "steady")
    )
    alone = _rows(_replay(tmp_path, alone_trace, "--shares", "none"))["steady"]
    shared = _replay(tmp_path, TRACE, "--shares", "steady=40")
    rows = _rows(shared)
    steady, bursty = rows["steady"], rows["bursty"]
    assert steady["token_hit_rate"] == alone["token_hit_rate"] > 0.75
    assert steady["noisy_neighbour_tokens"] == 0 and steady["guarantee_break_blocks"] == 0
    without = steady["without_shares"]
    assert without["token_hit_rate"] < steady["token_hit_rate"] / 2  # collapses without it
    assert without["noisy_neighbour_tokens"] > 0
    assert bursty["token_hit_rate"] == bursty["without_shares"]["token_hit_rate"] == 0.0
    assert shared["tenants"]["shares"] == {"steady": {"guaranteed_blocks": 40, "cap_blocks": None}}
    assert shared["config"]["shares"] == "steady=40"
    for row in rows.values():  # the per-tenant sums add up to the run's
        assert sum(row["misses"].values()) + row["hit_tokens"] == row["prompt_tokens"]
    assert sum(r["prompt_tokens"] for r in rows.values()) == shared["prompt_tokens"]
    assert sum(r["hit_tokens"] for r in rows.values()) == shared["hit_tokens"]
    md = (tmp_path / "run1" / "report.md").read_text()  # the shared run's
    assert "## Tenants" in md and "| steady | 40 guaranteed | 600 |" in md


def test_the_terminal_summary_shows_each_tenant_with_and_without_shares(tmp_path, capsys):
    _replay(tmp_path, TRACE, "--shares", "steady=40")
    out = capsys.readouterr().out
    assert "tenants         hit rate  (no shares)  evicted by others  neighbour's misses" in out
    steady = next(line for line in out.splitlines() if line.strip().startswith("steady"))
    assert steady.split()[1:3] == ["80.46%", "31.90%"]
    _replay(tmp_path, TRACE, "--shares", "none")
    out = capsys.readouterr().out
    assert "(no shares)" not in out and "neighbour's misses" in out


def test_per_tenant_figures_without_shares_name_the_neighbour(tmp_path):
    report = _replay(tmp_path, TRACE, "--shares", "none")
    steady = _rows(report)["steady"]
    assert "without_shares" not in steady and not report["tenants"].get("compared_without_shares")
    assert 0 < steady["noisy_neighbour_tokens"] <= steady["misses"]["capacity"]
    plain = _replay(tmp_path, TRACE)
    assert "tenants" not in plain  # no --shares: no tenant accounting, the same hits
    assert plain["hit_tokens"] == report["hit_tokens"]


def test_shares_in_a_serving_fleet_replay(tmp_path):
    report = _replay(
        tmp_path, TRACE, "--shares", "steady=50%:75%", "--mode", "serving", "--replicas", "2",
        "--model", "llama-3.1-8b",
    )  # fmt: skip
    rows = _rows(report)
    assert rows["steady"]["guaranteed_blocks"] == 32 and rows["steady"]["cap_blocks"] == 48
    assert rows["steady"]["requests"] == 600 and rows["bursty"]["requests"] == 900
    assert rows["steady"]["token_hit_rate"] > rows["steady"]["without_shares"]["token_hit_rate"]


@pytest.mark.parametrize(
    "text, message",
    [
        ("steady", "TENANT=GUARANTEE"),
        ("=5", "TENANT=GUARANTEE"),
        ("steady=lots", "block count or a percentage"),
        ("steady=-1", "block count or a percentage"),
        ("steady=120%", "block count or a percentage"),
        ("steady=5,steady=6", "two shares"),
        (",", "names no tenant"),
    ],
)
def test_bad_share_specs_are_refused(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_shares(text)


def test_share_specs_resolve_against_the_cache():
    specs = parse_shares("a=25%:50%, b=10")
    assert specs == (ShareSpec("a", 0.25, 0.5), ShareSpec("b", 10, None))
    assert shares_text(specs) == "a=25%:50%,b=10"
    assert resolve_shares(specs, 100) == {"a": (25, 50), "b": (10, None)}
    with pytest.raises(ConfigError, match="add up to"):
        resolve_shares(parse_shares("a=60%,b=50%"), 100)
    with pytest.raises(ConfigError, match=r"the cap is a block count >= the guarantee"):
        resolve_shares(parse_shares("a=50:10"), 100)
    assert parse_shares("none") == ()


def test_the_cli_says_what_is_wrong_with_shares(tmp_path, capsys):
    code = main(["replay", str(TRACE), "--blocks", "64", "--shares", "steady=80", "--out",
                 str(tmp_path / "x")])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "add up to 80 blocks, more than the pool's 64" in err
    assert "Traceback" not in err


def test_a_tenant_field_names_the_salt_on_mooncake_and_token_lines(tmp_path):
    mooncake = tmp_path / "m.jsonl"
    mooncake.write_text(
        '{"timestamp": 0, "input_length": 1024, "output_length": 4, "hash_ids": [1, 2], '
        '"tenant": "acme"}\n'
        '{"timestamp": 5, "input_length": 1024, "output_length": 4, "hash_ids": [1, 2], '
        '"salt": "globex"}\n'
        '{"timestamp": 9, "input_length": 1024, "output_length": 4, "hash_ids": [1, 2], '
        '"tenant": "acme"}\n'
    )
    report = _replay(tmp_path, mooncake, "--shares", "none")
    rows = _rows(report)
    assert rows["acme"]["requests"] == 2 and rows["globex"]["requests"] == 1
    assert rows["globex"]["hit_tokens"] == 0 < rows["acme"]["hit_tokens"]  # salts never match
    assert rows["globex"]["misses"]["isolation"] > 0  # the same tokens, another tenant's
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"tokens": [1, 2, 3], "tenant": "a", "salt": "b"}\n')
    assert main(["replay", str(bad), "--blocks", "8", "--out", str(tmp_path / "bad")]) == 2
