"""The HTTP side of ``eprt serve``: a FastAPI app on uvicorn, in a thread beside the engine loop.

Routes: ``GET /health``, ``GET /metrics``, ``GET /openapi.json``, ``GET /v1/models``,
``GET /v1/models/{model}``, ``POST /v1/completions``, ``POST /v1/chat/completions``, the LoRA
adapter routes, vLLM's ``POST /tokenize``, ``POST /detokenize`` and ``GET /version``. Every
4xx/5xx has an OpenAI error body (an unexpected exception too: a JSON 500); with an API key,
every route but ``/health`` needs ``Authorization: Bearer <key>`` (checked before routing).
``GuardedH11Protocol`` closes connections whose request headers do not arrive in time
(uvicorn alone never does), and never closes an idle keep-alive connection whose next request
has arrived; bodies are read under a size limit and a deadline (body.py).
A generation request submits to the engine, then waits for tokens woken by the engine
thread; a client that leaves has its sequence cancelled. See docs/serving.md.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import select
import socket
import threading
import time

import h11
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.h11_impl import H11Protocol

from eprt import __version__
from eprt.api import ENGINE_FAILED, RequestError
from eprt.engine.adapters import UnknownAdapter
from eprt.engine.choices import ranked
from eprt.serve import adapters, chat_output, openai, schema, tokenize
from eprt.serve.body import ApiError, parse_json, read_body
from eprt.serve.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from eprt.serve.metrics import ServerMetrics
from eprt.serve.settings import HttpSettings
from eprt.serve.stream import LiveRequest

log = logging.getLogger("eprt.serve")

MAX_HEADER_BYTES = 64 << 10  # request line and headers; more is answered 431
_CLIENT_CHECK_S = 0.25  # how often a waiting non-stream request checks that its client is still there
GENERATION_ROUTES = {"/v1/completions": False, "/v1/chat/completions": True}  # path -> is chat
ADAPTER_ROUTES = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
MODEL_ROUTE = "/v1/models/{model}"  # the metrics' route label of every /v1/models/<id>
UTILITY_ROUTES = ("/tokenize", "/detokenize", "/version")  # vLLM's, outside /v1 as there
ROUTES = ("/health", "/metrics", "/openapi.json", "/v1/models", MODEL_ROUTE, *GENERATION_ROUTES, *ADAPTER_ROUTES)
ROUTES += UTILITY_ROUTES


def error_response(e: ApiError, headers: dict | None = None) -> JSONResponse:
    body = openai.error_body(str(e), e.kind, e.param, e.code)
    # The body may be unread (401, 404, 413): the connection cannot carry another request.
    headers = {"Connection": "close", **(headers or {})}
    if e.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(body, status_code=e.status, headers=headers)


def internal_error() -> JSONResponse:
    """The answer to an unexpected exception (logged with its traceback where it was caught)."""
    return error_response(ApiError(500, "internal server error (see the server log)", "server_error"))


def route_label(path: str) -> str:
    """The route of ``path`` for the metrics (one label for every model id; "other": no route)."""
    if path.startswith("/v1/models/"):
        return MODEL_ROUTE
    return path if path in ROUTES else "other"


def _raw_error(status: int, reason: str, message: str) -> bytes:
    """A whole HTTP/1.1 error answer, for the protocol level (before there is a request)."""
    body = json.dumps(openai.error_body(message, "invalid_request_error")).encode()
    return b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s" % (
        status,
        reason.encode(),
        len(body),
        body,
    )


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, plus a deadline for a request's headers: counted from the
    connection (or from the first byte after a keep-alive answer), so a slow-loris client
    sending a byte at a time is closed after ``header_timeout_s`` however often it sends.
    Malformed requests get a JSON error body instead of uvicorn's plain text."""

    header_timeout_s = 30.0  # set by HttpServer on a subclass

    def connection_made(self, transport) -> None:
        self._header_timer, self._protocol_error = None, None
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            # asyncio sets this only when the socket's proto is IPPROTO_TCP, and a socket from
            # socket.create_server has proto 0: without it a response written as two segments
            # waits ~40 ms for the client's delayed ACK (Nagle)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        super().connection_made(transport)
        self._arm_header_timer()
        next_event = self.conn.next_event

        def noted_next_event():  # keep h11's own words for send_400_response
            try:
                return next_event()
            except h11.RemoteProtocolError as e:
                self._protocol_error = e
                raise

        self.conn.next_event = noted_next_event

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and self.conn.their_state is h11.IDLE:
            self._arm_header_timer()  # the next request of a keep-alive connection begins
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._disarm_header_timer()  # its headers are in

    def connection_lost(self, exc) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def timeout_keep_alive_handler(self) -> None:
        """Close the idle connection, unless its next request has begun to arrive: the event loop,
        when busy, runs this timer after bytes came in but before reading them, and closing then
        resets the connection under the client's request."""
        if not self.transport.is_closing() and self._readable():
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )
            return  # data_received (or connection_lost at EOF) comes next and cancels that
        super().timeout_keep_alive_handler()

    def _readable(self) -> bool:
        sock = self.transport.get_extra_info("socket")
        if sock is None:
            return False
        poll = select.poll()
        poll.register(sock.fileno(), select.POLLIN)
        return bool(poll.poll(0))

    def send_400_response(self, msg: str) -> None:
        e = self._protocol_error
        status = getattr(e, "error_status_hint", 400) if e is not None else 400
        status = status if status in (400, 431, 501) else 400
        reason = {400: "Bad Request", 431: "Request Header Fields Too Large", 501: "Not Implemented"}[status]
        self.transport.write(_raw_error(status, reason, f"malformed HTTP request: {e or msg}"))
        self.transport.close()

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _disarm_header_timer(self) -> None:
        if getattr(self, "_header_timer", None) is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            if self.conn.their_state is h11.IDLE and self.conn.our_state is h11.IDLE:
                self.transport.write(
                    _raw_error(
                        408, "Request Timeout", f"the request headers did not arrive within {self.header_timeout_s:g}s"
                    )
                )
            self.transport.close()


