"""Write scenarios/traces/noisy_neighbour.jsonl: a steady tenant next to a bursty one.

Mooncake trace format (one hash id per 512 tokens), with each line's tenant as its ``salt``:

- ``steady``: a request a second for ten minutes, each one of eight 4-block system prompts
  (uniformly) and a block of its own question;
- ``bursty``: every eight seconds, 12 requests within a second, each 6 blocks nobody sends
  again (a batch job's documents).

The steady tenant's prompts fit a small cache easily; each burst alone fills it many times
over. Run it with and without a guarantee (docs/replay.md, "Tenant shares"):

    prefixcache replay scenarios/traces/noisy_neighbour.jsonl --blocks 64 --shares steady=40
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parents[2] / "scenarios" / "traces" / "noisy_neighbour.jsonl"
BLOCK_TOKENS = 512


def lines() -> list[dict[str, object]]:
    """The trace's records, sorted by time."""
    rng = random.Random(11)
    next_id = 1000
    records: list[dict[str, object]] = []
    systems = [[100 * s + i for i in range(4)] for s in range(8)]
    for second in range(600):
        ids = [*systems[rng.randrange(8)], next_id]  # the system prompt, then its question
        next_id += 1
        records.append(_record(second * 1000 + rng.randrange(1000), ids, "steady", rng))
    for burst in range(75):
        for _ in range(12):
            ids = list(range(next_id, next_id + 6))
            next_id += 6
            at = burst * 8000 + 4000 + rng.randrange(1000)
            records.append(_record(at, ids, "bursty", rng))
    records.sort(key=lambda r: r["timestamp"])  # type: ignore[arg-type, return-value]
    return records


def _record(at_ms: int, ids: list[int], tenant: str, rng: random.Random) -> dict[str, object]:
    return {
        "timestamp": at_ms,
        "input_length": len(ids) * BLOCK_TOKENS - rng.randrange(100),
        "output_length": 64 + rng.randrange(64),
        "hash_ids": ids,
        "salt": tenant,
    }


def main() -> None:
    with OUT.open("w") as f:
        for record in lines():
            f.write(json.dumps(record, separators=(",", ":")) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
