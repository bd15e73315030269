"""Argument types and the trace options that the replay, analyze and export commands share.

Each type reads one option's text and raises ``argparse.ArgumentTypeError`` with what it
expected, so argparse prints the option, the message and the usage.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from prefixcache.blocks.pool import UNBOUNDED
from prefixcache.errors import ConfigError
from prefixcache.fleet.policies import POLICIES as ROUTING_POLICIES
from prefixcache.replay.model_specs import parse_size
from prefixcache.replay.workload.traces import (
    FORMATS,
    MAX_LINE_BYTES,
    MAX_PROMPT_TOKENS,
    MOONCAKE_CONTINUATIONS,
)


def int_at_least(minimum: int, what: str) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum``, else "expected {what}: 'text'"."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}: {text!r}")
        return value

    return parse


positive_int = int_at_least(1, "a positive integer")
non_negative_int = int_at_least(0, "a non-negative integer")
seed = non_negative_int


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number: {text!r}")
    return value


def str_list(text: str) -> list[str]:
    """Comma-separated words, blanks dropped."""
    return [x.strip() for x in text.split(",") if x.strip()]


def int_list(text: str, what: str = "integers") -> list[int]:
    """Comma-separated positive integers (at least one)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what} separated by commas: {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive {what}: {text!r}")
    return values


def blocks_list(text: str) -> list[int]:
    """Capacities in blocks; ``inf`` is an unbounded cache."""
    parts = str_list(text)
    if not parts:
        return int_list(text)  # raises: nothing given
    numbers = [x for x in parts if x.lower() != "inf"]
    finite = iter(int_list(",".join(numbers), "block counts (or inf)") if numbers else [])
    return [UNBOUNDED if x.lower() == "inf" else next(finite) for x in parts]


def replica_list(text: str) -> list[int]:
    """Comma-separated replica counts."""
    return int_list(text, "replica counts")


def routing_list(text: str) -> list[str]:
    """Comma-separated routing policies, each one the fleet router knows."""
    values = str_list(text)
    unknown = [v for v in values if v not in ROUTING_POLICIES]
    if not values or unknown:
        raise argparse.ArgumentTypeError(
            f"unknown routing policy {(unknown or [text])[0]!r}; choose from "
            f"{', '.join(sorted(ROUTING_POLICIES))}"
        )
    return values


def size_list(text: str) -> list[int]:
    """Comma-separated byte sizes such as 40GiB (``parse_size``), none negative."""
    parts = [x.strip() for x in text.split(",") if x.strip()]
    negative = next((x for x in parts if x.startswith("-")), None)
    if negative is not None:
        raise argparse.ArgumentTypeError(f"a size cannot be negative: {negative!r}")
    try:
        return [parse_size(x) for x in parts]
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive_size_list(text: str) -> list[int]:
    """Comma-separated byte sizes, each above zero."""
    negative = any(x.strip().startswith("-") for x in text.split(","))
    sizes = None if negative else size_list(text)
    if not sizes or min(sizes) <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, e.g. 40GiB: {text!r}")
    return sizes


def bandwidth(text: str) -> float:
    """Bytes per second, written as a size (55GB), positive."""
    if text.strip().startswith("-"):
        raise argparse.ArgumentTypeError(f"bandwidth must be positive, got {text!r}")
    try:
        value = parse_size(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(
            f"cannot read bandwidth {text!r}; write bytes per second, e.g. 55GB or 25GB"
        ) from exc
    if value <= 0:
        raise argparse.ArgumentTypeError(f"bandwidth must be positive, got {text!r}")
    return float(value)


def add_trace_args(parser: argparse.ArgumentParser) -> None:
    """The "traces" option group: how trace files are read."""
    g = parser.add_argument_group("traces")
    g.add_argument("--trace-format", choices=FORMATS, help="default: detected from the file")
    g.add_argument(
        "--trace-block-size",
        type=positive_int,
        default=512,
        help="tokens per Mooncake hash id (512)",
    )
    g.add_argument("--tokenizer", help="tokenizer.json for text prompts (default: bytes)")
    g.add_argument(
        "--chat-template",
        help="the model's tokenizer_config.json or a .jinja file: chat lines (messages) are "
        "rendered as the engine renders them (default: a neutral rendering)",
    )
    g.add_argument(
        "--output-len",
        type=non_negative_int,
        default=128,
        help="output tokens for lines that give none (128)",
    )
    g.add_argument(
        "--continuations",
        choices=("on", "off"),
        help="Mooncake traces: a turn that extends an earlier request's prompt and output hits "
        f"the blocks that request decoded (default: {'on' if MOONCAKE_CONTINUATIONS else 'off'})",
    )
    g.add_argument(
        "--max-line-bytes",
        type=positive_int,
        default=MAX_LINE_BYTES,
        help=f"reject longer trace lines ({MAX_LINE_BYTES:,})",
    )
    g.add_argument(
        "--max-prompt-tokens",
        type=positive_int,
        default=MAX_PROMPT_TOKENS,
        help=f"reject longer trace prompts ({MAX_PROMPT_TOKENS:,})",
    )


def trace_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The ``ReplayConfig`` fields that the ``add_trace_args`` options set."""
    return {
        "trace_format": args.trace_format,
        "trace_block_size": args.trace_block_size,
        "tokenizer": args.tokenizer,
        "chat_template": args.chat_template,
        "output_len": args.output_len,
        "max_line_bytes": args.max_line_bytes,
        "max_prompt_tokens": args.max_prompt_tokens,
        "continuations": None if args.continuations is None else args.continuations == "on",
    }
