"""The links: one TCP connection between rank 0 and each worker, opened when the transport is,
that carries one byte each way and nothing else: rank 0's ACK, and a goodbye (BYE) from a side
that closes in order (SHUTDOWN, a going-down notice, an exit, an abort). The kernel closes a
process's sockets when it dies, SIGKILL included, so a link that closes without a goodbye names
a dead peer within a millisecond, whatever the launcher does next (docs/design.md, "Failure
handling"). A node that vanishes without closing anything is left to the collective watchdog.
No MPI here: a thread waits on the sockets.
"""

from __future__ import annotations

import os
import secrets
import selectors
import socket
import sys
import threading
import time
from collections.abc import Callable

ACK, BYE = b"A", b"B"
CONNECT_TIMEOUT_S = 5.0  # a worker's connect to each of rank 0's addresses
ACCEPT_TIMEOUT_S = 60.0  # rank 0 accepts the workers' links for this long after the address exchange
DIED = "its process died without closing its link (killed by a signal, or crashed)"


class NoLinks:
    """Before the links are up, or a world of one: no peer can be lost."""

    lost: list = []

    def close(self) -> None:
        pass


class Links:
    """This rank's links: rank 0 holds one to every worker, a worker one to rank 0.

    ``exchange(text)`` is the transport's start-up all-gather (every rank's text, in rank
    order, on every rank): rank 0 tells the workers where to connect, the workers tell rank 0
    whether they could, and rank 0 accepts them all before the constructor returns. ``lost``: the
    peers whose link closed without a goodbye, in the order seen; each is said on stderr and
    passed to ``on_lost`` on the watcher thread. ``close`` says goodbye on every link and ends
    the watch (nothing is lost after it)."""

    def __init__(self, rank: int, size: int, exchange: Callable[[str], list], on_lost: Callable | None = None):
        self.rank, self.size = rank, size
        self.lost: list[int] = []
        self._on_lost = on_lost
        self._links: dict[socket.socket, int] = {}  # live link -> peer rank
        self._acked = rank == 0  # a worker's link counts once rank 0 accepted it
        self._closing = False
        self._wake_r, self._wake_w = os.pipe()
        listener, token, text = _listen(size) if rank == 0 else (None, "", "")
        address = exchange(text)[0]
        results = exchange("" if rank == 0 else self._connect(address))
        if rank == 0:
            self._accept(listener, token, {k for k in range(1, size) if not results[k]})
            for k in range(1, size):
                if results[k]:
                    self._say(f"no link to rank {k} ({results[k]}): its death is found only by the collective watchdog")
        self._thread = threading.Thread(target=self._watch, name="eprt-links", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Say goodbye on every link and stop watching (idempotent). The watcher stops only when
        woken here, after every goodbye is sent: were it to stop on seeing ``_closing`` (woken by a
        peer's own goodbye meanwhile), it would close links this thread has not said goodbye on
        yet, and those peers would report this rank dead."""
        if self._closing:
            return
        self._closing = True  # from here a closed link is no death
        for sock in list(self._links):
            try:
                sock.send(BYE)
            except OSError:  # closed by the watcher meanwhile
                pass
        os.write(self._wake_w, b"x")  # (the watcher reads nothing more, and closes every link)
        os.close(self._wake_w)

    # -- set-up ----------------------------------------------------------------------------------
    def _connect(self, address: str) -> str:
        """A worker: connect to rank 0 and say who this is; the error text, or "" when linked."""
        token, port, host, *addresses = address.split()
        errors = []
        for where in ["127.0.0.1"] if host == socket.gethostname() else [host, *addresses]:
            try:
                sock = socket.create_connection((where, int(port)), timeout=CONNECT_TIMEOUT_S)
                sock.sendall(f"{token} {self.rank}\n".encode())
                sock.settimeout(None)
                self._links[sock] = 0
                return ""
            except OSError as e:
                errors.append(f"{where}:{port}: {e}")
        return "; ".join(errors)[:400]

    def _accept(self, listener: socket.socket, token: str, expected: set) -> None:
        """Rank 0: accept the links of the ``expected`` ranks (they are in the listen backlog
        already); a stranger (wrong token, a rank taken) is dropped."""
        deadline = time.monotonic() + ACCEPT_TIMEOUT_S
        try:
            while expected and time.monotonic() < deadline:
                listener.settimeout(max(0.01, deadline - time.monotonic()))
                sock, _ = listener.accept()
                sock.settimeout(CONNECT_TIMEOUT_S)
                line = sock.makefile("rb").readline(64).decode("ascii", "replace").split()
                peer = int(line[1]) if len(line) == 2 and line[0] == token and line[1].isdigit() else -1
                if peer not in expected:
                    sock.close()
                    continue
                sock.settimeout(None)
                sock.sendall(ACK)
                self._links[sock] = peer
                expected.discard(peer)
        except OSError:  # the deadline
            pass
        listener.close()
        for k in sorted(expected):
            self._say(f"rank {k} connected but did not say so in time: its death is found only by the watchdog")

    # -- the watcher thread ----------------------------------------------------------------------
    def _watch(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        for sock, peer in self._links.items():
            sel.register(sock, selectors.EVENT_READ, peer)
        woken = False
        while not woken:
            for key, _ in sel.select():
                if key.data == "wake":
                    woken = True
                else:
                    self._readable(key.fileobj, key.data, sel)
        for sock in list(self._links):
            sock.close()
        sel.close()
        os.close(self._wake_r)

    def _readable(self, sock: socket.socket, peer: int, sel) -> None:
        data = _recv(sock)
        if data and BYE not in data:
            self._acked = self._acked or ACK in data
            return
        sel.unregister(sock)
        del self._links[sock]
        sock.close()
        if data or self._closing:
            return  # a goodbye: the peer closes in order
        if not self._acked:
            self._say("rank 0 did not accept this rank's link: its death is found only by the collective watchdog")
            return
        self.lost.append(peer)
        self._say(f"rank {peer} died: {DIED}")
        if self._on_lost is not None:
            self._on_lost(peer)

    def _say(self, text: str) -> None:
        sys.stderr.write(f"eprt: rank {self.rank}: {text}\n")  # one write: other threads print too
        sys.stderr.flush()


def _listen(size: int) -> tuple[socket.socket, str, str]:
    """Rank 0's listening socket, its token and the text the workers connect by:
    "TOKEN PORT HOST ADDRESS..." (every address of HOST but loopback)."""
    if socket.has_dualstack_ipv6():
        listener = socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True, backlog=size)
    else:
        listener = socket.create_server(("", 0), backlog=size)
    token, host = secrets.token_hex(8), socket.gethostname()
    try:
        found = {info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except OSError:
        found = set()
    addresses = sorted(a for a in found if not a.startswith(("127.", "::1")))
    text = " ".join([token, str(listener.getsockname()[1]), host, *addresses])
    return listener, token, text[:400].rsplit(" ", 1)[0] if len(text) > 400 else text


def _recv(sock: socket.socket) -> bytes:
    try:
        return sock.recv(64)
    except OSError:  # ECONNRESET: closed without a goodbye
        return b""
