"""ASGI guards in front of every route: the API key (401), the request-body size limit (413), and
a catch-all that turns an unexpected exception into an OpenAI-format 500 (traceback to the log).

The first two answer in the OpenAI error format before the app sees the request. The body limit
reads the body (at most `max_bytes` + 1 bytes) and replays it to the app, so a large or endless
body never reaches JSON parsing; later `receive` calls (disconnect detection) go to the client as
usual. The API key's scheme is case-insensitive (`bearer` works too, as RFC 7235 says).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tandem.server.errors import error_body

GUARDED_PREFIX = "/v1"          # vLLM guards only the OpenAI routes with --api-key
log = logging.getLogger("tandem.server")


async def send_error(send: Send, status: int, message: str, code: str | None = None,
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps(error_body(status, message, None, code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value
    return None


class CatchAllMiddleware:
    """The outermost guard: an exception nothing else handled is logged with its traceback and
    answered with a 500 in the OpenAI format (if the response has not started; otherwise the
    connection is dropped, as there is no way to tell the client in the middle of a body)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as e:
            log.error("internal error serving %s %s", scope.get("method"), scope.get("path"), exc_info=e)
            if started:
                raise
            await send_error(send, 500, "internal server error", "internal_error")


def bearer_token(value: bytes) -> bytes | None:
    """The token of an `Authorization: Bearer <token>` value (the scheme is case-insensitive, RFC 7235)."""
    scheme, _, token = value.strip().partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" and token.strip() else None


class APIKeyMiddleware:
    """Requires `Authorization: Bearer <key>` on the OpenAI routes (/v1/...), as vLLM does; /health,
    /metrics, /version and the tokenizer routes stay public (probes and scrapers carry no key)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not (path == GUARDED_PREFIX or path.startswith(GUARDED_PREFIX + "/")):
            await self.app(scope, receive, send)
            return
        given = _header(scope, b"authorization") or b""
        token = bearer_token(given)
        if token is None or not hmac.compare_digest(token, self.expected):
            msg = "missing API key: send 'Authorization: Bearer <key>'" if not given else "invalid API key"
            await send_error(send, 401, msg, "invalid_api_key", [(b"www-authenticate", b"Bearer")])
            return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Refuses request bodies over `max_bytes` with 413 (by Content-Length, or while reading), and
    bodies that take over `timeout_s` to arrive (a client trickling bytes) with 408."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float | None = 30.0) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None:
            try:
                too_big = int(declared) > self.max_bytes
            except ValueError:
                await send_error(send, 400, "invalid Content-Length header")
                return
            if too_big:
                await send_error(send, 413, self._message(int(declared)), "request_too_large")
                return
        try:
            messages = await self._read_body(receive)
        except TimeoutError:
            await send_error(send, 408, f"the request body did not arrive within {self.timeout_s:g} s",
                             "request_timeout", [(b"connection", b"close")])
            return
        if messages is None:
            await send_error(send, 413, self._message(None), "request_too_large")
            return
        await self.app(scope, _replay(messages, receive), send)

    def _message(self, size: int | None) -> str:
        got = f"{size} bytes" if size is not None else "more"
        return f"request body too large: {got}, the limit is {self.max_bytes} bytes"

    async def _read_body(self, receive: Receive) -> list[Message] | None:
        """The body's messages, or None once they pass the limit (TimeoutError past the deadline)."""
        messages: list[Message] = []
        size = 0
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        while True:
            if deadline is None:
                message = await receive()
            else:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            messages.append(message)
            if message["type"] != "http.request":
                return messages                   # a disconnect: let the app see it
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                return None
            if not message.get("more_body", False):
                return messages


def _replay(messages: list[Message], receive: Receive) -> Receive:
    pending = list(messages)

    async def replayed() -> dict[str, Any]:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed
