"""The example replica as an engine that ignores ``cache_salt``: every completion body loses its
``cache_salt`` before the replica reads it, so prompts of every salt share one cache, and its KV
events name blocks without a salt.

    python -m tests.fleet.salt_blind_replica --port 8100 ...   (examples/fleet/replica.py's options)
"""

from __future__ import annotations

import json
import sys
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tests.fleet.fleet_processes import load_fleet_example


class DropCacheSalt:
    """ASGI middleware: the JSON body of every POST loses its ``cache_salt``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        raw = b""
        while True:
            message = await receive()
            raw += message.get("body", b"")
            if not message.get("more_body"):
                break
        try:
            body: Any = json.loads(raw)
        except ValueError:
            body = None
        if isinstance(body, dict) and "cache_salt" in body:
            del body["cache_salt"]
            raw = json.dumps(body).encode()
        sent = False

        async def replayed() -> Message:
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}

        await self.app(scope, replayed, send)


def main(argv: list[str]) -> None:
    replica = load_fleet_example("replica")
    make_app = replica.create_app
    replica.create_app = lambda runtime: DropCacheSalt(make_app(runtime))
    replica.main(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
