"""Client-side tool calls: the Hermes parser (whole and streamed agree), rendering tools and tool
turns into the prompt, and the server turning a `<tool_call>` the model wrote into `tool_calls`
(over a scripted engine, since a random tiny model will not call tools on its own)."""

from __future__ import annotations

import asyncio
import json
import random
from types import SimpleNamespace

import httpx
import openai
import pytest

from tandem.engine.llm_engine import EngineStats
from tandem.engine.tokenizer import Tokenizer
from tandem.errors import InvalidRequestError
from tandem.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tandem.server import create_app
from tandem.server.serving_chat import chat_choice
from tandem.tools.chat_format import render_chat, select_tools, template_renders_tools
from tandem.tools.parsers import get_tool_parser

PARSER = get_tool_parser("hermes")
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


# --- the parser ---------------------------------------------------------------------------------------
def test_one_call_without_content():
    content, calls = PARSER.parse(CALL)
    assert content is None and len(calls) == 1
    assert calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Paris"}
    assert calls[0].id.startswith("call_")


def test_several_calls_with_content_and_loose_whitespace():
    text = ('Let me look.\n\n<tool_call>{"name":"a","arguments":{}}</tool_call>\n'
            '<tool_call>  \n {"name": "b", "arguments": {"x": [1, 2]}}  \n</tool_call>\n')
    content, calls = PARSER.parse(text)
    assert content == "Let me look." and [c.name for c in calls] == ["a", "b"]
    assert json.loads(calls[1].arguments) == {"x": [1, 2]}


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "a", "arguments": {</tool_call>',         # bad JSON
    '<tool_call>{"arguments": {}}</tool_call>',                      # no name
    '<tool_call>["a"]</tool_call>',                                   # not an object
    'Hello <tool_call>{"name": "a"',                                  # never closed
    "Plain text with a < and <tool but no call.\n",
])
def test_malformed_calls_stay_content(text):
    assert PARSER.parse(text) == (text, [])


def test_string_arguments_and_mixed_good_and_bad():
    text = 'x <tool_call>{"name": "a", "arguments": "{\\"k\\": 1}"}</tool_call> <tool_call>oops</tool_call>'
    content, calls = PARSER.parse(text)
    assert [c.name for c in calls] == ["a"] and calls[0].arguments == '{"k": 1}'
    assert content == "x<tool_call>oops</tool_call>"


@pytest.mark.parametrize("text", [
    CALL, "Sure. " + CALL + "\nDone.", CALL + CALL, "no calls at all  \n", 'a <tool_call>{"bad"</tool_call> b',
    "<tool_c", "text then <tool_call>{\"name\": \"a\"", "  leading and trailing  "])
def test_streaming_equals_parsing_whole(text):
    want_content, want_calls = PARSER.parse(text)
    rng = random.Random(0)
    for _ in range(20):
        stream, pieces, calls, i = PARSER.stream(), [], [], 0
        while i < len(text):
            j = i + rng.randint(1, 6)
            c, k = stream.feed(text[i:j])
            pieces.append(c)
            calls += k
            i = j
        c, k = stream.flush()
        pieces.append(c)
        calls += k
        assert ("".join(pieces) or None if calls else "".join(pieces)) == want_content
        assert [(x.name, x.arguments) for x in calls] == [(x.name, x.arguments) for x in want_calls]


def test_streaming_holds_back_only_a_possible_tag():
    stream = PARSER.stream()
    assert stream.feed("Hello <tool") == ("Hello", [])
    assert stream.feed("s are fun") == (" <tools are fun", [])


# --- rendering --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf(tiny_llama):
    return Tokenizer(tiny_llama).hf


def test_template_without_tools_gets_a_hermes_system_prompt(hf):
    assert not template_renders_tools(hf)
    messages = [{"role": "system", "content": "Be nice."}, {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "18C"},
                {"role": "tool", "tool_call_id": "c2", "content": "windy"}]
    text = render_chat(hf, messages, [WEATHER], "auto")
    assert text.startswith("<|im_start|>system\nBe nice.\n\n# Tools") and json.dumps(WEATHER) in text
    assert "<|im_start|>assistant\n" + CALL + "<|im_end|>" in text
    assert "<|im_start|>user\n<tool_response>\n18C\n</tool_response>\n<tool_response>\nwindy\n</tool_response>" in text
    assert "<|im_start|>tool" not in text and text.endswith("<|im_start|>assistant\n")
    assert "must call the function get_weather" in render_chat(
        hf, messages[1:2], [WEATHER], {"type": "function", "function": {"name": "get_weather"}})
    assert "# Tools" not in render_chat(hf, messages[1:2], [WEATHER], "none")


