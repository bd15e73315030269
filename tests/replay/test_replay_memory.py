"""What a long replay keeps in memory: the compact upper-bound set, rows spooled to disk, the
streaming report loader, and replays without the upper bound."""

from __future__ import annotations

import csv
import gc
import io
import json
import os
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import numpy as np
import pytest

from prefixcache.blocks.namespace import Namespace
from prefixcache.cli import main
from prefixcache.replay import ReplayConfig, replay_path, write_run
from prefixcache.replay.runner import replay_requests
from prefixcache.replay.sim.keyset import KeySet
from prefixcache.replay.sim.request_rows import RequestRows
from prefixcache.replay.workload.request import Request
from prefixcache.report.checks import consistency_checks
from prefixcache.report.run_dir import RunDirError, load_run, read_requests
from prefixcache.run_format import REQUEST_COLUMNS

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "scenarios" / "traces" / "mooncake_sample.jsonl"


def test_keyset_agrees_with_a_python_set_through_growth() -> None:
    rng = np.random.default_rng(3)
    keys = rng.integers(0, 2**64, 30_000, dtype=np.uint64, endpoint=False)
    keys[:50] = np.arange(50, dtype=np.uint64)  # small keys and 0 share home slots
    stream = [int(k) for k in np.concatenate([keys, keys[::7]])]  # repeats after growth
    ks, ref = KeySet(), set()
    for key in stream:
        assert ks.add(key) == (key not in ref)
        ref.add(key)
    assert len(ks) == len(ref)
    assert all(k in ks for k in ref)
    assert not any(int(k) in ks for k in rng.integers(2**63, 2**64, 2000, dtype=np.uint64))
    assert ks.nbytes <= 22 * len(ks)  # 8-byte slots at a load of at least three eighths
    more = [int(k) for k in rng.integers(0, 2**64, 40_000, dtype=np.uint64)] + [0, *ref]
    ks.update(more)
    ref.update(more)
    assert len(ks) == len(ref) and all(k in ks for k in more)


def test_keyset_chain_counts_the_leading_keys_it_held() -> None:
    rng = np.random.default_rng(4)
    ks, ref = KeySet(), set()
    for _ in range(3000):  # chains of fresh keys, old keys, small keys and 0, through growth
        fresh = [int(k) for k in rng.integers(0, 2**64, int(rng.integers(0, 9)), dtype=np.uint64)]
        old = [int(k) for k in rng.choice(sorted(ref), int(rng.integers(0, 4)))] if ref else []
        keys = old + fresh + [int(k) for k in rng.integers(0, 3, int(rng.integers(0, 2)))]
        leading = next((k for k, key in enumerate(keys) if key not in ref), len(keys))
        assert ks.add_chain(keys) == leading
        ref.update(keys)
        assert len(ks) == len(ref)
    assert all(k in ks for k in ref)


def test_rows_keep_the_rolling_hit_rate_across_flushes() -> None:
    rows = RequestRows()
    hits = [(i * 37) % 101 for i in range(9000)]
    for i, hit in enumerate(hits):
        rows.add(0.0, (i, 0, 100 + i % 3, hit, 6, 1, 0, 0, 0, 4, 0, 8))
        if i in (0, 150, 4095, 4096, 4200, 8191, 8999):
            last = range(max(0, i - 199), i + 1)
            want = sum(hits[k] for k in last) / sum(100 + k % 3 for k in last)
            assert rows.rolling_hit_rate() == want
    assert len(rows) == 9000
    rows.finish()
    assert rows.rolling_hit_rate() == want and len(rows) == 9000


def test_rows_take_columns_settled_later() -> None:
    """The shadow's misses, answered after the rows were spooled: written over those columns
    of the rows from a given one on (across the spool's flushes and the read chunks), the
    other columns and rows untouched; a column of the wrong length changes nothing."""
    rows = RequestRows()
    for i in range(70_000):
        rows.add(float(i), (i, 0, 100, i % 100, 6, 1, 0, 0, 0, 4, 0, 8))
    later = np.arange(70_000 - 5, dtype=np.int64) * 3
    with pytest.raises(ValueError, match="values for"):
        rows.set_columns(5, {"miss_cold": later, "miss_routing": later[1:]})
    assert not rows.column("miss_cold").any()
    rows.set_columns(5, {"miss_cold": later, "miss_routing": later + 1})
    assert rows.column("miss_cold").tolist() == [0] * 5 + later.tolist()
    assert rows.column("miss_routing").tolist() == [0] * 5 + (later + 1).tolist()
    assert rows.column("hit_tokens").tolist() == [i % 100 for i in range(70_000)]
    assert rows.column("request_id").tolist() == list(range(70_000))


