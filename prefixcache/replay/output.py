"""A run directory: report.json (canonical), requests.csv (a row per request), timeline.csv."""

from __future__ import annotations

import csv
import json
import math
import re
import time
from pathlib import Path

from prefixcache.replay.result import ReplayResult
from prefixcache.run_format import REQUEST_COLUMNS, TIMELINE_COLUMNS


def default_run_dir(name: str, root: str | Path = "runs") -> Path:
    """``runs/<name>-<YYYYmmdd-HHMMSS>`` (with a counter if that exists already)."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "run"
    base = Path(root) / f"{safe}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, k = base, 1
    while path.exists():
        k += 1
        path = base.with_name(f"{base.name}-{k}")
    return path


def write_run(result: ReplayResult, out_dir: str | Path) -> Path:
    """Write the three files of a run into ``out_dir`` (created if needed); returns it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = result.to_report_dict()
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    _write_requests(result, out / "requests.csv")
    _write_timeline(result, out / "timeline.csv")
    return out


def _num(x: float) -> str:
    return "" if math.isnan(x) else repr(round(x, 9))


def _write_requests(result: ReplayResult, path: Path) -> None:
    log = result.acc.log
    labels = [ns.label() for ns in result.acc.namespaces]
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(REQUEST_COLUMNS)
        if log is None:
            return
        n = len(log)
        zero = [0] * n
        blocks = [t // result.config.options.block_size for t in log.prompt_tokens]
        nan = [math.nan] * n
        w.writerows(
            zip(  # noqa: B905 - equal-length columns
                log.request_id,
                map(_num, log.arrival_s),
                (labels[i] for i in log.namespace),
                log.prompt_tokens,
                log.hit_tokens,
                blocks,
                log.hit_blocks,
                log.miss_cold,
                log.miss_capacity,
                log.miss_isolation,
                log.miss_tail,
                zero,
                log.output_tokens,
                map(_num, log.ttft_s or nan),
                map(_num, log.ttft_nocache_s or nan),
            )
        )


def _write_timeline(result: ReplayResult, path: Path) -> None:
    rows = result.acc.timeline.rows if result.acc.timeline is not None else []
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(TIMELINE_COLUMNS)
        for row in rows:
            w.writerow(
                (
                    _num(float(row[0])) if isinstance(row[0], float) else row[0],
                    *row[1:7],
                    _num(row[7]),
                )
            )
