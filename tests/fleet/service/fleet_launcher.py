"""Runs the fleet service for the tests: a config file, the in-memory fleet index seeded from a
JSON file, and an ingest source that leaves marker files when started and stopped.

    python -m tests.fleet.service.fleet_launcher --config fleet.yaml --port 8123 \
        --seed seed.json --markers DIR

``seed.json`` lists ``{"replica": name, "tokens": [...] | "text": "...", "medium": "GPU"}``; the
prompt's full blocks are stored for that replica under its configured namespace and block size.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import uvicorn

from prefixcache.blocks.hashing import BlockHasher
from prefixcache.fleet.events.ingest import IngestCounts
from prefixcache.fleet.index.memory import MemoryFleetIndex
from prefixcache.fleet.service.assembly import build_service
from prefixcache.fleet.service.configuration.config_file import load_config
from prefixcache.text.tokenizers import load_tokenizer

INGEST_COUNTS = {
    "replica-a": IngestCounts(5, 40, 2, 1, 0),
    "replica-b": IngestCounts(3, 8, 0, 0, 2),
}


class MarkerIngest:
    """An ingest source (and its counts) that leaves a marker file when started and stopped."""

    def __init__(self, markers: Path | None) -> None:
        self.markers = markers

    def _mark(self, name: str) -> None:
        if self.markers is not None:
            (self.markers / name).write_text("1")

    def start(self) -> None:
        self._mark("started")

    def stop(self) -> None:
        self._mark("stopped")

    def ingest_counts(self) -> dict[str, IngestCounts]:
        return INGEST_COUNTS


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--seed")
    parser.add_argument("--markers")
    args = parser.parse_args()
    config = load_config(args.config)
    index = MemoryFleetIndex()
    tokenizer = load_tokenizer(config.tokenizer)
    for row in json.loads(Path(args.seed).read_text()) if args.seed else []:
        replica = config.replica(row["replica"])
        assert replica is not None, row
        tokens = row["tokens"] if "tokens" in row else tokenizer.encode(row["text"])
        digests = BlockHasher(replica.block_size).hash_prompt(tokens, replica.namespace)
        index.store(replica.name, digests, row.get("medium", "GPU"))
    for replica in config.replicas:
        if replica.name not in index.replicas():
            index.store(replica.name, [])
    ingest = MarkerIngest(Path(args.markers) if args.markers else None)
    app = build_service(config, index=index, ingest=ingest)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
