"""vLLM's chat options through the HTTP server and the official openai client: --tool-call-parser,
--no-enable-auto-tool-choice (a 400 for tool_choice "auto"), --reasoning-parser (reasoning and
reasoning_content, whole and streamed), and the templating fields chat_template_kwargs,
add_generation_prompt, continue_final_message, chat_template (--trust-request-chat-template) and
documents. The model is scripted (a tiny random model writes none of these formats); the prompt it
was given is decoded to see what the template made of the request. One test runs the real engine
over canned tokens, to show special tokens reach the Mistral parser and the stop token does not."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest

from tandem.config import SchedulerConfig
from tandem.engine.async_engine import AsyncLLMEngine
from tandem.engine.llm_engine import EngineStats, LLMEngine
from tandem.engine.tokenizer import Tokenizer
from tandem.kv import KVCacheManager
from tandem.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tandem.sched.scheduler import Scheduler
from tandem.server import create_app
from tests.doubles import CannedModel
from tests.server_helpers import LiveServer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


class RecordingEngine:
    """An AsyncLLMEngine stand-in that 'generates' fixed text in pieces and records what it was asked."""

    def __init__(self, tokenizer: Tokenizer, pieces: list[str]) -> None:
        self.tokenizer = tokenizer
        self.pieces = pieces
        self.engine = SimpleNamespace(max_model_len=8192, vocab_size=tokenizer.vocab_size)
        self.requests: list[tuple[list[int], object]] = []

    def stats(self) -> EngineStats:
        return EngineStats(0, 0, 0.0, 1, 1, 0, 0, 0, 0, 0, 0)

    async def drain(self, timeout_s: float) -> bool:
        return True

    def prompt(self, k: int = -1) -> str:
        return self.tokenizer.decode(self.requests[k][0], skip_special_tokens=False)

    async def generate(self, prompt, params, *, prompt_token_ids=None, request_id=None):
        self.requests.append((prompt_token_ids, params))
        text = ""
        for k, piece in enumerate(self.pieces):
            await asyncio.sleep(0)
            text += piece
            done = k == len(self.pieces) - 1
            out = CompletionOutput(0, text, list(range(1, k + 2)), "stop" if done else None)
            yield RequestOutput(request_id, None, prompt_token_ids, [out], done, RequestMetrics(arrival_time=0.0),
                                delta_text=piece, delta_token_ids=[1])


@pytest.fixture(scope="module")
def tokenizer(tiny_llama) -> Tokenizer:
    return Tokenizer(tiny_llama)


def run(app, fn):
    """fn(openai client, raw httpx client), against `app` in-process."""
    async def main():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
        client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http, max_retries=0)
        try:
            return await fn(client, http)
        finally:
            await http.aclose()
    return asyncio.run(main())


async def whole_and_streamed(client, **kw):
    whole = await client.chat.completions.create(model="m", **kw)
    chunks = [c async for c in await client.chat.completions.create(model="m", stream=True, **kw)]
    return whole, [c.choices[0] for c in chunks if c.choices]


def joined(choices, field):
    return "".join(getattr(c.delta, field, None) or "" for c in choices)


# --- --tool-call-parser --------------------------------------------------------------------------------------
MISTRAL_PIECES = ["Let me check.", " [TOOL_", "CALLS]get_weather[AR", 'GS]{"city": ', '"Paris", "days": 2}']
PYTHONIC_PIECES = ["[get_weather(ci", "ty='Paris'), get_weather(city=", "'Rome', days=3)]"]
LLAMA_PIECES = ['<|python_tag|>{"name": "get_weather", ', '"parameters": {"city": "Paris"}}; {"name": "get_w',
                'eather", "parameters": {"city": "Rome"}}']
QWEN3_PIECES = ["<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=da",
                "ys>\n2\n</parameter>\n</function>\n</tool_call>"]


@pytest.mark.parametrize("parser,pieces,content,calls,special", [
    ("mistral", MISTRAL_PIECES, "Let me check.", [("get_weather", {"city": "Paris", "days": 2})], True),
    ("llama3_json", LLAMA_PIECES, None, [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})],
     True),
    ("pythonic", PYTHONIC_PIECES, None, [("get_weather", {"city": "Paris"}),
                                         ("get_weather", {"city": "Rome", "days": 3})], False),
    ("qwen3_coder", QWEN3_PIECES, None, [("get_weather", {"city": "Paris", "days": 2})], False),
])
def test_tool_call_parser_choice(tokenizer, parser, pieces, content, calls, special):
    engine = RecordingEngine(tokenizer, pieces)
    app = create_app(engine, "m", tool_parser=parser)
    whole, chunks = run(app, lambda c, _: whole_and_streamed(c, messages=ASK, tools=[WEATHER]))
    msg = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls" and msg.content == content
    assert [(t.function.name, json.loads(t.function.arguments)) for t in msg.tool_calls] == calls
    if parser == "mistral":
        assert all(len(t.id) == 9 and t.id.isalnum() for t in msg.tool_calls)
    deltas = [t for c in chunks for t in (c.delta.tool_calls or [])]
    assert [(t.index, t.function.name, json.loads(t.function.arguments)) for t in deltas] == \
        [(i, n, a) for i, (n, a) in enumerate(calls)]
    assert joined(chunks, "content") == (content or "") and chunks[-1].finish_reason == "tool_calls"
    # the format's markers are special tokens for mistral and llama3_json: decoded with them kept, for
    # tool requests only
    assert [p.skip_special_tokens for _, p in engine.requests] == [not special, not special]
    plain = RecordingEngine(tokenizer, pieces)
    run(create_app(plain, "m", tool_parser=parser), lambda c, _: c.chat.completions.create(model="m", messages=ASK))
    assert plain.requests[0][1].skip_special_tokens


def test_the_default_parser_is_still_hermes(tokenizer):
    engine = RecordingEngine(tokenizer, ['<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
                                         "</tool_call>"])
    resp = run(create_app(engine, "m"), lambda c, _: c.chat.completions.create(model="m", messages=ASK,
                                                                              tools=[WEATHER]))
    assert resp.choices[0].message.tool_calls[0].function.name == "get_weather"
    with pytest.raises(ValueError, match="unknown tool parser"):
        create_app(engine, "m", tool_parser="nope")
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        create_app(engine, "m", reasoning_parser="nope")


@pytest.fixture(scope="module")
def mistral_like(tiny_llama, tmp_path_factory) -> Path:
    """The tiny model's tokenizer with Mistral's [TOOL_CALLS] and [ARGS] as special tokens."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("mistral-like")
    for f in tiny_llama.iterdir():
        if f.is_file():
            (out / f.name).write_bytes(f.read_bytes())
    hf = AutoTokenizer.from_pretrained(str(tiny_llama))
    hf.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "[ARGS]"]})
    hf.save_pretrained(str(out))
    return out


