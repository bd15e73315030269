"""The shadow fleets in a process of their own, so that routing does not pay for them.

Each route costs the shadows a route and an admission per scenario (eight miniature fleets on
most long prompts at 1%): in the router's process that was 1.65x its CPU per route. Here the
route path only cuts the prompt down to its sampled blocks (``sample_prompt``, from the hashes
the live curves picked) and appends that to a queue; a sender thread ships the queue in batches
over a pipe to a child process that runs ``ShadowFleets`` and answers ``report``. The child is
a fresh interpreter (``python -m`` this module, the pipe one end of a socket pair: no fork of a
threaded server, no re-import of the caller's main script) and stops with the service, or when
its pipe closes.

The queue is bounded: if the child falls behind, the newest prompts are dropped and counted
(``dropped_requests`` in the report), and routing never waits for it. A child that dies, or
does not answer a report in ``REPLY_TIMEOUT_S`` (stopped, or far behind), is reported
(``error``), never raised into a request; one that answers again is read again.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

from prefixcache.fleet.replica_spec import ReplicaSpec
from prefixcache.fleet.whatif.shadow_fleets import FULL, ShadowFleets, sample_prompt

BATCH = 256  # prompts a message carries at most
FLUSH_S = 0.1  # the sender ships what is queued at least this often
MAX_QUEUED = 10_000  # prompts waiting for the child (a few MiB); past this they are dropped
REPLY_TIMEOUT_S = 5.0  # how long a report waits for the child


def _serve(conn: Connection) -> None:
    """The child: the fleets' settings, then offers in and reports out, until told to stop or
    the pipe closes."""
    try:
        _, specs, policy, rate = conn.recv()  # ("settings", ...), first
        shadows = ShadowFleets(specs, policy, rate)
        while True:
            message = conn.recv()
            kind = message[0]
            if kind == "offer":
                for prompt, tokens in message[1]:
                    shadows.offer_sampled(prompt, tokens)
            elif kind == "report":
                report = shadows.report()
                report["cpu_seconds"] = round(time.process_time(), 3)
                conn.send((message[1], report))
            else:  # "stop"
                return
    except (EOFError, KeyboardInterrupt, BrokenPipeError):
        return


class ShadowProcess:
    """``ShadowFleets`` run by a child process; ``offer`` and ``report`` as there
    (thread-safe). Only the sender thread writes to the pipe, so neither a route nor a report
    ever waits on a child that has stopped reading."""

    def __init__(self, specs: Sequence[ReplicaSpec], policy: str, rate: float) -> None:
        self.rate = rate
        self.threshold = min(FULL, int(rate * FULL))  # a sampling hash under it is sampled
        self._active = any(s.capacity_blocks > 0 for s in specs)  # as ShadowFleets sizes
        # prompts (a SampledPrompt and its token count), and in their place the questions:
        # ("report", number) and ("stop",)
        self._queue: deque[tuple[Any, ...]] = deque()
        self._wake = threading.Event()
        self._reading = threading.Lock()  # one report at a time reads the answers
        self._stopping = False
        self.dropped = 0  # prompts dropped because the child fell behind
        self.error: str | None = None  # set when the child has died
        self.sender_cpu = 0.0  # CPU seconds the sender thread has used (in this process)
        self._asked = 0  # reports asked for (each answer carries its number)
        ours, theirs = socket.socketpair()
        with theirs:
            self._process = subprocess.Popen(
                [sys.executable, "-m", __name__, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
            )
        self._conn = Connection(ours.detach())
        self._queue.append(("settings", list(specs), policy, rate))
        self._sender = threading.Thread(
            target=self._send_loop, name="prefixcache-shadow-sender", daemon=True
        )
        self._sender.start()

    def offer(
        self,
        digests: Sequence[bytes],
        prompt_tokens: int,
        picks: list[tuple[int, int]] | None = None,
    ) -> None:
        """A routed prompt (its full blocks' digests, root first): cut down to its sampled
        blocks here (from ``picks`` when the curves have picked at ``threshold`` or higher:
        ``sample_prompt``), queued for the child."""
        if not self._active or self.error is not None:
            return
        if len(self._queue) >= MAX_QUEUED:
            self.dropped += 1
            return
        self._queue.append((sample_prompt(digests, self.rate, picks), prompt_tokens))
        if len(self._queue) >= BATCH:
            self._wake.set()

    def _send_loop(self) -> None:
        while not self._stopping and self.error is None:
            self._wake.wait(FLUSH_S)
            self._wake.clear()
            self._flush()
            self.sender_cpu = time.thread_time()

    def _flush(self) -> None:
        """Ship everything queued: prompts in batches, each question in its place."""
        batch: list[tuple[Any, ...]] = []
        while self._queue and self.error is None:
            item = self._queue.popleft()
            if isinstance(item[0], str):  # a question
                if batch:
                    self._send(("offer", batch))
                    batch = []
                self._send(item)
            else:
                batch.append(item)
                if len(batch) >= BATCH:
                    self._send(("offer", batch))
                    batch = []
        if batch:
            self._send(("offer", batch))

    def _send(self, message: tuple[Any, ...]) -> None:
        try:
            self._conn.send(message)
        except (OSError, ValueError):
            self._died()

    def _died(self) -> None:
        try:
            code: int | None = self._process.wait(timeout=1)
        except subprocess.TimeoutExpired:
            code = None
        self.error = (
            f"the shadow fleets' process stopped (exit code {code}); routing and the curves go "
            "on without it, restart the service to run the shadows again"
        )
        self._queue.clear()

    def report(self) -> dict[str, Any]:
        """The child's ``ShadowFleets.report()`` once everything queued before has reached it,
        with ``dropped_requests``, the child's ``cpu_seconds`` and, when it has died or does
        not answer in ``REPLY_TIMEOUT_S``, ``error`` (and no scenarios)."""
        report: dict[str, Any] | None = None
        if not self._active:
            report = {**ShadowFleets.off(), "rate": self.rate}
        elif self.error is None and self._reading.acquire(timeout=REPLY_TIMEOUT_S):
            try:
                report = self._ask()
            finally:
                self._reading.release()
        if report is None:
            error = self.error or (
                f"the shadow fleets' process did not answer in {REPLY_TIMEOUT_S} s: it is behind "
                "(see dropped_requests) or stopped; its numbers return once it catches up, or "
                "lower whatif.counterfactual_rate"
            )
            report = {**ShadowFleets.off(), "rate": self.rate, "error": error}
        report["dropped_requests"] = self.dropped
        return report

    def _ask(self) -> dict[str, Any] | None:
        """Queue a question and wait for its answer; answers to earlier questions that came
        too late are passed over."""
        self._asked += 1
        asked = self._asked
        self._queue.append(("report", asked))
        self._wake.set()
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        try:
            while self.error is None and self._conn.poll(max(0.0, deadline - time.monotonic())):
                number, report = self._conn.recv()
                if number == asked:
                    return dict(report)
        except (EOFError, OSError):
            self._died()
        return None

    def close(self) -> None:
        """Stop the child and the sender (at the service's stop)."""
        if self.error is None:
            self._queue.append(("stop",))
            self._wake.set()
        try:
            self._process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait(timeout=5)
        self._stopping = True
        self._wake.set()
        self._sender.join(timeout=5)
        self._conn.close()


if __name__ == "__main__":  # the child: its end of the pipe is the file descriptor given
    _serve(Connection(int(sys.argv[1])))
