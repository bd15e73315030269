"""`GET /dashboard` in a real headless Chromium against a running service: the page fills its
tables and draws the what-if curves from the operator endpoints, refreshes them in place (no
reload), and with API keys asks for an operator key instead of showing anything."""

from __future__ import annotations

import re
import subprocess
from html import unescape
from pathlib import Path

import httpx
import numpy as np
from matplotlib.image import imread

from tests.fleet.service.serve_harness import BLOCK, MODEL, make_app, make_config, serving
from tests.fleet_support import wait_until
from tests.headless_browser import browser

CURVE_BLUE = (0x1F / 255, 0x77 / 255, 0xB4 / 255)  # the first replica's curve


def _chromium(tmp_path: Path, url: str, *mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [browser(), "--headless", "--disable-gpu", "--no-sandbox", "--hide-scrollbars",
         f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=8000",
         "--window-size=1100,1400", *mode, url],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def _route_some(base: str, headers: dict[str, str]) -> None:
    rng = np.random.default_rng(5)
    systems = [rng.integers(1, 30_000, BLOCK * 6).tolist() for _ in range(8)]
    popular = np.array([8, 4, 2, 1, 1, 1, 1, 1]) / 19
    with httpx.Client(base_url=base, headers=headers) as client:
        for i in range(160):
            tokens = systems[int(rng.choice(8, p=popular))] + rng.integers(1, 30_000, 9).tolist()
            body = {"model": MODEL, "tokens": tokens, "request_id": f"r{i}"}
            routed = client.post("/v1/route", json=body).json()
            release = {"request_id": f"r{i}", "cached_tokens": routed["cached_tokens"]}
            assert client.post("/v1/release", json=release).status_code == 200


def test_the_dashboard_draws_the_fleet_and_refreshes_in_place(tmp_path: Path) -> None:
    replicas = [
        {"name": n, "model": MODEL, "block_size": BLOCK, "capacity_blocks": 20}
        for n in ("r1", "r2")
    ]
    extra = {
        "whatif": {"rate": 1.0},
        "replicas": replicas,
        "routing": {"policy": "prefix"},
        "record_trace": {"path": "routed.jsonl"},
    }
    config = make_config(tmp_path, keys=False, extra=extra)
    app, _ = make_app(config)
    with serving(app, config) as base:
        _route_some(base, {})
        # the other fleets: a replay of the recorded trace, started as the page's button does
        with httpx.Client(base_url=base) as client:
            assert client.post("/v1/whatif/counterfactuals").status_code == 202
            wait_until(
                lambda: client.get("/v1/whatif/counterfactuals").json()["state"] == "done",
                "the counterfactual replay",
                300,
            )
        page = f"{base}/dashboard?every=1"
        dom = unescape(_chromium(tmp_path, page, "--dump-dom").stdout)
        shot = tmp_path / "dashboard.png"
        result = _chromium(tmp_path, page, f"--screenshot={shot}")
    refreshes = int(re.search(r'data-refreshes="(\d+)"', dom).group(1))  # type: ignore[union-attr]
    assert refreshes >= 3, dom[:2000]  # redrawn every second, the page never reloaded
    assert "policy prefix" in dom
    rows = re.findall(r"<tr><td>([^<]+)</td><td class=\"ok\">up</td>", dom)
    assert sorted(rows) == ["r1", "r2"], rows
    svg = re.search(r'<svg id="curves".*?</svg>', dom, re.S)
    assert svg and svg.group(0).count("<polyline") == 3  # each replica's curve and the fleet's
    fleet = re.search(r"<tr><td>fleet</td>((?:<td>[\d.]+% \u00b1 [\d.]+</td>)+)</tr>", dom)
    assert fleet, dom[-3000:]
    rates = [float(x) for x in re.findall(r"([\d.]+)%", fleet.group(1))]
    assert len(rates) == 6 and rates == sorted(rates) and rates[-1] > 50
    assert re.search(r"<td>\(none\)</td><td>m</td><td>160</td>", dom)  # attribution row
    fleets = dict(re.findall(r"<tr><td>([^<]+)</td><td>\d+</td><td>[a-z_]+</td><td>([\d.]+)%", dom))
    assert {"as configured", "N-1 replicas", "2N replicas", "policy round_robin"} <= set(fleets)
    assert float(fleets["as configured"]) > float(fleets["policy round_robin"])
    note = re.search(r'class="muted" id="counterfactuals-note">([^<]*)<', dom)
    assert note and note.group(1).startswith("replay over 160 recorded requests"), dom[-3000:]
    assert shot.is_file(), result.stderr[-2000:]
    image = imread(shot)[..., :3]
    blue = (np.abs(image - np.array(CURVE_BLUE)).max(axis=2) < 0.08).sum()
    assert blue > 300, "the first replica's curve is not drawn"
    assert (image.min(axis=2) < 0.5).mean() > 0.01  # text and lines, not a blank page


def _whatif_page(tmp_path: Path, whatif: dict, blocks: int, requests: int) -> str:
    """The dashboard's DOM after ``requests`` routes of ``blocks`` random blocks each."""
    replicas = [
        {"name": n, "model": MODEL, "block_size": BLOCK, "capacity_blocks": 40}
        for n in ("r1", "r2")
    ]
    extra = {"whatif": whatif, "replicas": replicas, "routing": {"policy": "round_robin"}}
    config = make_config(tmp_path, keys=False, extra=extra)
    app, _ = make_app(config)
    rng = np.random.default_rng(9)
    with serving(app, config) as base:
        with httpx.Client(base_url=base) as client:
            for _ in range(requests):
                tokens = rng.integers(1, 30_000, BLOCK * blocks + 1).tolist()
                assert client.post("/v1/route", json={"model": MODEL, "tokens": tokens}).is_success
        return unescape(_chromium(tmp_path, f"{base}/dashboard", "--dump-dom").stdout)


def test_the_whatif_rows_say_the_rate_sampled_and_a_sample_too_small(tmp_path: Path) -> None:
    # a memory bound lowers the rate: the note says the rate sampled now and the one asked
    (tmp_path / "lowered").mkdir()
    dom = _whatif_page(tmp_path / "lowered", {"rate": 0.5, "max_memory_mib": 0.5}, 10, 200)
    note = re.search(r'id="whatif-note">([^<]*)<', dom)
    assert note and re.match(r"sampling \d+\.\d% of blocks \(asked 50\.0%, lowered", note.group(1))
    # a sample too small to answer: no figure, and the note names the curves
    (tmp_path / "small").mkdir()
    dom = _whatif_page(tmp_path / "small", {"rate": 0.01}, 3, 40)
    note = re.search(r'class="bad" id="whatif-note">([^<]*)<', dom)
    assert note and "too few sampled blocks to answer for r1, r2, fleet" in note.group(1), dom
    fleet = re.search(r"<tr><td>fleet</td>((?:<td>[^<]*</td>)+)</tr>", dom)
    assert fleet and re.findall(r"<td>([^<]*)</td>", fleet.group(1)) == ["-"] * 6
    svg = re.search(r'<svg id="curves".*?</svg>', dom, re.S)
    assert svg and "<polyline" not in svg.group(0)


def test_with_keys_the_page_asks_for_an_operator_key(tmp_path: Path) -> None:
    config = make_config(tmp_path)  # with API keys
    app, _ = make_app(config)
    with serving(app, config) as base:
        assert httpx.get(f"{base}/dashboard").status_code == 200  # the page itself is open
        dom = unescape(_chromium(tmp_path, f"{base}/dashboard", "--dump-dom").stdout)
    assert 'id="key" style="display: block;"' in dom
    assert "an operator key is needed" in dom
    assert re.search(r'<svg id="curves"[^>]*></svg>', dom)  # nothing drawn
