"""Reading an HTTP request's JSON body, and the error answer type of ``eprt serve``.

A body comes with one Content-Length or as ``Transfer-Encoding: chunked`` (what clients
send for a body of unknown size). Everything that is wrong with it is an ``ApiError``
naming the problem: 400 malformed, 408 not arriving in time, 411 no length, 413 too large,
501 an unsupported transfer coding.
"""
from __future__ import annotations

import json

MAX_BODY_BYTES = 32 << 20     # larger request bodies get 413
MAX_TRAILERS = 64             # header lines after a chunked body


class ApiError(Exception):
    """An error answer: HTTP status plus the fields of an OpenAI error body."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code


def read_json(headers, rfile, timeout: float):
    """The request body parsed as JSON (``rfile``: the connection, ``timeout``: its socket timeout)."""
    try:
        raw = _read_chunked(rfile) if _chunked(headers) else _read_sized(headers, rfile)
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout:g}s") from None
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:   # RecursionError: nested too deep
        raise ApiError(400, f"the request body is not valid JSON: {e}", param="body") from None


def _chunked(headers) -> bool:
    codings = [c.strip().lower() for v in headers.get_all("Transfer-Encoding", [])
               for c in v.split(",")]
    if codings and codings != ["chunked"]:
        raise ApiError(501, f"unsupported Transfer-Encoding {', '.join(codings)!r}; send chunked or "
                            f"a Content-Length")
    return bool(codings)


def _read_sized(headers, rfile) -> bytes:
    lengths = {v.strip() for v in headers.get_all("Content-Length", [])}
    if not lengths:
        raise ApiError(411, "send the request body with a Content-Length header (or chunked)")
    if len(lengths) > 1:                # which one the body follows is ambiguous (request smuggling)
        raise ApiError(400, f"conflicting Content-Length headers {sorted(lengths)}")
    length = lengths.pop()
    if not (length.isascii() and length.isdigit()):     # str.isdigit() alone takes '²'
        raise ApiError(400, f"bad Content-Length {length!r}")
    if int(length) > MAX_BODY_BYTES:
        raise ApiError(413, f"request body of {length} bytes is over the {MAX_BODY_BYTES} byte limit")
    data = rfile.read(int(length))
    if len(data) < int(length):
        raise ApiError(400, f"the request body ended after {len(data)} of its {length} bytes")
    return data


def _read_chunked(rfile) -> bytes:
    """A ``Transfer-Encoding: chunked`` body (what clients send for a body of unknown size)."""
    parts, size = [], 0
    while True:
        line = rfile.readline(1024)
        digits = line.split(b";")[0].strip()     # chunk extensions after ';' are ignored
        if not line.endswith(b"\n") or not digits or digits.strip(b"0123456789abcdefABCDEF"):
            raise ApiError(400, f"bad chunk size line {line[:40]!r} in a chunked body")
        n = int(digits, 16)
        size += n
        if size > MAX_BODY_BYTES:
            raise ApiError(413, f"chunked request body is over the {MAX_BODY_BYTES} byte limit")
        if n == 0:
            break
        data = rfile.read(n)
        if len(data) < n or rfile.readline(3) not in (b"\r\n", b"\n"):
            raise ApiError(400, "a chunk of the chunked body is shorter than its size line says")
        parts.append(data)
    for _ in range(MAX_TRAILERS):     # trailer fields, ignored, up to the empty line
        if rfile.readline(65537) in (b"\r\n", b"\n", b""):
            return b"".join(parts)
    raise ApiError(400, f"more than {MAX_TRAILERS} trailer lines after a chunked body")
