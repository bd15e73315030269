"""Serving replays say how loaded the GPU is, print benchmark figures and their assumptions, and
reject setups that cannot exist."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from test_report_figures import _check, expected_figures, html_rows, markdown_rows, terminal_rows

from prefixcache.cli import main
from prefixcache.errors import ConfigError
from prefixcache.replay import ReplayConfig, replay_path
from prefixcache.replay.model_specs import get_gpu, get_model
from prefixcache.replay.sim.roofline import Roofline
from prefixcache.report import build_document, load_run
from prefixcache.report.render.html import render_html
from prefixcache.report.render.text_formats import render_markdown, render_terminal

# 40 requests of ~6k tokens in one simulated second: far more prefill than one L40S does in it
HEAVY = """\
seed: 5
requests: 40
arrivals: {process: poisson, rate: 40}
prompt:
  - shared: {length: 2048}
  - unique: {length: 4096}
output: 8
"""


def heavy(tmp_path: Path) -> Path:
    path = tmp_path / "heavy.yaml"
    path.write_text(HEAVY)
    return path


def serving_config(**options: object) -> ReplayConfig:
    base: dict[str, object] = dict(
        capacity_blocks=4000, mode="serving", model="llama-3.1-8b", gpu="l40s"
    )
    return ReplayConfig(**(base | options))  # type: ignore[arg-type]


def test_overload_is_reported_and_rate_scale_finds_a_sustainable_load(tmp_path: Path) -> None:
    path = heavy(tmp_path)
    fast = replay_path(path, serving_config()).to_report_dict()["serving"]
    load = fast["load"]
    assert load["overloaded"] and load["offered_load"] > 1
    assert load["busy_s"] > load["arrival_span_s"]
    scale = load["sustainable_rate_scale_estimate"]
    assert 0 < scale < 1
    slow = replay_path(path, serving_config(rate_scale=scale / 2)).to_report_dict()["serving"]
    assert not slow["load"]["overloaded"]
    assert slow["load"]["arrival_span_s"] == pytest.approx(load["arrival_span_s"] * 2 / scale)
    assert slow["ttft_p50_s"] < fast["ttft_p50_s"]
    # --time-scale stretches the same way
    stretched = replay_path(path, serving_config(time_scale=2 / scale)).to_report_dict()
    assert stretched["serving"]["load"]["arrival_span_s"] == pytest.approx(
        slow["load"]["arrival_span_s"]
    )


def test_overload_warning_in_every_format_and_strict_exit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    args = ["replay", str(heavy(tmp_path)), "--mode", "serving", "--gpu", "l40s"]
    args += ["--blocks", "4000", "--out", str(out), "--no-progress"]
    assert main(args) == 0
    summary = capsys.readouterr().out
    assert "WARNING: OVERLOADED" in summary
    assert "no --model given: llama-3.1-8b assumed" in summary
    run = load_run(out)
    doc = build_document(run)
    assert "OVERLOADED" in render_terminal(doc).split("── Run")[0]
    assert "> **Warning:** OVERLOADED" in render_markdown(doc)
    assert 'class="warning" role="alert"><strong>Warning:</strong> OVERLOADED' in render_html(
        doc, run
    )
    assert main([*args[:-3], "--out", str(tmp_path / "run2"), "--strict"]) == 3


def test_benchmark_figures_with_and_without_cache_match_the_rows(tmp_path: Path) -> None:
    out = tmp_path / "run"
    code = main(
        ["replay", str(heavy(tmp_path)), "--mode", "serving", "--model", "llama-3.1-8b"]
        + ["--blocks", "4000", "--out", str(out), "--no-progress", "--rate-scale", "0.05"]
    )
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    bench = report["serving"]["benchmark"]
    a, b = bench["with_cache"], bench["without_cache"]
    assert a["completed"] == b["completed"] == 40
    assert a["ttft_mean_s"] < b["ttft_mean_s"]  # the shared 2k tokens are not recomputed
    assert a["ttft_p50_s"] <= a["ttft_p90_s"] <= a["ttft_p99_s"]
    assert a["e2e_p50_s"] > a["ttft_p50_s"] and a["tpot_mean_s"] > 0
    assert a["output_token_throughput_tps"] == pytest.approx(40 * 8 / a["duration_s"])
    # TTFT with cache agrees with requests.csv
    ttfts = sorted(float(x) for x in _column(out / "requests.csv", "ttft_s"))
    assert math.isclose(a["ttft_mean_s"], sum(ttfts) / len(ttfts), rel_tol=1e-6)
    run = load_run(out)
    doc = build_document(run)
    expected = expected_figures(out)
    _check(terminal_rows(render_terminal(doc)), expected, "terminal")
    _check(markdown_rows(render_markdown(doc)), expected, "markdown")
    _check(html_rows(render_html(doc, run)), expected, "html")
    # the assumptions are in every format, not only in report.json
    for text in (render_terminal(doc), render_markdown(doc), render_html(doc, run)):
        for label in ("Compute efficiency (MFU)", "Bandwidth efficiency", "Token budget per step"):
            assert label in text
        assert "Max running sequences" in text and "h100-sxm" in text


def _column(path: Path, name: str) -> list[str]:
    lines = path.read_text().splitlines()
    i = lines[0].split(",").index(name)
    return [line.split(",")[i] for line in lines[1:]]


def test_impossible_setups_are_rejected_and_tp_splits_them(
    capsys: pytest.CaptureFixture[str],
) -> None:
    big = dict(model="llama-3.1-70b", gpu="l40s", kv_memory=500 * 2**30)
    with pytest.raises(ConfigError, match=r"does not fit.*l40s.*--tp 15"):
        serving_config(capacity_blocks=None, **big).resolve()
    serving_config(capacity_blocks=None, **big, tp=16).resolve()
    code = main(
        ["replay", "scenarios/rag.yaml", "--mode", "serving", "--model", "llama-3.1-70b"]
        + ["--gpu", "l40s", "--kv-memory", "500GiB"]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "does not fit" in err
    assert "Traceback" not in err


def test_tensor_parallelism_multiplies_compute_and_bandwidth() -> None:
    model, gpu = get_model("llama-3.1-8b"), get_gpu("h100-sxm")
    one, four = Roofline(model, gpu), Roofline(model, gpu, tp=4)
    overhead = one.step_overhead_s
    prefill = (8192, 8192 * 8193 // 2, 8192, 1)
    assert four.step_seconds(*prefill) - overhead == pytest.approx(
        (one.step_seconds(*prefill) - overhead) / 4
    )


def test_prefill_flops_count_lm_head_once_and_no_embedding() -> None:
    model = get_model("llama-3.1-8b")
    gpu = get_gpu("h100-sxm")
    roof = Roofline(model, gpu, memory_efficiency=1e9, step_overhead_s=0.0)  # compute-bound
    seconds = roof.step_seconds(1000, 0, 1000, 1)
    flops = seconds * gpu.peak_flops * roof.compute_efficiency
    embed = 128256 * 4096
    expected = 2 * (model.params - 2 * embed) * 1000 + 2 * embed
    assert flops == pytest.approx(expected, rel=1e-9)
    # the old count (every token through embedding and lm_head) was ~13% higher
    assert 2 * model.params * 1000 / expected == pytest.approx(1.15, abs=0.01)
    # tied embeddings: one table, still one lm_head per sampled position
    small = get_model("llama-3.2-1b")
    assert small.layer_flops_params == small.params - 128256 * 2048


def test_mooncake_block_size_defaults_to_the_trace_block_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = "scenarios/traces/mooncake_sample.jsonl"
    out = tmp_path / "run"
    assert main(["replay", trace, "--blocks", "1000", "--out", str(out), "--no-progress"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["config"]["block_size"] == 512 and report["rejected_requests"] == 0
    capsys.readouterr()
    small = ["replay", trace, "--blocks", "1000", "--block-size", "16", "--no-progress"]
    assert main([*small, "--out", str(tmp_path / "r2")]) == 0
    summary = capsys.readouterr().out
    assert "WARNING: 154 of 300 requests (51.3%) were rejected" in summary
    assert main([*small, "--out", str(tmp_path / "r3"), "--strict"]) == 3


def test_strict_and_warnings_cover_every_sweep_point(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # --strict read only the first point: a sweep whose second point rejected everything
    # exited 0, and said nothing about it
    trace = "scenarios/traces/mooncake_sample.jsonl"
    args = ["replay", trace, "--blocks", "1000,2", "--no-progress", "--strict"]
    assert main([*args, "--out", str(tmp_path / "run")]) == 3
    summary = " ".join(capsys.readouterr().out.split())  # the warning is wrapped
    needle = "other sweep points rejected requests: capacity blocks 2, block size 512, policy lru"
    assert f"{needle} (294 rejected)" in summary
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert [p["rejected_requests"] for p in report["sweep"]] == [0, 294]


def test_help_says_the_model_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["replay", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "llama-3.1-8b when not given" in text
    for flag in ("--rate-scale", "--time-scale", "--tp", "--strict"):
        assert flag in text


def test_partial_copy_sources_do_not_inflate_peak_blocks(tmp_path: Path) -> None:
    path = tmp_path / "rag.yaml"
    path.write_text(
        "seed: 2\nrequests: 200\narrivals: {process: poisson, rate: 10}\n"
        "prompt:\n  - shared: {length: 512}\n"
        "  - pool: {size: 6, pick: 2, length: 300}\n  - unique: {length: 50}\noutput: 4\n"
    )
    report = replay_path(path, ReplayConfig(capacity_blocks=2000, model="llama-3.1-8b"))
    r = report.to_report_dict()
    assert r["partial_copy_tokens"] > 0  # the case this covers
    s = r["savings"]
    assert s["physical_blocks_peak"] <= s["logical_blocks_peak"]
    assert s["sharing_factor"] >= 1.0
    longest = max(-(-int(t) // 16) for t in _prompt_lengths(report))
    assert s["physical_blocks_peak"] <= longest + 1  # one request, plus one copy source
    assert (
        s["kv_bytes_saved_by_sharing"]
        == (s["logical_blocks_peak"] - s["physical_blocks_peak"]) * r["config"]["bytes_per_block"]
    )


def _prompt_lengths(result: object) -> list[int]:
    log = result.acc.log  # type: ignore[attr-defined]
    return [int(t) for t in log.column("prompt_tokens")]


# 60 short prompts, 2 a second, each decoding 1,500 tokens: the GPU always has a request in flight
# (busy longer than the arrivals last) but never has a queue
DECODE_BOUND = """\
seed: 3
requests: 60
arrivals: {process: poisson, rate: 2}
prompt:
  - unique: {length: 256}