class Waker:
    """Wakes one asyncio waiter from the engine thread; at most one wake-up in flight."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop, self._event, self._pending = loop, asyncio.Event(), False

    def __call__(self) -> None:  # on the engine thread
        if not self._pending:
            self._pending = True
            try:
                self._loop.call_soon_threadsafe(self._event.set)
            except RuntimeError:  # the HTTP loop is gone (shutdown)
                pass

    async def wait(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self._event.wait(), timeout)
        except TimeoutError:
            pass
        self._event.clear()
        self._pending = False  # cleared before the caller drains the queue


class ServerState:
    """What the routes share: the engine, its loop, the settings, the metrics."""

    def __init__(self, engine, loop, settings: HttpSettings):
        self.engine, self.loop, self.settings = engine, loop, settings
        self.model_name = settings.served_model_name or engine.model_name
        # the reasoning parser and tool settings, for this model (ValueError: start-up error)
        self.chat_features = chat_output.ChatFeatures.resolve(engine, settings.reasoning_parser, settings.tools)
        self.metrics = ServerMetrics(engine)
        self.created = int(time.time())
        self._busy = 0  # generation requests being answered
        self._idle = threading.Condition()

    def begin(self) -> None:
        with self._idle:
            self._busy += 1

    def end(self) -> None:
        with self._idle:
            self._busy -= 1
            self._idle.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no generation request is being answered; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._busy == 0, timeout)

    def check_accepting(self) -> None:
        if self.loop.failure is not None:
            raise ApiError(503, f"the engine failed: {self.loop.failure}", "server_error")
        if self.loop.stop.is_set() or self.loop.stopped.is_set():
            raise ApiError(503, "the server is shutting down", "server_error")


class Generation:
    """One submitted generation request: its tokens, its waker, and its end (``close``,
    idempotent: cancels the sequences still running, counts the request as answered). ``groups``:
    each prompt's choices (one prompt, unless a completion sent a list); ``lives``: all of them,
    choice k of prompt p at p * choices + k."""

    def __init__(self, state: ServerState, api: openai.ApiRequest, info: dict):
        self.state, self.api, self.info = state, api, info
        self.waker = Waker(asyncio.get_running_loop())
        self.groups: list = []
        state.begin()
        try:
            for request in api.requests:  # a prompt refused here ends the request: the others are cancelled
                self.groups.append(self._submit(request))
        except BaseException:
            for live in (live for group in self.groups for live in group):
                live.cancel()
            state.end()
            raise
        self.lives = [live for group in self.groups for live in group]
        self.live = self.lives[0]
        self._closed = False

    def _submit(self, request) -> list:
        engine, api = self.state.engine, self.api
        # output: a chat's reasoning and tool calls (api.output), or plain text
        kwargs = dict(notify=self.waker, include_stop=api.include_stop, output=api.output)
        if request.params.choices == 1:
            return [LiveRequest(engine, request, api.stop_strings, **kwargs)]
        return LiveRequest.choices(engine, request, api.stop_strings, **kwargs)  # several sharing one prefill

    def grouped(self, results: list) -> list:
        """A result per live (in ``lives``' order) -> a list of them per prompt."""
        sizes = [len(group) for group in self.groups]
        starts = [sum(sizes[:p]) for p in range(len(sizes))]
        return [results[start : start + size] for start, size in zip(starts, sizes)]

    def close(self, complete: bool) -> None:
        if self._closed:
            return
        self._closed = True
        for other in self.lives:
            if not other.handle.done():
                other.cancel()  # the client left or the handler failed: free the sequence
        live = self.live
        if live.first_token_at is not None:
            self.info["ttft"] = live.first_token_at - live.submitted_at
        self.info["gone"] = not complete
        self.state.end()

    def error(self, result) -> ApiError:
        """The answer to a request the engine ended with an error: 503 when the engine is down."""
        message = result.error or "generation failed"
        down = self.state.loop.failure is not None or message.startswith(ENGINE_FAILED)
        return ApiError(503 if down else 500, message, "server_error")


class _Stream(StreamingResponse):
    """An SSE response that closes its generation however it ends (even never started)."""

    def __init__(self, gen: Generation):
        super().__init__(_events(gen), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.gen = gen

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.gen.close(complete=False)  # a no-op after the stream's own close


class Guard:
    """ASGI middleware: metrics for every request, and the API key checked before routing."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state
        self._key = state.settings.api_key.encode() if state.settings.api_key is not None else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        info = scope["eprt"] = {"status": None, "ttft": None, "gone": False, "sent": False}
        start = time.monotonic()

        async def send_and_note(message):
            if message["type"] == "http.response.start":
                info["status"] = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                info["sent"] = True
            await send(message)

        metrics = self.state.metrics
        metrics.request_started()
        try:
            if self._key is not None and path != "/health" and not self._authorized(scope):
                e = ApiError(
                    401,
                    "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                    code="invalid_api_key",
                )
                await error_response(e)(scope, receive, send_and_note)
            else:
                await self.app(scope, receive, send_and_note)
        except Exception:  # the app's catch-all handler logged it, and answered if it still could
            if info["status"] is None:  # raised outside the app (no handler saw it)
                log.exception("%s failed", path)
                await internal_error()(scope, receive, send_and_note)
            elif not info["sent"]:
                raise  # uvicorn closes the connection of an answer cut short
        finally:
            status = 499 if info["gone"] or info["status"] is None else info["status"]
            generated = status == 200 and path in GENERATION_ROUTES
            metrics.request_finished(
                route_label(path),
                status,
                time.monotonic() - start if generated else None,
                info["ttft"] if generated else None,
            )

    def _authorized(self, scope) -> bool:
        values = [v for k, v in scope["headers"] if k == b"authorization"]
        scheme, _, token = (values[0] if len(values) == 1 else b"").partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)


def build_app(state: ServerState):
    """The ASGI application: the FastAPI routes inside the ``Guard`` middleware."""
    app = FastAPI(title="eprt", version=__version__, docs_url=None, redoc_url=None)
    app.openapi = lambda: _openapi(app, state)

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):
        if exc.status_code == 404:
            e = ApiError(
                404,
                f"no route {request.url.path!r}; try /v1/completions, /v1/chat/completions, /v1/models",
                code="not_found",
            )
        elif exc.status_code == 405:
            e = ApiError(405, f"{request.url.path} does not accept {request.method}", code="method_not_allowed")
        else:
            e = ApiError(exc.status_code, str(exc.detail))
        return error_response(e, dict(exc.headers or {}))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, exc: RequestValidationError):
        err = (exc.errors() or [{}])[0]
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        return error_response(
            ApiError(
                400, f"{'.'.join(loc) or 'body'}: {err.get('msg', 'invalid request')}", param=loc[0] if loc else "body"
            )
        )

    @app.exception_handler(Exception)
    async def unexpected_error(request, exc: Exception):  # Starlette's would answer in plain text
        log.error("%s failed", request.url.path, exc_info=exc)
        return internal_error()

    @app.get("/health", openapi_extra=schema.operation(schema.Health))
    async def health():
        h = state.loop.health()
        if h.ok:
            return JSONResponse({"status": "ok"})
        body = openai.error_body(
            f"the server is {h.status}" + (f": {h.detail}" if h.detail else ""),
            "server_error",
            code=h.status.replace(" ", "_"),
        )
        return JSONResponse({"status": h.status, **body}, status_code=503)

    @app.get("/metrics", openapi_extra=schema.operation(None, text=True))
    async def metrics():
        data = await run_in_threadpool(state.metrics.render)
        return Response(data, media_type=METRICS_CONTENT_TYPE)

    @app.get("/v1/models", openapi_extra=schema.operation(schema.ModelList))
    async def models():
        return JSONResponse(openai.models_body(state.engine, state.created, state.model_name))

    @app.get("/v1/models/{model:path}", openapi_extra=schema.operation(schema.ModelCard))
    async def model(model: str):
        cards = openai.models_body(state.engine, state.created, state.model_name)["data"]
        card = next((c for c in cards if c["id"] == model), None)
        if card is not None:
            return JSONResponse(card)
        e = ApiError(404, f"the model {model!r:.200} does not exist", param="model", code="model_not_found")
        return error_response(e)

    @app.post("/v1/load_lora_adapter", openapi_extra=schema.operation(None, schema.LoadLoraAdapterRequest, text=True))
    async def load_lora_adapter(request: Request):
        return await _body_call(state, request, adapters.load_adapter, state.settings.lora_dir, text=True)

    @app.post(
        "/v1/unload_lora_adapter", openapi_extra=schema.operation(None, schema.UnloadLoraAdapterRequest, text=True)
    )
    async def unload_lora_adapter(request: Request):
        return await _body_call(state, request, adapters.unload_adapter, text=True)

    _add_utility_routes(app, state)

    @app.post(
        "/v1/completions", openapi_extra=schema.operation(schema.CompletionResponse, schema.CompletionRequest, True)
    )
    async def completions(request: Request):
        return await _answer(state, request, chat=False)

    @app.post(
        "/v1/chat/completions",
        openapi_extra=schema.operation(schema.CompletionResponse, schema.ChatCompletionRequest, True),
    )
    async def chat_completions(request: Request):
        return await _answer(state, request, chat=True)

    return Guard(app, state)


def _add_utility_routes(app: FastAPI, state: ServerState) -> None:
    """vLLM's /tokenize, /detokenize and /version (eprt.serve.tokenize)."""

    @app.post("/tokenize", openapi_extra=schema.operation(schema.TokenizeResponse, schema.TokenizeRequest))
    async def tokenize_route(request: Request):
        return await _body_call(state, request, tokenize.tokenize_body, state.model_name)

    @app.post("/detokenize", openapi_extra=schema.operation(schema.DetokenizeResponse, schema.DetokenizeRequest))
    async def detokenize_route(request: Request):
        return await _body_call(state, request, tokenize.detokenize_body, state.model_name)

    @app.get("/version", openapi_extra=schema.operation(schema.Version))
    async def version():
        return JSONResponse(tokenize.version_body())


def _openapi(app: FastAPI, state: ServerState) -> dict:
    if app.openapi_schema is None:
        app.openapi_schema = schema.openapi(app, state.settings.api_key is not None)
    return app.openapi_schema


async def _body_call(state: ServerState, request: Request, call, *args, text: bool = False):
    """A route whose JSON body goes to ``call(engine, body, *args)``, off the event loop (it reads
    files, or tokenizes); its answer as JSON (``text``: as plain text); a RequestError is a 400."""
    try:
        raw = await read_body(request, state.settings.max_body_bytes, state.settings.http_timeout_s)
        answer = await run_in_threadpool(call, state.engine, parse_json(raw), *args)
        return Response(answer, media_type="text/plain") if text else JSONResponse(answer)
    except ApiError as e:
        return error_response(e)
    except RequestError as e:  # FieldError carries the field's name
        return error_response(ApiError(400, str(e), param=getattr(e, "param", None)))


async def _answer(state: ServerState, request: Request, chat: bool):
    """One generation request, every failure turned into its error answer."""
    try:
        return await _generate(state, request, chat)
    except ClientDisconnect:
        request.scope["eprt"]["gone"] = True
        return Response(status_code=499)  # never seen: the client is gone
    except ApiError as e:
        return error_response(e)
    except UnknownAdapter as e:  # unloaded between parsing and submitting
        return error_response(ApiError(400, str(e), param="model", code="model_not_found"))
    except RequestError as e:  # FieldError carries the field's name
        return error_response(ApiError(400, str(e), param=getattr(e, "param", None)))
    except Exception:
        log.exception("%s failed", request.url.path)
        return internal_error()


def _parse(raw: bytes, state: ServerState, chat: bool) -> openai.ApiRequest:
    settings = state.settings
    return openai.parse_request(
        parse_json(raw),
        state.engine,
        chat,
        state.model_name,
        settings.media,
        settings.chat_max_tokens,
        state.chat_features,
    )


async def _generate(state: ServerState, request: Request, chat: bool):
    settings = state.settings
    raw = await read_body(request, settings.max_body_bytes, settings.http_timeout_s)
    state.check_accepting()
    api = await run_in_threadpool(_parse, raw, state, chat)  # tokenizing must not stall other streams
    state.check_accepting()
    gen = Generation(state, api, request.scope["eprt"])
    if api.stream:
        return _Stream(gen)
    complete = False
    try:
        response = await _complete(request, gen)
        complete = response.status_code != 499
        return response
    finally:
        gen.close(complete)


async def _complete(request: Request, gen: Generation):
    lives, next_check = gen.lives, time.monotonic() + _CLIENT_CHECK_S
    while not all(live.finished() for live in lives):
        await gen.waker.wait(_CLIENT_CHECK_S)
        for live in lives:
            live.pump()
        if time.monotonic() >= next_check:
            next_check = time.monotonic() + _CLIENT_CHECK_S
            if await request.is_disconnected():
                return Response(status_code=499)  # never seen: the client is gone
    results = [live.result()[0] for live in lives]
    failed = next((r for r in results if r.finish_reason == "error"), None)
    if failed is not None:
        return error_response(gen.error(failed))
    texts = [live.text if gen.api.output is not None else None for live in lives]  # each choice's ChatOutput
    params = gen.api.request.params
    groups = [ranked(pairs, params) for pairs in gen.grouped(list(zip(results, texts)))]
    results_of = [[result for result, _ in pairs] for pairs in groups]
    outputs = None if gen.api.output is None else [[text for _, text in pairs] for pairs in groups]
    return JSONResponse(openai.batch_body(gen.api, results_of, outputs))


def _event(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def _pieces(api: openai.ApiRequest, live: LiveRequest, text: str, records, index: int) -> list:
    """The chunks of what one pump brought: its text, or a chat message's deltas (reasoning,
    content, tool calls); the tokens' logprobs ride on the first."""
    if api.output is None:
        return [_event(openai.chunk(api, text, records=records, index=index))] if text or records else []
    deltas = live.text.deltas() or ([{}] if records else [])
    return [
        _event(openai.chunk(api, records=records if k == 0 else None, index=index, delta=d))
        for k, d in enumerate(deltas)
    ]


async def _events(gen: Generation):
    """The SSE stream of one request; an engine failure ends it with an error event and [DONE]."""
    api, lives, complete = gen.api, gen.lives, False
    try:
        if api.chat:
            for i in range(len(lives)):
                yield _event(openai.chunk(api, first=True, index=i))
        results: list = [None] * len(lives)
        echo_due = [api.echo] * len(lives)  # the prompt's text (and logprobs) once its prefill is done
        while True:
            for i, live in enumerate(lives):
                if results[i] is not None:
                    continue
                delta = live.pump()
                if echo_due[i] and (live.token_ids or live.finished()):
                    echo_due[i] = False
                    yield _event(openai.echo_chunk(api, live.request_prompt, live.handle.prompt_logprobs, i))
                for piece in _pieces(api, live, delta, live.take_logprobs(), i):
                    yield piece
                if live.finished():
                    results[i], tail = live.result()
                    for piece in _pieces(api, live, tail, live.take_logprobs(), i):
                        yield piece
                    if results[i].finish_reason != "error":
                        reason = chat_output.finish_reason(results[i].finish_reason, api.output and live.text)
                        yield _event(openai.chunk(api, finish_reason=reason, index=i))
            if all(r is not None for r in results):
                break
            await gen.waker.wait(1.0)
        failed = next((r for r in results if r.finish_reason == "error"), None)
        if failed is not None:
            e = gen.error(failed)
            yield _event(openai.error_body(str(e), e.kind, code=str(e.status)))
        elif api.include_usage:
            yield _event(openai.usage_chunk(api, gen.grouped(results)))
        yield b"data: [DONE]\n\n"
        complete = True
    finally:
        gen.close(complete)


class HttpServer:
    """uvicorn serving ``build_app(state)`` on its own thread and event loop."""

    def __init__(self, state: ServerState, host: str, port: int):
        s = state.settings
        self.state = state
        self.sock = socket.create_server((host, port), backlog=s.backlog, reuse_port=False)  # OSError: caller's
        self.port = self.sock.getsockname()[1]
        protocol = type("EprtH11Protocol", (GuardedH11Protocol,), {"header_timeout_s": s.http_timeout_s})
        config = uvicorn.Config(
            build_app(state),
            http=protocol,
            lifespan="off",
            log_config=None,
            access_log=False,
            backlog=s.backlog,
            timeout_keep_alive=s.keep_alive_s,
            headers=[("keep-alive", f"timeout={int(s.keep_alive_s)}")],  # undici and others close before
            timeout_graceful_shutdown=5,
            server_header=False,
            h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        )
        logging.getLogger("uvicorn.error").setLevel(logging.ERROR)  # not a line per malformed request
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, name="eprt-http", daemon=True
        )

    def start(self, timeout: float = 30.0) -> None:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start (see the log above)")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()
