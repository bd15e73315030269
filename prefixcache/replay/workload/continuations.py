"""Multi-turn continuations in Mooncake traces: the next turn hits the blocks the last decoded.

A Mooncake hash id names a prefix, so a turn that extends an earlier request's prompt shares that
request's hash ids, but the blocks that the earlier request's output filled (and that a serving
engine cached as decode filled them) carry new ids in the next turn: synthesized from their ids
alone, no replay could hit them. With continuations, those blocks get the tokens the earlier
request decoded (its ``Request.output_tokens``, which the replay writes), so their hashes match.

Request ``j`` continues the latest earlier request ``i`` when ``j``'s input holds ``i``'s prompt
and output (``input_length(j) >= input_length(i) + output_length(i)``) and ``j``'s hash ids start
with ``i``'s full-block ids, and either

- ``i``'s prompt ends on a block boundary and ``j``'s ids start with all of ``i``'s; or
- ``i``'s last block is partial, ``j``'s id there differs (that block now holds output too, so
  its prefix hash changed) and no other request has branched from ``i``'s full blocks: every
  earlier request with those blocks and more went on with ``i``'s last id. A prefix that several
  requests diverge from (a shared system prompt) is not one conversation's.

The longest such prefix wins. Deciding needs the whole trace before the first request is replayed
(an earlier request must know to write its output), so ``plan_continuations`` reads the trace's
lengths and ids once first; it keeps one entry per distinct hash id.

In ``j``, positions ``[input(i), input(i) + output(i))`` are ``i``'s output; the blocks covering
``[full(i), input(i) + output(i))`` are rebuilt from ``i``'s prompt tail, that output and the
synthesized rest, and their ids keep those tokens for every later request that names them. A
request that named such an id before it was rebuilt keeps its synthesized block.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from prefixcache.replay.workload.synth import stream_key, stream_tokens

_BRANCHED = -1  # a prefix that earlier requests went on from with different ids


@dataclass
class ContinuationPlan:
    """Which requests (by 0-based position among the trace's non-empty lines) continue which,
    and how often each is continued (so the replay can forget a request after its last
    continuation). Built by ``plan_continuations``; ``len()`` is the number of continuing
    requests."""

    parent: dict[int, int] = field(default_factory=dict)  # continuing request -> continued one
    uses: dict[int, int] = field(default_factory=dict)  # continued request -> continuations

    def __len__(self) -> int:
        return len(self.parent)


class _Seen:
    """What the planner keeps of one request: its position, lengths (tokens) and hash ids."""

    __slots__ = ("ids", "index", "input_length", "output_length")

    def __init__(self, index: int, input_length: int, output_length: int, ids: list[int]):
        self.index, self.input_length, self.output_length = index, input_length, output_length
        self.ids = ids


def find_parent(
    ids: list[int],
    input_length: int,
    block: int,
    latest: dict[int, _Seen],
    successor: dict[int, int],
) -> _Seen | None:
    """The earlier request that a request with these hash ids and ``input_length`` (tokens)
    continues, or None. ``block``: tokens per hash id (the trace's block size). ``latest``: by
    the id of its last full block, the latest request whose full blocks end there;
    ``successor``: by id, the one id that followed it in every request so far, or
    ``_BRANCHED``. Both are kept up to date by ``note_request``; neither is changed here."""
    for n in range(len(ids) - 1, 0, -1):  # n: the parent's full blocks, longest first
        seen = latest.get(ids[n - 1])
        if seen is None or seen.input_length // block != n:
            continue
        if input_length < seen.input_length + seen.output_length:
            return None
        if len(seen.ids) == n:  # ends on a block boundary: all of its ids lead ours
            return seen
        last = seen.ids[n]
        if ids[n] != last and successor.get(ids[n - 1]) == last:
            return seen
        return None
    return None


def note_request(
    seen: _Seen, block: int, latest: dict[int, _Seen], successor: dict[int, int]
) -> None:
    """Remember a request for the ones after it: update ``successor`` with each pair of
    consecutive ids and, when it has a full block (``block`` tokens per id), make it the
    ``latest`` request ending on its last full block's id."""
    ids = seen.ids
    for k in range(len(ids) - 1):
        before = successor.get(ids[k])
        if before is None:
            successor[ids[k]] = ids[k + 1]
        elif before != ids[k + 1]:
            successor[ids[k]] = _BRANCHED
    full = seen.input_length // block
    if full:
        latest[ids[full - 1]] = seen


def plan_continuations(lines: Iterator[tuple[int, str]], block: int) -> ContinuationPlan:
    """The continuations of a Mooncake trace: ``lines`` are (line number, text) pairs of its
    non-empty lines, ``block`` its tokens per hash id. A line that is not a valid record is
    skipped here (the reader, which reads the lines again after this, reports it); nothing is
    raised but what iterating ``lines`` raises."""
    plan = ContinuationPlan()
    latest: dict[int, _Seen] = {}
    successor: dict[int, int] = {}
    for index, (_, line) in enumerate(lines):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue  # the reader reports it with its line number
        if not isinstance(obj, dict):
            continue
        ids = obj.get("hash_ids")
        length = obj.get("input_length")
        if not isinstance(ids, list) or not isinstance(length, int) or not ids:
            continue  # the reader reports it with its line number
        output = obj.get("output_length", 0)
        output = output if isinstance(output, int) and output >= 0 else 0
        parent = find_parent(ids, length, block, latest, successor)
        if parent is not None:
            plan.parent[index] = parent.index
            plan.uses[parent.index] = plan.uses.get(parent.index, 0) + 1
        note_request(_Seen(index, length, output, list(ids)), block, latest, successor)
    return plan


def output_tokens(seed: int, index: int, length: int, vocab: int) -> np.ndarray:
    """The ``length`` int32 tokens, in ``[0, vocab)``, that request ``index`` of a trace
    decodes when a later turn continues it; the same for the same ``seed``."""
    return stream_tokens(stream_key("mooncake-output", seed, index), length, vocab)


class Continuations:
    """Applies a plan while the reader builds requests, in trace order: keeps the decoded
    context of each continued request until its last continuation took it. ``seed`` and
    ``vocab`` (token ids are below it) choose the synthesized outputs."""

    def __init__(self, plan: ContinuationPlan, seed: int, vocab: int) -> None:
        self.plan, self.seed, self.vocab = plan, seed, vocab
        self._context: dict[int, tuple[int, np.ndarray]] = {}  # index -> (start, tokens)

    def output_of(
        self, index: int, prompt: np.ndarray, output_length: int, block: int
    ) -> np.ndarray | None:
        """The ``output_length`` tokens (int32) request ``index`` writes, or None when no later
        turn continues it. Also keeps its context for its continuations: ``prompt`` from its
        last full block (``block`` tokens per hash id) on, then that output."""
        if index not in self.plan.uses:
            return None
        out = output_tokens(self.seed, index, output_length, self.vocab)
        start = len(prompt) // block * block  # the context from the parent's last full block
        self._context[index] = (start, np.concatenate([prompt[start:], out]))
        return out

    def parent_context(self, index: int) -> tuple[int, np.ndarray] | None:
        """For continuing request ``index``: ``(start, tokens)``, the token position where its
        parent's context starts and that context (the parent's prompt tail, then its output);
        None when it continues no request or the parent's output was not kept. Counts one use
        of the parent: the context is forgotten after its last continuation."""
        parent = self.plan.parent.get(index)
        if parent is None or parent not in self._context:
            return None
        context = self._context[parent]
        left = self.plan.uses[parent] - 1
        if left:
            self.plan.uses[parent] = left
        else:
            del self._context[parent]
        return context
