"""The embedding example's own scheduler loop, run against the K/V fingerprint runtime: every
read of K/V in every step is checked, at pool sizes from tight (constant preemption) to ample."""

import pytest

from examples.embedding import main
from prefixcache import CacheManager
from tests.kv_fingerprint import FingerprintRuntime


@pytest.mark.parametrize("num_blocks", [40, 48, 60, 64, 80, 128, 256])
def test_embedding_loop_reads_only_written_kv(num_blocks):
    rt = FingerprintRuntime(CacheManager(num_blocks, 16, stepped=True))
    figures = main(num_blocks, engine=rt)
    assert rt.reads > 0 and figures["active"] == 0
    assert figures["free"] + figures["cached"] == num_blocks
    if num_blocks <= 64:
        assert figures["preempted"] > 0  # the tight pools do exercise preemption
