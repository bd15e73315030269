"""Run directories, the report contract, the CLI, sweeps, model sizing and trace analysis."""

from __future__ import annotations

import csv
import io
import itertools
import json
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from prefixcache.cli import main
from prefixcache.errors import ConfigError
from prefixcache.replay import ReplayConfig, get_model, parse_size, replay_path, write_run
from prefixcache.replay.runner import with_progress
from prefixcache.replay.sim.accounting import Timeline
from prefixcache.report.checks import consistency_checks
from prefixcache.report.run_dir import load_run, schema_problems
from prefixcache.run_format import REQUEST_COLUMNS, TIMELINE_COLUMNS

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "scenarios" / "traces" / "mooncake_sample.jsonl"
TENANTS = ROOT / "scenarios" / "multi_tenant.yaml"

REPORT_KEYS = {
    "schema_version",
    "library_version",
    "source",
    "config",
    "config_sha256",
    "namespaces",
    "replay_seconds",
    "requests_per_second",
    "requests",
    "prompt_tokens",
    "hit_tokens",
    "token_hit_rate",
    "prompt_blocks",
    "hit_blocks",
    "block_hit_rate",
    "upper_bound_token_hit_rate",
    "upper_bound_block_hit_rate",
    "zero_hit_requests",
    "misses",
    "evicted_blocks",
    "cow_copies",
    "partial_copy_tokens",
    "peak_blocks_in_use",
    "output_tokens",
    "savings",
    "serving",
    "top_prefixes",
    "sweep",
}


def run_cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("mode", ["sequential", "serving"])
def test_run_directory_holds_the_contract(tmp_path: Path, mode: str) -> None:
    cfg = ReplayConfig(capacity_blocks=3000, mode=mode, block_size=64, model="llama-3.1-8b")
    result = replay_path(SAMPLE, cfg)
    out = write_run(result, tmp_path / "run")
    report = json.loads((out / "report.json").read_text())
    assert set(report) >= REPORT_KEYS
    assert report["schema_version"] == 1
    assert report["source"]["kind"] == "mooncake" and len(report["source"]["sha256"]) == 64
    assert report["config"]["bytes_per_block"] == 2 * 32 * 8 * 128 * 2 * 64
    assert report["config"]["capacity_bytes"] == 3000 * report["config"]["bytes_per_block"]
    assert sum(report["misses"].values()) == report["prompt_tokens"] - report["hit_tokens"]
    rows = read_csv(out / "requests.csv")
    assert list(rows[0]) == list(REQUEST_COLUMNS) and len(rows) == report["requests"]
    assert sum(int(r["hit_tokens"]) for r in rows) == report["hit_tokens"]
    assert all((r["ttft_s"] == "") == (mode == "sequential") for r in rows)
    timeline = read_csv(out / "timeline.csv")
    assert list(timeline[0]) == list(TIMELINE_COLUMNS)
    assert int(timeline[-1]["prompt_tokens_cum"]) == report["prompt_tokens"]
    assert int(timeline[-1]["evicted_blocks_cum"]) == report["evicted_blocks"]
    assert (report["serving"] is None) == (mode == "sequential")
    assert schema_problems(report) == []
    failed = [c for c in consistency_checks(load_run(out)) if not c.ok]
    assert failed == []


def test_replay_command_sweeps_in_parallel_and_writes_the_run(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    code, stdout, stderr = run_cli(
        "replay",
        str(SAMPLE),
        "--block-size",
        "512",
        "--blocks",
        "300,1000,3000",
        "--out",
        str(out),
        "--format",
        "json",
        "--jobs",
        "2",
        "--no-progress",
    )
    assert code == 0, stderr
    report = json.loads(stdout)
    assert [row["capacity_blocks"] for row in report["sweep"]] == [300, 1000, 3000]
    rates = [row["token_hit_rate"] for row in report["sweep"]]
    assert rates == sorted(rates) and rates[0] == report["token_hit_rate"]
    single = replay_path(SAMPLE, ReplayConfig(capacity_blocks=3000, block_size=512))
    assert rates[2] == single.to_report_dict()["token_hit_rate"]
    assert (out / "requests.csv").is_file() and (out / "timeline.csv").is_file()
    assert f"wrote {out}" in stderr


def test_replay_command_text_summary_and_kv_memory(tmp_path: Path) -> None:
    code, stdout, _ = run_cli(
        "replay",
        str(TENANTS),
        "--kv-memory",
        "4GiB",
        "--model",
        "qwen2.5-7b",
        "--seed",
        "3",
        "--out",
        str(tmp_path / "t"),
    )
    assert code == 0
    report = json.loads((tmp_path / "t" / "report.json").read_text())
    per_block = 2 * 28 * 4 * 128 * 2 * 16
    assert report["config"]["capacity_blocks"] == 4 * 2**30 // per_block
    assert report["config"]["seed"] == 3
    assert len(report["namespaces"]) == 8 and report["misses"]["isolation"] > 0
    assert "token hit rate" in stdout and "isolation" in stdout


def test_default_run_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    code, _stdout, _ = run_cli("replay", str(SAMPLE), "--block-size", "512", "--blocks", "500")
    assert code == 0
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert run_dir.name.startswith("mooncake_sample-") and (run_dir / "report.json").is_file()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "give the cache size"),
        (("--kv-memory", "1GiB"), "needs --model"),
        (("--blocks", "10", "--model", "gpt-9"), "unknown model 'gpt-9'"),
        (("--blocks", "10", "--policy", "fifo"), "unknown policy 'fifo'"),
        (("--blocks", "10", "--block-size", "48"), "does not divide"),
    ],
)
def test_replay_command_errors(tmp_path: Path, args: tuple[str, ...], message: str) -> None:
    code, _, stderr = run_cli("replay", str(SAMPLE), "--out", str(tmp_path / "x"), *args)
    assert code == 2 and message in stderr


