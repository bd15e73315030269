"""What the manager keeps per live request: its tokens, block table and step bookkeeping."""

from __future__ import annotations

from collections.abc import Hashable

from prefixcache.blocks.namespace import Namespace
from prefixcache.blocks.radix import Node


class RequestState:
    """A request's private state. It holds the index path from the root down to ``deepest``."""

    __slots__ = (
        "blocked",
        "claim",
        "copy_source",
        "deepest",
        "dependents",
        "namespace",
        "num_tokens",
        "pending",
        "pending_start",
        "private",
        "request_id",
        "table",
        "tokens",
        "unconfirmed",
    )

    def __init__(
        self,
        request_id: Hashable,
        namespace: Namespace,
        tokens: bytes | bytearray,
        num_tokens: int,
        table: list[int],
        deepest: Node | None,
    ) -> None:
        self.request_id = request_id
        self.namespace = namespace
        self.tokens = tokens  # int32 LE token ids (bytes until the first append)
        self.num_tokens = num_tokens
        self.table = table  # block table
        self.private: list[int] = []  # table blocks that are not on the index path
        self.deepest = deepest  # None: holds no indexed block
        self.blocked = False  # a digest collision stopped committing this sequence
        self.copy_source: Node | None = None  # held until its partial copy has surely run
        self.claim: tuple[int, float] | None = None  # (priority, retain until) of its blocks
        self.unconfirmed = False  # wrote K/V that no end_step or release has confirmed yet
        # blocks it entered into the index, not yet confirmed (a list once there are any)
        self.pending: list[int] | tuple[()] = ()
        self.pending_start: int | None = None  # block position of the first of them
        # forks taken while it was unconfirmed (a list once there are any)
        self.dependents: list[RequestState] | tuple[()] = ()

    def confirm(self) -> None:
        """Its K/V is written: nothing of it is pending and nothing depends on its writes."""
        self.unconfirmed = False
        self.pending = ()
        self.pending_start = None
        self.dependents = ()
