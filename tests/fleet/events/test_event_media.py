"""The media events carry are vLLM's own strings: the names vLLM 0.33's kv_events.py gives them,
and events of every medium that prefixcache sends encode byte for byte as vLLM's structs with
the same values."""

from __future__ import annotations

import ast
import typing
import zipfile

import msgspec
import pytest
from engine_wheels import VLLM, missing, wheel
from vllm_structs import BlockRemoved as VLLMBlockRemoved
from vllm_structs import BlockStored as VLLMBlockStored
from vllm_structs import KVEventBatch as VLLMEventBatch

from prefixcache import Namespace
from prefixcache.fleet.events.publisher import to_wire
from prefixcache.fleet.events.wire import KVEventBatch, encode_batch
from prefixcache.manager.block_events import BlockRemoved, BlockStored
from prefixcache.medium import CPU, GPU, STORAGE, STORE, Medium


def test_the_media_are_the_names_vllm_gives_them():
    reason = missing(VLLM)
    if reason is not None:
        pytest.skip(reason)
    path = wheel(VLLM)
    assert path is not None
    with zipfile.ZipFile(path) as zf:
        tree = ast.parse(zf.read("vllm/distributed/kv_events.py").decode())
    theirs = {
        node.targets[0].id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and isinstance(node.targets[0], ast.Name)
        and node.targets[0].id.startswith("MEDIUM_")
        and isinstance(node.value, ast.Constant)
    }
    assert theirs == {"MEDIUM_GPU": GPU, "MEDIUM_CPU": CPU, "MEDIUM_STORAGE": STORAGE}
    assert typing.get_args(Medium) == (GPU, CPU, STORAGE, STORE)  # one spelling each


@pytest.mark.parametrize("medium", typing.get_args(Medium))
def test_an_event_of_each_medium_encodes_as_vllms(medium):
    digests, tokens = [bytes(range(16)), bytes(range(16, 32))], list(range(8))
    ns = Namespace("llama")
    ours = encode_batch(
        KVEventBatch(
            1.5,
            [
                to_wire(BlockStored(digests, None, tokens, 4, ns, medium)),
                to_wire(BlockRemoved(digests[1:], ns, medium)),
            ],
            0,
        )
    )
    theirs = msgspec.msgpack.encode(
        VLLMEventBatch(
            1.5,
            [
                VLLMBlockStored(list(digests), None, tokens, 4, None, medium, None),
                VLLMBlockRemoved(digests[1:], medium),
            ],
            0,
        )
    )
    assert ours == theirs
    assert msgspec.msgpack.decode(ours)[1][0]["medium"] == medium