def test_analyze_command_reports_the_upper_bound() -> None:
    code, stdout, _ = run_cli("analyze", str(SAMPLE), "--format", "json", "--model", "llama-3.1-8b")
    assert code == 0
    analysis = json.loads(stdout)
    bounds = {row["block_size"]: row for row in analysis["infinite_cache"]}
    assert set(bounds) == {16, 512}
    replayed = replay_path(SAMPLE, ReplayConfig(capacity_blocks=100, block_size=512))
    assert bounds[512]["upper_bound_token_hit_rate"] == pytest.approx(
        replayed.to_report_dict()["upper_bound_token_hit_rate"]
    )
    assert analysis["requests"] == 300 and analysis["prompt_tokens"]["max"] > 0
    assert bounds[16]["working_set_bytes"] == bounds[16]["unique_blocks"] * 2 * 2**20
    code, stdout, _ = run_cli("analyze", str(TENANTS), "--block-size", "16,32")
    assert code == 0 and "infinite cache" in stdout


def test_models_table_and_sizes(tmp_path: Path) -> None:
    llama = get_model("Llama-3.1-8B")
    assert llama.kv_bytes_per_token == 131072 and llama.bytes_per_block(16) == 2 * 2**20
    assert get_model("meta-llama/Llama-3.1-70B-Instruct").num_layers == 80
    for name in ("qwen2.5-7b", "qwen2.5-72b", "mistral-7b", "llama-3.1-70b"):
        assert get_model(name).params > 1e9
    assert parse_size("40GiB") == 40 * 2**30 and parse_size("1.5 GB") == 1_500_000_000
    assert parse_size("4096") == 4096
    with pytest.raises(ConfigError, match="cannot read size"):
        parse_size("lots")
    own = tmp_path / "mine.yaml"
    own.write_text(
        "params: 1000000\nnum_layers: 2\nnum_attention_heads: 4\nnum_kv_heads: 2\n"
        "head_dim: 8\ndtype: float16\n"
    )
    assert get_model(str(own)).kv_bytes_per_token == 2 * 2 * 2 * 8 * 2
    hf = tmp_path / "config.json"
    hf.write_text(
        json.dumps(
            {
                "hidden_size": 4096,
                "num_hidden_layers": 32,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "intermediate_size": 14336,
                "vocab_size": 128256,
                "torch_dtype": "bfloat16",
            }
        )
    )
    derived = get_model(str(hf))
    assert derived.kv_bytes_per_token == llama.kv_bytes_per_token
    assert abs(derived.params - llama.params) / llama.params < 0.01
    bad = tmp_path / "bad.json"
    bad.write_text('{"params": 1}')
    with pytest.raises(ConfigError, match="lacks num_layers"):
        get_model(str(bad))


def test_timeline_keeps_evenly_spaced_rows_and_the_end() -> None:
    tl = Timeline(target=10)
    for i in range(1000):
        if tl.due(i):
            tl.add(i, (i,))
    tl.finish(999, (999,))
    ticks = [row[0] for row in tl.rows]
    assert 10 <= len(ticks) <= 21 and ticks[-1] == 999
    gaps = {b - a for a, b in itertools.pairwise(ticks[:-1])}  # the last row is the end
    assert len(gaps) == 1


def test_progress_is_off_unless_asked() -> None:
    err = io.StringIO()
    with redirect_stderr(err):
        assert list(with_progress(range(5000), 5000, "x")) == list(range(5000))
    assert err.getvalue() == ""
    with redirect_stderr(err):
        assert list(with_progress(range(5000), 5000, "x", enabled=True)) == list(range(5000))
    assert "5,000" in err.getvalue() or "5.00k" in err.getvalue()
