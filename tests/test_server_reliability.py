"""The probe's defects (issue 16), kept fixed: text the tokenizer cannot take, nesting that would
blow the stack, unexpected errors, `n` over `--max-waiting`, loose types, the API key scheme's case,
what /metrics is documented as, big prompts and the event loop, and what clients get when the drain
deadline passes. Each answer is an OpenAI error body with its status, never a plain-text 500."""

from __future__ import annotations

import asyncio
import json
import logging
import threading

import httpx
import pytest
from server_helpers import LiveServer, engine_idle, tiny_engine, wait_until

from tandem.engine.llm_engine import EngineStats
from tandem.engine.tokenizer import Tokenizer
from tandem.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tandem.server import create_app
from tandem.server import serving_chat, serving_completion

MODEL = "tiny"
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
USER = [{"role": "user", "content": "Hello"}]
MAX_WAITING = 4


@pytest.fixture(scope="module")
def engine(tiny_llama):
    eng = tiny_engine(tiny_llama, max_waiting=MAX_WAITING)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    srv = LiveServer(create_app(engine, MODEL, max_tokens_limit=64, max_n=16))
    yield srv
    srv.stop()


def post(server, path: str, body: dict, **kw) -> httpx.Response:
    """POST `body` as ASCII JSON (escapes such as \\ud800 survive; httpx would encode it as UTF-8)."""
    headers = {"content-type": "application/json", **kw.pop("headers", {})}
    return httpx.post(server.url + path, content=json.dumps(body).encode(), headers=headers, timeout=30, **kw)


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": USER, "max_tokens": 2, **fields}


def comp(**fields) -> dict:
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 2, **fields}


def assert_400(r: httpx.Response, param: str, *words: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    for w in words:
        assert w in err["message"], err


def tool_def(description: str = "d", parameters: dict | None = None) -> dict:
    fn = {"name": "f", "description": description}
    if parameters is not None:
        fn["parameters"] = parameters
    return {"type": "function", "function": fn}


# --- 1: lone surrogates ----------------------------------------------------------------------------
SURROGATES = [
    (CHAT, chat(messages=[{"role": "user", "content": "\ud800 hi"}]), "messages[0].content"),
    (CHAT, chat(messages=[{"role": "user", "content": "hi \udfff"}], stream=True), "messages[0].content"),
    (CHAT, chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a\udc00"}]}]),
     "messages[0].content[0].text"),
    (CHAT, chat(messages=USER + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "\ud83d"}]),
     "messages[2].content"),
    (CHAT, chat(tools=[tool_def("weather \ud800")]), "tools[0].function.description"),
    (CHAT, chat(tools=[tool_def(parameters={"type": "object", "properties": {"c\udc01": {"type": "string"}}})]),
     "tools[0].function.parameters.properties"),
    (COMP, comp(prompt="\ud800 hi"), "prompt"),
    (COMP, comp(prompt=["fine", "bad \udbff"], stream=True), "prompt[1]"),
]


@pytest.mark.parametrize("path,body,param", SURROGATES, ids=[s[2] + ("-stream" if s[1].get("stream") else "")
                                                               for s in SURROGATES])
def test_lone_surrogates_get_400_naming_the_field(server, path, body, param):
    assert_400(post(server, path, body), param, "surrogate")


def test_surrogate_pairs_are_fine(server):
    r = post(server, CHAT, chat(messages=[{"role": "user", "content": "smile \ud83d\ude00"}]))
    assert r.status_code == 200, r.text


