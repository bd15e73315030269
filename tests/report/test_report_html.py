"""The HTML report in a real browser: self-contained, no console errors, plots drawn.

Needs headless Chromium (``apt-get install chromium``, or set PREFIXCACHE_BROWSER); without it
these tests fail rather than skip, since the page is only known to work once a browser shows it.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
from html import unescape
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread
from test_report_runs import write_run

from prefixcache.cli import main
from prefixcache.report import render_all
from tests.headless_browser import browser

PLOT_COLORS = (
    np.array([[0x1F, 0x77, 0xB4], [0xFF, 0x7F, 0x0E], [0x2C, 0xA0, 0x2C], [0xD6, 0x27, 0x28]]) / 255
)
_CONSOLE = re.compile(r"CONSOLE|Uncaught|Failed to load resource")
CHAT = Path(__file__).resolve().parents[1] / "golden" / "chat_small.yaml"
# replays whose pages are opened: an overloaded serving run (TTFT of seconds, capacity above
# the blocks in use) and a capacity sweep with more points than labelled ticks
REPLAYS = {
    "serving": [
        *("--mode", "serving", "--model", "llama-3.1-8b", "--blocks", "2000"),
        *("--rate-scale", "4"),
    ],
    "sweep": ["--blocks", "40,80,160,320,640,1280,2560,5120,10240", "--jobs", "1"],
}
EXPECTED_PLOTS = {
    "serving": {"headline", "hit ratio histogram", "misses", "timeline", "ttft"},
    "sweep": {"headline", "hit ratio histogram", "misses", "timeline", "sweep capacity"},
}
_SIZES = (
    "<script>window.addEventListener('load', () => document.body.setAttribute('data-images', "
    "JSON.stringify([...document.images].map(i => [i.alt, i.naturalWidth, i.naturalHeight, "
    "i.complete]))));</script>"
)


def open_page(page: Path, tmp_path: Path, height: int = 2000) -> tuple[np.ndarray, list[str]]:
    """Screenshot of ``page`` at 1280 × ``height`` and the console messages it logged."""
    shot = tmp_path / f"{page.stem}.png"
    result = subprocess.run(
        [
            browser(),
            "--headless",
            "--disable-gpu",
            "--no-sandbox",
            "--hide-scrollbars",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--enable-logging=stderr",
            "--v=0",
            f"--screenshot={shot}",
            f"--window-size=1280,{height}",
            page.resolve().as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert shot.is_file(), f"browser wrote no screenshot:\n{result.stderr[-2000:]}"
    return imread(shot), [line for line in result.stderr.splitlines() if _CONSOLE.search(line)]


def image_sizes(page: Path, tmp_path: Path) -> list[tuple[str, int, int, bool]]:
    """Each image of ``page`` as the browser loaded it: alt, natural width and height, complete.

    Measured on a copy with a script that records them once the page has loaded."""
    probe = tmp_path / f"{page.stem}-probe.html"
    probe.write_text(page.read_text().replace("</body>", _SIZES + "</body>"))
    result = subprocess.run(
        [
            browser(),
            "--headless",
            "--disable-gpu",
            "--no-sandbox",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--dump-dom",
            probe.resolve().as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    found = re.search(r'data-images="([^"]*)"', result.stdout)
    assert found, f"the page did not finish loading:\n{result.stderr[-2000:]}"
    return [tuple(row) for row in json.loads(unescape(found.group(1)))]


def plot_pixels(image: np.ndarray) -> int:
    """Pixels within a small distance of the plot palette (bars, lines, areas)."""
    rgb = image[..., :3].reshape(-1, 1, 3)
    return int((np.abs(rgb - PLOT_COLORS).max(axis=2) < 0.06).any(axis=1).sum())


def ink_share(image: np.ndarray) -> float:
    """Share of pixels that are not white or near-white background."""
    return float((image[..., :3].min(axis=2) < 0.9).mean())


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return render_all(write_run(tmp_path_factory.mktemp("run")))["html"]


def test_page_is_self_contained(page: Path) -> None:
    text = page.read_text()
    assert "<script" not in text
    assert not re.search(r"""(src|href)=["']?(https?:|//)""", text)
    assert text.count('src="data:image/png;base64,') >= 6


