"""The headless Chromium the page tests drive (the HTML report, the service's dashboard)."""

from __future__ import annotations

import os
import shutil

import pytest

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")


def browser() -> str:
    """The browser's path: ``PREFIXCACHE_BROWSER``, else the first of ``BROWSERS`` found; the
    test fails (not skips) without one, since CI installs it."""
    found = os.environ.get("PREFIXCACHE_BROWSER") or next(
        filter(None, map(shutil.which, BROWSERS)), None
    )
    if not found:
        pytest.fail(
            f"no headless Chromium found (tried {', '.join(BROWSERS)}); install it "
            "(apt-get install -y chromium) or set PREFIXCACHE_BROWSER to its path"
        )
    return found
