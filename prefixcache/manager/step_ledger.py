"""The step protocol's ledger: which indexed blocks are pending (K/V not yet written), what
depends on them, and which copy sources a step still has to read.

A block that ``admit`` or ``append`` enters into the index is pending until ``end_step()``
confirms the step's writes, or the writer's ``release``. ``abort`` takes out a request whose
K/V was never written: its pending blocks leave the index, with every request that relies on
them. With steps, the source of each copy handed out in a step is held until ``end_step()``,
so no block freed during the step is handed out again while a copy still has to read it.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import NamedTuple

from prefixcache.blocks.hashing import split_digests
from prefixcache.blocks.radix import Node
from prefixcache.manager.block_events import BlockRemoved
from prefixcache.manager.block_supply import BlockSupply
from prefixcache.manager.state import CacheState, RequestState


class AbortScope(NamedTuple):
    """What an abort takes out."""

    requests: list[RequestState]  # the aborted request first, then the live ones relying on it
    tops: list[Node]  # the top node of each one's unwritten indexed blocks


class StepLedger:
    """Tracks unwritten K/V per request and the copy sources held through a step."""

    __slots__ = ("state", "supply")

    def __init__(self, state: CacheState, supply: BlockSupply) -> None:
        self.state = state  # its ``holds`` and ``refs``: the copy sources the step still reads
        self.supply = supply

    # ---- during a step --------------------------------------------------------------------
    def let_go_copy_source(self, seq: RequestState) -> None:
        """The prefill that runs ``seq``'s partial copy is planned: its source is let go, at
        the end of the step when there are steps."""
        source = seq.copy_source
        assert source is not None
        if self.state.stepped:
            self.state.holds.append((source, seq))
        else:
            self.supply.unhold(source)
        seq.copy_source = None

    def let_go_copied_block(self, block: int) -> None:
        """A shared private block was copied out of: its other owners may leave in this step,
        so with steps it is kept until the end."""
        if self.state.stepped:
            self.state.refs.append(block)
        else:
            self.state.pool.drop([block])

    def add_fork(self, parent: RequestState, child: RequestState) -> None:
        """``child`` forks ``parent``: while ``parent`` is unconfirmed, the fork reads what it
        still has to write (and passes that on to its own forks)."""
        if not parent.unconfirmed:
            return
        deps = parent.dependents
        if deps:
            if len(deps) >= 16 and not len(deps) & (len(deps) - 1):  # at 16, 32, 64, ...
                seqs = self.state.seqs
                deps[:] = [
                    d for d in deps if seqs.get(d.request_id) is d or d.dependents or d.pending
                ]
            deps.append(child)
        else:
            parent.dependents = [child]
        child.unconfirmed = True

    def end_step(self) -> None:
        """The step's K/V is written: every request is confirmed, and the copy sources held for
        the step are let go."""
        state = self.state
        for seq in state.seqs.values():
            if seq.unconfirmed:
                seq.confirm()
        for node, _ in state.holds:
            self.supply.unhold(node)
        state.holds.clear()
        state.pool.drop(state.refs)
        state.refs.clear()

    # ---- abort ----------------------------------------------------------------------------
    def abort(self, seq: RequestState) -> list[Hashable]:
        """Drop ``seq`` and every live request relying on K/V it never wrote; their unwritten
        indexed blocks leave the index. Returns the ids dropped, ``seq``'s first."""
        scope = self._abort_scope(seq)
        supply, state = self.supply, self.state
        now = state.now()
        if state.holds:  # the copies of dropped requests do not run
            gone = {id(dead) for dead in scope.requests}
            region = {id(top) for top in scope.tops}  # and no hold may keep a node that leaves
            keep = []
            for node, owner in state.holds:
                if id(owner) in gone or _under(node, region):
                    supply.unhold(node)
                else:
                    keep.append((node, owner))
            state.holds = keep
        for dead in scope.requests:
            del state.seqs[dead.request_id]
            supply.release_request(dead)
        for top in sorted(scope.tops, key=lambda node: node.depth):
            if top.parent is not None:  # not inside a region removed already
                self._unindex(top, now)
        state.stats.aborted_requests += len(scope.requests)
        return [dead.request_id for dead in scope.requests]

    def _unindex(self, top: Node, now: float) -> None:
        """Take ``top`` and everything below it out of the index; its blocks are free."""
        state = self.state
        index, events, offload = state.index, state.listeners, state.offload
        parent = top.parent
        assert parent is not None
        namespace = index.namespace_of(top)
        for node, ids, digests in index.remove_subtree(top):
            state.pool.give_back(ids)
            state.stats.unindexed_blocks += len(ids)
            if events.callbacks:
                events.emit(BlockRemoved(split_digests(digests), namespace))
            if offload is not None:
                offload.drop_below(node)
        if parent.parent is not None and state.evictor.evictable(parent):
            state.evictor.push(parent, now)

    def _abort_scope(self, seq: RequestState) -> AbortScope:
        """``seq`` and every live request that relies on K/V it (or they, in turn) has not
        written yet, plus the top node of each one's unwritten indexed blocks. The forks of a
        fork released already count too: they read what ``seq`` never wrote through it."""
        seqs = self.state.seqs
        doomed, seen, tops = [seq], {id(seq)}, []
        chain = [seq]  # the doomed and the released forks between them
        region: set[int] = set()  # ids of nodes in unwritten regions
        i = 0
        while True:
            while i < len(chain):
                cur = chain[i]
                i += 1
                if not cur.unconfirmed:
                    continue
                for dep in cur.dependents:
                    if id(dep) not in seen:
                        seen.add(id(dep))
                        chain.append(dep)
                        if seqs.get(dep.request_id) is dep:
                            doomed.append(dep)
                if cur.deepest is not None and cur.deepest.parent is None:
                    continue  # released, and its blocks left the index since
                top = self._pending_top(cur)
                if top is not None:
                    tops.append(top)
                    stack = [top]
                    while stack:
                        node = stack.pop()
                        region.add(id(node))
                        if node.children:
                            stack.extend(node.children.values())
            grew = False
            if region:
                readers: list[tuple[Node | None, RequestState]]
                readers = [(s.deepest, s) for s in seqs.values()]
                readers += [(s.copy_source, s) for s in seqs.values()]
                readers += [(node, s) for node, s in self.state.holds]
                for held, other in readers:
                    if id(other) in seen or seqs.get(other.request_id) is not other:
                        continue
                    if _under(held, region):
                        seen.add(id(other))
                        doomed.append(other)
                        chain.append(other)
                        grew = True
            if not grew:
                return AbortScope(doomed, tops)

    def _pending_top(self, seq: RequestState) -> Node | None:
        """The node that starts ``seq``'s unconfirmed indexed blocks (split off if needed)."""
        start = seq.pending_start
        node = seq.deepest
        if start is None or node is None:
            return None
        while node.parent is not None and node.depth > start:
            node = node.parent
        assert node.parent is not None and node.depth <= start < node.end
        if node.depth < start:
            self.state.index.split(node, start - node.depth)  # ``node`` keeps the lower part
        return node

    # ---- views ----------------------------------------------------------------------------
    def num_holds(self) -> int:
        """Copy sources held until the end of the step (nodes and private blocks)."""
        return len(self.state.holds) + len(self.state.refs)


def _under(node: Node | None, region: set[int]) -> bool:
    """Whether ``node`` is in ``region`` (node ids) or below it."""
    while node is not None and node.parent is not None:
        if id(node) in region:
            return True
        node = node.parent
    return False
