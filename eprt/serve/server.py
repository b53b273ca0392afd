"""The OpenAI-compatible HTTP server on rank 0 (uvicorn on its own thread, the engine loop on the
main thread); SIGINT/SIGTERM drain and exit 0, an engine failure ends every request with an error
naming the failed rank and exits non-zero (docs/serving.md). The command, ``eprt serve``, is
``eprt/entry/serve.py``.
"""

from __future__ import annotations

import ipaddress
import logging
import sys

from eprt.api import EXIT_BAD_INPUT
from eprt.serve.loop import EngineLoop, RankLost
from eprt.serve.settings import HttpSettings

log = logging.getLogger("eprt.serve")

SHUTDOWN_GRACE_S = 10.0  # how long finished requests get to write their answers at shutdown
EXIT_ENGINE_FAILED = 3  # rank 0's exit status when the engine failed


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def serve(engine, host: str, port: int, settings: HttpSettings | None = None, stall_s: float = 30.0) -> int:
    """Serve ``engine`` over HTTP until SIGINT/SIGTERM (0) or an engine failure (non-zero);
    the calling thread runs the engine loop."""
    from eprt.serve.http import HttpServer, ServerState  # the web stack, once there is something to serve

    settings = settings or HttpSettings()
    loop = EngineLoop(engine, stall_s)
    try:
        state = ServerState(engine, loop, settings)
    except ValueError as e:  # a reasoning or tool-call parser this model cannot have
        print(f"eprt serve: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        http = HttpServer(state, host, port)
    except OSError as e:
        print(f"eprt serve: cannot listen on {host}:{port}: {e.strerror or e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if settings.api_key is None and not _is_loopback(host):
        log.warning("listening on %s without --api-key: anyone who can reach this port can use it", host)
    http.start()
    transport = getattr(engine, "transport", None)
    if transport is not None:
        transport.watchdog_raises = True  # a hung rank fails the requests (answered) instead of aborting
    print(
        f"eprt serve: {state.model_name} on http://{host}:{http.port}/v1 (SIGINT/SIGTERM to stop)",
        file=sys.stderr,
        flush=True,
    )
    failure = None
    try:
        loop.run()
    except Exception as e:  # the engine failed: loop.run has failed every request
        failure = e
    finally:
        loop.stop.set()
        if not state.wait_idle(SHUTDOWN_GRACE_S):
            log.warning("some answers were still being written after %.0fs; closing anyway", SHUTDOWN_GRACE_S)
        if failure is None or not _aborts(engine):
            http.stop()  # (an aborting job answers 503, /health too, until it is gone)
    if failure is not None:
        return _engine_failed(engine, failure)
    print("eprt serve: stopped", file=sys.stderr, flush=True)
    return 0


def _failed_rank(failure: BaseException) -> str:
    """Which rank failed and why, as one line."""
    if getattr(failure, "rank", None) is not None or isinstance(failure, RankLost):
        return str(failure)  # "rank K failed: ..." (WorkerFailed), "rank K died (...)"
    return f"rank 0 failed: {type(failure).__name__}: {failure}"


def _aborts(engine) -> bool:
    """Whether an engine failure ends the job with an MPI abort (more than one rank)."""
    transport = getattr(engine, "transport", None)
    return transport is not None and transport.size > 1


def _engine_failed(engine, failure: BaseException) -> int:
    """Every client has had its error; name the failed rank and end the whole job."""
    message = f"eprt serve: {_failed_rank(failure)}; every request in flight was answered with an error; exiting"
    if _aborts(engine):
        engine.transport.abort(message)  # prints it; a dead or stopped rank cannot finalize MPI: end the job
    print(message, file=sys.stderr, flush=True)
    return EXIT_ENGINE_FAILED
