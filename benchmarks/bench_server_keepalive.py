"""Lost requests at many concurrent clients on keep-alive connections, against a running ``eprt serve``.

    eprt serve --port 8123 &            # the built-in model
    PYTHONPATH=$PWD python benchmarks/bench_server_keepalive.py --url http://127.0.0.1:8123 \
        [--runs 3] [--requests 400] [--clients 200] [--max-tokens 4] [--client httpx|aiohttp] [--shared-pool]

Each run sends ``--requests`` non-stream completions from ``--clients`` concurrent clients, each
with its own connection pool (``--shared-pool``: one for all, as one application's client);
a client waits a random ``--think-min`` to ``--think`` seconds before each request, so its
connection has sat idle that long, and the runs are ``--think`` seconds apart. The default
4.5 - 5.5 s straddles uvicorn's default idle timeout of 5 s (eprt's before it was raised) and
httpx's pool's. ``--pool-idle`` is how long a pool keeps an idle connection (httpx's default is
5 s, aiohttp's 15 s; urllib3 and Go keep them longer). A request fails when it gets no answer
(a reset, a drop) or a status other than 200; each failure is counted as on a new or a reused
connection (the client's trace hooks say whether the request opened one). ``--no-keep-alive``
sends ``Connection: close`` instead. Exit status 1 if any request failed. aiohttp is not an eprt
dependency (``pip install aiohttp``).

Measured here (2 shared cores, 3 x 400 requests at 200 clients, defaults otherwise): eprt as it
was (5 s idle timeout) lost 2 of 1,200 with httpx and 2 of 1,200 with aiohttp, all on reused
connections (ReadError / "Connection reset by peer" / "Server disconnected"), 0 of 400 with
``--no-keep-alive``; with the 120 s idle timeout, 0 of 1,200 with each client, and 0 of 1,200
with ``--shared-pool`` for each. The other half of the fix alone (the 5 s timeout kept, but no
idle connection closed with a request's bytes unread) still lost 2 and 8 of 1,200: mostly the
request is on its way when the server closes, so only a server that outwaits the pool helps.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from collections import Counter


class HttpxPool:
    """httpx.AsyncClient; httpcore's trace tells a request that opened a connection."""

    def __init__(self, args):
        import httpx

        self.errors = (httpx.HTTPError,)
        limits = httpx.Limits(
            max_connections=args.clients, max_keepalive_connections=args.clients, keepalive_expiry=args.pool_idle
        )
        self.client = httpx.AsyncClient(base_url=args.url, limits=limits, timeout=args.timeout)

    async def post(self, path: str, body: dict, headers: dict, seen: dict) -> tuple[int, str]:
        async def trace(event: str, info: dict) -> None:
            if event == "connection.connect_tcp.started":
                seen["opened"] = True

        r = await self.client.post(path, json=body, headers=headers, extensions={"trace": trace})
        return r.status_code, r.text

    async def close(self) -> None:
        await self.client.aclose()


class AiohttpPool:
    """aiohttp.ClientSession; its TraceConfig tells a request that opened a connection."""

    def __init__(self, args):
        import aiohttp

        self.errors = (aiohttp.ClientError, asyncio.TimeoutError)
        self.url = args.url
        trace = aiohttp.TraceConfig()
        trace.on_connection_create_start.append(self._opened)
        connector = aiohttp.TCPConnector(limit=args.clients, keepalive_timeout=args.pool_idle)
        self.session = aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=args.timeout), trace_configs=[trace]
        )

    @staticmethod
    async def _opened(session, ctx, params) -> None:
        ctx.trace_request_ctx["opened"] = True

    async def post(self, path: str, body: dict, headers: dict, seen: dict) -> tuple[int, str]:
        async with self.session.post(self.url + path, json=body, headers=headers, trace_request_ctx=seen) as r:
            return r.status, await r.text()

    async def close(self) -> None:
        await self.session.close()


async def one(pool, i: int, args, failures: Counter, latencies: list, opens: list) -> None:
    headers = {} if args.keep_alive else {"Connection": "close"}
    body = {"prompt": f"request {i}: the capital of France is", "max_tokens": args.max_tokens}
    t0 = time.perf_counter()
    seen: dict = {}  # "opened": the request opened a connection (else it reused one)
    try:
        status, text = await pool.post("/v1/completions", body, headers, seen)
        outcome = None if status == 200 else f"HTTP {status}: {text[:120]}"
    except pool.errors as e:
        outcome = f"{type(e).__name__}: {e}"
    latencies.append(time.perf_counter() - t0)
    opens.append(seen.get("opened", False))
    if outcome is not None:
        failures[("new" if seen.get("opened") else "reused", outcome)] += 1


async def run(pools: list, args, failures: Counter) -> tuple[list, int]:
    queue = list(range(args.requests))
    latencies: list = []
    opens: list = []

    async def client(pool) -> None:
        while queue:
            i = queue.pop()
            await asyncio.sleep(random.uniform(args.think_min, args.think))
            await one(pool, i, args, failures, latencies, opens)

    await asyncio.gather(*(client(pools[k % len(pools)]) for k in range(args.clients)))
    return latencies, sum(opens)


async def main_async(args) -> int:
    random.seed(args.seed)
    kind = {"httpx": HttpxPool, "aiohttp": AiohttpPool}[args.client]
    pools = [kind(args) for _ in range(1 if args.shared_pool else args.clients)]
    shape = f"{args.client}, {'one pool' if args.shared_pool else 'a pool each'}, pool idle {args.pool_idle:g} s"
    shape += f", keep-alive {'on' if args.keep_alive else 'off'}"
    total: Counter = Counter()
    try:
        for k in range(args.runs):
            if k:
                await asyncio.sleep(args.think)  # the pool's connections idle between runs too
            failures: Counter = Counter()
            t0 = time.perf_counter()
            lat, opened = await run(pools, args, failures)
            lat.sort()
            print(
                f"run {k + 1}: {args.requests} requests, {args.clients} clients ({shape}): "
                f"{sum(failures.values())} failed, {opened} opened a connection, {time.perf_counter() - t0:.1f} s, "
                f"latency p50 {statistics.median(lat):.3f} s max {lat[-1]:.2f} s",
                flush=True,
            )
            for (where, what), n in sorted(failures.items()):
                print(f"    {n} x on a {where} connection: {what}")
            total += failures
    finally:
        for pool in pools:
            await pool.close()
    print(f"total: {sum(total.values())} failed of {args.runs * args.requests}")
    return 1 if total else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--clients", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--client", choices=("httpx", "aiohttp"), default="httpx")
    p.add_argument("--think", type=float, default=5.5, help="a client waits up to this many seconds before a request")
    p.add_argument("--think-min", type=float, default=4.5, help="... and at least this long")
    p.add_argument("--pool-idle", type=float, default=15.0, help="the pool closes connections idle this long")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shared-pool", action="store_true", help="one connection pool for all the clients")
    p.add_argument("--no-keep-alive", dest="keep_alive", action="store_false")
    return asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
