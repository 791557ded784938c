"""Call a replica's own FastAPI app (`tandem.server.create_app`) in-process, as ASGI, and hand the
response back in pieces a Ray Serve streaming handle can carry.

The ingress does not reimplement the OpenAI routes: each replica runs the same app `tandem serve`
runs, and `forward` feeds it one HTTP request (method, path, headers, body) and yields the response:
first a `ResponseHead` (status, headers) together with the first body bytes, then further body
chunks (the SSE events of a stream) as the app sends them. Coalescing the head with the first bytes
means that until a caller has received anything, nothing has reached its client, so a request
whose replica died before answering can be retried safely. Leaving the generator early (the client
went away, or Ray cancelled the call) tells the app that the client disconnected, which aborts the
engine requests it was running. No Ray here: this is plain asyncio.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, AsyncIterator


@dataclass
class ResponseHead:
    status: int
    headers: list[tuple[str, str]]
    body: bytes = b""             # the first body bytes (a whole response: all of it)
    more: bool = False            # more chunks follow
    extra: dict[str, Any] = field(default_factory=dict)

    def header(self, name: str) -> str | None:
        name = name.lower()
        return next((v for k, v in self.headers if k.lower() == name), None)


def _scope(method: str, path: str, query: str, headers: list[tuple[str, str]]) -> dict[str, Any]:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": method.upper(), "scheme": "http", "path": path, "raw_path": path.encode(),
            "query_string": query.encode(), "root_path": "",
            "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers],
            "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}


async def forward(app: Any, method: str, path: str, query: str = "", headers: list[tuple[str, str]] | None = None,
                  body: bytes = b"", extra_headers: list[tuple[str, str]] = ()) -> AsyncIterator[ResponseHead | bytes]:
    """Run one request through `app`; yield a ResponseHead (with the first bytes), then bytes.
    `extra_headers` are added to the response (e.g. which replica answered)."""
    sent: asyncio.Queue = asyncio.Queue()
    disconnected = asyncio.Event()
    body_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await disconnected.wait()            # the app polls for a disconnect while it generates
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        await sent.put(message)

    async def run() -> None:
        try:
            await app(_scope(method, path, query, list(headers or [])), receive, send)
        finally:
            await sent.put(None)             # the app is done (or failed)

    task = asyncio.create_task(run())
    head: ResponseHead | None = None
    try:
        while True:
            message = await sent.get()
            if message is None:
                break
            if message["type"] == "http.response.start":
                hs = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", [])]
                head = ResponseHead(message["status"], hs + list(extra_headers))
            elif message["type"] == "http.response.body":
                chunk, more = message.get("body", b""), message.get("more_body", False)
                if head is not None:
                    head.body, head.more = chunk, more
                    out, head = head, None
                    yield out
                    if not more:
                        break
                elif chunk:
                    yield chunk
                if not more:
                    break
        await task                           # re-raises what the app raised
    finally:
        disconnected.set()
        if not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), 5.0)   # let the app abort its requests
            except (asyncio.TimeoutError, Exception):                # noqa: BLE001
                task.cancel()
