"""Live what-if and ``--record-trace`` on real traffic to real vLLM: the trace the service
recorded replays (``prefixcache replay``) to the hit rates of its live fleet curve, and the
dashboard, in headless Chromium, shows the real fleet: both vLLM replicas up, their curves, and
where reuse went."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from html import unescape
from pathlib import Path

import pytest
from real_fleet import BLOCK, MODEL, as_text, random_tokens, serving

from prefixcache.engines.vllm import VLLMFleet, VLLMInstall
from tests.headless_browser import browser

CAPACITY = 24  # blocks per replica as configured for the curves (the engines have 2,048)
REQUESTS = 80


def _dashboard(tmp_path: Path, url: str) -> str:
    done = subprocess.run(
        [browser(), "--headless", "--disable-gpu", "--no-sandbox", "--hide-scrollbars",
         f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=8000",
         "--window-size=1100,1400", "--dump-dom", f"{url}/dashboard?every=1"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    return unescape(done.stdout)


def test_the_recorded_trace_replays_to_the_live_curve_and_the_dashboard_shows_the_fleet(
    fleet: VLLMFleet, vllm_install: VLLMInstall, tmp_path: Path
) -> None:
    rng = random.Random(11)
    systems = [random_tokens(rng.randrange(2, 6) * BLOCK) for _ in range(10)]
    overrides = {s.name: {"capacity_blocks": CAPACITY} for s in fleet}
    with serving(
        tmp_path,
        list(fleet),
        vllm_install.model,
        args=["--record-trace", str(tmp_path / "routed.jsonl")],
        replica_overrides=overrides,
        whatif={"rate": 1.0},
    ) as service:
        service.wait_probed([s.name for s in fleet])
        for i in range(REQUESTS):
            prompt = systems[rng.randrange(len(systems))] + random_tokens(rng.randrange(4, 40))
            service.proxied(as_text(prompt) if i % 2 else prompt, max_tokens=2)
        curves = service.get("/v1/whatif")
        dom = _dashboard(tmp_path, service.url)
        stats = service.get("/v1/stats")
    # the trace: one line per routed request (the attach probes went straight to the engines)
    lines = [json.loads(x) for x in (tmp_path / "routed.jsonl").read_text().splitlines()]
    assert len(lines) == REQUESTS == curves["window"]["routed_requests"]
    points = {p["factor"]: p for p in curves["fleet"]["points"]}
    for factor in (0.5, 1.0, 2.0):
        point = points[factor]
        out = tmp_path / f"replayed-{factor}"
        replay = [
            sys.executable, "-m", "prefixcache", "replay", str(tmp_path / "routed.jsonl"),
            "--trace-block-size", str(BLOCK), "--blocks", str(point["blocks"]),
            "--out", str(out), "--no-progress",
        ]  # fmt: skip
        subprocess.run(replay, check=True, capture_output=True, timeout=300)
        report = json.loads((out / "report.json").read_text())
        assert report["requests"] == REQUESTS
        assert report["token_hit_rate"] == pytest.approx(point["token_hit_rate"], abs=0.02), factor
    assert points[2.0]["token_hit_rate"] > points[0.5]["token_hit_rate"]
    # the dashboard: the real replicas, up; every curve drawn; the attribution row
    (tmp_path / "dashboard.html").write_text(dom)
    status = re.search(r'id="status"[^>]*>([^<]*)<', dom)
    table = re.search(r'<table id="replicas">.*?</table>', dom, re.S)
    shown = f"status: {status and status.group(1)}; {table and table.group(0)}"
    rows = re.findall(r"<tr><td>([^<]+)</td><td class=\"ok\">up</td>", dom)
    assert sorted(rows) == ["vllm-0", "vllm-1"], shown
    svg = re.search(r'<svg id="curves".*?</svg>', dom, re.S)
    assert svg and svg.group(0).count("<polyline") == 3
    (row,) = stats["attribution"]
    assert re.search(rf"<td>\(none\)</td><td>{MODEL}</td><td>{row['requests']}</td>", dom)
