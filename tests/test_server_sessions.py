"""Sessions over HTTP (sched/retention.py): a chat call with an `x-session-id` header (or the OpenAI
`user` field) leaves its KV held for the session, and the session's next call takes it over; another
bearer token cannot; `cache_salt` keeps tenants' prefix caches apart; an over-long key is a 400."""

from __future__ import annotations

import httpx
import pytest
from server_helpers import LiveServer

from tandem import LLM
from tandem.engine.async_engine import AsyncLLMEngine
from tandem.server import create_app

MODEL = "tiny"
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
TEXT = "tell me about the sea and the sky " * 3        # ~100 byte-level tokens: several 16-token blocks

@pytest.fixture(scope="module")
def engine(tiny_llama):
    """Under InferCept's policy, which holds a session's KV (vLLM-like FCFS frees it)."""
    llm = LLM(model=str(tiny_llama), dtype="float32", progress=False, max_num_seqs=8, scheduling_policy="infercept")
    eng = AsyncLLMEngine(llm.engine)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    s = LiveServer(create_app(engine, MODEL))
    yield s
    s.stop()


def turn(server, messages, headers=None, **fields):
    body = {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0, **fields}
    r = httpx.post(server.url + CHAT, json=body, headers=headers or {}, timeout=60)
    assert r.status_code == 200, r.text
    turn.prompt_tokens = r.json()["usage"]["prompt_tokens"]
    return r.json()["choices"][0]["message"]["content"]


def adopted(engine) -> int:
    return engine.engine.scheduler.sessions.num_adopted_tokens


def test_the_next_call_of_a_session_takes_over_its_held_kv_and_others_cannot(server, engine):
    first = [{"role": "user", "content": TEXT}]
    reply = turn(server, first, {"x-session-id": "agent-1", "authorization": "Bearer alice"})
    follow = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "and the moon?"}]
    before = adopted(engine)
    turn(server, follow, {"x-session-id": "agent-1", "authorization": "Bearer bob"})     # another owner
    assert adopted(engine) == before
    reply = turn(server, first, {"x-session-id": "agent-3", "authorization": "Bearer carol"})
    turn(server, first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "and?"}],
         {"x-session-id": "agent-3", "authorization": "bearer  carol"})    # the same key, as auth reads it
    assert adopted(engine) > before
    before = adopted(engine)
    reply = turn(server, first, {"x-session-id": "agent-2"}, user="ignored-when-the-header-is-there")
    whole_blocks = turn.prompt_tokens // 16 * 16
    follow = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "and the moon?"}]
    turn(server, follow, {"x-session-id": "agent-2"})
    gained = adopted(engine) - before
    assert gained >= whole_blocks >= 32 and gained % 16 == 0     # the first prompt's whole blocks, at least
    reply = turn(server, first, user="u-7")            # the OpenAI `user` field names a session too
    before = adopted(engine)
    turn(server, first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "ok"}], user="u-7")
    assert adopted(engine) > before


def test_cache_salt_keeps_prefix_caches_apart(server, engine):
    kv = engine.engine.scheduler.kv
    prompt = "salted " + TEXT

    def hits(salt):
        before = kv.num_hit_tokens
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "cache_salt": salt}
        assert httpx.post(server.url + COMP, json=body, timeout=60).status_code == 200
        return kv.num_hit_tokens - before

    assert hits("tenant-a") == 0
    assert hits("tenant-a") > 0
    assert hits("tenant-b") == 0


def test_bad_session_fields_are_a_400(server):
    r = httpx.post(server.url + CHAT, headers={"x-session-id": "x" * 300}, timeout=60,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    assert r.status_code == 400 and "session key" in r.json()["error"]["message"]
    r = httpx.post(server.url + COMP, json={"model": MODEL, "prompt": "hi", "max_tokens": 1, "cache_salt": ""},
                   timeout=60)
    assert r.status_code == 400 and "cache_salt" in r.text
