"""Put and get bandwidth of the K/V stores next to a plain memcpy of the same bytes.

    python bench/store_bandwidth.py [--store lmdb|mooncake|mooncake://HOST:PORT?metadata=URL]
                                    [--blocks 256] [--repeats 5] [--dir /dev/shm]

For records of 0.25, 0.5 and 2 MiB, in one run: ``memcpy`` (numpy copy of the record into a
preallocated buffer), ``get`` (the connector's read: ``get_into`` a preallocated buffer, then
the header and checksum check), ``get, no check`` (``get_into`` alone) and ``put`` (what the
connector's background writer does per record: the checksum, the header written in front of
the payload the step's snapshot left in place, and ``put_many`` in batches of 16; the snapshot
itself is one copy on the step's side, a memcpy's worth). Then the same records as one prompt's
chain (each the parent of the next, as the connector writes them), and the ``touch`` a load
sends for each block read, on records written epochs before: what the store's eviction order
costs. Each figure is the median
over ``--repeats`` passes of ``--blocks`` distinct records; the ratios are to the memcpy of the
same pass, and the bookkeeping is the get's time per block beyond the memcpy's. A first pass
fills the new store (the first touch of its pages, reported on its own line) and is not in the
medians: a store in use sits at its bound and writes into pages its evictions freed. The figures to
feed ``prefixcache replay --pool-bw`` are the get bandwidths (docs/tiers.md).

``--store mooncake`` starts a Mooncake master and a separate storage process (holding the
memory, as another host would) on loopback, and measures from a client that holds nothing:
every byte crosses the transfer engine (TCP). A ``mooncake://`` URL uses a running store.

Each LMDB store lives in a new directory under ``--dir`` and is deleted as soon as its record
size is measured, and on Ctrl-C (or SIGTERM) too: a run leaves nothing in /dev/shm.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from types import FrameType

import numpy as np

from prefixcache import Namespace
from prefixcache.errors import ConfigError
from prefixcache.store.backend import BlockPlace, KVBlockStore
from prefixcache.store.block_record import (
    BlockLayout,
    check_record,
    encode_header,
    namespace_fingerprint,
    payload_checksum,
)
from prefixcache.store.from_url import open_store

MIB = 1 << 20
NS = namespace_fingerprint(Namespace(model="bench"))


def layout_for(nbytes: int) -> BlockLayout:
    """A layout of 16 tokens x 8 KV heads x 128 in fp16 over as many layers as make ``nbytes``
    of K and V (64 KiB per layer)."""
    per_layer = 2 * 16 * 8 * 128 * 2
    return BlockLayout(16, max(1, nbytes // per_layer), "float16", 2, (16, 8, 128))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def mooncake_on_loopback(segment_mib: int) -> Iterator[str]:
    """A master and a separate storage process (``mooncake_client``, holding the memory) on
    loopback, as another host would be; yields the URL of a client that holds nothing itself."""
    import mooncake

    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    here = Path(mooncake.__file__).parent
    rpc, http = free_port(), free_port()
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    master = subprocess.Popen(
        [
            str(here / "mooncake_master"),
            f"--rpc_port={rpc}",
            "--rpc_address=127.0.0.1",
            "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={http}",
            "--metrics_host=127.0.0.1",
            f"--metrics_port={free_port()}",
        ],
        **quiet,
    )
    meta = f"http://127.0.0.1:{http}/metadata"
    time.sleep(1.5)
    store_host = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from mooncake.store import MooncakeDistributedStore as S; "
            "s = S(); rc = s.setup('127.0.0.1', sys.argv[1], int(sys.argv[2]), 16 << 20, 'tcp', "
            "'', sys.argv[3]); assert rc == 0, rc; time.sleep(3600)",
            meta,
            str(segment_mib << 20),
            f"127.0.0.1:{rpc}",
        ],
        **quiet,
    )
    time.sleep(3)
    try:
        yield f"mooncake://127.0.0.1:{rpc}?metadata={meta}&segment=0&buffer=64"
    finally:
        store_host.kill()
        master.terminate()
        master.wait(10)


@contextmanager
def store_to_measure(spec: str, capacity: int, where: str) -> Iterator[KVBlockStore]:
    """The store to measure, closed (and an LMDB store's directory deleted) on the way out."""
    if spec.startswith("mooncake://"):
        store: KVBlockStore = open_store(spec)
        try:
            yield store
        finally:
            store.close()
        return
    if spec != "lmdb":
        raise SystemExit(f"unknown store {spec!r}: lmdb or mooncake")
    from prefixcache.store.lmdb import LMDBBlockStore

    path = tempfile.mkdtemp(prefix="store-bandwidth-", dir=where)
    try:
        store = LMDBBlockStore(path, capacity_bytes=capacity)
        try:
            yield store
        finally:
            store.close()
    finally:
        shutil.rmtree(path, ignore_errors=True)


def one_pass(store: KVBlockStore, layout: BlockLayout, n: int, seed: int) -> dict[str, float]:
    """Seconds per block of each operation over ``n`` fresh records."""
    rng = np.random.default_rng(seed)
    payloads = [rng.integers(0, 255, layout.payload_bytes, dtype=np.uint8) for _ in range(n)]
    keys = [rng.bytes(16) for _ in range(n)]
    out = np.empty(layout.record_bytes, dtype=np.uint8)
    view = out.data
    t: dict[str, float] = {}

    records = np.empty((n, layout.record_bytes), dtype=np.uint8)  # as the connector's
    header = layout.header_bytes  # snapshot leaves them: payloads in place, headers to write
    for i, payload in enumerate(payloads):
        records[i, header:] = payload
    start = time.perf_counter()
    items = []
    for i, key in enumerate(keys):  # what the background writer does per record
        checksum = payload_checksum(records[i, header:])
        records[i, :header] = np.frombuffer(encode_header(key, NS, layout, checksum), np.uint8)
        items.append((key, records[i].data))
    for i in range(0, n, 16):
        store.put_many(items[i : i + 16])
    t["put"] = (time.perf_counter() - start) / n

    start = time.perf_counter()
    for i in range(n):
        np.copyto(out, records[i])
    t["memcpy"] = (time.perf_counter() - start) / n

    start = time.perf_counter()
    for key in keys:
        store.get_into(key, view)
    t["get, no check"] = (time.perf_counter() - start) / n

    start = time.perf_counter()
    for key in keys:
        m = store.get_into(key, view)
        assert m is not None and check_record(view[:m], key, NS, layout) is None
    t["get"] = (time.perf_counter() - start) / n

    # the same records again as one prompt's chain (each the parent of the next), then the
    # first ones read again: what the eviction order costs a put and a load
    chain = [rng.bytes(16) for _ in range(n)]
    places = {k: BlockPlace(chain[i - 1] if i else None, i) for i, k in enumerate(chain)}
    for i, key in enumerate(chain):
        checksum = payload_checksum(records[i, header:])
        records[i, :header] = np.frombuffer(encode_header(key, NS, layout, checksum), np.uint8)
    linked = [(key, records[i].data) for i, key in enumerate(chain)]
    start = time.perf_counter()
    for i in range(0, n, 16):
        store.put_many(linked[i : i + 16], places=places)
    t["put, chain"] = (time.perf_counter() - start) / n
    start = time.perf_counter()
    for i in range(0, n, 16):  # written an epoch or more ago: each moves to the current one
        store.touch(keys[i : i + 16])
    t["touch"] = (time.perf_counter() - start) / n
    for key in keys + chain:
        store.remove(key)
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--store",
        default="lmdb",
        help="lmdb (a new LMDB store under --dir, the default), mooncake (a master and a "
        "storage process started on loopback), or a running store's "
        "mooncake://MASTER:PORT?metadata=URL",
    )
    ap.add_argument(
        "--blocks",
        type=int,
        default=256,
        help="distinct records written and read in each pass (default 256)",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="passes per record size; each figure is their median (default 5)",
    )
    ap.add_argument(
        "--dir",
        default="/dev/shm",
        help="where the LMDB stores go, each deleted once measured (default /dev/shm, tmpfs)",
    )
    args = ap.parse_args()
    if args.blocks < 1 or args.repeats < 1:
        ap.error("--blocks and --repeats must be at least 1")
    signal.signal(signal.SIGTERM, _stop)  # cleaned up as on Ctrl-C
    try:
        with ExitStack() as stack:
            if args.store == "mooncake":
                segment = 3 * args.blocks * 2 * (2 * MIB + 4096) >> 20
                args.store = stack.enter_context(mooncake_on_loopback(segment))
            run(args)
    except KeyboardInterrupt:
        print("interrupted: the stores are deleted", file=sys.stderr)
        raise SystemExit(130) from None
    except ConfigError as exc:  # a store that cannot open here, e.g. too large for --dir
        raise SystemExit(f"store_bandwidth: {exc}") from None


