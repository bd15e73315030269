"""Work that needs nothing from this process's next steps, run in a forked second process.

A fleet replay's no-cache and pooled passes read only the workload and the configuration, so
they can run on a spare core while the fleet pass runs here (``fleet.simulator.run_fleet``).
``SideRun`` forks a child that runs ``work``, hands back its result through a pipe, and passes
on, about five times a second, the requests it completed and the pass it is in, for the
progress bar here; a ``FeedPipe`` carries messages the other way while both work (a serving
replay's log for the shadow it defers, ``shadow_feed``). Only where ``fork`` is available (the
child starts with the workload already open, nothing is pickled on the way in) and at least two
cores are usable.

The child never outlives this process's interest in it: it ignores Ctrl-C (this process gets
it, and ``stop`` ends the child), ends itself when this process is gone, and leaves by
``os._exit``, so no exit handler, buffered output or traceback of this process's runs twice.
Whatever goes wrong in the child (an exception, a signal, a result that cannot be pickled)
closes its end of the pipe with nothing sent: the caller runs the work itself, where the same
error, if any, is raised as it would have been without the child.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
import warnings
from collections.abc import Callable
from queue import Empty, SimpleQueue
from typing import Any, Generic, TypeVar

T = TypeVar("T")
SEND_EVERY_S = 0.2  # seconds between the child's reports of its progress, at the least

# work(count, stage): count(n) says n more requests completed, stage(k) that pass k began
Work = Callable[[Callable[[int], None], Callable[[int], None]], T]


def side_process_available() -> bool:
    """Whether a second process can run beside this one: ``fork`` exists and at least two cores
    are usable here."""
    if "fork" not in mp.get_all_start_methods():
        return False
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform
        cores = os.cpu_count() or 1
    return cores >= 2


class SideRun(Generic[T]):
    """``work`` running in a forked child; ``result`` waits for what it returns."""

    def __init__(self, work: Work[T], first_stage: int = 0, feed: FeedPipe | None = None) -> None:
        """``feed``: a pipe this process sends the child messages through while it works."""
        ctx = mp.get_context("fork")
        self._count = ctx.RawValue("q", 0)  # requests the child completed, as last reported
        self._stage = ctx.RawValue("i", first_stage)
        self._seen = 0
        self._recv, send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(
            target=_child,
            args=(work, send, self._count, self._stage, os.getpid(), feed),
            daemon=True,  # ended by multiprocessing's exit handler, should stop be missed
        )
        # Ctrl-C held back while the child starts: it ignores it from its first instruction,
        # and this process takes it once the child runs
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            with warnings.catch_warnings():
                # Python 3.12 warns of fork beside threads (a progress bar's monitor): the
                # child only runs the work, which takes no lock another thread could hold
                warnings.filterwarnings("ignore", ".*fork.*", DeprecationWarning)
                self._proc.start()
        except BaseException:
            self._recv.close()
            raise
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            send.close()
            if feed is not None:
                feed.parent_side()

    def counted(self) -> int:
        """Requests the child completed since the last call (as it last reported)."""
        now = self._count.value
        new, self._seen = now - self._seen, now
        return new

    @property
    def taken(self) -> int:
        """Requests the child completed, as taken by ``counted`` so far."""
        return self._seen

    @property
    def stage(self) -> int:
        """The stage the child is in, as it last reported (-1: its work is done)."""
        return int(self._stage.value)

    def result(self, tick: Callable[[], None] | None = None) -> T | None:
        """Wait for the child's result, calling ``tick`` every ``SEND_EVERY_S`` seconds or so;
        None when the child ended without one (its pipe closed unsent)."""
        try:
            while not self._recv.poll(SEND_EVERY_S):
                if tick is not None:
                    tick()
            status, value = self._recv.recv()
        except (EOFError, OSError):
            return None
        finally:
            self.stop()
        return value if status == "ok" else None

    def stop(self) -> None:
        """End the child (when it still runs) and collect it."""
        if self._proc.is_alive():
            self._proc.kill()
        self._proc.join()
        self._recv.close()


def _child(
    work: Work[Any], send: Any, count: Any, stage: Any, parent: int, feed: FeedPipe | None
) -> None:
    """The child's body: run ``work`` and send ``("ok", result)``; nothing when it fails."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    if feed is not None:
        feed.child_side()
    pending = 0
    sent_at = time.monotonic()

    def send_count() -> None:
        nonlocal pending, sent_at
        count.value += pending
        pending = 0
        sent_at = time.monotonic()
        if os.getppid() != parent:  # the parent is gone: nobody waits for the result
            os._exit(1)

    def on_finish(n: int) -> None:
        nonlocal pending
        pending += n
        if time.monotonic() - sent_at >= SEND_EVERY_S:
            send_count()

    def on_stage(k: int) -> None:
        send_count()
        stage.value = k

    code = 0
    try:
        result = work(on_finish, on_stage)
        send_count()
        stage.value = -1
        send.send(("ok", result))
    except BaseException:  # no result: the parent runs the work itself
        code = 1
    finally:
        os._exit(code)


class FeedPipe:
    """Messages (bytes) this process hands a ``SideRun``'s child while both work: ``send``
    here (``close`` ends them), ``received`` there. A thread of the child reads them as they
    come, so the sender never waits on a child busy with other work."""

    def __init__(self) -> None:
        self._recv, self._send = mp.get_context("fork").Pipe(duplex=False)
        self._queue: SimpleQueue[bytes | None] = SimpleQueue()
        self.broken = False  # the child is gone: what is sent goes nowhere
        self.ended = False  # (in the child) every message is received

    def send(self, data: bytes) -> None:
        """One message (not empty) to the child; nothing once the child is gone."""
        if not self.broken:
            try:
                self._send.send_bytes(data)
            except OSError:  # the child ended: the caller learns it from SideRun.result
                self.broken = True

    def close(self) -> None:
        """The end of the messages."""
        self.send(b"")
        self._send.close()

    def received(self, wait: bool) -> list[bytes]:
        """(In the child) the messages come since the last call; ``wait``: at least one,
        unless they have ended (``ended``: the end came, or the sender is gone)."""
        queue = self._queue
        got: list[bytes] = []
        while not self.ended:
            if got or not wait:
                try:
                    data = queue.get_nowait()
                except Empty:
                    break
            else:
                data = queue.get()
            if data is None:
                self.ended = True
            else:
                got.append(data)
        return got

    def parent_side(self) -> None:
        """The child started: this process keeps the sending end alone."""
        self._recv.close()

    def child_side(self) -> None:
        """The child's first step: keep the receiving end alone (so the sender's end closes
        when this process's parent is gone) and start reading."""
        self._send.close()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        queue = self._queue
        try:
            while data := self._recv.recv_bytes():
                queue.put(data)
        except (EOFError, OSError):
            pass
        queue.put(None)


def skip_first(update: Callable[[int], None] | None, skip: int) -> Callable[[int], None] | None:
    """``update``, less the first ``skip`` counted (counted once already: by the child, when
    the caller runs its work again)."""
    if update is None or not skip:
        return update
    left = skip

    def on_finish(n: int) -> None:
        nonlocal left
        if left:
            taken = min(left, n)
            left -= taken
            n -= taken
        if n:
            update(n)

    return on_finish
