"""``eprt serve``: an OpenAI-compatible HTTP server on rank 0.

    mpiexec -n 4 eprt serve --model DIR [--host 127.0.0.1] [--port 8000] [--api-key KEY]  (or EPRT_API_KEY)

Every rank loads its shard; the worker ranks then follow rank 0's broadcasts, and only
rank 0 gets past ``launch_engine``. There the HTTP server runs on its own threads
(``eprt.serve.http``) while the main thread runs the engine's scheduler loop (MPI stays
on the main thread). SIGINT/SIGTERM stop taking requests, finish the ones in flight,
then shut the worker ranks down; see docs/serving.md.
"""
from __future__ import annotations

import ipaddress
import logging
import sys
import threading

from eprt import env
from eprt.serve.http import OpenAIServer
from eprt.serve.loop import EngineLoop

log = logging.getLogger("eprt.serve")

SHUTDOWN_GRACE_S = 10.0    # how long finished requests get to write their answers at shutdown


def add_arguments(parser) -> None:
    from eprt.engine.engine import add_engine_arguments

    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default: loopback only; 0.0.0.0 for every interface)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 picks a free one)")
    parser.add_argument("--api-key", metavar="KEY", default=None,
                        help="require 'Authorization: Bearer KEY' on the /v1/ routes")
    add_engine_arguments(parser)


def main(args) -> int:
    from eprt.engine.engine import launch_engine

    with launch_engine(args) as engine:     # worker ranks never get past this line
        return serve(engine, args.host, args.port, args.api_key or env.API_KEY.get() or None)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def serve(engine, host: str, port: int, api_key: str | None = None) -> int:
    """Serve ``engine`` over HTTP until SIGINT/SIGTERM; the calling thread runs the engine loop."""
    loop = EngineLoop(engine)
    try:
        httpd = OpenAIServer((host, port), engine, loop, api_key)
    except OSError as e:
        print(f"eprt serve: cannot listen on {host}:{port}: {e.strerror or e}", file=sys.stderr)
        return 2
    if api_key is None and not _is_loopback(host):
        log.warning("listening on %s without --api-key: anyone who can reach this port can use it", host)
    http_thread = threading.Thread(target=httpd.serve_forever, name="eprt-http", daemon=True)
    http_thread.start()
    print(f"eprt serve: {engine.model_name} on http://{host}:{httpd.server_port}/v1 "
          f"(SIGINT/SIGTERM to stop)", file=sys.stderr, flush=True)
    try:
        loop.run()
    finally:
        loop.stop.set()
        if not httpd.wait_idle(SHUTDOWN_GRACE_S):
            log.warning("some answers were still being written after %.0fs; closing anyway", SHUTDOWN_GRACE_S)
        httpd.shutdown()
        httpd.server_close()
        http_thread.join()
    print("eprt serve: stopped", file=sys.stderr, flush=True)
    return 0
