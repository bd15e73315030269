"""Block records: a record reads back only as exactly the block, namespace and layout written,
whole and intact; every other case is refused with its reason."""

import numpy as np
import pytest

from prefixcache import Namespace
from prefixcache.errors import ConfigError
from prefixcache.store.block_record import (
    BlockLayout,
    Refusal,
    check_record,
    encode_header,
    namespace_fingerprint,
    payload_checksum,
)

LAYOUT = BlockLayout(16, 2, "float16", 2, (16, 2, 8))
NS = namespace_fingerprint(Namespace(model="m"))
DIGEST = bytes(range(16))


def record(layout=LAYOUT, digest=DIGEST, ns=NS, payload=None):
    if payload is None:
        payload = np.arange(layout.payload_bytes, dtype=np.uint8).tobytes()
    return encode_header(digest, ns, layout, payload_checksum(payload)) + payload


def test_a_record_reads_back_and_its_payload_is_aligned():
    rec = record()
    assert len(rec) == LAYOUT.record_bytes and LAYOUT.header_bytes % 16 == 0
    assert check_record(memoryview(rec), DIGEST, NS, LAYOUT) is None


@pytest.mark.parametrize(
    "mutate, reason",
    [
        (lambda r: r[:10], Refusal.TRUNCATED),
        (lambda r: r[:-1], Refusal.TRUNCATED),
        (lambda r: b"XXXX" + r[4:], Refusal.NOT_A_RECORD),
        (lambda r: b"junk", Refusal.NOT_A_RECORD),
        (lambda r: r[:4] + b"\x09" + r[5:], Refusal.NOT_A_RECORD),  # another version
        (lambda r: r[:-1] + bytes([r[-1] ^ 1]), Refusal.CHECKSUM),
        (lambda r: r + b"\x00", Refusal.TRUNCATED),
    ],
)
def test_torn_corrupt_and_foreign_values_are_refused(mutate, reason):
    assert check_record(memoryview(mutate(record())), DIGEST, NS, LAYOUT) is reason


def test_another_block_namespace_or_layout_is_refused():
    other_ns = namespace_fingerprint(Namespace(model="m", salt="t"))
    assert check_record(memoryview(record()), bytes(16), NS, LAYOUT) is Refusal.DIGEST
    assert check_record(memoryview(record()), DIGEST, other_ns, LAYOUT) is Refusal.NAMESPACE
    for other in (
        LAYOUT._replace(block_size=32),
        LAYOUT._replace(num_layers=3),
        LAYOUT._replace(dtype="bfloat16"),
        LAYOUT._replace(shape=(16, 4, 4)),
    ):
        rec = record(layout=other)
        assert check_record(memoryview(rec), DIGEST, NS, LAYOUT) is Refusal.LAYOUT


def test_a_bad_layout_is_a_config_error():
    with pytest.raises(ConfigError, match="shape"):
        LAYOUT._replace(shape=(0, 2)).check()
    with pytest.raises(ConfigError, match="num_layers"):
        LAYOUT._replace(num_layers=0).check()
