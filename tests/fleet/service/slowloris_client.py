"""A slowloris from many addresses, as a process of its own: from each of ``--addresses``
loopback addresses (127.0.0.<first> onwards, each socket bound to its address) it holds
``--per-address`` partial requests to the service and opens a new one for each the service
answers or closes:

    python -m tests.fleet.service.slowloris_client --port 8123 --addresses 59 --per-address 17

Half the requests stop inside the head (a request line and one header, then a header byte every
few seconds, as a slowloris trickles), half send a whole head and 1 byte of a 50-byte body. Every
``--report`` seconds it prints one line, ``held H opened O answered A failed F``: connections
held now, opened since the start, answered or closed by the service, and connects that failed
(refused, or not accepted in time). It runs until ``--seconds`` have passed or SIGTERM, and ends
with a ``total`` line of the same counts and the connections opened per second.
"""

from __future__ import annotations

import argparse
import errno
import selectors
import signal
import socket
import time
from dataclasses import dataclass

HEAD_LINE = b"POST /v1/route HTTP/1.1\r\nHost: x\r\n"
FULL_HEAD = HEAD_LINE + b"Content-Type: application/json\r\nContent-Length: 50\r\n\r\n{"
TRICKLE_S = 3.0  # a partial head gets one more header byte this often
CONNECT_S = 2.0  # a connect not accepted by then counts as failed


@dataclass
class Held:
    """One connection: its address, whether it sends a whole head, when it connected."""

    source: str
    full_head: bool
    since: float
    connected: bool = False
    trickled: float = 0.0


class Slowloris:
    def __init__(self, port: int, sources: list[str], per_source: int) -> None:
        self.port = port
        self.sources = sources
        self.per_source = per_source
        self.selector = selectors.DefaultSelector()
        self.held: dict[socket.socket, Held] = {}
        self.opened = self.answered = self.failed = 0
        self._k = 0

    def open(self, source: str) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.bind((source, 0))
            err = sock.connect_ex(("127.0.0.1", self.port))
        except OSError:
            sock.close()
            self.failed += 1
            return
        if err not in (0, errno.EINPROGRESS):
            sock.close()
            self.failed += 1
            return
        self._k += 1
        self.held[sock] = Held(source, self._k % 2 == 0, time.monotonic())
        self.selector.register(sock, selectors.EVENT_WRITE)
        self.opened += 1

    def drop(self, sock: socket.socket) -> None:
        self.selector.unregister(sock)
        del self.held[sock]
        sock.close()

    def fill(self) -> None:
        """Open connections until every address holds its share again."""
        count = dict.fromkeys(self.sources, 0)
        for held in self.held.values():
            count[held.source] += 1
        for source, n in count.items():
            for _ in range(self.per_source - n):
                self.open(source)

    def step(self, timeout: float) -> None:
        now = time.monotonic()
        for key, mask in self.selector.select(timeout):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            held = self.held[sock]
            if not held.connected and mask & selectors.EVENT_WRITE:
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) != 0:
                    self.failed += 1
                    self.opened -= 1
                    self.drop(sock)
                    continue
                held.connected, held.trickled = True, now
                try:
                    sock.send(FULL_HEAD if held.full_head else HEAD_LINE)
                except OSError:
                    self.answered += 1
                    self.drop(sock)
                    continue
                self.selector.modify(sock, selectors.EVENT_READ)
            elif mask & selectors.EVENT_READ:  # an answer (429, 503, 408) or a close
                self.answered += 1
                self.drop(sock)
        for sock, held in list(self.held.items()):
            if not held.connected and now - held.since > CONNECT_S:
                self.failed += 1
                self.opened -= 1
                self.drop(sock)
            elif held.connected and not held.full_head and now - held.trickled > TRICKLE_S:
                held.trickled = now
                try:
                    sock.send(b"X")  # one byte of one more header line
                except OSError:
                    self.answered += 1
                    self.drop(sock)

    def counts(self) -> str:
        held = sum(h.connected for h in self.held.values())
        return f"held {held} opened {self.opened} answered {self.answered} failed {self.failed}"

    def close(self) -> None:
        for sock in list(self.held):
            self.drop(sock)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--addresses", type=int, default=59)
    parser.add_argument("--first", type=int, default=10, help="127.0.0.<first> is the first")
    parser.add_argument("--per-address", type=int, default=17)
    parser.add_argument("--seconds", type=float, default=3600.0)
    parser.add_argument("--report", type=float, default=0.5)
    args = parser.parse_args()
    sources = [f"127.0.0.{args.first + k}" for k in range(args.addresses)]
    attack = Slowloris(args.port, sources, args.per_address)
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    start = last = time.monotonic()
    try:
        while not stopping and time.monotonic() - start < args.seconds:
            attack.fill()
            attack.step(0.02)
            if time.monotonic() - last >= args.report:
                last = time.monotonic()
                print(attack.counts(), flush=True)
    finally:
        seconds = time.monotonic() - start
        print(f"total {attack.counts()} seconds {seconds:.1f} per_s {attack.opened / seconds:.0f}")
        attack.close()


if __name__ == "__main__":
    main()
