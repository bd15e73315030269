"""The callables that receive a manager's block events, shared by the manager's state and the
tiers below the GPU that announce what they store and drop."""

from __future__ import annotations

import logging

from prefixcache.manager.block_events import CacheEvent, EventListener

log = logging.getLogger("prefixcache.manager")


class Listeners:
    """The callables that receive the manager's BlockStored / BlockRemoved / AllBlocksCleared
    events. ``callbacks`` is replaced, never changed in place, so an event being sent keeps the
    list it started with; an empty list means no event needs building. ``token_ids``: whether
    any listener reads token ids (else BlockStored events carry none)."""

    __slots__ = ("callbacks", "errors", "token_ids", "tokenless")

    def __init__(self) -> None:
        self.callbacks: list[EventListener] = []
        self.tokenless: list[EventListener] = []  # the listeners that read no token ids
        self.token_ids = False
        self.errors = 0  # exceptions raised by listeners (logged, then ignored)

    def add(self, listener: EventListener, token_ids: bool = True) -> None:
        """Call ``listener`` with every later event; ``token_ids``: it reads their token ids
        (a listener added again takes its last say)."""
        self.callbacks = [*self.callbacks, listener]
        self.tokenless = [x for x in self.tokenless if x != listener]
        if not token_ids:
            self.tokenless.append(listener)
        self._recount()

    def remove(self, listener: EventListener) -> None:
        """Stop calling ``listener``; ValueError when it was not added."""
        callbacks = list(self.callbacks)
        callbacks.remove(listener)
        self.callbacks = callbacks
        if listener not in callbacks:
            self.tokenless = [x for x in self.tokenless if x != listener]
        self._recount()

    def _recount(self) -> None:
        self.token_ids = any(x not in self.tokenless for x in self.callbacks)

    def emit(self, event: CacheEvent) -> None:
        """Send ``event`` to every listener. Events go out in the middle of an operation, so an
        exception from a listener is logged and counted, never raised."""
        for listener in self.callbacks:
            try:
                listener(event)
            except Exception:  # mid-operation: raising here would leave the state half-changed
                self.errors += 1
                log.exception("event listener %r failed on %s", listener, type(event).__name__)