def _stop(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> None:
    print(
        f"store {args.store.split('?')[0]}, {args.blocks} records a pass, {args.repeats} passes",
        flush=True,
    )
    print(
        f"{'record':>8} {'memcpy GB/s':>12} {'get GB/s':>9} {'get/memcpy':>11} "
        f"{'no-check/memcpy':>16} {'put GB/s':>9} {'put/memcpy':>11} {'get extra us':>13}"
    )
    for size in (256 << 10, 512 << 10, 2 * MIB):
        layout = layout_for(size)
        capacity = 4 * args.blocks * layout.record_bytes
        with store_to_measure(args.store, capacity, args.dir) as store:
            cold = one_pass(store, layout, args.blocks, 99)  # first touch of the store's pages
            passes = [one_pass(store, layout, args.blocks, seed) for seed in range(args.repeats)]
        med = {k: statistics.median(p[k] for p in passes) for k in passes[0]}
        ratio = {k: statistics.median(p["memcpy"] / p[k] for p in passes) for k in passes[0]}
        extra = statistics.median(p["get"] - p["memcpy"] for p in passes)
        gbs = {k: layout.record_bytes / v / 1e9 for k, v in med.items()}
        print(
            f"{layout.record_bytes / MIB:7.2f}M {gbs['memcpy']:12.2f} {gbs['get']:9.2f} "
            f"{ratio['get']:11.2f} {ratio['get, no check']:16.2f} {gbs['put']:9.2f} "
            f"{ratio['put']:11.2f} {extra * 1e6:13.1f}"
        )
        fill = layout.record_bytes / cold["put"] / 1e9
        print(f"{'':>8} first fill of a new store: put {fill:.2f} GB/s")
        print(
            f"{'':>8} as one chain: put {gbs['put, chain']:.2f} GB/s "
            f"({ratio['put'] / ratio['put, chain']:.2f}x the put's time); a load's touch "
            f"{med['touch'] * 1e6:.1f} us a block"
        )


if __name__ == "__main__":
    main()
