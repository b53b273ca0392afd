"""The HTTP side of ``eprt serve``: stdlib ``ThreadingHTTPServer``, one thread per connection.

Routes: ``GET /health``, ``GET /metrics``, ``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions``. With an API key, the ``/v1/`` routes need
``Authorization: Bearer <key>`` (health and metrics stay open for probes and scrapers).

A generation handler submits to the engine (``engine.submit`` is thread-safe) and then
waits on the request's token queue, writing SSE chunks as text arrives. While it waits
it checks whether the client went away (a failed write, or EOF on the socket) and, if
so, cancels the sequence so its KV blocks are freed. A bad request is answered 400 from
the handler's own thread and never touches other requests. Request bodies are read by
``body.py``; a client that stalls (sends or reads nothing for
``_SOCKET_TIMEOUT_S``) is dropped, so it holds no thread and no sequence for ever.
"""
from __future__ import annotations

import hmac
import json
import logging
import select
import socket
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from eprt import __version__
from eprt.api import RequestError
from eprt.serve import openai
from eprt.serve.body import ApiError, read_json
from eprt.serve.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE, ServerMetrics
from eprt.serve.stream import LiveRequest

log = logging.getLogger("eprt.serve")

_WAIT_S = 0.05                # longest wait for tokens before looking at the client and the engine
_CLIENT_CHECK_S = 0.25        # how often a waiting handler checks that its client is still there
_SOCKET_TIMEOUT_S = 120.0     # a client that sends nothing (or reads nothing) this long is dropped

GET_ROUTES = ("/health", "/metrics", "/v1/models")
POST_ROUTES = {"/v1/completions": False, "/v1/chat/completions": True}   # path -> is chat


class ClientGone(Exception):
    """The client closed its connection before the answer was complete."""