NATIVE = ("{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %}{{ t['function']['name'] }};{% endfor %}"
          "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
          "{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.function.name }} {{ c.function.arguments.city }}"
          "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_template_that_renders_tools_is_used_as_is(tiny_llama):
    hf = Tokenizer(tiny_llama).hf
    hf.chat_template = NATIVE
    assert template_renders_tools(hf)
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "content": "18C"}]
    text = render_chat(hf, messages, [WEATHER])
    assert "TOOLS:get_weather;" in text and "CALL get_weather Paris" in text   # arguments as a dict
    assert "<|im_start|>tool\n18C" in text and "<tools>" not in text


def test_select_tools():
    assert select_tools([WEATHER], "none") == (None, "")
    assert select_tools(None, "auto") == (None, "")
    assert "at least one" in select_tools([WEATHER], "required")[1]
    with pytest.raises(InvalidRequestError) as e:
        select_tools([WEATHER], {"type": "function", "function": {"name": "nope"}})
    assert e.value.field == "tool_choice"


# --- the response builder and the HTTP path -----------------------------------------------------
def canned(text: str, delta: str, finished: bool, num_tokens: int, rid: str = "r") -> RequestOutput:
    out = CompletionOutput(0, text, list(range(1, num_tokens + 1)), "stop" if finished else None)
    return RequestOutput(rid, None, [1, 2, 3], [out], finished, RequestMetrics(arrival_time=0.0),
                         delta_text=delta, delta_token_ids=[1])


def test_chat_choice_turns_tool_call_text_into_tool_calls():
    choice = chat_choice(0, canned("Checking. " + CALL, "", True, 5), PARSER)
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    assert choice.message.tool_calls[0].function.name == "get_weather"
    plain = chat_choice(0, canned(CALL, "", True, 5), None)           # tools off: text stays text
    assert plain.finish_reason == "stop" and plain.message.content == CALL and plain.message.tool_calls is None


class ScriptedEngine:
    """An AsyncLLMEngine stand-in that 'generates' a fixed text in pieces."""

    def __init__(self, tokenizer: Tokenizer, pieces: list[str]) -> None:
        self.tokenizer = tokenizer
        self.pieces = pieces
        self.engine = SimpleNamespace(max_model_len=4096, vocab_size=tokenizer.vocab_size)

    def stats(self) -> EngineStats:
        return EngineStats(0, 0, 0.0, 1, 1, 0, 0, 0, 0, 0, 0)

    async def drain(self, timeout_s: float) -> bool:
        return True

    async def generate(self, prompt, params, *, prompt_token_ids=None, request_id=None):
        text = ""
        for k, piece in enumerate(self.pieces):
            await asyncio.sleep(0)
            text += piece
            yield canned(text, piece, k == len(self.pieces) - 1, k + 1, request_id)


def test_http_tool_calls_whole_and_streamed(tiny_llama):
    pieces = ["I will check.", "\n<tool_", 'call>\n{"name": "get_weather", ', '"arguments": {"city": "Paris"}}',
              "\n</tool_call>\n"]
    app = create_app(ScriptedEngine(Tokenizer(tiny_llama), pieces), "scripted")
    messages = [{"role": "user", "content": "Weather in Paris?"}]

    async def main():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
        client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http, max_retries=0)
        whole = await client.chat.completions.create(model="scripted", messages=messages, tools=[WEATHER])
        chunks = [c async for c in await client.chat.completions.create(
            model="scripted", messages=messages, tools=[WEATHER], stream=True)]
        off = await client.chat.completions.create(model="scripted", messages=messages, tools=[WEATHER],
                                                   tool_choice="none")
        await http.aclose()
        return whole, chunks, off

    whole, chunks, off = asyncio.run(main())
    msg = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls" and msg.content == "I will check."
    assert msg.tool_calls[0].type == "function" and msg.tool_calls[0].function.name == "get_weather"
    assert json.loads(msg.tool_calls[0].function.arguments) == {"city": "Paris"}
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "I will check."
    tool_deltas = [t for d in deltas for t in (d.tool_calls or [])]
    assert len(tool_deltas) == 1 and tool_deltas[0].index == 0 and tool_deltas[0].function.name == "get_weather"
    assert json.loads(tool_deltas[0].function.arguments) == {"city": "Paris"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert off.choices[0].finish_reason == "stop" and "<tool_call>" in off.choices[0].message.content