# --- 2: nesting ------------------------------------------------------------------------------------
def test_deeply_nested_tool_call_arguments_get_400(server):
    deep = "[" * 5000 + "1" + "]" * 5000
    messages = USER + [{"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    assert_400(post(server, CHAT, chat(messages=messages)), "messages[1].tool_calls[0].function.arguments",
               "nested")
    inside_a_string = '{"a": "' + "[" * 100 + '"}'         # brackets inside a JSON string do not nest
    messages[1]["tool_calls"][0]["function"]["arguments"] = inside_a_string
    assert post(server, CHAT, chat(messages=messages)).status_code == 200


def test_deeply_nested_objects_get_400(server):
    params: dict = {"type": "string"}
    for _ in range(200):
        params = {"type": "object", "properties": {"x": params}}
    r = post(server, CHAT, chat(tools=[tool_def(parameters=params)]))
    assert_400(r, "tools[0].function.parameters", "nested")


# --- 3: the catch-all ------------------------------------------------------------------------------
def test_unexpected_error_is_an_openai_500_and_logged(server, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("kaboom 3f9c")

    monkeypatch.setattr(serving_completion, "prepare_completion", broken)
    with caplog.at_level(logging.ERROR):
        r = post(server, COMP, comp())
    assert r.status_code == 500 and r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert err["type"] == "internal_error" and "kaboom" not in err["message"]       # details stay in the log
    logged = [rec for rec in caplog.records if rec.exc_info and "kaboom 3f9c" in str(rec.exc_info[1])]
    assert logged and logged[0].name == "tandem.server"
    assert post(server, CHAT, chat()).status_code == 200                           # still serving


# --- 4: n over --max-waiting -----------------------------------------------------------------------
def test_n_over_max_waiting_is_400_not_503(server, engine):
    assert_400(post(server, CHAT, chat(n=MAX_WAITING + 1)), "n", "--max-waiting", str(MAX_WAITING))
    assert_400(post(server, COMP, comp(prompt=["a"] * (MAX_WAITING + 1))), "prompt", "--max-waiting")
    assert_400(post(server, COMP, comp(prompt=["a", "b"], n=3)), "n", "--max-waiting")
    assert wait_until(lambda: engine_idle(engine))
    r = post(server, CHAT, chat(n=MAX_WAITING))
    assert r.status_code == 200 and len(r.json()["choices"]) == MAX_WAITING


# --- smaller ones ----------------------------------------------------------------------------------
LOOSE = [
    (CHAT, chat(stream="yes"), "stream"),
    (CHAT, chat(max_tokens=True), "max_tokens"),
    (CHAT, chat(n=2.0), "n"),
    (CHAT, chat(logprobs="true"), "logprobs"),
    (CHAT, chat(temperature="0.5"), "temperature"),
    (COMP, comp(prompt=[[False]]), "prompt"),
    (COMP, comp(prompt=[True, 5]), "prompt"),
    (COMP, comp(echo=1), "echo"),
]


@pytest.mark.parametrize("path,body,param", LOOSE, ids=[f"{p[1:]}-{b}" for p, _, b in LOOSE])
def test_loose_types_are_400(server, path, body, param):
    assert_400(post(server, path, body), param)


def test_strict_types_still_take_what_openai_clients_send(server):
    assert post(server, CHAT, chat(temperature=1, top_p=1, stream=False, n=1, seed=3)).status_code == 200
    assert post(server, COMP, comp(prompt=[5, 6, 7], temperature=0)).status_code == 200
    assert post(server, COMP, comp(prompt=[[5, 6], [7]], stream=None)).status_code == 200


def test_bearer_scheme_is_case_insensitive(engine):
    srv = LiveServer(create_app(engine, MODEL, api_key="sekret"))
    try:
        for auth in ("Bearer sekret", "bearer sekret", "BEARER sekret", "Bearer   sekret"):
            assert post(srv, COMP, comp(), headers={"Authorization": auth}).status_code == 200, auth
        for auth in ("bearer wrong", "Basic sekret", "sekret", "Bearersekret", ""):
            r = post(srv, COMP, comp(), headers={"Authorization": auth})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", auth
    finally:
        srv.stop()


def test_openapi_documents_metrics_as_text(server):
    spec = httpx.get(server.url + "/openapi.json").json()
    content = spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(content) == ["text/plain"]
    assert httpx.get(server.url + "/metrics").headers["content-type"].startswith("text/plain")


def test_large_prompts_are_tokenized_off_the_event_loop(server, monkeypatch):
    seen: list[str] = []
    for module, name in ((serving_chat, "prepare_chat"), (serving_completion, "prepare_completion")):
        real = getattr(module, name)

        def spy(*args, _real=real, **kwargs):
            seen.append(threading.current_thread().name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    big = "The quick brown fox. " * 20_000                   # ~400 KB: over the prompt limit, so a 400
    assert post(server, CHAT, chat(messages=[{"role": "user", "content": big}])).status_code == 400
    assert post(server, COMP, comp(prompt=big)).status_code == 400
    assert post(server, COMP, comp()).status_code == 200     # small ones stay on the loop
    loop_thread = seen[-1]
    assert seen[0] != loop_thread and seen[1] != loop_thread


# --- 6: the drain deadline -------------------------------------------------------------------------
class HangingEngine:
    """An AsyncLLMEngine stand-in whose requests produce one piece of text, then never finish."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.engine = type("E", (), {"max_model_len": 512, "vocab_size": tokenizer.vocab_size})()
        self.max_waiting = 64
        self.started: list[str] = []
        self.closed: list[str] = []

    def stats(self) -> EngineStats:
        return EngineStats(0, 0, 0.0, 1, 1, 0, 0, 0, 0, 0, 0)

    async def drain(self, timeout_s: float) -> bool:
        return True

    async def generate(self, prompt, params, *, prompt_token_ids=None, request_id=None):
        self.started.append(request_id)
        try:
            out = CompletionOutput(0, "Hi", [1], None)
            yield RequestOutput(request_id, None, prompt_token_ids, [out], False, RequestMetrics(arrival_time=0.0),
                                delta_text="Hi", delta_token_ids=[1])
            await asyncio.Event().wait()
        finally:
            self.closed.append(request_id)


def test_drain_deadline_ends_requests_with_errors_and_done(tiny_llama, caplog):
    from tandem.server.launch import make_server

    eng = HangingEngine(Tokenizer(tiny_llama))
    app = create_app(eng, MODEL, drain_timeout_s=0.3)
    server = make_server(app, host="127.0.0.1", port=0, drain_timeout_s=0.3, log_level="warning")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    assert wait_until(lambda: server.started)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            async def stream(path, body):
                async with c.stream("POST", path, json=body) as r:
                    return r.status_code, [line async for line in r.aiter_lines() if line]

            tasks = [asyncio.ensure_future(stream(CHAT, chat(stream=True))),
                     asyncio.ensure_future(stream(COMP, comp(stream=True, n=2))),
                     asyncio.ensure_future(c.post(CHAT, json=chat())),
                     asyncio.ensure_future(c.post(COMP, json=comp()))]
            while len(eng.started) < 5:
                await asyncio.sleep(0.01)
            server.should_exit = True                     # what SIGTERM does
            return await asyncio.gather(*tasks)

    with caplog.at_level(logging.INFO):
        chat_stream, comp_stream, chat_whole, comp_whole = asyncio.run(main())
    thread.join(10)
    assert not thread.is_alive()
    for status, lines in (chat_stream, comp_stream):
        assert status == 200 and lines[-1] == "data: [DONE]"
        err = json.loads(lines[-2][len("data: "):])["error"]
        assert err["code"] == "shutting_down" and "drain" in err["message"]
        assert any('"Hi"' in line for line in lines)    # what was generated before the deadline came through
    for r in (chat_whole, comp_whole):
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
    assert sorted(eng.closed) == sorted(eng.started)       # every engine request was aborted
    assert not [rec for rec in caplog.records if "CancelledError" in rec.getMessage()
                or (rec.exc_info and isinstance(rec.exc_info[1], asyncio.CancelledError))]
    assert not [rec for rec in caplog.records if "Cancel" in rec.getMessage() and "task" in rec.getMessage()]


def raw_exchange(server, request: bytes) -> tuple[bytes, bytes]:
    """Send `request` bytes as they are; the reply's head and body (the server closes after it)."""
    import socket

    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(request)
        reply = b""
        while chunk := sock.recv(4096):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    return head, body


@pytest.mark.parametrize("header", [b"Content-Length: abc", b"Content-Length: -5", b"Content-Length: 5, 7"])
def test_an_invalid_content_length_gets_an_openai_400(server, header):
    head, body = raw_exchange(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                      b"Content-Type: application/json\r\n" + header + b"\r\n\r\n{}")
    assert head.startswith(b"HTTP/1.1 400"), head
    assert b"content-type: application/json" in head.lower()
    err = json.loads(body)["error"]
    assert err["code"] == "invalid_http" and "Content-Length" in err["message"]
    assert post(server, COMP, comp()).status_code == 200                  # the server keeps serving


def test_a_trickling_body_gets_408(engine):
    import socket

    srv = LiveServer(create_app(engine, MODEL, body_timeout_s=0.3))
    try:
        host, port = srv.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"prompt\":")          # 10 of the 100 bytes, then nothing
            reply = b""
            while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
                chunk = sock.recv(4096)
                if not chunk:
                    break
                reply += chunk
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), reply
        assert json.loads(body)["error"]["code"] == "request_timeout"
        assert post(srv, COMP, comp()).status_code == 200                  # others are served
    finally:
        srv.stop()
