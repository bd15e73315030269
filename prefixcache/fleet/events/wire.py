"""KV cache events on the wire, as vLLM publishes them: msgpack batches of tagged events.

The structs below carry the field names, order, types and struct options of
``vllm/distributed/kv_events.py`` in vLLM 0.33: ``KVEventBatch(ts, events, data_parallel_rank)``,
an ``array_like`` struct, and the events ``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``,
msgspec structs with ``omit_defaults=True, gc=False`` and ``tag=True`` (the tag is the class name
under the key ``"type"``). Block hashes are ``bytes | int`` there; prefixcache sends its 16-byte
digests. Here the events are ``WireBlockStored``, ``WireBlockRemoved`` and
``WireAllBlocksCleared``, each tagged with vLLM's class name (prefixcache's own events of those
names, which the publisher turns into these, are in ``prefixcache.manager.block_events``); the
publisher leaves their optional fields None (omitted), so an encoded batch is byte for byte what
vLLM 0.33 encodes for the same values.

vLLM has used three layouts, all decoded here (``decode_batch`` tries each); only the first is
sent (``encode_batch``), since it is the only one vLLM 0.33's own decoder,
``msgspec.msgpack.Decoder(KVEventBatch)``, reads:

- ``WireLayout.MAP_EVENTS``: the batch is an array ``[ts, events, data_parallel_rank]`` and each
  event a map tagged ``"type"``, its required fields always present and the optional ones
  omitted when None. vLLM 0.33 (``EventBatch`` is ``array_like``, events are not) and SGLang 0.5
  (whose batch ends in ``attn_dp_rank``) publish this.
- ``WireLayout.MAP``: the batch and its events are maps, as vLLM declared them at commit
  ``0181ea3173e53eea8cf04a86891488e3dc89bb34`` (``EventBatch`` without ``array_like``).
- ``WireLayout.ARRAY``: everything is an array, an event being ``[tag, field, ...]`` in
  declaration order; vLLM before events became maps (e.g. commit
  ``b4e69e0af33f4698e157a262cc787fe61983cd3d``) and older SGLang
  (``python/sglang/srt/disaggregation/kv_events.py`` at commit
  ``006d053f182f9b488d2bd841afa06d5f9120a258``, whose ``BlockStored`` stops at ``lora_id`` and
  whose batch has no rank) publish this.

SGLang 0.5 adds ``cache_salt`` to ``BlockStored`` (decoded here), and its hashes are signed.

On the ZMQ side a message is three frames, ``(topic, sequence number as 8 big-endian bytes,
payload)``. A replay request, from a DEALER, is ``(b"", start sequence as 8 big-endian bytes)``;
the answer, as vLLM 0.33 and SGLang 0.5 send it, is ``(b"", topic, sequence, payload)`` per
buffered batch from ``start`` on, then the end marker ``(b"", b"", END_SEQ, b"")``.

Decoding is lenient where engines differ (fields a version does not send get their defaults,
unknown fields are ignored) and strict about types: anything else raises ``WireFormatError``.
"""

from __future__ import annotations

import enum
from itertools import pairwise
from typing import Any, NamedTuple

import msgspec

from prefixcache.errors import WireFormatError

SEQ_BYTES = 8
END_SEQ = (-1).to_bytes(SEQ_BYTES, "big", signed=True)  # replay: no more batches
BlockHash = bytes | int


class WireLayout(str, enum.Enum):
    """Which of vLLM's encodings a batch came in (see the module docstring); only
    ``MAP_EVENTS`` is sent."""

    MAP = "map"
    MAP_EVENTS = "map-events"
    ARRAY = "array"


# ---- vLLM's structs, as declared (encoding) -------------------------------------------------


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of every KV cache event (a tagged map)."""


class WireBlockStored(KVCacheEvent, tag="BlockStored"):
    """A run of consecutive full blocks entered the cache."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class WireBlockRemoved(KVCacheEvent, tag="BlockRemoved"):
    """Blocks left the cache (of ``medium``)."""

    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class WireAllBlocksCleared(KVCacheEvent, tag="AllBlocksCleared"):
    """The cache was reset."""


WireEvent = WireBlockStored | WireBlockRemoved | WireAllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One published message: the events of one step (``[ts, events, data_parallel_rank]``)."""

    ts: float
    events: list[WireEvent]
    data_parallel_rank: int | None = None


# ---- lenient structs for decoding -----------------------------------------------------------


class _In(msgspec.Struct, gc=False, tag=True):
    pass


class _InStored(_In, tag="BlockStored"):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None = None
    # SGLang with EAGLE speculative decoding (bigram radix keys) sends one ``[t_j, t_j+1]`` pair
    # per position instead of ``t_j``
    token_ids: list[int | tuple[int, int]] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    cache_salt: str | None = None  # SGLang's


class _InRemoved(_In, tag="BlockRemoved"):
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None


class _InCleared(_In, tag="AllBlocksCleared"):
    pass


class _InStoredA(_InStored, array_like=True, tag="BlockStored"):
    pass


class _InRemovedA(_InRemoved, array_like=True, tag="BlockRemoved"):
    pass


class _InClearedA(_InCleared, array_like=True, tag="AllBlocksCleared"):
    pass


_InMapEvent = _InStored | _InRemoved | _InCleared


class _InMapBatch(msgspec.Struct, gc=False):
    ts: float
    events: list[_InMapEvent]
    data_parallel_rank: int | None = None


class _InMapEventsBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_InMapEvent]
    data_parallel_rank: int | None = None


class _InArrayBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_InStoredA | _InRemovedA | _InClearedA]
    data_parallel_rank: int | None = None


# ---- what decoding hands back ---------------------------------------------------------------


class StoredBlocks(NamedTuple):
    """A decoded ``BlockStored``."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None
    group_idx: int | None
    lora_id: int | None = None  # set for LoRA blocks (the only LoRA field in older layouts)
    cache_salt: str | None = None  # SGLang's salt of the blocks (vLLM's is in extra_keys)


