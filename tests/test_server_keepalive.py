"""Keep-alive connections: the server's idle timeout outlasts clients' pools (and says so), and
an idle connection is never closed under a request that has arrived but is not read yet (what
reset 3 of 1,200 requests at 200 concurrent clients; benchmarks/bench_server_keepalive.py)."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
from fake_engine import FakeEngine

from eprt.serve.http import HttpServer, ServerState
from eprt.serve.loop import EngineLoop
from eprt.serve.settings import KEEP_ALIVE_S, HttpSettings

BODY = b'{"prompt": "ab", "max_tokens": 2}'
REQUEST = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY)


@contextmanager
def server(**settings):
    engine = FakeEngine()
    loop = EngineLoop(engine)
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    http = HttpServer(ServerState(engine, loop, HttpSettings(**settings)), "127.0.0.1", 0)
    http.start()
    try:
        yield http
    finally:
        loop.stop.set()
        thread.join(10)
        http.stop()


def _answer(sock: socket.socket) -> bytes:
    """One whole HTTP answer (headers and a Content-Length body), b"" if the connection ended first."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return b""
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    fields = dict(h.lower().partition(b": ")[::2] for h in head.split(b"\r\n")[1:])
    length = int(fields[b"content-length"])
    while len(body) < length:
        body += sock.recv(65536)
    return head


def test_the_idle_timeout_outlasts_client_pools_and_is_announced():
    assert KEEP_ALIVE_S > 90  # httpx 5 s, aiohttp 15 s, Go's net/http and hyper 90 s
    with server() as http, httpx.Client(base_url=f"http://127.0.0.1:{http.port}") as c:
        assert c.get("/health").headers["keep-alive"] == f"timeout={KEEP_ALIVE_S:g}"


def test_a_request_arriving_as_the_idle_timer_fires_is_answered():
    """The event loop, busy, runs the keep-alive timer in the same round as other callbacks; a
    request that arrives meanwhile is in the socket, unread, when the timer fires. Closing then
    resets it: here the round's callback before the timer blocks while the request arrives."""
    with server(keep_alive_s=1.0) as http, socket.create_connection(("127.0.0.1", http.port)) as sock:
        sock.settimeout(10)
        sock.sendall(REQUEST)
        assert _answer(sock).startswith(b"HTTP/1.1 200")
        (proto,) = http.server.server_state.connections
        while proto.timeout_keep_alive_task is None:  # armed just after the answer is written
            time.sleep(0.001)
        loop, due = proto.loop, proto.timeout_keep_alive_task.when()  # loop.time() is time.monotonic()
        if type(loop).__module__.split(".")[0] != "asyncio":
            pytest.skip(f"the timing below is asyncio's event loop's, not {type(loop).__module__}'s")

        def busy(seconds: float):
            return lambda: time.sleep(seconds)

        def schedule():
            loop.call_at(due - 0.3, busy(0.4))  # the loop is busy past the timer's time...
            loop.call_at(due - 0.05, busy(0.6))  # ...then this runs just before the timer, in its round

        loop.call_soon_threadsafe(schedule)
        time.sleep(max(0.0, due + 0.35 - time.monotonic()))
        sock.sendall(REQUEST)  # arrives while the second callback blocks the loop
        try:
            answer = _answer(sock)
        except ConnectionResetError:
            answer = b"reset"
        assert answer.startswith(b"HTTP/1.1 200"), answer
