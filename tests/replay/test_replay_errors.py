"""Bad input and interruptions end in one clear line and a known exit code, never a traceback or a
half-written run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import prefixcache
from prefixcache.cli import main
from prefixcache.replay import run_result

SCENARIO = "scenarios/shared_system_prompt.yaml"


def one_error_line(capsys: pytest.CaptureFixture[str], *needles: str) -> None:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("prefixcache replay: error:")]
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0]


def test_non_utf8_trace_names_the_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    good = json.dumps({"timestamp": 0, "input_length": 20, "output_length": 2, "hash_ids": [1]})
    trace.write_bytes((good + "\n").encode() * 3 + b'{"bad": "\xff"}\n')
    assert main(["replay", str(trace), "--blocks", "10", "--no-progress"]) == 2
    one_error_line(capsys, "t.jsonl:4:", "not UTF-8")


def test_bad_chat_template_is_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "chat.jsonl"
    trace.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}")
    args = ["replay", str(trace), "--blocks", "10", "--no-progress", "--out", str(tmp_path / "r")]
    assert main([*args, "--chat-template", str(tmp_path / "broken.jinja")]) == 2
    one_error_line(capsys, "broken.jinja: chat template line 1")
    (tmp_path / "ok.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert main([*args, "--chat-template", str(tmp_path / "ok.jinja")]) == 0


def test_non_utf8_scenario_names_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "s.yaml"
    path.write_bytes(b"seed: 1\nrequests: 3\n# caf\xe9\n")
    assert main(["replay", str(path), "--blocks", "10", "--no-progress"]) == 2
    one_error_line(capsys, "s.yaml:3:", "not UTF-8")


def test_out_pointing_at_a_file_fails_before_the_replay(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "file"
    target.write_text("x")

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the replay ran")

    monkeypatch.setattr("prefixcache.replay.runner.replay_sweep", never)
    assert main(["replay", SCENARIO, "--blocks", "10", "--out", str(target)]) == 2
    one_error_line(capsys, "not a directory")
    assert main(["replay", SCENARIO, "--blocks", "10", "--out", str(target / "sub")]) == 2
    one_error_line(capsys, "is a file")


def test_negative_seed_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["replay", SCENARIO, "--blocks", "10", "--seed", "-1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "non-negative integer" in err and "Traceback" not in err


def test_ctrl_c_during_the_replay_exits_130(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("prefixcache.replay.runner.replay_sweep", interrupted)
    out = tmp_path / "run"
    assert main(["replay", SCENARIO, "--blocks", "10", "--out", str(out)]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "prefixcache replay: interrupted; no run written"
    assert not out.exists()


def test_ctrl_c_while_writing_leaves_no_run_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(run_result, "_write_timeline", interrupted)
    out = tmp_path / "run"
    assert main(["replay", SCENARIO, "--blocks", "10", "--out", str(out), "--seed", "1"]) == 130
    assert not out.exists()


def test_a_rewritten_run_is_never_half_old(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "run"
    assert main(["replay", SCENARIO, "--blocks", "10", "--out", str(out), "--seed", "1"]) == 0
    before = (out / "report.json").read_text()

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(run_result, "_write_timeline", interrupted)
    rerun = ["replay", SCENARIO, "--blocks", "20", "--out", str(out), "--seed", "1", "--force"]
    assert main(rerun) == 130
    assert (out / "report.json").read_text() == before  # the old run, complete
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary files


def test_an_out_dir_holding_a_run_is_refused_without_force(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "run"
    out.mkdir()  # empty: fine
    args = ["replay", SCENARIO, "--blocks", "10", "--out", str(out), "--seed", "1"]
    assert main([*args, "--no-progress"]) == 0
    before = (out / "report.json").read_text()
    capsys.readouterr()

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the replay ran")

    with monkeypatch.context() as m:
        m.setattr("prefixcache.replay.runner.replay_sweep", never)
        assert main(["replay", SCENARIO, "--blocks", "20", "--out", str(out), "--seed", "1"]) == 2
    one_error_line(capsys, f"--out {out}", "holds files", "--force")
    assert (out / "report.json").read_text() == before  # untouched
    assert main(["replay", SCENARIO, "--blocks", "20", "--out", str(out), "--force"]) == 0
    assert json.loads((out / "report.json").read_text())["config"]["capacity_blocks"] == 20


def test_report_exits_non_zero_when_checks_fail(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    assert main(["replay", SCENARIO, "--blocks", "10", "--out", str(out), "--seed", "1"]) == 0
    assert main(["report", str(out), "--quiet"]) == 0
    report = json.loads((out / "report.json").read_text())
    report["hit_tokens"] += 1
    (out / "report.json").write_text(json.dumps(report))
    capsys.readouterr()
    assert main(["report", str(out), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "consistency check(s) failed" in err and "Traceback" not in err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps it to the terminal
    assert out == f"prefixcache {prefixcache.__version__} (core: {prefixcache.CORE_BUILD.reason})"


@pytest.mark.parametrize(
    ("line", "mode"),
    [
        ('{"timestamp": NaN, "input_length": 20, "output_length": 2, "hash_ids": [1]}', "serving"),
        ('{"arrival_s": Infinity, "token_ids": [1, 2, 3]}', "serving"),
        ('{"arrival_s": 1e300, "token_ids": [1, 2, 3]}', "sequential"),
        ('{"arrival_s": 1' + "0" * 400 + ', "token_ids": [1, 2, 3]}', "sequential"),
    ],
)
def test_non_finite_or_huge_arrival_times_are_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], line: str, mode: str
) -> None:
    # NaN passed the ">= 0" check and hung the serving simulation
    trace = tmp_path / "t.jsonl"
    trace.write_text(line + "\n")
    out = tmp_path / "run"
    args = ["replay", str(trace), "--blocks", "64", "--mode", mode, "--out", str(out)]
    assert main([*args, "--no-progress"]) == 2
    one_error_line(capsys, "t.jsonl:1:", "finite number")
    assert not out.exists()


def test_an_out_dir_that_cannot_be_made_is_checked_before_the_replay(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    args = ["replay", SCENARIO, "--blocks", "64", "--out", str(blocker / "run"), "--no-progress"]
    assert main(args) == 2
    one_error_line(capsys, str(blocker / "run"))


def test_an_out_dir_the_system_refuses_is_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # /proc/x passes the writable check as root, then mkdir fails: that was a traceback
    def refuse(self: Path, *args: object, **kwargs: object) -> None:
        raise FileNotFoundError(2, "No such file or directory", str(self))

    monkeypatch.setattr(Path, "mkdir", refuse)
    out = tmp_path / "run"
    args = ["replay", SCENARIO, "--blocks", "64", "--out", str(out), "--no-progress"]
    assert main(args) == 2
    one_error_line(capsys, f"--out {out}: No such file or directory")


@pytest.mark.parametrize(
    ("source", "flags", "needle"),
    [
        (SCENARIO, ["--gpu", "h200"], "--gpu needs --model (it prices the GPU time"),
        (SCENARIO, ["--token-budget", "5"], "--token-budget and --max-seqs need --mode serving"),
        (SCENARIO, ["--max-seqs", "3"], "--token-budget and --max-seqs need --mode serving"),
        (SCENARIO, ["--trace-format", "mooncake"], "--trace-format: only for traces"),
        (SCENARIO, ["--output-len", "5"], "--output-len: only for traces"),
        (SCENARIO, ["--max-prompt-tokens", "100"], "--max-prompt-tokens: only for traces"),
        (SCENARIO, ["--blocks", "64,128,64"], "--blocks: 64 is given twice"),
        (SCENARIO, ["--policy", "lru,lfu,lru"], "--policy: lru is given twice"),
        (
            SCENARIO,
            ["--rate-scale", "2", "--time-scale", "2"],
            "--rate-scale and --time-scale need --mode serving",
        ),
        (
            "scenarios/traces/mooncake_sample.jsonl",
            ["--tokenizer", "tok.json"],
            "--tokenizer and --chat-template do not apply",
        ),
        ("TOKENS", ["--tokenizer", "tok.json"], "token-id trace (already tokenized)"),
        ("TOKENS", ["--chat-template", "t.jinja"], "token-id trace (already tokenized)"),
        ("TOKENS", ["--trace-block-size", "7"], "--trace-block-size is the block size"),
        ("TEXT", ["--chat-template", "t.jinja"], "--chat-template does not apply"),
    ],
)
def test_options_that_would_be_ignored_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], source: str, flags: list[str], needle: str
) -> None:
    # a token-id or text trace ignored --tokenizer, --chat-template and --trace-block-size
    if source == "TOKENS":
        source = str(tmp_path / "t.jsonl")
        Path(source).write_text('{"token_ids": [1, 2, 3, 4, 5]}\n')
    elif source == "TEXT":
        source = str(tmp_path / "t.txt")
        Path(source).write_text("hello there\n")
    out = tmp_path / "run"
    args = ["replay", source, "--blocks", "64", *flags, "--out", str(out), "--no-progress"]
    assert main(args) == 2
    one_error_line(capsys, needle)
    assert not out.exists()


def test_memory_sizes_giving_the_same_cache_are_one_sweep_point(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 64 MiB and one byte more hold the same 32 blocks: the point ran twice
    out = tmp_path / "run"
    args = ["replay", SCENARIO, "--model", "llama-3.1-8b", "--kv-memory", "64MiB,67108865"]
    assert main([*args, "--out", str(out), "--no-progress"]) == 2
    one_error_line(capsys, "two sweep points give the same cache", "(32 blocks)")
    assert not out.exists()


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--time-scale", "1e300"], "request 2 would arrive at inf s"),
        (["--rate-scale", "1e-300"], "request 2 would arrive at inf s"),
    ],
)
def test_arrivals_scaled_past_the_clock_are_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], needle: str
) -> None:
    # the scaled time overflowed: the run was written, then its report failed the schema
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"token_ids": [1, 2], "arrival_s": 0}\n{"token_ids": [3], "arrival_s": 1e12}\n'
    )
    out = tmp_path / "run"
    args = ["replay", str(trace), "--blocks", "64", "--mode", "serving", *flags]
    assert main([*args, "--out", str(out), "--no-progress"]) == 2
    one_error_line(capsys, needle)
    assert not out.exists()


def test_gpu_is_accepted_for_a_tier_sweep_with_a_zero_point(tmp_path: Path) -> None:
    # the check looked at each point alone: the 0 point had no tier, so --gpu was refused
    import yaml

    spec = yaml.safe_load(Path(SCENARIO).read_text())
    spec["requests"] = 50
    scenario = tmp_path / "s.yaml"
    scenario.write_text(yaml.safe_dump(spec))
    args = ["replay", str(scenario), "--model", "llama-3.1-8b", "--blocks", "200"]
    args += ["--host-memory", "0,1GiB", "--gpu", "a100-80gb", "--out", str(tmp_path / "run")]
    assert main([*args, "--no-progress"]) == 0


@pytest.mark.parametrize(
    ("args", "flag", "message"),
    [
        (["--kv-memory", "-1GiB", "--model", "llama-3.1-8b"], "--kv-memory", "must be positive"),
        (["--kv-memory", "0", "--model", "llama-3.1-8b"], "--kv-memory", "must be positive"),
        (["--blocks", "10", "--host-memory", "-4GiB"], "--host-memory", "cannot be negative"),
        (["--blocks", "10", "--pool-memory", "0,-1TiB"], "--pool-memory", "cannot be negative"),
        (["--blocks", "10", "--host-bw", "-1GB"], "--host-bw", "must be positive"),
        (["--blocks", "-5"], "--blocks", "positive"),
        (["--blocks", "10", "--mode", "serving", "--rate-scale", "0"], "--rate-scale", "positive"),
        (["--blocks", "10", "--mode", "serving", "--rate-scale", "-2"], "--rate-scale", "positive"),
        (
            ["--blocks", "10", "--mode", "serving", "--time-scale", "-1.5"],
            "--time-scale",
            "positive",
        ),
        (["--blocks", "10", "--mode", "serving", "--tp", "0"], "--tp", "positive"),
        (
            ["--blocks", "10", "--mode", "serving", "--token-budget", "-1"],
            "--token-budget",
            "positive",
        ),
        (["--blocks", "10", "--mode", "serving", "--max-seqs", "0"], "--max-seqs", "positive"),
        (["--blocks", "10", "--trace-block-size", "-512"], "--trace-block-size", "positive"),
        (["--blocks", "10", "--output-len", "-1"], "--output-len", "non-negative"),
    ],
)
def test_bad_numbers_name_their_option(
    args: list[str], flag: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A negative or zero value reaches the option's own check, which names the option."""
    try:
        code = main(["replay", SCENARIO, "--no-progress", *args])
    except SystemExit as exc:  # a usage error
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "expected one argument" not in err
    last = err.strip().splitlines()[-1]
    assert flag in last and message in last, last
    assert flag.lstrip("-").replace("-", "_") + " " not in last  # the flag, not the field


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["analyze", SCENARIO, "--seed", "-1"], "--seed"),
        (["analyze", SCENARIO, "--output-len", "-1"], "--output-len"),
        (["export", SCENARIO, "--format", "mooncake", "--block-size", "-512"], "--block-size"),
        (["export", SCENARIO, "--format", "openai-jsonl", "--vocab-size", "0"], "--vocab-size"),
    ],
)
def test_bad_numbers_of_analyze_and_export_name_their_option(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"argument {flag}:" in last and "Traceback" not in last


def _fleet_replay_without(
    module: str, workload: str, out: Path
) -> subprocess.CompletedProcess[str]:
    """A two-replica serving replay of ``workload`` in a process where ``module`` cannot be
    imported (as on an install without the extra that brings it)."""
    code = (
        f"import sys; sys.modules[{module!r}] = None\n"
        "from prefixcache.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    args = [workload, "--blocks", "64", "--mode", "serving", "--replicas", "2", "--out", str(out)]
    return subprocess.run(
        [sys.executable, "-c", code, "replay", *args],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )


@pytest.mark.parametrize("missing", ["msgspec"])
def test_a_fleet_replay_without_the_service_extra_names_it(tmp_path: Path, missing: str) -> None:
    # a library-only install (no [service]): one error line naming the extra, no traceback
    proc = _fleet_replay_without(missing, SCENARIO, tmp_path / "run")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == (
        "prefixcache replay: error: a fleet replay (--replicas, --routing) runs the service's "
        f"router, which needs {missing}: pip install 'prefixcache[service]'\n"
    )
    assert not (tmp_path / "run").exists()


def test_a_fleet_replay_needs_no_zmq(tmp_path: Path) -> None:
    # the replicas' events reach the fleet index in process: no socket, no ZMQ library
    proc = _fleet_replay_without("zmq", "tests/golden/chat_small.yaml", tmp_path / "run")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "run" / "report.json").is_file()