class OpenAIServer(ThreadingHTTPServer):
    daemon_threads = True          # an idle keep-alive connection must not hold up shutdown
    allow_reuse_address = True

    def __init__(self, address: tuple, engine, loop, api_key: str | None = None):
        super().__init__(address, Handler)
        self.engine, self.loop, self.api_key = engine, loop, api_key
        self.metrics = ServerMetrics()
        self.created = int(time.time())
        self._busy = 0                      # generation requests being answered
        self._idle = threading.Condition()

    @contextmanager
    def generation(self):
        with self._idle:
            self._busy += 1
        try:
            yield
        finally:
            with self._idle:
                self._busy -= 1
                self._idle.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no generation request is being answered; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._busy == 0, timeout)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = f"eprt/{__version__}"
    timeout = _SOCKET_TIMEOUT_S     # socket timeout: a stalled read or write raises TimeoutError
    server: OpenAIServer

    def do_GET(self):
        self._dispatch("GET")

    def do_POST(self):
        self._dispatch("POST")

    def log_message(self, format, *args):
        log.debug("%s %s", self.address_string(), format % args)

    def send_response(self, code, message=None):
        self._status = code
        super().send_response(code, message)

    # ---- dispatch -----------------------------------------------------------------------

    def _dispatch(self, method: str) -> None:
        path = urlsplit(self.path).path
        route = path if path in GET_ROUTES or path in POST_ROUTES else "other"
        self._status, self._streaming, self._chunked, self._ttft = None, False, True, None
        start = time.monotonic()
        metrics = self.server.metrics
        metrics.request_started()
        try:
            self._route(method, path)
        except (ClientGone, BrokenPipeError, ConnectionResetError, TimeoutError):  # timeout: a stuck reader
            log.info("%s: client went away; its request was cancelled", path)
            self.close_connection = True
            self._status = 499              # "client closed request", even after a 200 header
        except RequestError as e:           # FieldError carries the field's name
            self._fail(ApiError(400, str(e), param=getattr(e, "param", None)))
        except ApiError as e:
            self._fail(e)
        except Exception:
            log.exception("%s failed", path)
            self._fail(ApiError(500, "internal server error (see the server log)", "server_error"))
        finally:
            ok = self._status == 200 and route in POST_ROUTES
            metrics.request_finished(route, self._status or 499,
                                     time.monotonic() - start if ok else None, self._ttft if ok else None)

    def _route(self, method: str, path: str) -> None:
        known = path in GET_ROUTES or path in POST_ROUTES
        if not known:
            raise ApiError(404, f"no route {path!r}; try /v1/completions, /v1/chat/completions, /v1/models",
                           code="not_found")
        if (method == "GET") != (path in GET_ROUTES):
            raise ApiError(405, f"{path} does not accept {method}", code="method_not_allowed")
        if method == "GET" and ("Content-Length" in self.headers or "Transfer-Encoding" in self.headers):
            self.close_connection = True    # an unread body must not be taken for the next request
        if path.startswith("/v1/"):
            self._check_api_key()
        if path == "/health":
            stopping = self.server.loop.stop.is_set()
            self._send_json(503 if stopping else 200, {"status": "shutting down" if stopping else "ok"})
        elif path == "/metrics":
            text = self.server.metrics.render(self.server.engine.stats())
            self._send(200, text.encode(), METRICS_CONTENT_TYPE)
        elif path == "/v1/models":
            self._send_json(200, openai.models_body(self.server.engine, self.server.created))
        else:
            self._generate(POST_ROUTES[path])

    def _check_api_key(self) -> None:
        key = self.server.api_key
        if key is None:
            return
        scheme, _, token = self.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    def _read_json(self):
        return read_json(self.headers, self.rfile, self.timeout)

    # ---- generation ---------------------------------------------------------------------

    def _generate(self, chat: bool) -> None:
        srv = self.server
        api = openai.parse_request(self._read_json(), srv.engine, chat)
        if srv.loop.stop.is_set():
            raise ApiError(503, "the server is shutting down", "server_error")
        with srv.generation():
            live = LiveRequest(srv.engine, api.request, api.stop_strings)
            try:
                if api.stream:
                    self._stream(api, live)
                else:
                    self._complete(api, live)
            finally:
                if not live.handle.done():
                    live.cancel()          # the client left or the handler failed: free the sequence
                if live.first_token_at is not None:
                    self._ttft = live.first_token_at - live.submitted_at

    def _deltas(self, live: LiveRequest):
        """Yield new text until the request is finished; raise ClientGone if the client left."""
        last_check = time.monotonic()
        while not live.finished():
            delta = live.pump(_WAIT_S)
            if delta:
                yield delta
            if time.monotonic() - last_check > _CLIENT_CHECK_S:
                last_check = time.monotonic()
                if self._client_gone():
                    raise ClientGone()
            if self.server.loop.stopped.is_set() and not live.handle.done():
                raise ApiError(503, "the engine stopped before this request finished", "server_error")

    def _complete(self, api, live: LiveRequest) -> None:
        for _ in self._deltas(live):
            pass
        result, _ = live.result()
        if result.finish_reason == "error":
            raise ApiError(500, result.error or "generation failed", "server_error")
        self._send_json(200, openai.response_body(api, result))

    def _stream(self, api, live: LiveRequest) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        # An HTTP/1.0 client knows no chunked encoding: the stream ends when the connection closes.
        self._chunked = self.request_version != "HTTP/1.0"
        if self._chunked:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self._streaming = True
        if api.chat:
            self._event(openai.chunk(api, first=True))
        for delta in self._deltas(live):
            self._event(openai.chunk(api, delta))
        result, tail = live.result()
        if tail:
            self._event(openai.chunk(api, tail))
        if result.finish_reason == "error":
            self._event(openai.error_body(result.error or "generation failed", "server_error"))
        else:
            self._event(openai.chunk(api, finish_reason=result.finish_reason))
            if api.include_usage:
                self._event(openai.usage_chunk(api, result))
        self._end_stream()

    # ---- writing ------------------------------------------------------------------------

    def _client_gone(self) -> bool:
        """EOF (or an error) on the connection while we still owe an answer."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _chunk(self, data: bytes) -> None:
        if self._chunked:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        elif data:
            self.wfile.write(data)

    def _event(self, obj: dict) -> None:
        self._chunk(b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n")

    def _end_stream(self) -> None:
        self._chunk(b"data: [DONE]\n\n")
        self._chunk(b"")

    def _send(self, status: int, data: bytes, content_type: str, headers: tuple = ()) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def _send_json(self, status: int, obj: dict, headers: tuple = ()) -> None:
        self._send(status, json.dumps(obj, ensure_ascii=False).encode(), "application/json", headers)

    def _fail(self, e: ApiError) -> None:
        body = openai.error_body(str(e), e.kind, e.param, e.code)
        if e.status >= 500:
            log.warning("answering %d: %s", e.status, e)
        try:
            if self._streaming:             # the status line is gone: report in the stream
                self._event(body)
                self._end_stream()
                return
            # The body may be unread (a 401 or 404 before reading it): do not reuse the connection.
            self.close_connection = True
            headers = [("Connection", "close")]
            if e.status == 401:
                headers.append(("WWW-Authenticate", "Bearer"))
            self._send_json(e.status, body, tuple(headers))
        except OSError:
            self.close_connection = True
