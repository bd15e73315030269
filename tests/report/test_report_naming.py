"""The infinite-cache figures are named and defined the same way by analyze and the reports."""

from __future__ import annotations

import pytest

from prefixcache.cli import main
from prefixcache.report.definitions import DEFINITIONS


def test_analyze_says_whole_blocks_and_not_upper_bound(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["analyze", "scenarios/shared_system_prompt.yaml"]) == 0
    out = capsys.readouterr().out
    assert "infinite cache, whole blocks only" in out
    assert "upper bound on any cache" not in out


def test_definitions_explain_partial_copies_and_the_in_flight_block() -> None:
    assert "whole blocks only" in DEFINITIONS["upper_bound"].text
    assert "N − 1 reusable" in DEFINITIONS["capacity"].text
