"""Every endpoint the service registers is named where a user looks for it: the routes module's
docstring, ``prefixcache serve --help`` and docs/service.md."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from fastapi import FastAPI

from prefixcache.fleet.service import routes
from prefixcache.fleet.service.openai_proxy import proxy
from prefixcache.fleet.service.routes import API_ROUTES, add_api_routes

ROOT = Path(__file__).resolve().parents[3]


def _registered() -> list[str]:
    """The paths an app with the service's routes and the proxy's answers (the service is not
    started: only the route table is read)."""
    app = FastAPI()
    add_api_routes(app)
    proxy.add_proxy_routes(app)
    return [getattr(r, "path", "") for r in app.router.routes if getattr(r, "path", "")]


def test_the_route_table_is_what_the_app_registers() -> None:
    paths = _registered()
    assert {p for p, _, _ in API_ROUTES} <= set(paths)
    assert {"/v1/completions", "/v1/chat/completions"} <= set(paths)


def test_every_endpoint_is_named_in_the_docstring_the_help_and_the_docs() -> None:
    own = [
        p
        for p in _registered()
        if p.startswith("/") and not p.startswith(("/docs", "/openapi", "/redoc"))
    ]
    help_text = subprocess.run(
        [sys.executable, "-m", "prefixcache", "serve", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    help_flat = " ".join(help_text.split())
    docs = (ROOT / "docs" / "service.md").read_text(encoding="utf-8")
    doc = routes.__doc__ or ""
    for path in own:
        if path not in ("/v1/completions", "/v1/chat/completions"):
            assert path in doc, f"routes.py's docstring does not name {path}"
        assert path in help_flat, f"serve --help does not name {path}"
        assert path.split("{")[0] in docs, f"docs/service.md does not name {path}"
