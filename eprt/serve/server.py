"""``eprt serve``: an OpenAI-compatible HTTP server on rank 0 (uvicorn on its own thread, the
engine loop on the main thread); SIGINT/SIGTERM drain and exit 0, an engine failure ends
every request with an error naming the failed rank and exits non-zero (docs/serving.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import ipaddress
import logging
import sys

from eprt import env
from eprt.api import EXIT_BAD_INPUT
from eprt.serve import reasoning, tool_calls
from eprt.serve.adapters import check_adapters_dir
from eprt.serve.body import DEFAULT_MAX_BODY_BYTES
from eprt.serve.loop import EngineLoop, RankLost
from eprt.serve.media import MediaPolicy
from eprt.serve.params import DEFAULT_CHAT_MAX_TOKENS
from eprt.serve.settings import KEEP_ALIVE_S, HttpSettings, check_api_key
from eprt.serve.tool_calls import ToolSettings

log = logging.getLogger("eprt.serve")

SHUTDOWN_GRACE_S = 10.0  # how long finished requests get to write their answers at shutdown
EXIT_ENGINE_FAILED = 3  # rank 0's exit status when the engine failed
HEALTH_STALL_S = 10.0  # /health turns 503 when pending work makes no step for this long


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(f"must be > 0, got {text}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is an integer in [0, 65535], got {text!r}")
    return value


def add_arguments(parser) -> None:
    from eprt.engine.engine import add_engine_arguments

    parser.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: loopback only; 0.0.0.0 for every interface)"
    )
    parser.add_argument("--port", type=_port, default=8000, help="TCP port (default 8000; 0 picks a free one)")
    parser.add_argument(
        "--api-key",
        metavar="KEY",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but /health "
        "(default: EPRT_API_KEY; an empty or blank key, from either, is an error)",
    )
    parser.add_argument(
        "--served-model-name",
        metavar="NAME",
        default=None,
        help="the model name clients send and see (default: the checkpoint's)",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help=f"larger request bodies get 413 before being read (default {DEFAULT_MAX_BODY_BYTES})",
    )
    parser.add_argument(
        "--http-timeout",
        type=_positive,
        default=30.0,
        metavar="S",
        help="a request's headers, then its body, must arrive within S seconds, else the "
        "connection is closed (slow clients); default 30",
    )
    parser.add_argument(
        "--keep-alive-timeout",
        type=_positive,
        default=KEEP_ALIVE_S,
        metavar="S",
        help=f"close a keep-alive connection idle for S seconds (default {KEEP_ALIVE_S:g}: longer than "
        "clients' pools keep idle connections, so that a client never sends on one the server is closing)",
    )
    parser.add_argument(
        "--health-stall-timeout",
        type=_positive,
        default=None,
        metavar="S",
        help="/health answers 503 when work is pending and no scheduler step completed for "
        f"S seconds (default {HEALTH_STALL_S:g}, at most EPRT_COLLECTIVE_TIMEOUT): a rank may "
        "be stopped or dead; the watchdog ends the job at EPRT_COLLECTIVE_TIMEOUT",
    )
    _add_request_arguments(parser)
    add_engine_arguments(parser)


def _add_request_arguments(parser) -> None:
    """The flags about what requests may ask for."""
    parser.add_argument(
        "--default-max-tokens",
        type=int,
        default=DEFAULT_CHAT_MAX_TOKENS,
        metavar="N",
        help=f"max_tokens of a chat request that sets none (default {DEFAULT_CHAT_MAX_TOKENS}; 0: the rest of the "
        "context, vLLM's default); completions keep OpenAI's 16",
    )
    parser.add_argument(
        "--allowed-local-media-path",
        metavar="DIR",
        default=None,
        help="chat image parts may name file:// images under DIR (default: data: URLs only; http(s) never)",
    )
    parser.add_argument(
        "--lora-modules-dir",
        metavar="DIR",
        default=None,
        help="/v1/load_lora_adapter may load adapters under DIR (regular files, symlinks resolved "
        "inside it; default: no adapter loading at run time)",
    )
    reasoning.add_arguments(parser)
    tool_calls.add_arguments(parser)


WEB_STACK = ("fastapi", "uvicorn", "pydantic", "prometheus_client", "jinja2")  # install_requires (setup.cfg)


def _spec(name: str):
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):  # a broken install, or a module blocked in sys.modules
        return None


def check_web_stack() -> None:
    """ValueError with the one-line install hint when a package of the HTTP server is missing
    (they install with eprt; a trimmed environment may lack them)."""
    missing = [name for name in WEB_STACK if _spec(name) is None]
    if missing:
        raise ValueError(f"the HTTP server needs {', '.join(missing)}: pip install 'eprt[serve]'")


def main(args) -> int:
    from eprt.engine.engine import launch_engine

    try:  # every rank checks: all leave together, before loading
        check_web_stack()
        settings = _settings(args)
    except ValueError as e:
        print(f"eprt serve: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    stall_s = args.health_stall_timeout or min(HEALTH_STALL_S, env.COLLECTIVE_TIMEOUT.get())
    with launch_engine(args) as engine:  # worker ranks never get past this line
        return serve(engine, args.host, args.port, settings, stall_s)


def _settings(args) -> HttpSettings:
    """The HTTP settings of the command line; ValueError naming what is wrong."""
    if args.api_key is not None:
        api_key = check_api_key(args.api_key, "--api-key")
    else:  # set but empty is refused, not taken as unset
        api_key = check_api_key(env.API_KEY.raw(), env.API_KEY.name)
    if args.max_body_bytes < 1024:
        raise ValueError(f"--max-body-bytes must be >= 1024, got {args.max_body_bytes}")
    if args.default_max_tokens < 0:
        raise ValueError(
            f"--default-max-tokens must be >= 0 (0: the rest of the context), got {args.default_max_tokens}"
        )
    return HttpSettings(
        api_key=api_key,
        served_model_name=args.served_model_name,
        max_body_bytes=args.max_body_bytes,
        http_timeout_s=args.http_timeout,
        keep_alive_s=args.keep_alive_timeout,
        media=MediaPolicy(args.allowed_local_media_path),
        lora_dir=check_adapters_dir(args.lora_modules_dir),
        chat_max_tokens=args.default_max_tokens,
        reasoning_parser=_reasoning_name(args.reasoning_parser),
        tools=ToolSettings(args.enable_auto_tool_choice, args.tool_call_parser),
    )


def _reasoning_name(name: str) -> str:
    reasoning.check_name(name)
    return name


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
