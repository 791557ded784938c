"""The OpenAI-compatible server end to end: the official `openai` client against a real uvicorn
server over a tiny random Llama (chat, completions, streaming, usage, seeds, n, logprobs, tools),
a client leaving mid-stream (its KV blocks come back), and the Prometheus metrics."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import LiveServer, engine_idle, long_context_copy, tiny_engine, wait_until

from tandem.server import create_app
from tandem.tools.chat_format import render_chat

MODEL = "tiny"
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def served(tiny_llama, tmp_path_factory):
    engine = tiny_engine(long_context_copy(tiny_llama, tmp_path_factory.mktemp("tiny-2k")))
    app = create_app(engine, MODEL, max_tokens_limit=1024)
    server = LiveServer(app)
    yield server, engine, app
    server.stop()
    engine.shutdown()


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served[0].url}/v1", api_key="unused", max_retries=0, timeout=30)


def sse_events(url: str, body: dict) -> list[str]:
    """The raw `data:` payloads of a streamed response, in order."""
    with httpx.stream("POST", url, json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]


def test_models_and_health(served, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{served[0].url}/health").json() == {"status": "ok"}


def test_chat_completion_and_usage(served, client):
    engine = served[1]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=7, **GREEDY)
    assert r.object == "chat.completion" and r.model == MODEL and len(r.choices) == 1
    assert r.choices[0].message.role == "assistant" and isinstance(r.choices[0].message.content, str)
    assert r.choices[0].finish_reason == "length"
    prompt = render_chat(engine.tokenizer.hf, messages)
    assert r.usage.prompt_tokens == len(engine.tokenizer.encode(prompt, add_special_tokens=False))
    assert r.usage.completion_tokens == 7 and r.usage.total_tokens == r.usage.prompt_tokens + 7
    alias = client.chat.completions.create(model="default", messages=messages, max_tokens=7, **GREEDY)
    assert alias.choices[0].message.content == r.choices[0].message.content


def test_completion_and_usage(served, client):
    engine = served[1]
    r = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=5, **GREEDY)
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(engine.tokenizer.encode("The quick brown fox"))
    assert r.usage.completion_tokens == 5
    ids = engine.tokenizer.encode("The quick brown fox")
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, **GREEDY)
    assert by_ids.choices[0].text == r.choices[0].text


def test_streamed_chat_equals_non_streamed(served, client):
    messages = [{"role": "user", "content": "Tell me about the lazy dog."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, **GREEDY)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    raw = sse_events(f"{served[0].url}/v1/chat/completions",
                     {"model": MODEL, "messages": messages, "max_tokens": 4, "stream": True})
    assert raw[-1] == "[DONE]" and json.loads(raw[0])["choices"][0]["delta"]["role"] == "assistant"


def test_streamed_completion_equals_non_streamed(served, client):
    whole = client.completions.create(model=MODEL, prompt="Hello tandem", max_tokens=20, **GREEDY)
    chunks = list(client.completions.create(model=MODEL, prompt="Hello tandem", max_tokens=20, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 20
    raw = sse_events(f"{served[0].url}/v1/completions", {"prompt": "Hello", "max_tokens": 3, "stream": True})
    assert raw[-1] == "[DONE]"


def test_seed_reproducible_and_n(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Say something."}], max_tokens=12,
              temperature=1.0)
    a = client.chat.completions.create(seed=7, **kw).choices[0].message.content
    b = client.chat.completions.create(seed=7, **kw).choices[0].message.content
    assert a == b
    others = {client.chat.completions.create(seed=s, **kw).choices[0].message.content for s in (8, 9, 10)}
    assert others != {a}
    two = client.chat.completions.create(seed=7, n=2, **kw)
    assert [c.index for c in two.choices] == [0, 1]
    assert two.choices[0].message.content == a                 # choice i samples with seed + i
    assert two.choices[1].message.content == client.chat.completions.create(seed=8, **kw).choices[0].message.content
    assert two.usage.completion_tokens == 24 or all(c.finish_reason == "stop" for c in two.choices)
    comp = client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, n=3, seed=1, **GREEDY)
    assert [c.index for c in comp.choices] == [0, 1, 2] and comp.usage.completion_tokens == 12


def test_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                       logprobs=True, top_logprobs=3, **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    for tok in content:
        assert len(tok.top_logprobs) == 3 and tok.logprob <= 0
        assert tok.logprob == pytest.approx(tok.top_logprobs[0].logprob, abs=1e-4)   # greedy takes the best
        assert bytes(tok.bytes).decode("utf-8", "replace") == tok.token
    c = client.completions.create(model=MODEL, prompt="Hi", max_tokens=5, logprobs=2, **GREEDY)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert lp.text_offset[0] == 0 and all(len(t) <= 2 for t in lp.top_logprobs)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_tools_are_rendered_into_the_prompt(served, client, monkeypatch):
    engine = served[1]
    seen: list[list[int]] = []
    generate = engine.generate

    def spy(prompt, params, *, prompt_token_ids=None, request_id=None):
        seen.append(prompt_token_ids)
        return generate(prompt, params, prompt_token_ids=prompt_token_ids, request_id=request_id)

    monkeypatch.setattr(engine, "generate", spy)
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18C and sunny"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=4, **GREEDY)
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")
    prompt = engine.tokenizer.decode(seen[-1], skip_special_tokens=False)
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt and '"city"' in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\n18C and sunny\n</tool_response>" in prompt
    client.chat.completions.create(model=MODEL, messages=messages[:1], tools=[WEATHER], tool_choice="none",
                                   max_tokens=2, **GREEDY)
    assert "get_weather" not in engine.tokenizer.decode(seen[-1], skip_special_tokens=False)


def test_client_leaving_mid_stream_aborts_and_frees_kv(served):
    url, engine, app = served
    before = app.state.tandem.metrics.success.first.labels(MODEL, "abort")._value.get()
    body = {"model": MODEL, "prompt": "Hello world", "max_tokens": 1000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{url.url}/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [line for _, line in zip(range(6), lines)]
        assert any(line.startswith("data: {") for line in got)
        assert engine.engine.scheduler.num_running == 1
    assert wait_until(lambda: engine_idle(engine), 10.0)
    assert app.state.tandem.metrics.success.first.labels(MODEL, "abort")._value.get() == before + 1


def test_client_leaving_a_non_streamed_request_aborts_it(served):
    url, engine, app = served
    before = app.state.tandem.metrics.success.first.labels(MODEL, "abort")._value.get()
    body = {"model": MODEL, "prompt": "Hello world", "max_tokens": 1000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url.url}/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.3))
    assert wait_until(lambda: engine_idle(engine), 10.0)
    assert app.state.tandem.metrics.success.first.labels(MODEL, "abort")._value.get() == before + 1


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    return {s.name + json.dumps(s.labels, sort_keys=True): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_metrics(served, client):
    url, engine, _ = served
    wait_until(lambda: engine_idle(engine))
    key = json.dumps({"model_name": MODEL})
    gen_key = "tandem:generation_tokens_total" + key
    before = _metrics(url.url)
    r = client.completions.create(model=MODEL, prompt="count me", max_tokens=9, **GREEDY)
    assert wait_until(lambda: _metrics(url.url)[gen_key] == before[gen_key] + 9)
    after = _metrics(url.url)
    assert after[gen_key] == engine.stats().num_generation_tokens
    prompt_key = "tandem:prompt_tokens_total" + key
    assert after[prompt_key] == before[prompt_key] + r.usage.prompt_tokens
    stop_key = "tandem:request_success_total" + json.dumps({"finished_reason": "length", "model_name": MODEL},
                                                           sort_keys=True)
    assert after[stop_key] == before.get(stop_key, 0) + 1
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "inter_token_latency_seconds"):
        assert after[f"tandem:{name}_count" + key] > before.get(f"tandem:{name}_count" + key, 0)
    itl = f"tandem:inter_token_latency_seconds_count{key}"
    assert after[itl] - before.get(itl, 0) == 8                               # 9 tokens, 8 gaps
    for name in ("num_requests_running", "num_requests_waiting", "num_requests_paused", "kv_cache_usage_perc"):
        assert 0 <= after[f"tandem:{name}" + key] <= (1 if name == "kv_cache_usage_perc" else 100)
    for name in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
                 "tool_calls", "tool_errors"):
        assert after[f"tandem:{name}_total" + key] == 0


def test_speculative_server_streams_the_same_text(tiny_loopy):
    """A server with n-gram speculation: streamed deltas rebuild the non-streamed greedy text."""
    from tandem import LLM
    from tandem.config import SpecConfig
    from tandem.engine.async_engine import AsyncLLMEngine
    from tandem.server.app import create_app

    llm = LLM(model=str(tiny_loopy), dtype="float32", progress=False,
              speculative=SpecConfig(method="ngram", policy="fixed", max_draft_tokens=4))
    engine = AsyncLLMEngine(llm.engine)
    live = LiveServer(create_app(engine, "spec"))
    try:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="x")
        kw = dict(model="spec", prompt="hello hello hello hello", max_tokens=24, temperature=0)
        whole = client.completions.create(**kw).choices[0].text
        streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)
        assert streamed == whole and len(whole) > 0
        assert engine.stats().spec_num_draft_tokens > 0
    finally:
        live.stop()
        engine.shutdown()


def test_stream_sends_nothing_before_the_first_token(served):
    """The role chunk goes out with the first generated token (vLLM's behaviour, and what every client
    that times the first chunk measures as TTFT), not when the request is accepted."""
    import threading

    server, engine, _ = served
    gate, entered = threading.Event(), threading.Event()
    executor = engine.engine.executor
    execute = executor.execute

    def gated(plan):
        entered.set()
        gate.wait(10)
        return execute(plan)

    lines: list[tuple[float, str]] = []

    def read() -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=30) as r:
            lines.extend((time.monotonic(), x) for x in r.iter_lines() if x.startswith("data: "))

    executor.execute = gated
    try:
        reader = threading.Thread(target=read)
        reader.start()
        assert entered.wait(10)          # the first step (prefill + first token) is held
        time.sleep(0.3)
        released = time.monotonic()
        gate.set()
        reader.join(30)
    finally:
        executor.execute = execute
    assert lines and lines[0][0] >= released
    first = json.loads(lines[0][1][len("data: "):])
    assert first["choices"][0]["delta"]["role"] == "assistant"