def test_special_tokens_reach_the_mistral_parser_and_the_stop_token_does_not(mistral_like):
    """The real engine over canned tokens: [TOOL_CALLS] and [ARGS] are special tokens, which a plain
    decode drops; with --tool-call-parser mistral the call is found, and the EOS token decoded with
    them is not left in the content."""
    tok = Tokenizer(mistral_like)
    text = 'Checking. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.hf.convert_tokens_to_ids("[TOOL_CALLS]") in ids
    after = tok.encode(" Sunny.", add_special_tokens=False)
    model = CannedModel(ids + after + [tok.eos_token_ids[0]])
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=4096, max_model_len=4096), KVCacheManager(512, 16))
    engine = AsyncLLMEngine(LLMEngine(sched, model, tok, vocab_size=tok.vocab_size, max_model_len=4096))
    live = LiveServer(create_app(engine, "m", tool_parser="mistral"))      # a real server: the engine takes time
    try:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
        kw = dict(model="m", messages=ASK, tools=[WEATHER], max_tokens=200)
        whole = client.chat.completions.create(**kw)
        chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **kw) if c.choices]
        off = client.chat.completions.create(tool_choice="none", **kw)
    finally:
        live.stop()
        engine.shutdown()
    msg = whole.choices[0].message
    assert [(t.function.name, json.loads(t.function.arguments)) for t in msg.tool_calls] == \
        [("get_weather", {"city": "Paris"})]
    assert msg.content == "Checking.Sunny." and whole.choices[0].finish_reason == "tool_calls"
    assert joined(chunks, "content") == "Checking.Sunny." and "<|im_end|>" not in joined(chunks, "content")
    # tool_choice none: the text as a plain decode gives it, special tokens dropped
    assert off.choices[0].message.content == 'Checking. get_weather{"city": "Paris"} Sunny.'


