"""Every argument of every subcommand explains itself in ``--help``."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest

from prefixcache.cli import build_parser, main


def _parsers(
    parser: argparse.ArgumentParser, name: str = "prefixcache"
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


def test_every_argument_has_help() -> None:
    parsers = dict(_parsers(build_parser()))
    assert {"prefixcache replay", "prefixcache report", "prefixcache compare"} <= set(parsers)
    missing = [
        f"{name}: {'/'.join(action.option_strings) or action.dest}"
        for name, parser in parsers.items()
        for action in parser._actions
        if not isinstance(action, argparse._SubParsersAction)
        and (not action.help or not action.help.strip() or action.help == argparse.SUPPRESS)
    ]
    assert missing == []


def test_help_exits_zero_for_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    for name, _ in _parsers(build_parser()):
        with pytest.raises(SystemExit) as exit_info:
            main([*name.split()[1:], "--help"])
        assert exit_info.value.code == 0, name
        assert "usage: " + name in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [["demo"], ["analyze", "scenarios/traces/mooncake_sample.jsonl"], ["--help"]],
    ids=["demo", "analyze", "help"],
)
def test_a_reader_that_stops_early_is_not_an_error(argv: list[str]) -> None:
    """``prefixcache ... | head -1``: the reader closed the pipe; no traceback, exit 0."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefixcache", *argv],
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before the command writes anything
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, err
    assert "Traceback" not in err and "Broken pipe" not in err


def test_every_command_describes_itself(capsys: pytest.CaptureFixture[str]) -> None:
    """``prefixcache COMMAND --help`` says what the command does, not only its options."""
    for name, parser in _parsers(build_parser()):
        assert parser.description and len(parser.description.split()) >= 8, name
        with pytest.raises(SystemExit):
            main([*name.split()[1:], "--help"])
        assert parser.description.split()[0] in capsys.readouterr().out, name
