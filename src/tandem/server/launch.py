"""Run the app under uvicorn: print how to reach it, serve, drain on SIGTERM, stop the engine.

On SIGTERM (or Ctrl-C) uvicorn stops accepting connections and in-flight requests (streams
included) get `drain_timeout_s` to finish; at that deadline the app ends what is left itself (a
stream with an error event and [DONE], a whole response with a 503; uvicorn's own cancellation, a
little later, then finds nothing to cut). The app's lifespan then waits for the engine to drain and
shuts the engine thread down. (uvicorn then re-raises the signal, so a SIGTERM'd server
exits as killed by SIGTERM, after the drain.)
"""

from __future__ import annotations

import math
import shlex
import sys
from typing import Any, TextIO

from tandem.engine.async_engine import AsyncLLMEngine
from tandem.server.app import create_app
from tandem.server.metrics import PREFIXES


def usage_banner(host: str, port: int, model_name: str, api_key: str | None) -> str:
    """The URL and a curl example, as printed at start."""
    shown_host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    url = f"http://{shown_host}:{port}"
    auth = f" -H {shlex.quote('Authorization: Bearer ' + api_key)}" if api_key else ""
    body = ('{"model": "%s", "messages": [{"role": "user", "content": "Why is the sky blue?"}], '
            '"max_tokens": 64}' % model_name)
    return (f"Tandem serving {model_name!r} at {url}  (OpenAI API under {url}/v1)\n"
            f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n"
            f"       -d {shlex.quote(body)}\n")


DRAIN_MARGIN_S = 2.0        # uvicorn cancels tasks this long after the app's own drain deadline


def http_protocol() -> type:
    """uvicorn's h11 protocol, except that the 400 it sends for a request h11 refuses before the app
    sees it (an invalid Content-Length, a malformed request line or header) has an OpenAI error body
    like every other 400, instead of uvicorn's plain text."""
    import json

    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    from tandem.server.errors import error_body

    class OpenAIErrorH11Protocol(H11Protocol):
        def send_400_response(self, msg: str) -> None:
            body = json.dumps(error_body(400, "malformed HTTP request (for example an invalid Content-Length "
                                              "or request line): " + msg, None, "invalid_http")).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"connection", b"close")]
            for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
                          h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
            self.transport.close()

    return OpenAIErrorH11Protocol


def make_server(app: Any, *, host: str = "127.0.0.1", port: int = 8000, drain_timeout_s: float = 30.0,
                log_level: str = "info") -> Any:
    """A uvicorn server for `app` (from `create_app`) whose shutdown starts the app's drain deadline."""
    import uvicorn

    class _Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:        # type: ignore[override]
            drain = getattr(getattr(app.state, "tandem", None), "drain", None)
            if drain is not None:
                drain.begin()
            await super().shutdown(sockets)

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, http=http_protocol(),
                            timeout_graceful_shutdown=max(1, math.ceil(drain_timeout_s + DRAIN_MARGIN_S)))
    return _Server(config)


def serve(engine: AsyncLLMEngine, model_name: str, *, host: str = "127.0.0.1", port: int = 8000,
          api_key: str | None = None, max_request_bytes: int = 2 * 2**20, max_tokens_limit: int = 4096,
          drain_timeout_s: float = 30.0, log_level: str = "info", out: TextIO = sys.stdout,
          tools=None, metrics_prefixes: tuple[str, ...] = PREFIXES, strict: bool = False,
          tool_parser: str = "hermes", enable_auto_tool_choice: bool = True, reasoning_parser: str | None = None,
          trust_request_chat_template: bool = False) -> None:
    """Serve until SIGTERM / SIGINT, then drain and shut the engine down."""
    app = create_app(engine, model_name, api_key=api_key, max_request_bytes=max_request_bytes,
                     max_tokens_limit=max_tokens_limit, drain_timeout_s=drain_timeout_s,
                     on_shutdown=engine.shutdown, tools=tools, metrics_prefixes=metrics_prefixes,
                     strict=strict, tool_parser=tool_parser, enable_auto_tool_choice=enable_auto_tool_choice,
                     reasoning_parser=reasoning_parser, trust_request_chat_template=trust_request_chat_template)
    server = make_server(app, host=host, port=port, drain_timeout_s=drain_timeout_s, log_level=log_level)
    print(usage_banner(host, port, model_name, api_key), file=out, flush=True)
    try:
        server.run()
    finally:
        engine.shutdown()