# --- --no-enable-auto-tool-choice ------------------------------------------------------------------------------
def test_auto_tool_choice_off_refuses_auto(tokenizer):
    engine = RecordingEngine(tokenizer, ['{"city": "Paris"}'])
    app = create_app(engine, "m", enable_auto_tool_choice=False)

    async def main(client, http):
        errors = []
        for extra in ({}, {"tool_choice": "auto"}):
            with pytest.raises(openai.BadRequestError) as e:
                await client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], **extra)
            errors.append(e.value)
        named = await client.chat.completions.create(
            model="m", messages=ASK, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
        none = await client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], tool_choice="none")
        plain = await client.chat.completions.create(model="m", messages=ASK)
        return errors, named, none, plain

    errors, named, none, plain = run(app, main)
    for e in errors:
        assert e.status_code == 400 and e.param == "tool_choice"
        assert '"auto" tool choice requires --enable-auto-tool-choice' in e.message
    assert named.choices[0].message.tool_calls[0].function.name == "get_weather"      # forced calls still work
    assert none.choices[0].message.content == '{"city": "Paris"}' and plain.choices[0].message.content
    assert len(engine.requests) == 3                                                    # the refused never ran


# --- --reasoning-parser -------------------------------------------------------------------------------------------
def test_reasoning_content_whole_and_streamed(tokenizer):
    pieces = ["<think>\nThe user", " wants Paris.\n</th", "ink>\n\nIt is", " sunny."]
    app = create_app(RecordingEngine(tokenizer, pieces), "m", reasoning_parser="deepseek_r1")
    whole, chunks = run(app, lambda c, _: whole_and_streamed(c, messages=ASK))
    msg = whole.choices[0].message
    assert msg.reasoning_content == msg.reasoning == "\nThe user wants Paris.\n"
    assert msg.content == "\n\nIt is sunny." and whole.choices[0].finish_reason == "stop"
    assert joined(chunks, "reasoning_content") == joined(chunks, "reasoning") == "\nThe user wants Paris.\n"
    assert joined(chunks, "content") == "\n\nIt is sunny."
    first_content = next(i for i, c in enumerate(chunks) if c.delta.content)
    assert not joined(chunks[first_content:], "reasoning_content")      # the reasoning, then the answer


def test_reasoning_then_tool_call_and_options(tokenizer):
    pieces = ["Need the", " weather.\n</think>\n\n<tool_call>\n{\"name\": \"get_weather\", ",
              "\"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"]
    app = create_app(RecordingEngine(tokenizer, pieces), "m", reasoning_parser="qwen3", tool_parser="qwen3")

    async def main(client, http):      # (one event loop per app: its drain event belongs to the first)
        whole, chunks = await whole_and_streamed(client, messages=ASK, tools=[WEATHER])
        hidden = await client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER],
                                                      extra_body={"include_reasoning": False})
        off = await client.chat.completions.create(model="m", messages=ASK, extra_body={
            "chat_template_kwargs": {"enable_thinking": False}})
        raw = await http.post("/v1/chat/completions", json={"messages": ASK})
        return whole, chunks, hidden, off, raw.json()

    whole, chunks, hidden, off, raw = run(app, main)
    msg = whole.choices[0].message
    assert msg.reasoning_content == "Need the weather.\n" and msg.content is None
    assert msg.tool_calls[0].function.name == "get_weather" and whole.choices[0].finish_reason == "tool_calls"
    assert joined(chunks, "reasoning_content") == "Need the weather.\n" and joined(chunks, "content") == ""
    assert [t.function.name for c in chunks for t in (c.delta.tool_calls or [])] == ["get_weather"]
    assert hidden.choices[0].message.reasoning_content is None and hidden.choices[0].message.tool_calls
    # Qwen3 with thinking off: no reasoning split, the text is the content
    assert off.choices[0].message.content == "".join(pieces) and off.choices[0].message.reasoning_content is None
    assert raw["choices"][0]["message"]["reasoning"] == raw["choices"][0]["message"]["reasoning_content"] \
        == "Need the weather.\n"