def test_rows_reach_disk_while_the_replay_runs() -> None:
    rows = RequestRows()
    for i in range(20_000):
        rows.add(float(i), (i, 0, 100, i % 100, 6, 1, 0, 0, 0, 4, 0, 8))
    ints, arrivals = rows._ints_file.fileno(), rows._arrivals_file.fileno()
    assert os.fstat(ints).st_size >= (20_000 - 4096) * 12 * 8  # at most one buffer held back
    assert os.fstat(arrivals).st_size >= (20_000 - 4096) * 8
    if os.name == "posix":  # anonymous files: nothing on disk outlives the process
        assert os.fstat(ints).st_nlink == 0 and os.fstat(arrivals).st_nlink == 0
    assert rows.rolling_hit_rate() == pytest.approx(sum(range(100)) * 2 / 20_000)
    assert rows.column("hit_tokens").tolist() == [i % 100 for i in range(20_000)]
    first, second = rows.chunks(rows=5000), rows.chunks(rows=7000)  # readers do not interfere
    a, b = next(first), next(second)
    assert a[0][:, 0].tolist() == list(range(5000)) and b[1].tolist() == list(range(7000))
    assert next(first)[0][0, 0] == 5000 and next(second)[0][0, 0] == 7000
    spool = {fd: (os.fstat(fd).st_dev, os.fstat(fd).st_ino) for fd in (ints, arrivals)}
    del rows, first, second, a, b
    gc.collect()
    for fd, file_id in spool.items():  # the spool goes with its rows
        try:  # closed; or the number already reused by another open file (other tests' threads)
            now = os.fstat(fd)
        except OSError:
            continue
        assert (now.st_dev, now.st_ino) != file_id, "a spool file outlived its rows"


def test_written_rows_are_the_replayed_requests(tmp_path: Path) -> None:
    result = replay_path(SAMPLE, ReplayConfig(capacity_blocks=4000))
    out = write_run(result, tmp_path / "run")
    with open(out / "requests.csv", newline="") as f:
        table = list(csv.DictReader(f))
    report = json.loads((out / "report.json").read_text())
    assert len(table) == report["requests"]
    assert sum(int(r["hit_tokens"]) for r in table) == report["hit_tokens"]
    assert {r["ttft_s"] for r in table} == {""}


def _requests_csv(path: Path, n: int, bad_row: int | None = None) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(REQUEST_COLUMNS)
        for i in range(n):
            hit = (i * 7) % 50
            row = [i, f"{i * 0.5}", "default", 50, hit, 3, hit // 16, 50 - hit, 0, 0, 0, 0, 8]
            row += ["", ""] if i % 2 else [f"{0.1 * i}", f"{0.2 * i}"]
            w.writerow(row[:-1] if i == bad_row else row)


def test_loader_streams_requests_in_chunks(tmp_path: Path) -> None:
    path = tmp_path / "requests.csv"
    n = 40_000  # more than two chunks
    _requests_csv(path, n)
    totals, columns = read_requests(path)
    hits = np.array([(i * 7) % 50 for i in range(n)])
    assert totals.rows == n and totals.rows_add_up
    assert totals.sums["hit_tokens"] == hits.sum() and totals.sums["prompt_tokens"] == 50 * n
    assert totals.sums["miss_cold"] == (50 - hits).sum()
    assert totals.zero_hit_rows == int(np.count_nonzero(hits == 0))
    assert set(columns) == {"prompt_tokens", "hit_tokens", "ttft_s", "ttft_nocache_s"}
    assert np.array_equal(columns["hit_tokens"], hits)
    assert np.isnan(columns["ttft_s"][1]) and columns["ttft_s"][2] == pytest.approx(0.2)
    _requests_csv(path, n, bad_row=30_000)
    with pytest.raises(RunDirError, match="row 30002 has 14 cells"):
        read_requests(path)


def run_cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


def test_replay_without_the_upper_bound(tmp_path: Path) -> None:
    run = tmp_path / "run"
    code, _, err = run_cli(
        "replay", str(SAMPLE), "--blocks", "4000", "--out", str(run), "--no-upper-bound"
    )
    assert code == 0, err
    report = json.loads((run / "report.json").read_text())
    assert report["upper_bound_token_hit_rate"] is None
    assert report["upper_bound_block_hit_rate"] is None
    assert report["config"]["upper_bound"] is False
    assert report["misses"]["capacity"] == report["misses"]["isolation"] == 0
    assert report["misses"]["cold"] > 0
    assert all(c.ok for c in consistency_checks(load_run(run)))
    code, out, err = run_cli("report", str(run))
    assert code == 0, err
    assert "upper bound" in out.lower()


def test_hits_do_not_depend_on_the_upper_bound() -> None:
    x = np.arange(64, dtype=np.int32)
    reqs = [Request(float(i), x, 4, Namespace()) for i in range(3)]
    on = replay_requests(reqs, ReplayConfig(capacity_blocks=8, block_size=16))
    off = replay_requests(reqs, ReplayConfig(capacity_blocks=8, block_size=16, upper_bound=False))
    assert on.acc.totals.hit_tokens == off.acc.totals.hit_tokens == 2 * 63
    assert len(off.acc.shadow.seen) == 0 and len(on.acc.shadow.seen) == 4