output: 1500
"""


def test_busy_time_past_the_arrivals_without_a_queue_is_not_overload(tmp_path: Path) -> None:
    path = tmp_path / "decode.yaml"
    path.write_text(DECODE_BOUND)
    sv = replay_path(path, serving_config(gpu="h100-sxm")).to_report_dict()["serving"]
    load = sv["load"]
    assert load["offered_load"] > 1  # decode keeps the GPU busy after the last arrival
    assert not load["overloaded"]
    assert abs(load["ttft_growth_s"]) < 0.05 * load["arrival_span_s"]
    assert sv["ttft_p99_s"] < 1.0


def test_overload_needs_the_queue_to_grow() -> None:
    from prefixcache.replay.sim.serving_figures import OfferedLoad, ttft_growth

    busy = OfferedLoad(100.0, 150.0, 150.0, 1.0)
    assert busy.overloaded  # no TTFTs known: the load alone decides
    steady = OfferedLoad(100.0, 150.0, 150.0, 1.0, ttft_growth_s=2.0)
    growing = OfferedLoad(100.0, 150.0, 150.0, 1.0, ttft_growth_s=30.0)
    idle = OfferedLoad(100.0, 50.0, 50.0, 1.0, ttft_growth_s=30.0)
    assert not steady.overloaded and growing.overloaded and not idle.overloaded
    # the last tenth of arrivals against the first, in arrival order, served requests only
    arrival = [float(i) for i in range(20)]
    ttft = [0.1] * 18 + [5.0, float("nan")]
    assert ttft_growth(list(reversed(arrival)), list(reversed(ttft))) == pytest.approx(4.9)
    assert ttft_growth([0.0], [1.0]) is None


def test_tpot_of_parallel_samples_counts_the_tokens_of_one_sample() -> None:
    """Four samples of 11 tokens decode side by side: 10 steps after the first token, not 43."""
    from prefixcache.replay.sim.serving_figures import benchmark_figures

    figures = benchmark_figures([0.0], [1.0], [11.0], [100], [44], 1.0, samples=[4])
    assert figures.tpot.mean == pytest.approx(1.0)
    assert figures.output_tokens == 44  # throughput still counts every sample's tokens


def test_tpot_is_the_decode_step_time_whatever_the_number_of_samples(tmp_path: Path) -> None:
    spec = "seed: 2\nrequests: 1\narrivals: {process: poisson, rate: 1}\n"
    spec += "prompt:\n  - unique: {length: 64}\noutput: 50\n"
    tpot = {}
    for n in (1, 4):
        path = tmp_path / f"n{n}.yaml"
        path.write_text(spec + f"n: {n}\n")
        bench = replay_path(path, serving_config()).to_report_dict()["serving"]["benchmark"]
        tpot[n] = bench["with_cache"]["tpot_mean_s"]
    # four sequences decode in about the time of one (memory bound): TPOT barely moves
    assert tpot[4] == pytest.approx(tpot[1], rel=0.2)


def test_simulated_time_runs_from_the_first_arrival(tmp_path: Path) -> None:
    """A trace whose clock starts late (Mooncake timestamps do) reports the time it simulated,
    not the clock's reading at the end."""
    path = tmp_path / "late.jsonl"
    rows = [
        {"token_ids": list(range(1, 65)), "arrival_s": 1000.0 + k, "output_length": 4}
        for k in range(2)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sv = replay_path(path, serving_config()).to_report_dict()["serving"]
    assert 1.0 < sv["simulated_seconds"] < 2.0


# unique prompts (the cache saves nothing) and one output token each (no TPOT to measure)
ONE_TOKEN = """\
seed: 3
requests: 60
arrivals: {process: poisson, rate: 20}
prompt:
  - unique: {length: {dist: uniform, low: 200, high: 400}}
output: 1
"""


def test_one_token_outputs_and_a_cache_that_saves_nothing_read_plainly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    scenario = tmp_path / "one.yaml"
    scenario.write_text(ONE_TOKEN)
    out = tmp_path / "run"
    args = ["replay", str(scenario), "--mode", "serving", "--model", "llama-3.1-8b"]
    assert main([*args, "--blocks", "2000", "--out", str(out), "--no-progress"]) == 0
    summary = capsys.readouterr().out
    assert "TPOT          n/a (no request has more than one output token)" in summary
    assert "0.0 ms" not in summary
    assert "the same with and without the cache" in summary
    doc = build_document(load_run(out))
    rows = terminal_rows(render_terminal(doc))
    assert rows["TPOT mean"][0] == ["n/a", "n/a", "n/a"]
    assert rows["TPOT p99"][0] == ["n/a", "n/a", "n/a"]
    assert "(the same without the cache)" in rows["Offered load"][0][0]
    assert "no cache" not in rows["Offered load"][0][0]


def test_a_fleet_report_gives_the_capacity_per_replica(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    chat = Path(__file__).resolve().parents[1] / "golden" / "chat_small.yaml"
    out = tmp_path / "run"
    args = ["replay", str(chat), "--mode", "serving", "--model", "llama-3.1-8b"]
    args += ["--blocks", "300", "--replicas", "2", "--pool-memory", "8GiB"]
    assert main([*args, "--out", str(out), "--no-progress"]) == 0
    assert "cache 300 blocks (600.0 MiB of llama-3.1-8b KV) per replica" in capsys.readouterr().out
    doc = build_document(load_run(out))
    assert doc.subtitle.endswith(
        "300 blocks per replica, lru, serving, 2 replicas routed by prefix_cost, pool 8.00 GiB "
        "shared"
    )
    rows = terminal_rows(render_terminal(doc))
    assert rows["Capacity"][0] == ["300 blocks (600.00 MiB) per replica (2 replicas)"]
    assert markdown_rows(render_markdown(doc))["Capacity"][0][0].startswith(
        "300 blocks (600.00 MiB) per replica"
    )


def test_a_fleet_busy_to_the_brim_with_a_long_tail_is_not_called_sustainable() -> None:
    """The average under 1x must not hide the busiest replica at capacity, nor a TTFT tail of
    queued requests (0.99x per replica, busiest 1.00x, TTFT p99 13 s read "sustainable")."""
    from prefixcache.report.serving_sections import load_fields

    load = {
        "offered_load": 0.99,
        "offered_load_nocache": 1.4,
        "offered_load_busiest": 0.999,
        "overloaded": False,
        "replicas": 4,
        "busy_s": 396.0,
        "arrival_span_s": 100.0,
    }
    (offered, *_) = load_fields(load, ttft_p50=0.4, ttft_p99=13.0)
    assert "sustainable" not in offered.note
    assert offered.note == (
        "at capacity: the busiest GPU is busy 100% of the span; TTFT p99 13 s against p50 0.4 s: "
        "requests queue"
    )
    calm = load | {"offered_load": 0.5, "offered_load_busiest": 0.55, "busy_s": 200.0}
    assert load_fields(calm, ttft_p50=0.4, ttft_p99=0.9)[0].note == "sustainable"
    tail_only = calm | {"offered_load_busiest": 0.6}
    assert load_fields(tail_only, ttft_p50=0.2, ttft_p99=4.0)[0].note.startswith("at capacity")
