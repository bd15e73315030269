"""Two runs side by side: what differs in their setup, and how each figure moved."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from prefixcache.report import formatting as fmt
from prefixcache.report.document import Document, Section, Table
from prefixcache.report.figures import ratio_percentiles, request_hit_ratios
from prefixcache.report.run_dir import Run
from prefixcache.report.sweep_curves import miss_share, sort_key, sweep_label
from prefixcache.run_format import MISS_CAUSES, PERCENTILES

Value = float | int | None
Point = dict[str, Any]
# What identifies a sweep point: its cache setup (the rest of a point are its measurements)
POINT_KEYS = (
    "capacity_blocks",
    "block_size",
    "policy",
    "host_blocks",
    "pool_blocks",
    "pool_write",
    "replicas",
    "routing",
)


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
    out = {
        name: _config_value(key, value) for name, key, value in _config_items("config", r["config"])
    }
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
    sections = [setup, figures]
    if a.report["sweep"] or b.report["sweep"]:
        figures.notes.append(
            "These figures compare the primary runs (the first sweep point of a sweep); "
            "the sweep points are compared below."
        )
        sections.append(sweep_section(a, b))
    return Document("prefixcache compare", f"A: {a.path}   B: {b.path}", sections)


def run_points(run: Run) -> list[Point]:
    """A run's sweep points; a run without a sweep is its one point."""
    r = run.report
    cfg, fleet = r["config"], r.get("fleet")
    setup: Point = {"block_size": cfg["block_size"], "policy": cfg["policy"]}
    if fleet:
        setup |= {"replicas": fleet["replicas"], "routing": fleet["routing"]}
    tiers = r.get("tiers") or {}  # no tier is a tier of 0 blocks: --host-memory 0 matches it
    setup |= {
        "host_blocks": (tiers.get("host") or {}).get("blocks", 0),
        "pool_blocks": (tiers.get("pool") or {}).get("blocks", 0),
        "pool_write": (tiers.get("pool") or {}).get("write"),  # None without a pool
    }
    if r["sweep"]:  # a point leaves out what it shares with the run's configuration
        return [_pool_write(setup | p) for p in r["sweep"]]
    point: Point = {
        **setup,
        "capacity_blocks": cfg["capacity_blocks"],
        "token_hit_rate": r["token_hit_rate"],
        "block_hit_rate": r["block_hit_rate"],
        "evicted_blocks": r["evicted_blocks"],
        "prompt_tokens": r["prompt_tokens"],
        "misses": r["misses"],
    }
    return [_pool_write(point)]


def _pool_write(point: Point) -> Point:
    """A point without a pool has no pool write policy (so it matches a run without tiers)."""
    if not point.get("pool_blocks"):
        point["pool_write"] = None
    return point


def _point_key(point: Point, keys: list[str]) -> tuple[Any, ...]:
    return tuple(point.get(k) for k in keys)


def _point_label(point: Point, keys: list[str]) -> str:
    return ", ".join(
        fmt.capacity_blocks(point[k])
        if k == "capacity_blocks"
        else f"{k.replace('_', ' ')} {point.get(k)}"
        for k in keys
    )


def _uniform(points: list[Point], key: str) -> Any:
    """The one value of ``key`` in every point, else None."""
    values = {repr(p.get(key)) for p in points}
    return points[0].get(key) if len(values) == 1 else None


def sweep_section(a: Run, b: Run) -> Section:
    """The sweep points of A and B matched by their setup, each compared; unmatched ones named.

    A setting that is one value in every point of A and another in every point of B (two
    capacity sweeps with different pool sizes) is a difference of the runs, shown in their
    setup: points are matched by what the sweeps vary, not by it."""
    pa, pb = run_points(a), run_points(b)
    # a setup key that no point sets (tiers all 0) is left out of the labels
    keys = [k for k in POINT_KEYS if any(p.get(k) for p in [*pa, *pb])]
    apart = [
        k
        for k in keys
        if _uniform(pa, k) is not None
        and _uniform(pb, k) is not None
        and _uniform(pa, k) != _uniform(pb, k)
    ]
    keys = [k for k in keys if k not in apart]
    by_b = {_point_key(p, keys): p for p in pb}
    matched = [(p, by_b[_point_key(p, keys)]) for p in pa if _point_key(p, keys) in by_b]
    matched.sort(key=lambda pair: [sort_key(v) for v in _point_key(pair[0], keys)])
    in_a = {_point_key(p, keys) for p in pa}
    only_a = [p for p in pa if _point_key(p, keys) not in by_b]
    only_b = [p for p in pb if _point_key(p, keys) not in in_a]
    section = Section("sweep", f"Sweep points: {len(matched)} of A's {len(pa)} match B's {len(pb)}")
    if matched:
        rows = []
        for pt_a, pt_b in matched:
            row = [_cell(pt_a.get(k), k) for k in keys]
            for get in (
                lambda p: p["token_hit_rate"],
                lambda p: miss_share(p, "capacity"),
                lambda p: miss_share(p, "cold"),
            ):
                va, vb = get(pt_a), get(pt_b)
                delta = _pp(vb - va) if va is not None and vb is not None else fmt.NA
                row += [fmt.pct(va), fmt.pct(vb), delta]
            rows.append(row)
        columns = [sweep_label(k) for k in keys]
        columns += [
            f"{name} {side}"
            for name in ("Token hit rate", "Capacity miss", "Cold miss")
            for side in ("A", "B", "Δ")
        ]
        section.tables.append(
            Table(
                columns,
                rows,
                key="miss_ratio_curve",
                caption="Misses: share of the prompt tokens; Δ is B − A in percentage points.",
            )
        )
    else:
        section.notes.append("No sweep point of A has the same setup as a point of B.")
    for k in apart:
        section.notes.append(
            f"Matched without {k.replace('_', ' ')}: {_cell(_uniform(pa, k), k)} in every point "
            f"of A, {_cell(_uniform(pb, k), k)} in every point of B."
        )
    for name, points in (("A", only_a), ("B", only_b)):
        if points:
            shown = "; ".join(_point_label(p, keys) for p in points)
            section.notes.append(f"Only in {name} ({len(points)}): {shown}.")
    return section


def _config_items(prefix: str, config: dict[str, Any]) -> list[tuple[str, str, Any]]:
    """(row name, key, value) per setting; a nested group (tiers) gives one row per setting."""
    items: list[tuple[str, str, Any]] = []
    for key, value in config.items():
        if isinstance(value, dict):
            items += _config_items(f"{prefix}.{key}", value)
        else:
            items.append((f"{prefix}.{key}", key, value))
    return items


def _config_value(key: str, value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if key == "capacity_blocks":
        return fmt.capacity(int(value))
    if key.endswith("_bytes_per_s"):
        return f"{value / 1e9:.1f} GB/s"
    if key.endswith("_bytes") or key.startswith("bytes_"):
        return fmt.nbytes(value)
    if key.endswith("_blocks"):
        return fmt.count(value)
    return str(value)


def _cell(value: Any, key: str = "") -> str:
    if value is None:
        return fmt.NA
    if key == "capacity_blocks":
        return fmt.capacity(value)
    return fmt.count(value) if isinstance(value, int) else str(value)
