"""Two runs side by side: what differs in their setup, and how each figure moved."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from prefixcache.report import formatting as fmt
from prefixcache.report.document import Document, Section, Table
from prefixcache.report.figures import ratio_percentiles, request_hit_ratios
from prefixcache.report.run_dir import Run
from prefixcache.run_format import MISS_CAUSES, PERCENTILES

Value = float | int | None


class Metric(NamedTuple):
    label: str
    key: str | None  # definition key
    get: Callable[[Run], Value]
    show: Callable[[Value], str]
    delta: Callable[[float], str]


def _pp(d: float) -> str:
    return f"{100 * d:+.2f} pp"


def _count_delta(d: float) -> str:
    return f"{int(d):+,}"


def _get(*path: str) -> Callable[[Run], Value]:
    def get(run: Run) -> Value:
        node: Any = run.report
        for key in path:
            if node is None:
                return None
            node = node[key]
        return node

    return get


def _ratio_pct(q: int) -> Callable[[Run], Value]:
    return lambda run: ratio_percentiles(request_hit_ratios(run))[q]


def _metrics() -> list[Metric]:
    rate, count = (fmt.pct, _pp), (fmt.count, _count_delta)
    secs = (fmt.seconds, lambda d: fmt.signed(fmt.seconds(d)))
    rows = [
        Metric("Token hit rate", "token_hit_rate", _get("token_hit_rate"), *rate),
        Metric("Token upper bound", "upper_bound", _get("upper_bound_token_hit_rate"), *rate),
        Metric("Block hit rate", "block_hit_rate", _get("block_hit_rate"), *rate),
        Metric("Block upper bound", "upper_bound", _get("upper_bound_block_hit_rate"), *rate),
        *(
            Metric(f"Per-request hit ratio p{q}", "request_hit_ratio", _ratio_pct(q), *rate)
            for q in PERCENTILES
        ),
        Metric("Requests", None, _get("requests"), *count),
        Metric("Requests with zero hits", "zero_hit_requests", _get("zero_hit_requests"), *count),
        Metric("Prompt tokens", None, _get("prompt_tokens"), *count),
        Metric("Hit tokens", "hit_tokens", _get("hit_tokens"), *count),
        *(
            Metric(f"{c.capitalize()} misses", f"miss_{c}", _get("misses", c), *count)
            for c in MISS_CAUSES
        ),
        Metric("Evicted blocks", "evicted_blocks", _get("evicted_blocks"), *count),
        Metric("Copy-on-write copies", "cow_copies", _get("cow_copies"), *count),
        Metric("Peak blocks in use", "peak_blocks_in_use", _get("peak_blocks_in_use"), *count),
        Metric(
            "FLOPs saved",
            "flops_saved",
            _get("savings", "flops_saved_estimate"),
            fmt.flops,
            lambda d: fmt.signed(fmt.flops(d)),
        ),
        Metric(
            "Sharing factor",
            "sharing_factor",
            _get("savings", "sharing_factor"),
            fmt.ratio,
            lambda d: f"{d:+.2f}×",
        ),
        Metric(
            "KV bytes saved by sharing",
            "kv_bytes_saved",
            _get("savings", "kv_bytes_saved_by_sharing"),
            fmt.nbytes,
            lambda d: fmt.signed(fmt.nbytes(d)),
        ),
        Metric(
            "Internal fragmentation (slots)",
            "fragmentation",
            _get("savings", "internal_fragmentation_slots"),
            *count,
        ),
        *(
            Metric(f"TTFT p{q} (estimate)", "ttft", _get("serving", f"ttft_p{q}_s"), *secs)
            for q in PERCENTILES
        ),
        Metric("Preemptions", "preemptions", _get("serving", "preemptions"), *count),
    ]
    return rows


def _relative(a: Value, b: Value) -> str:
    if a is None or b is None or a == 0:
        return fmt.NA
    return f"{100 * (b - a) / abs(a):+.1f}%"


def _setup(run: Run) -> dict[str, str]:
    r = run.report
    out = {f"config.{k}": "none" if v is None else str(v) for k, v in r["config"].items()}
    out |= {
        "workload": r["source"]["path"],
        "workload digest": r["source"]["sha256"][:16],
        "library version": r["library_version"],
        "namespaces": ", ".join(r["namespaces"]),
    }
    return out


def compare_document(a: Run, b: Run) -> Document:
    sa, sb = _setup(a), _setup(b)
    differ = [
        [k, sa.get(k, fmt.NA), sb.get(k, fmt.NA)]
        for k in dict.fromkeys([*sa, *sb])
        if sa.get(k) != sb.get(k)
    ]
    setup = Section("setup", "What differs")
    if differ:
        setup.tables.append(Table(["Setting", "A", "B"], differ))
    else:
        setup.notes.append("Same workload and configuration.")
    rows, keys = [], []
    for m in _metrics():
        va, vb = m.get(a), m.get(b)
        if va is None and vb is None:
            continue
        delta = m.delta(vb - va) if va is not None and vb is not None else fmt.NA
        rows.append([m.label, m.show(va), m.show(vb), delta, _relative(va, vb)])
        keys.append(m.key)
    figures = Section(
        "figures",
        "Figures",
        tables=[
            Table(
                ["Figure", "A", "B", "Δ (B − A)", "Relative"],
                rows,
                row_keys=keys,
                caption="Rates move in percentage points (pp); relative change is against A.",
            )
        ],
    )
    return Document("prefixcache compare", f"A: {a.path}   B: {b.path}", [setup, figures])
