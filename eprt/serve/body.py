"""Reading a request's JSON body under a size limit and a deadline, and the error answer type.

The limit is enforced while reading: a Content-Length over it is refused before a byte of
the body is read, and a chunked body is refused as soon as it grows past it. Everything
wrong is an ``ApiError``: 400 malformed, 408 not arriving in time, 413 too large.
"""

from __future__ import annotations

import asyncio
import json

DEFAULT_MAX_BODY_BYTES = 16 << 20


class ApiError(Exception):
    """An error answer: HTTP status plus the fields of an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code


def _declared_length(headers) -> int | None:
    values = headers.getlist("content-length")
    if not values:
        return None
    if len(set(values)) > 1 or not (values[0].isascii() and values[0].isdigit()):
        raise ApiError(400, f"bad Content-Length {values!r}")  # h11 refuses these first; kept for other servers
    return int(values[0])


async def read_body(request, max_bytes: int, timeout_s: float) -> bytes:
    """The whole body of ``request`` (a Starlette request); ApiError past ``max_bytes`` or ``timeout_s``."""
    declared = _declared_length(request.headers)
    if declared is not None and declared > max_bytes:
        raise ApiError(
            413,
            f"the request body of {declared} bytes is over the {max_bytes} byte limit (--max-body-bytes)",
            param="body",
        )
    parts, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for part in request.stream():
                size += len(part)
                if size > max_bytes:
                    raise ApiError(
                        413, f"the request body is over the {max_bytes} byte limit (--max-body-bytes)", param="body"
                    )
                parts.append(part)
    except TimeoutError:
        raise ApiError(
            408, f"the request body did not arrive within {timeout_s:g}s (--http-timeout)", param="body"
        ) from None
    return b"".join(parts)


def parse_json(raw: bytes):
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:  # RecursionError: nested too deep
        raise ApiError(400, f"the request body is not valid JSON: {e}", param="body") from None
