"""Latency of normal requests to ``eprt serve`` with and without N slow-loris sockets.

    PYTHONPATH=$PWD python benchmarks/bench_server_slowloris.py [--sockets 50] [--timeout 2] [--requests 40]

Runs the real HTTP stack (eprt.serve.http) on the fake engine of tests/fake_engine.py, so
what is measured is the server, not the model. Prints the p50/p95/max latency of sequential
non-stream completions, first alone, then while N sockets send their headers a byte every
50 ms, and how long after connecting the server closed each slow socket.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import threading
import time

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from fake_engine import FakeEngine  # noqa: E402
from test_server import running_server  # noqa: E402


def latencies(url: str, n: int) -> list:
    out = []
    with httpx.Client(base_url=url, timeout=30) as c:
        for i in range(n):
            t0 = time.perf_counter()
            r = c.post("/v1/completions", json={"prompt": f"hello {i}", "max_tokens": 8})
            out.append(time.perf_counter() - t0)
            assert r.status_code == 200, r.text
    return out


def loris(url: str, closed_after: list, stop: threading.Event) -> None:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as s:
        t0 = time.monotonic()
        try:
            for byte in b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100_000:
                if stop.is_set():
                    return
                s.sendall(bytes([byte]))
                time.sleep(0.05)
        except OSError:
            closed_after.append(time.monotonic() - t0)


def show(name: str, xs: list) -> None:
    xs = sorted(xs)
    print(
        f"{name:<28} p50 {1e3 * statistics.median(xs):7.2f} ms   p95 {1e3 * xs[int(0.95 * (len(xs) - 1))]:7.2f} ms"
        f"   max {1e3 * xs[-1]:7.2f} ms   (n={len(xs)})"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sockets", type=int, default=50)
    ap.add_argument("--timeout", type=float, default=2.0, help="--http-timeout of the server")
    ap.add_argument("--requests", type=int, default=40)
    a = ap.parse_args()
    with running_server(FakeEngine(token_delay=0.001), http_timeout_s=a.timeout) as url:
        latencies(url, 5)  # warm-up
        show("alone", latencies(url, a.requests))
        closed, stop = [], threading.Event()
        threads = [threading.Thread(target=loris, args=(url, closed, stop), daemon=True) for _ in range(a.sockets)]
        for t in threads:
            t.start()
        show(f"with {a.sockets} slow-loris sockets", latencies(url, a.requests))
        for t in threads:
            t.join(a.timeout + 10)
        stop.set()
    print(
        f"slow sockets closed by the server: {len(closed)} of {a.sockets}; after "
        f"{min(closed, default=0):.2f}-{max(closed, default=0):.2f} s (http timeout {a.timeout:g} s)"
    )


if __name__ == "__main__":
    main()