class RemovedBlocks(NamedTuple):
    """A decoded ``BlockRemoved``."""

    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None


class ClearedAll(NamedTuple):
    """A decoded ``AllBlocksCleared``."""


DecodedEvent = StoredBlocks | RemovedBlocks | ClearedAll


class DecodedBatch(NamedTuple):
    """A decoded batch and the layout it came in."""

    ts: float
    events: list[DecodedEvent]
    data_parallel_rank: int | None
    layout: WireLayout


_ENCODER = msgspec.msgpack.Encoder()


def encode_batch(batch: KVEventBatch, layout: WireLayout = WireLayout.MAP_EVENTS) -> bytes:
    """The msgpack payload of ``batch``, in vLLM 0.33's layout (``MAP_EVENTS``, the only one
    sent); WireFormatError for another ``layout``, which no current engine's decoder reads."""
    if layout is not WireLayout.MAP_EVENTS:
        raise WireFormatError(
            f"the {getattr(layout, 'value', layout)!r} layout is read, not sent: vLLM 0.33's "
            f"decoder reads only {WireLayout.MAP_EVENTS.value!r}"
        )
    return _ENCODER.encode(batch)


class BatchDecoder:
    """Decodes payloads in any of the layouts; remembers the last one that worked, which it
    tries first next time (a stream keeps one layout)."""

    def __init__(self) -> None:
        self._decoders: list[tuple[WireLayout, msgspec.msgpack.Decoder[Any]]] = [
            (WireLayout.MAP_EVENTS, msgspec.msgpack.Decoder(_InMapEventsBatch)),
            (WireLayout.MAP, msgspec.msgpack.Decoder(_InMapBatch)),
            (WireLayout.ARRAY, msgspec.msgpack.Decoder(_InArrayBatch)),
        ]

    def decode(self, payload: bytes) -> DecodedBatch:
        """The batch in ``payload``; ``WireFormatError`` when no layout fits."""
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise WireFormatError(f"payload must be bytes, got {type(payload).__name__}")
        errors = []
        for k, (layout, decoder) in enumerate(self._decoders):
            try:
                raw = decoder.decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                errors.append(f"{layout.value}: {exc}")
                continue
            if k:
                self._decoders.insert(0, self._decoders.pop(k))
            return DecodedBatch(
                raw.ts, [_convert(e) for e in raw.events], raw.data_parallel_rank, layout
            )
        raise WireFormatError(
            "not a KV event batch in any known layout (" + "; ".join(errors) + ")"
        )


def unpair_tokens(token_ids: list[Any]) -> list[int]:
    """The token ids of a ``BlockStored``: as sent, or, when SGLang sent its EAGLE bigram pairs
    (position ``j`` as ``(t_j, t_j+1)``, consecutive pairs sharing a token), the first token of
    each pair, the token at that position. ``WireFormatError`` for pairs that do not chain or a
    mix of pairs and ids."""
    if not token_ids or (type(token_ids[0]) is not tuple and type(token_ids[-1]) is not tuple):
        return token_ids
    if not all(type(t) is tuple for t in token_ids):
        raise WireFormatError("token_ids mix token ids and bigram pairs")
    if any(a[1] != b[0] for a, b in pairwise(token_ids)):
        raise WireFormatError("token_ids bigram pairs do not chain ((a, b) then (b, c))")
    return [pair[0] for pair in token_ids]


def _convert(event: Any) -> DecodedEvent:
    if isinstance(event, _InStored):
        return StoredBlocks(
            event.block_hashes,
            event.parent_block_hash,
            unpair_tokens(event.token_ids),
            event.block_size,
            event.medium,
            event.lora_name,
            event.extra_keys,
            event.group_idx,
            event.lora_id,
            event.cache_salt,
        )
    if isinstance(event, _InRemoved):
        return RemovedBlocks(event.block_hashes, event.medium, event.group_idx)
    return ClearedAll()


_DEFAULT_DECODER = BatchDecoder()


def decode_batch(payload: bytes) -> DecodedBatch:
    """Decode one payload (any layout); ``WireFormatError`` when it is not a KV event batch."""
    return _DEFAULT_DECODER.decode(payload)


def encode_seq(seq: int) -> bytes:
    """The sequence-number frame: 8 bytes, big-endian."""
    return seq.to_bytes(SEQ_BYTES, "big")


def decode_seq(frame: bytes) -> int:
    """The sequence number in a frame; ``WireFormatError`` unless it is 8 bytes."""
    if len(frame) != SEQ_BYTES:
        raise WireFormatError(f"sequence frame must be {SEQ_BYTES} bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)