def test_no_reasoning_parser_leaves_the_text_alone(tokenizer):
    pieces = ["<think>x</think>", "answer"]
    resp = run(create_app(RecordingEngine(tokenizer, pieces), "m"),
               lambda c, http: http.post("/v1/chat/completions", json={"messages": ASK}))
    msg = resp.json()["choices"][0]["message"]
    assert msg["content"] == "<think>x</think>answer" and msg["reasoning_content"] is None


def test_structured_output_is_not_split_into_reasoning(tokenizer):
    """A grammar shapes the output from its first token (no <think> section): all of it is content."""
    engine = RecordingEngine(tokenizer, ['{"a": 1}'])
    resp = run(create_app(engine, "m", reasoning_parser="qwen3"), lambda c, _: c.chat.completions.create(
        model="m", messages=ASK, response_format={"type": "json_object"}))
    assert resp.choices[0].message.content == '{"a": 1}' and resp.choices[0].message.reasoning_content is None


# --- templating fields ------------------------------------------------------------------------------------------
KWARGS_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                   "{% if documents %}DOCS:{% for d in documents %}[{{ d['title'] }}: {{ d['text'] }}]{% endfor %}\n"
                   "{% endif %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                   "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
                   "{% endif %}{% if persona %}PERSONA={{ persona }}{% endif %}")


@pytest.fixture
def templated(tiny_llama):
    tok = Tokenizer(tiny_llama)
    tok.hf.chat_template = KWARGS_TEMPLATE
    return tok


def test_chat_template_kwargs_reach_the_template(templated):
    engine = RecordingEngine(templated, ["ok"])
    app = create_app(engine, "m")

    async def main(client, http):
        await client.chat.completions.create(model="m", messages=ASK, extra_body={
            "chat_template_kwargs": {"enable_thinking": False, "persona": "pirate", "unused_var": 1,
                                     "add_generation_prompt": False}})
        await client.chat.completions.create(model="m", messages=ASK)
        await client.chat.completions.create(model="m", messages=ASK, extra_body={
            "documents": [{"title": "Paris", "text": "Sunny all week."}]})
        with pytest.raises(openai.BadRequestError) as e:
            await client.chat.completions.create(model="m", messages=ASK, extra_body={
                "chat_template_kwargs": {"tokenize": True}})
        return e.value

    err = run(app, main)
    thinking_off, default, docs = engine.prompt(0), engine.prompt(1), engine.prompt(2)
    # the request's add_generation_prompt (true) wins over the one in chat_template_kwargs, as in vLLM
    assert thinking_off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nPERSONA=pirate")
    assert default.endswith("Weather in Paris?<|im_end|>\n<|im_start|>assistant\n")
    assert "DOCS:[Paris: Sunny all week.]<|im_start|>assistant\n" in docs      # (jinja trims the newline)
    assert err.status_code == 400 and err.param == "chat_template_kwargs.tokenize"
    assert len(engine.requests) == 3


