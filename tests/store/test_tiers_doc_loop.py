"""The step loop docs/tiers.md gives for a shared store, run as written: two requests of one step
whose loads both fail, the second relying on blocks the first was to load, are each aborted
and requeued once."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("lmdb", reason="the one-host store needs lmdb (pip install '.[store]')")

from prefixcache import Namespace

ROOT = Path(__file__).resolve().parents[2]
HEADING = "## A shared store: K/V that other processes computed"
STEP = "# every step:"


def documented_loop() -> tuple[str, str]:
    """The section's first ```python block, split into its setup and its step."""
    doc = (ROOT / "docs" / "tiers.md").read_text(encoding="utf-8")
    assert HEADING in doc, f"docs/tiers.md has no {HEADING!r} section"
    section = doc.split(HEADING, 1)[1].split("\n## ", 1)[0]
    code = section.split("```python\n", 1)[1].split("\n```", 1)[0] + "\n"
    assert STEP in code, f"the store snippet has no {STEP!r} line"
    setup, step = code.split(STEP, 1)
    return setup, step


def test_the_documented_step_survives_two_dependent_failed_loads(tmp_path):
    setup, step = documented_loop()
    # the store on this test's directory, at a size any machine has
    setup, n = re.subn(
        r'open_store\("lmdb://[^"?]*\?capacity=[^"]*"\)',
        f"open_store({'lmdb://' + str(tmp_path / 'kv') + '?capacity=64MiB'!r})",
        setup,
    )
    assert n == 1, "the snippet opens no LMDB store by URL"
    requeued: list[object] = []
    env: dict[str, object] = {
        "num_layers": 1,
        "num_blocks": 32,
        "block_size": 16,
        "kv_heads": 2,
        "head_dim": 64,
        "requeue": requeued.extend,
    }
    exec(compile(setup, "docs/tiers.md", "exec"), env)
    mgr, store = env["mgr"], env["store"]
    ns = Namespace()
    tokens = list(range(4 * 16 + 3))
    chain = mgr.hasher.hash_prompt(tokens, ns)  # type: ignore[attr-defined]
    # four stored blocks, the first and the third not records at all (a foreign writer's)
    store.backend.put_many(  # type: ignore[attr-defined]
        [(d, b"not a record" if i in (0, 2) else b"x" * 64) for i, d in enumerate(chain)]
    )
    mgr.admit("a", tokens[: 2 * 16 + 3], ns)  # type: ignore[attr-defined]  # loads blocks 0-1
    mgr.admit("b", tokens, ns)  # type: ignore[attr-defined]  # 0-1 from "a", loads 2-3
    exec(compile(step, "docs/tiers.md", "exec"), env)  # the documented step, as written
    assert sorted(map(str, requeued)) == ["a", "b"]  # each once
    assert mgr.requests == []  # type: ignore[attr-defined]
    refused = store.counters().refused  # type: ignore[attr-defined]
    assert refused == {"not_a_record": 2}
    store.close()  # type: ignore[attr-defined]