def test_page_opens_without_console_errors_and_shows_plots(page: Path, tmp_path: Path) -> None:
    image, console = open_page(page, tmp_path)
    assert console == []
    assert image.shape[:2] == (2000, 1280)
    assert image[..., :3].std() > 0.05, "screenshot is blank"
    # the same page without its images: what the plots contribute is the difference
    bare = tmp_path / "bare.html"
    bare.write_text(re.sub(r"<img [^>]*>", "", page.read_text()))
    bare_image, _ = open_page(bare, tmp_path)
    with_plots, without = plot_pixels(image), plot_pixels(bare_image)
    assert with_plots > 20_000 and with_plots > 5 * without, (with_plots, without)
    # where the plots sit (right half of the first screen: hit rate, histogram, misses), ink
    ink, bare_ink = ink_share(image[300:1800, 640:]), ink_share(bare_image[300:1800, 640:])
    assert ink > 0.06 and ink > 3 * bare_ink, (ink, bare_ink)


def test_console_errors_are_detected(tmp_path: Path) -> None:
    broken = tmp_path / "broken.html"
    broken.write_text('<p>x</p><script>console.error("boom"); missing();</script>')
    _, console = open_page(broken, tmp_path, height=200)
    assert any("boom" in line for line in console)
    assert any("Uncaught" in line for line in console)


@pytest.fixture(scope="module", params=sorted(REPLAYS))
def replayed_page(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Path]:
    kind: str = request.param
    out = tmp_path_factory.mktemp(kind) / "run"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        code = main(["replay", str(CHAT), *REPLAYS[kind], "--out", str(out), "--no-progress"])
    assert code == 0
    return kind, out / "report.html"


def test_replayed_pages_load_and_draw_every_figure(
    replayed_page: tuple[str, Path], tmp_path: Path
) -> None:
    kind, page = replayed_page
    image, console = open_page(page, tmp_path, height=3000)
    assert console == []
    assert image[..., :3].std() > 0.05, "screenshot is blank"
    assert plot_pixels(image) > 20_000
    sizes = image_sizes(page, tmp_path)
    assert {alt for alt, *_ in sizes} == EXPECTED_PLOTS[kind]
    for alt, width, height, complete in sizes:
        assert complete and width > 300 and height > 200, (alt, width, height)


_TABLE_EDGES = (
    "<script>window.addEventListener('load', () => document.body.setAttribute('data-tables', "
    "JSON.stringify([...document.querySelectorAll('section table')].map(t => {"
    "  const section = t.closest('section').getBoundingClientRect();"
    "  let box = t.getBoundingClientRect();"
    "  for (let el = t.parentElement; el && el.tagName !== 'SECTION'; el = el.parentElement) {"
    "    const o = getComputedStyle(el).overflowX;"
    "    if (o === 'auto' || o === 'scroll') { box = el.getBoundingClientRect(); break; } }"
    "  return [t.closest('section').id, box.right, section.right]; }))));</script>"
)


def test_a_wide_sweep_table_stays_within_the_page(tmp_path: Path) -> None:
    """A sweep over replicas, routing and both tiers has a table wider than a 1,400 px page: it
    scrolls within its section instead of running past it."""
    out = tmp_path / "run"
    args = ["replay", str(CHAT), "--mode", "serving", "--model", "llama-3.1-8b", "--blocks", "100"]
    args += ["--replicas", "1,2", "--routing", "prefix_cost,round_robin", "--jobs", "1"]
    args += ["--host-memory", "0,1GiB", "--pool-memory", "0,2GiB", "--out", str(out)]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert main([*args, "--no-progress"]) == 0
    page = out / "report.html"
    probe = tmp_path / "probe.html"
    probe.write_text(page.read_text().replace("</body>", _TABLE_EDGES + "</body>"))
    result = subprocess.run(
        [
            browser(),
            "--headless",
            "--disable-gpu",
            "--no-sandbox",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--window-size=1400,2000",
            "--dump-dom",
            probe.resolve().as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    found = re.search(r'data-tables="([^"]*)"', result.stdout)
    assert found, f"the page did not finish loading:\n{result.stderr[-2000:]}"
    edges = json.loads(unescape(found.group(1)))
    assert "sweep" in {section for section, _, _ in edges}
    past = [(section, right, edge) for section, right, edge in edges if right > edge + 0.5]
    assert past == []