def test_add_generation_prompt_and_continue_final_message(templated):
    engine = RecordingEngine(templated, [" and sunny."])
    app = create_app(engine, "m")
    prefill = ASK + [{"role": "assistant", "content": "It is warm"}]

    async def main(client, http):
        cont = await client.chat.completions.create(model="m", messages=prefill, extra_body={
            "continue_final_message": True, "add_generation_prompt": False})
        await client.chat.completions.create(model="m", messages=prefill, extra_body={"continue_final_message": True})
        await client.chat.completions.create(model="m", messages=ASK, extra_body={"add_generation_prompt": False})
        errors = []
        for body in ({"continue_final_message": True, "add_generation_prompt": True},
                     {"continue_final_message": True, "add_generation_prompt": False,
                      "messages": ASK + [{"role": "assistant", "content": ""}]}):
            r = await http.post("/v1/chat/completions", json={"messages": prefill, **body})
            errors.append((r.status_code, r.json()["error"]["param"]))
        return cont, errors

    cont, errors = run(app, main)
    assert engine.prompt(0).endswith("<|im_start|>assistant\nIt is warm")         # left open, no new turn
    assert engine.prompt(1) == engine.prompt(0)        # add_generation_prompt's default gives way to continuing
    assert engine.prompt(2).endswith("Weather in Paris?<|im_end|>\n")
    assert cont.choices[0].message.content == " and sunny."
    assert errors == [(400, "continue_final_message"), (400, "continue_final_message")]


def test_request_chat_template_needs_trust(tokenizer):
    template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}{% if add_generation_prompt %}GO{% endif %}"
    untrusted, trusted = RecordingEngine(tokenizer, ["x"]), RecordingEngine(tokenizer, ["x"])

    async def refused(client, http):
        return await http.post("/v1/chat/completions", json={"messages": ASK, "chat_template": template})

    r = run(create_app(untrusted, "m"), refused)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
    assert "--trust-request-chat-template" in r.json()["error"]["message"] and not untrusted.requests

    async def accepted(client, http):
        await client.chat.completions.create(model="m", messages=ASK, extra_body={"chat_template": template})
        return await http.post("/v1/chat/completions", json={"messages": ASK, "chat_template": "{% for %}"})

    bad = run(create_app(trusted, "m", trust_request_chat_template=True), accepted)
    assert trusted.prompt(0) == "<<Weather in Paris?>>GO"
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template"


def test_field_types_are_checked(tokenizer):
    app = create_app(RecordingEngine(tokenizer, ["x"]), "m")

    async def main(client, http):
        out = []
        for body in ({"chat_template_kwargs": "enable_thinking"}, {"continue_final_message": "yes"},
                     {"documents": [{"title": 1}]}, {"include_reasoning": 0}):
            r = await http.post("/v1/chat/completions", json={"messages": ASK, **body})
            out.append((r.status_code, r.json()["error"]["param"].split(".")[0].split("[")[0]))
        return out

    assert run(app, main) == [(400, "chat_template_kwargs"), (400, "continue_final_message"), (400, "documents"),
                              (400, "include_reasoning")]


# --- tandem serve's flags -----------------------------------------------------------------------------------------
def test_serve_flags_reach_the_app(monkeypatch):
    from tandem.cli import build_parser
    from tandem.server import launch

    a = build_parser().parse_args(["serve"])
    assert (a.tool_call_parser, a.enable_auto_tool_choice, a.reasoning_parser, a.trust_request_chat_template) == \
        ("hermes", True, None, False)
    a = build_parser().parse_args(["serve", "--tool-call-parser", "mistral", "--no-enable-auto-tool-choice",
                                   "--reasoning-parser", "deepseek_r1", "--trust-request-chat-template"])
    assert (a.tool_call_parser, a.enable_auto_tool_choice, a.reasoning_parser, a.trust_request_chat_template) == \
        ("mistral", False, "deepseek_r1", True)
    assert build_parser().parse_args(["serve", "--enable-auto-tool-choice"]).enable_auto_tool_choice
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--tool-call-parser", "nope"])

    seen = {}
    monkeypatch.setattr(launch, "create_app", lambda engine, name, **kw: seen.update(kw) or SimpleNamespace())
    monkeypatch.setattr(launch, "make_server", lambda app, **kw: SimpleNamespace(run=lambda: None))
    launch.serve(SimpleNamespace(shutdown=lambda: None), "m", out=open("/dev/null", "w"), tool_parser="pythonic",
                 enable_auto_tool_choice=False, reasoning_parser="qwen3", trust_request_chat_template=True)
    assert (seen["tool_parser"], seen["enable_auto_tool_choice"], seen["reasoning_parser"],
            seen["trust_request_chat_template"]) == ("pythonic", False, "qwen3", True)
