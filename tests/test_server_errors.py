"""Bad input gets its status and a message naming the problem, in the OpenAI error format, and the
server keeps serving everyone else: 400 (field in `param`), 401, 404, 413, 503 with Retry-After."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from server_helpers import LiveServer, engine_idle, module_engine, wait_until

from tandem.server import create_app

MODEL = "tiny"
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
USER = [{"role": "user", "content": "Hello"}]


engine = module_engine("engine")


@pytest.fixture(scope="module")
def server(engine):
    app = create_app(engine, MODEL, max_tokens_limit=256, max_request_bytes=20_000, max_n=4)
    srv = LiveServer(app)
    yield srv
    srv.stop()


def post(server, path: str, body: dict | None = None, **kw) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=30, **kw)


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": USER, "max_tokens": 4, **fields}


def comp(**fields) -> dict:
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 4, **fields}


BAD_400 = [
    (CHAT, chat(temperature=-1), "temperature", "greater than or equal"),
    (CHAT, chat(top_p=0), "top_p", "greater than"),
    (CHAT, chat(n=0), "n", "greater than"),
    (CHAT, chat(n=5), "n", "limit of 4"),
    (CHAT, chat(max_tokens=0), "max_tokens", "greater than"),
    (CHAT, chat(max_tokens=300), "max_tokens", "limit of 256"),
    (CHAT, chat(max_completion_tokens=300), "max_completion_tokens", "limit of 256"),
    (COMP, comp(prompt=[5] * 300, max_tokens=256), "max_tokens", "maximum context length is 512"),
    (COMP, comp(prompt="x" * 600), "prompt", "limit is 511"),
    (CHAT, chat(messages=[]), "messages", "at least 1"),
    (CHAT, chat(messages=[{"role": "robot", "content": "hi"}]), "messages[0].role", "Input should be"),
    (CHAT, chat(messages=[{"role": "user"}]), "messages[0].content", "no content"),
    (CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "messages", "image_url"),
    (CHAT, chat(response_format={"type": "xml"}), "response_format.type", "not one of"),
    (CHAT, chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
     "response_format.json_schema.schema", "needs json_schema.schema"),
    (CHAT, chat(guided_regex="(unclosed"), "guided_regex", "invalid regex"),
    (CHAT, chat(guided_choice=[]), "guided_choice", "non-empty list"),
    (COMP, comp(structured_outputs={"yaml": "a: b"}), "structured_outputs.yaml", "not supported"),
    (CHAT, chat(guided_regex="a+", guided_choice=["a"]), "guided_choice", "one output constraint"),
    (CHAT, chat(top_logprobs=2), "top_logprobs", "requires logprobs"),
    (CHAT, chat(logprobs=True, top_logprobs=21), "top_logprobs", "less than or equal"),
    (CHAT, chat(tool_choice="auto"), "tool_choice", "requires tools"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}],
                tool_choice={"type": "function", "function": {"name": "g"}}), "tool_choice", "'g'"),
    (CHAT, chat(stop=[""]), "stop", "non-empty"),
    (CHAT, chat(seed=2**70), "seed", "less than or equal"),
    (CHAT, chat(presence_penalty=2.5), "presence_penalty", "less than or equal"),
    (CHAT, chat(repetition_penalty=0), "repetition_penalty", "greater than"),
    (CHAT, chat(min_p=1.5), "min_p", "less than or equal"),
    (CHAT, chat(logit_bias={"99999": 1}), "logit_bias", "outside the vocabulary"),
    (CHAT, chat(logit_bias={"5": 101}), "logit_bias", "[-100, 100]"),
    (CHAT, chat(logit_bias={"x": 1}), "logit_bias", "token ids"),
    (CHAT, chat(min_tokens=10), "min_tokens", "min_tokens"),
    (CHAT, chat(top_k=-5), "top_k", "top_k"),
    (CHAT, chat(stream="maybe"), "stream", "boolean"),
    (COMP, comp(prompt=""), "prompt", "empty"),
    (COMP, comp(prompt=[1, 2, 99999]), "prompt", "outside the vocabulary"),
    (COMP, comp(prompt=[]), "prompt", "empty"),
    (COMP, comp(echo=True), "echo", "not supported"),
    (COMP, comp(logprobs=21), "logprobs", "less than or equal"),
    (COMP, {"model": MODEL}, "prompt", "Field required"),
]


@pytest.mark.parametrize("path,body,param,words", BAD_400, ids=[f"{p[1:]}-{b[2]}" for p, *b in BAD_400])
def test_bad_fields_get_400_naming_the_field(server, path, body, param, words):
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"] and err["type"] == "invalid_request_error"


def test_invalid_json_and_unknown_routes(server):
    r = httpx.post(server.url + CHAT, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    assert httpx.get(server.url + CHAT).status_code == 405


@pytest.mark.parametrize("path,body", [(CHAT, chat(model="gpt-4o")), (COMP, comp(model="gpt-4o"))])
def test_unknown_model_is_404(server, path, body):
    r = post(server, path, body)
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["param"] == "model" and "gpt-4o" in err["message"] and err["code"] == "model_not_found"


def test_body_over_the_limit_is_413(server):
    r = post(server, COMP, comp(prompt="x" * 30_000))
    assert r.status_code == 413 and "limit is 20000 bytes" in r.json()["error"]["message"]

    def chunks():                      # no Content-Length: the limit applies while reading
        for _ in range(30):
            yield b"x" * 1000

    r = httpx.post(server.url + COMP, content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413


def test_api_key(engine):
    srv = LiveServer(create_app(engine, MODEL, api_key="sekret"))
    try:
        assert httpx.post(srv.url + COMP, json=comp()).status_code == 401
        r = httpx.post(srv.url + COMP, json=comp(), headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(srv.url + "/v1/models").status_code == 401
        # As vLLM: only /v1 is guarded; probes, scrapers and the tokenizer routes carry no key.
        for path in ("/health", "/metrics", "/version"):
            assert httpx.get(srv.url + path).status_code == 200, path
        assert httpx.post(srv.url + "/tokenize", json={"prompt": "hi"}).status_code == 200
        ok = httpx.post(srv.url + COMP, json=comp(), headers={"Authorization": "Bearer sekret"}, timeout=30)
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] is not None
    finally:
        srv.stop()


def test_queue_full_is_503_with_retry_after(server, engine, monkeypatch):
    # The queue looks full: max_waiting (64) requests already wait. (max_waiting 0 would not do:
    # a request needing more queue slots than max_waiting gets a 400, as it could never be accepted.)
    monkeypatch.setattr(engine, "_num_pending", engine.max_waiting)
    for path, body in ((CHAT, chat()), (COMP, comp()), (COMP, comp(stream=True)), (CHAT, chat(n=3))):
        r = post(server, path, body)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert "retry later" in r.json()["error"]["message"]
    monkeypatch.undo()
    assert wait_until(lambda: engine_idle(engine))
    assert post(server, CHAT, chat()).status_code == 200


def test_bad_and_good_requests_concurrently(server, engine):
    bad = [body for path, body, *_ in BAD_400 if path == CHAT][:10]
    good = [chat(max_tokens=8, temperature=0.0, ignore_eos=True, stream=i % 2 == 1) for i in range(10)]

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            reqs = [c.post(CHAT, json=b) for pair in zip(bad, good) for b in pair]
            return await asyncio.gather(*reqs)

    responses = asyncio.run(main())
    statuses = [r.status_code for r in responses]
    assert statuses[0::2] == [400] * 10 and statuses[1::2] == [200] * 10
    for r in responses[1::2]:
        assert "[DONE]" in r.text if r.headers["content-type"].startswith("text/event-stream") \
            else r.json()["usage"]["completion_tokens"] == 8
    assert wait_until(lambda: engine_idle(engine))
