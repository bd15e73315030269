"""``prefixcache serve``: the fleet routing service from a YAML config, run by uvicorn with the
config's connection limits and TLS (``transport``); with ``--workers N``, N processes on one port
over a shared (Redis) index (``startup``). Requests are not logged one by one unless
``--access-log``. At start the open-file limit is raised to what ``server.max_connections``
needs where the hard limit allows, and where it does not, the connections are lowered to fit,
with a warning naming the limit to raise (``connection_budget``)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

from prefixcache.errors import ConfigError

STARTUP_FAILURE = 3  # the exit status when the app's startup fails (uvicorn's)


def register(subparsers: Any) -> None:
    """Add the ``serve`` command to the CLI's subparsers."""
    sp = subparsers.add_parser(
        "serve",
        help="run the fleet prefix-cache routing service",
        description="Serve POST /v1/lookup, /v1/route, /v1/release, "
        "/v1/replicas/{name}/probe and /v1/whatif/counterfactuals, GET /v1/replicas, "
        "/v1/models, /v1/stats, /v1/whatif, /v1/whatif/counterfactuals, "
        "/dashboard, /healthz, /health and /metrics for the replicas of a fleet config (see "
        "examples/fleet/fleet.yaml); with --proxy, also forward POST /v1/completions and "
        "/v1/chat/completions to the chosen replica.",
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
        "--workers",
        type=int,
        default=1,
        help="service processes on the one port (1); past 1 the index must be Redis, shared by "
        "them: each worker counts its own in-flight load and per-key limits",
    )
    sp.add_argument(
        "--record-trace",
        type=Path,
        default=None,
        metavar="PATH",
        help="write every routed request as a Mooncake trace line (block hash ids, never token "
        "ids) to PATH, rotated by size, for prefixcache replay (default: the config's "
        "record_trace)",
    )
    sp.add_argument(
        "--access-log",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="log every request (off: a line per request costs about as much as a route)",
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

        from prefixcache.fleet.service.configuration.config_file import load_config
        from prefixcache.fleet.service.guards.connection_budget import (
            followed_replicas,
            raise_descriptor_limit,
            service_budget,
        )
        from prefixcache.fleet.service.startup import (
            WORKER_ENV,
            ServeOptions,
            check_workers,
            index_of,
            open_service,
            worker_protocol,
        )
        from prefixcache.fleet.service.transport import (
            BatchedAcceptServer,
            exposure_warning,
            uvicorn_config,
            uvicorn_options,
        )
    except ImportError as exc:
        print(
            f"prefixcache serve: error: needs the service extra (pip install "
            f"'prefixcache[service]'): {exc}",
            file=sys.stderr,
        )
        return 2
    if not 0 < args.port < 65536:
        raise ConfigError(f"--port must be in 1..65535, got {args.port}")
    record = str(args.record_trace.resolve()) if args.record_trace is not None else None
    options = ServeOptions(str(args.config.resolve()), args.index, args.proxy, record)
    config = load_config(args.config)
    if args.workers > 1 and (record is not None or config.record_trace.path is not None):
        raise ConfigError(
            "a recorded trace is written by one process: run --workers 1 with "
            "--record-trace (or record_trace in the config)"
        )
    check_workers(args.workers, index_of(options, config))
    raised = raise_descriptor_limit(config.server, followed_replicas(config))
    budget = service_budget(config)  # ConfigError when the limit leaves too few
    # opened here in either case, so that a bad config or index fails before any worker
    app, config = open_service(options)
    if config.proxy.enabled and config.chat_template is None:  # --proxy applied to config
        print(
            "prefixcache serve: note: no chat_template in the config; chat requests are routed "
            "on a neutral rendering, which matches other chats but not what replicas cache "
            "(set chat_template to the model's tokenizer_config.json)",
            file=sys.stderr,
        )
    if raised is not None:
        print(f"prefixcache serve: note: {raised}", file=sys.stderr)
    if budget.warning is not None:
        print(f"prefixcache serve: warning: {budget.warning}", file=sys.stderr)
    warning = exposure_warning(args.host, config)
    if warning is not None:
        print(f"prefixcache serve: warning: {warning}", file=sys.stderr)
    if args.workers > 1:  # each worker opens its own service over the shared index
        os.environ[WORKER_ENV] = json.dumps(dataclasses.asdict(options))
        limits = uvicorn_options(config)
        limits["http"] = worker_protocol(config.server)
        worker = "prefixcache.fleet.service.startup:worker_app"
        run = {"host": args.host, "port": args.port, "log_level": args.log_level}
        uvicorn.run(
            worker, factory=True, workers=args.workers, access_log=args.access_log, **run, **limits
        )
    else:  # one process: its event loop accepts a batch a turn (transport.BatchedAcceptServer)
        settings = uvicorn_config(
            app, config, args.host, args.port, args.log_level, access_log=args.access_log
        )
        server = BatchedAcceptServer(settings)
        with contextlib.suppress(KeyboardInterrupt):
            server.run()
        if not server.started:
            return STARTUP_FAILURE
    return 0
