"""``prefixcache serve``: the fleet routing service from a YAML config, run by uvicorn."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from prefixcache.errors import ConfigError, PrefixCacheError


def register(subparsers: Any) -> None:
    """Add the ``serve`` command to the CLI's subparsers."""
    sp = subparsers.add_parser(
        "serve",
        help="run the fleet prefix-cache routing service",
        description="Serve /v1/lookup, /v1/route, /v1/release, /v1/replicas, /healthz and "
        "/metrics for the replicas of a fleet config (see examples/fleet/fleet.yaml); with "
        "--proxy, also forward OpenAI-compatible completions to the chosen replica.",
    )
    sp.add_argument("--config", type=Path, required=True, help="fleet YAML file")
    sp.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    sp.add_argument("--port", type=int, default=8000, help="port to listen on (8000)")
    sp.add_argument(
        "--index",
        help="override the config's index: memory | redis://host:port/db | "
        "redis+cluster://host:port",
    )
    sp.add_argument(
        "--proxy",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="forward /v1/completions and /v1/chat/completions (default: the config's proxy)",
    )
    sp.add_argument(
        "--log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug"),
        help="uvicorn log level (info)",
    )
    sp.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from prefixcache.fleet.events.subscriber import KVEventSubscriber, ReplicaEndpoint
        from prefixcache.fleet.index.open_index import check_index_url, open_index
        from prefixcache.fleet.service.app import create_app
        from prefixcache.fleet.service.settings import build_router, load_config
    except ImportError as exc:
        print(
            f"prefixcache serve: error: needs the service extra (pip install "
            f"'prefixcache[service]'): {exc}",
            file=sys.stderr,
        )
        return 2
    try:
        if not 0 < args.port < 65536:
            raise ConfigError(f"--port must be in 1..65535, got {args.port}")
        config = load_config(args.config)
        index_url = check_index_url(args.index, "--index") if args.index else config.index
        index = open_index(index_url, prefix=config.index_prefix)
        router = build_router(config, index)
        # every replica with an event endpoint is followed from the app's start to its stop
        subscriber = KVEventSubscriber(
            index,
            [
                ReplicaEndpoint(
                    r.name,
                    r.events,
                    r.replay,
                    r.namespace,
                    r.block_size,
                    hash_algo=config.hash_algo,
                )
                for r in config.replicas
                if r.events is not None
            ],
            max_replicas=config.limits.max_replicas,
            max_message_bytes=config.limits.max_event_message_bytes,
            replay_deadline=config.limits.replay_deadline_s,
            max_replay_frames=config.limits.max_replay_frames,
        )
        app = create_app(router, config, proxy=args.proxy, ingest=subscriber)
    except (PrefixCacheError, OSError) as exc:
        print(f"prefixcache serve: error: {exc}", file=sys.stderr)
        return 2
    proxying = config.proxy.enabled if args.proxy is None else args.proxy
    if proxying and config.chat_template is None:
        print(
            "prefixcache serve: note: no chat_template in the config; chat requests are routed "
            "on a neutral rendering, which matches other chats but not what replicas cache "
            "(set chat_template to the model's tokenizer_config.json)",
            file=sys.stderr,
        )
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
