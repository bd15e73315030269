"""A service restarted onto the trace it recorded before goes on with that trace: timestamps
continue from the last line and the partial blocks' ids never repeat the earlier run's (equal ids
mean a shared prefix to the replay)."""

from __future__ import annotations

import json
from pathlib import Path

from prefixcache.fleet.whatif.trace_recorder import TraceRecordConfig, TraceRecorder

UNIQUE = 1 << 63


def _record(path: Path, prompts: int) -> None:
    rec = TraceRecorder(TraceRecordConfig(path=str(path)), [4])
    for i in range(prompts):
        rec.record([bytes([i + 1]) * 16], 6, 4)  # one full block and a partial one
    rec.close()


def test_a_restarted_recorder_continues_the_trace(tmp_path: Path) -> None:
    path = tmp_path / "routed.jsonl"
    _record(path, 3)
    first = [json.loads(x) for x in path.read_text().splitlines()]
    # the earlier run's last request was a while after its first
    lines = [{**line, "timestamp": 5000 + k} for k, line in enumerate(first)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    _record(path, 3)
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(rows) == 6
    stamps = [r["timestamp"] for r in rows]
    assert stamps == sorted(stamps) and stamps[3] > stamps[2]
    partials = [i for r in rows for i in r["hash_ids"] if i >= UNIQUE]
    assert len(partials) == 6 and len(set(partials)) == 6


def test_a_restart_after_a_rotation_continues_from_the_rotated_file(tmp_path: Path) -> None:
    path = tmp_path / "routed.jsonl"
    _record(path, 2)
    older = Path(f"{path}.1")
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    older.write_text("".join(json.dumps({**x, "timestamp": 9000}) + "\n" for x in lines))
    path.write_text("")
    _record(path, 1)
    row = json.loads(path.read_text().splitlines()[0])
    assert row["timestamp"] >= 9000
