"""Request fields outside the core schema: a vLLM or OpenAI field this server does not implement is
a 400 naming it unless it asks for the default; an unknown field is logged, or a 400 under
`--strict`; and the vLLM extras `request_id`, `truncate_prompt_tokens` / `truncation_side` and the
completions' `add_special_tokens` do what vLLM does."""

from __future__ import annotations

import logging

import httpx
import pytest
from server_helpers import LiveServer, module_engine

from tandem.server import create_app
from tandem.server.protocol import ACCEPTED_UNUSED, UNSUPPORTED, ChatCompletionRequest, CompletionRequest

MODEL = "tiny"
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
USER = [{"role": "user", "content": "Hello"}]

engine = module_engine("engine")


@pytest.fixture(scope="module")
def servers(engine):
    lax, strict = LiveServer(create_app(engine, MODEL)), LiveServer(create_app(engine, MODEL, strict=True))
    yield lax, strict
    lax.stop()
    strict.stop()


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": USER, "max_tokens": 2, **fields}


def comp(**fields) -> dict:
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 2, **fields}


@pytest.mark.parametrize("path,body,param", [
    (CHAT, chat(use_beam_search=True), "use_beam_search"),
    (COMP, comp(length_penalty=0.5), "length_penalty"),
    (CHAT, chat(bad_words=["no"]), "bad_words"),
    (CHAT, chat(priority=3), "priority"),
    (CHAT, chat(echo=True), "echo"),
    (CHAT, chat(allowed_token_ids=[1, 2]), "allowed_token_ids"),
    (COMP, comp(prompt_logprobs=1), "prompt_logprobs"),
    (CHAT, chat(add_special_tokens=True), "add_special_tokens"),
    (CHAT, chat(spaces_between_special_tokens=False), "spaces_between_special_tokens"),
    (CHAT, chat(functions=[{"name": "f"}]), "functions"),
    (CHAT, chat(modalities=["text", "audio"]), "modalities"),
    (CHAT, chat(priority=True), "priority"),           # True == 1 in Python, but not 0 and not an int here
])
def test_unsupported_field_with_a_non_default_value_is_a_400_naming_it(servers, path, body, param):
    r = post(servers[0], path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "not supported" in err["message"]


@pytest.mark.parametrize("body", [
    chat(use_beam_search=False, priority=0, echo=False, add_special_tokens=False, bad_words=[], length_penalty=1,
         spaces_between_special_tokens=True, modalities=["text"], include_reasoning=True, allowed_token_ids=None),
    chat(store=True, metadata={"k": "v"}, service_tier="auto", session_id="s1", user="u"),
])
def test_unsupported_fields_at_their_default_and_bookkeeping_fields_are_accepted(servers, body):
    for server in servers:                       # --strict too: these are known fields
        r = post(server, CHAT, body)
        assert r.status_code == 200, r.text


def test_unknown_field_is_logged_once_or_a_400_under_strict(servers, caplog):
    with caplog.at_level(logging.WARNING, logger="tandem.server"):
        for _ in range(2):
            assert post(servers[0], CHAT, chat(frobnicate_x=1)).status_code == 200
    hits = [r for r in caplog.records if "frobnicate_x" in r.getMessage()]
    assert len(hits) == 1 and "--strict" in hits[0].getMessage()
    r = post(servers[1], CHAT, chat(frobnicate_x=1))
    assert r.status_code == 400 and r.json()["error"]["param"] == "frobnicate_x"
    r = post(servers[1], CHAT, chat(messages=[{"role": "user", "content": "hi", "colour": "red"}]))
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].colour"
    r = post(servers[1], COMP, comp(stream_options={"include_usage": True, "x": 1}, stream=False))
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options.x"


def test_request_id_names_the_response(servers):
    assert post(servers[0], CHAT, chat(request_id="abc-1")).json()["id"] == "chatcmpl-abc-1"
    assert post(servers[0], COMP, comp(request_id="xyz")).json()["id"] == "cmpl-xyz"
    r = post(servers[0], CHAT, chat(request_id="has space"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "request_id"


def test_truncate_prompt_tokens_keeps_the_side_vllm_keeps(servers):
    prompt = [(7 * i) % 200 + 5 for i in range(40)]

    def run(p, **kw):
        r = post(servers[0], COMP, comp(prompt=p, max_tokens=6, temperature=0, **kw))
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"], r.json()["usage"]["prompt_tokens"]

    left = run(prompt, truncate_prompt_tokens=10)
    assert left == run(prompt[-10:]) and left[1] == 10
    right = run(prompt, truncate_prompt_tokens=10, truncation_side="right")
    assert right == run(prompt[:10])
    assert run(prompt, truncate_prompt_tokens=-1)[1] == 40          # -1: the context length
    assert run(prompt, truncate_prompt_tokens=100) == run(prompt)
    r = post(servers[0], CHAT, chat(truncate_prompt_tokens=3))
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 3
    for bad in (0, -2):
        r = post(servers[0], COMP, comp(truncate_prompt_tokens=bad))
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"


def test_completion_add_special_tokens(servers, engine):
    text = "Hello there"
    tok = engine.tokenizer
    for flag in (True, False):
        r = post(servers[0], COMP, comp(prompt=text, add_special_tokens=flag))
        assert r.json()["usage"]["prompt_tokens"] == len(tok.encode(text, add_special_tokens=flag))


def test_every_request_field_is_in_the_api_table():
    """docs/api.md names every field a request can carry: the schema's, and the tables above."""
    from pathlib import Path

    doc = (Path(__file__).parents[1] / "docs" / "api.md").read_text()
    names = set(ChatCompletionRequest.model_fields) | set(CompletionRequest.model_fields)
    names |= set(UNSUPPORTED) | ACCEPTED_UNUSED
    missing = sorted(n for n in names if f"`{n}`" not in doc)
    assert not missing, f"docs/api.md does not name {missing}"
