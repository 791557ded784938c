"""Tool-call parsers (llama3_json, mistral, pythonic, qwen3_coder, qwen3) and reasoning parsers
(deepseek_r1, qwen3) on outputs written the way those models write them: the calls and content
parsed whole, the same when the text is streamed in any pieces, malformed calls left in the
content, and nothing ever raising."""

from __future__ import annotations

import json
import random
import string

import pytest

from tandem.tools.output import OutputStream, parse_output
from tandem.tools.parsers import ALIASES, TOOL_PARSERS, get_tool_parser
from tandem.tools.reasoning import REASONING_PARSERS, get_reasoning_parser

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "ratio": {"type": "number"}, "tags": {"type": "array"}, "opts": {"type": "object"},
        "note": {"type": ["string", "null"]}, "zip": {"type": "string"}, "unit": {"enum": ["c", "f"]}}}}}
TOOLS = [WEATHER]


def calls_of(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


def streamed(parser, text: str, rng: random.Random, max_piece: int = 6):
    """Feed `text` in random pieces; (content as parse() gives it, calls)."""
    stream, pieces, calls, i = parser.stream(), [], [], 0
    while i < len(text):
        j = i + rng.randint(1, max_piece)
        content, found = stream.feed(text[i:j])
        pieces.append(content)
        calls += found
        i = j
    content, found = stream.flush()
    pieces.append(content)
    calls += found
    content = "".join(pieces)
    return (content or None) if calls else content, calls


def assert_streams_like_whole(parser, text: str, tries: int = 30) -> None:
    want_content, want_calls = parser.parse(text)
    rng = random.Random(text)
    for k in range(tries):
        content, calls = streamed(parser, text, rng, 1 if k == 0 else 2 + k % 7)
        assert content == want_content, (text, k)
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in want_calls], (text, k)


# --- recorded-style outputs: (parser, text, content, calls) ----------------------------------------------
CASES = [
    # Llama 3.1 (with <|python_tag|>) and 3.2 (bare JSON), one or several calls
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "San Francisco, CA"}}',
     None, [("get_weather", {"city": "San Francisco, CA"})]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Boston", "days": 2}}',
     None, [("get_weather", {"city": "Boston", "days": 2})]),
    ("llama3_json", '{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": [1, 2]}}',
     None, [("a", {}), ("b", {"x": [1, 2]})]),
    ("llama3_json", '\n\n{"type": "function", "name": "a", "parameters": {"q": "}{"}}\n',
     None, [("a", {"q": "}{"})]),
    ("llama3_json", '{"name": "a", "parameters": {}}\n\nI called a.', "I called a.", [("a", {})]),
    ("llama3_json", '{"name": "a", "parameters": "{\\"k\\": 1}"}', None, [("a", {"k": 1})]),
    # Mistral: the older JSON array (Mistral 7B v0.3 writes a space after the marker) and v11+ name[ARGS]{...}
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}]',
     None, [("get_weather", {"city": "Paris", "unit": "c"})]),
    ("mistral", '[TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"n": 1}}]',
     None, [("a", {}), ("b", {"n": 1})]),
    ("mistral", 'Let me check. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
     "Let me check.", [("get_weather", {"city": "Paris"})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}',
     None, [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]),
    ("mistral", '[TOOL_CALLS]get_weather{"city": "Lyon"}', None, [("get_weather", {"city": "Lyon"})]),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"s": "[TOOL_CALLS] inside a string"} and then some text',
     "and then some text", [("f", {"s": "[TOOL_CALLS] inside a string"})]),
    # Pythonic: Llama 3.2 / ToolACE lists, Llama 4 inside <|python_start|> ... <|python_end|>
    ("pythonic", "[get_weather(city='San Francisco', metric=True), get_time(timezone=\"PST\")]",
     None, [("get_weather", {"city": "San Francisco", "metric": True}), ("get_time", {"timezone": "PST"})]),
    ("pythonic", '<|python_start|>[get_weather(city="Paris", days=3)]<|python_end|>',
     None, [("get_weather", {"city": "Paris", "days": 3})]),
    ("pythonic", "[ns.search(q='a)b]c', opts={'k': [1, (2, 3)], 'n': None}, x=-1.5)]",
     None, [("ns.search", {"q": "a)b]c", "opts": {"k": [1, [2, 3]], "n": None}, "x": -1.5})]),
    ("pythonic", "[f(s='''multi\nline ] text''')]\nDone.", "Done.", [("f", {"s": "multi\nline ] text"})]),
    ("pythonic", "[get_time()]", None, [("get_time", {})]),
    # Qwen3-Coder XML, parameters typed by the tool's schema
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n"
                    "<parameter=ratio>\n0.5\n</parameter>\n<parameter=tags>\n[\"a\", \"b\"]\n</parameter>\n"
                    "<parameter=opts>\n{\"k\": 1}\n</parameter>\n<parameter=note>\nnull\n</parameter>\n"
                    "<parameter=zip>\n07001\n</parameter>\n<parameter=unit>\nc\n</parameter>\n</function>\n"
                    "</tool_call>",
     None, [("get_weather", {"city": "Paris", "days": 3, "metric": True, "ratio": 0.5, "tags": ["a", "b"],
                             "opts": {"k": 1}, "note": None, "zip": "07001", "unit": "c"})]),
    ("qwen3_coder", "I'll look.\n\n<tool_call>\n<function=unknown_fn>\n<parameter=n>\n42\n</parameter>\n"
                    "<parameter=s>\nplain words\n</parameter>\n<parameter=l>\n[1, 2]\n</parameter>\n</function>\n"
                    "</tool_call>",
     "I'll look.", [("unknown_fn", {"n": 42, "s": "plain words", "l": [1, 2]})]),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n<parameter=days>\nseven\n"
                    "</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
     None, [("get_weather", {"city": "Rome", "days": "seven"}), ("get_time", {})]),
    ("qwen3_coder", "<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>",
     None, [("get_weather", {"city": "Oslo"})]),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nBern\n</parameter>\n</function>",
     None, [("get_weather", {"city": "Bern"})]),        # </tool_call> cut off at the very end
    # Qwen3: Hermes JSON and XML blocks, each read as written
    ("qwen3", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
              "<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
     None, [("get_weather", {"city": "Paris"}), ("get_weather", {"days": 2})]),
    ("qwen3", 'Sure.\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>', "Sure.", [("a", {})]),
]


@pytest.mark.parametrize("name,text,content,calls", CASES, ids=lambda v: v if isinstance(v, str) and
                         v in TOOL_PARSERS else "")
def test_parses_recorded_outputs(name, text, content, calls):
    parser = get_tool_parser(name, TOOLS)
    got_content, got_calls = parser.parse(text)
    assert got_content == content
    assert calls_of(got_calls) == calls
    assert_streams_like_whole(parser, text)


# --- malformed calls stay content, exactly as written -------------------------------------------------------
MALFORMED = [
    ("llama3_json", 'Here it is: {"name": "a", "parameters": {}}'),        # prose first: not a call
    ("llama3_json", '{"name": "John", "age": 31}'),                          # no parameters / arguments
    ("llama3_json", '{"name": "a", "parameters": {"x": 1}'),                 # cut off
    ("llama3_json", '<|python_tag|>brave_search.call(query="weather")'),     # Llama's built-in tool syntax
    ("llama3_json", '{"name": "a", "parameters": [1]}'),
    ("llama3_json", '{"name": "a", "parameters": {}, "arguments": {}}'),
    ("llama3_json", "<|python_tag|>"),
    ("mistral", "[TOOL_CALLS]Sorry, I cannot call tools."),
    ("mistral", '[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}'),        # cut off
    ("mistral", '[TOOL_CALLS][{"arguments": {}}]'),                          # no name
    ("mistral", '[TOOL_CALLS]get weather[ARGS]{"city": "x"}'),              # a space in the name
    ("mistral", "[TOOL_CALLS]f[ARGS]not json"),
    ("mistral", "Plain text with [TOOL_CALL and [brackets]."),
    ("pythonic", "[1, 2, 3] are the numbers."),
    ("pythonic", "[get_weather('Paris')]"),                                  # positional argument
    ("pythonic", "[get_weather(city=open('/etc/passwd'))]"),                 # not a literal
    ("pythonic", "[get_weather(**kw)]"),
    ("pythonic", "[get_weather(city='Paris'"),                               # cut off
    ("pythonic", "Calling [f()] now"),
    ("pythonic", "[f(x={1, 2})]"),                                           # a set has no JSON form
    ("qwen3_coder", "<tool_call>\n<function=bad name>\n</function>\n</tool_call>"),
    ("qwen3_coder", "<tool_call>\n<function=f>\nstray text\n<parameter=a>\n1\n</parameter>\n</function>\n"
                    "</tool_call>"),
    ("qwen3_coder", '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'),   # JSON is qwen3's, not coder's
    ("qwen3_coder", "<tool_call>\n<function=f>\n<parameter=a>\n1"),                    # cut off
    ("qwen3", "<tool_call>not a call</tool_call>"),
    ("qwen3", '<tool_call>{"name": "f", "arguments": {</tool_call>'),
]


@pytest.mark.parametrize("name,text", MALFORMED)
def test_malformed_calls_stay_in_the_content(name, text):
    parser = get_tool_parser(name, TOOLS)
    assert parser.parse(text) == (text, [])
    assert_streams_like_whole(parser, text)


def test_a_bad_call_after_good_ones_keeps_them():
    content, calls = get_tool_parser("llama3_json").parse('{"name": "a", "parameters": {}}; {"name": oops}')
    assert calls_of(calls) == [("a", {})] and content == '; {"name": oops}'
    text = '[TOOL_CALLS]a[ARGS]{}[TOOL_CALLS]b[ARGS]{bad}'
    content, calls = get_tool_parser("mistral").parse(text)
    assert calls_of(calls) == [("a", {})] and content == "[TOOL_CALLS]b[ARGS]{bad}"
    content, calls = get_tool_parser("qwen3").parse('<tool_call>{"name": "a", "arguments": {}}</tool_call>'
                                                    "<tool_call>oops</tool_call>")
    assert calls_of(calls) == [("a", {})] and content == "<tool_call>oops</tool_call>"


def test_mistral_ids_are_nine_alphanumerics():
    _, calls = get_tool_parser("mistral").parse('[TOOL_CALLS][{"name": "a", "arguments": {}}, '
                                                '{"name": "b", "arguments": {}}]')
    assert len(calls) == 2 and calls[0].id != calls[1].id
    for c in calls:
        assert len(c.id) == 9 and c.id.isalnum() and c.id.isascii()
    _, calls = get_tool_parser("llama3_json").parse('{"name": "a", "parameters": {}}')
    assert calls[0].id.startswith("call_")                 # the others keep Tandem's ids


def test_qwen3_coder_types_follow_the_schema_or_json():
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n"
            "<parameter=days>\n3.0\n</parameter>\n<parameter=metric>\nmaybe\n</parameter>\n"
            "<parameter=extra>\n{\"a\": true}\n</parameter>\n</function>\n</tool_call>")
    _, calls = get_tool_parser("qwen3_coder", TOOLS).parse(text)
    # a string stays a string; 3.0 is no integer but reads as JSON; "maybe" is no boolean: a string;
    # a parameter the schema does not list is read as JSON
    assert calls_of(calls) == [("get_weather", {"city": "42", "days": 3.0, "metric": "maybe", "extra": {"a": True}})]
    _, calls = get_tool_parser("qwen3_coder").parse(text)      # no tools known: JSON where it parses
    assert calls_of(calls) == [("get_weather", {"city": 42, "days": 3.0, "metric": "maybe", "extra": {"a": True}})]


def test_streaming_shows_content_before_a_call_arrives():
    stream = get_tool_parser("mistral").stream()
    assert stream.feed("Checking the weather [TOOL") == ("Checking the weather", [])
    assert stream.feed('_CALLS]get_weather[ARGS]{"city": ') == ("", [])
    content, calls = stream.feed('"Paris"}')
    assert content == "" and calls_of(calls) == [("get_weather", {"city": "Paris"})]
    stream = get_tool_parser("llama3_json").stream()
    assert stream.feed("Hello") == ("Hello", [])              # not a call: shown at once
    stream = get_tool_parser("qwen3_coder").stream()
    assert stream.feed("a <func") == ("a", [])
    assert stream.feed("tion") == ("", [])
    assert stream.feed("al programming") == (" <functional programming", [])


@pytest.mark.parametrize("name", TOOL_PARSERS)
def test_parsers_never_raise_and_always_stream_like_whole(name):
    """Random text built from each format's own pieces: parse() never raises, streaming agrees."""
    pieces = ["<|python_tag|>", "[TOOL_CALLS]", "[ARGS]", "<tool_call>", "</tool_call>", "<function=f>",
              "</function>", "<parameter=a>", "</parameter>", "<|python_start|>", "<|python_end|>", '{"name": "f"',
              ', "arguments": {}}', ', "parameters": {"x": 1}}', "[f(a=1)]", "f(", ")", "[", "]", "{", "}", '"', "'",
              ";", "\\", "\n", " ", "hello", "\u00e9\u4f60"]
    rng = random.Random(name)
    parser = get_tool_parser(name, TOOLS)
    for _ in range(150):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        text += "".join(rng.choice(string.printable) for _ in range(rng.randint(0, 3)))
        assert_streams_like_whole(parser, text, tries=4)


def test_unknown_parser_name_and_vllm_aliases():
    with pytest.raises(ValueError, match="known"):
        get_tool_parser("nope")
    assert {k: get_tool_parser(k).name for k in ALIASES} == {
        "qwen3_json": "hermes", "qwen3_xml": "qwen3_coder", "llama4_json": "llama3_json",
        "llama4_pythonic": "pythonic"}


def test_special_token_needs():
    assert get_tool_parser("mistral").needs_special_tokens and get_tool_parser("llama3_json").needs_special_tokens
    assert not getattr(get_tool_parser("hermes"), "needs_special_tokens", False)
    assert not get_tool_parser("qwen3").needs_special_tokens


# --- reasoning ------------------------------------------------------------------------------------------------
# (parser, chat_template_kwargs, text, reasoning, content): vLLM 0.32's answers for these texts
REASONING = [
    ("deepseek_r1", None, "<think>Let me think.</think>The answer is 4.", "Let me think.", "The answer is 4."),
    ("deepseek_r1", None, "Let me think.\n</think>\n\nThe answer is 4.", "Let me think.\n", "\n\nThe answer is 4."),
    ("deepseek_r1", None, "\n<think>\nabc\n</think>\n\nHello", "\nabc\n", "\n\nHello"),
    ("deepseek_r1", None, "Still thinking, cut off", "Still thinking, cut off", None),
    ("deepseek_r1", None, "<think>abc", "abc", None),
    ("deepseek_r1", None, "abc</think>", "abc", None),
    ("deepseek_r1", None, "a</think>b</think>c", "a", "b</think>c"),
    ("deepseek_r1", None, "", None, None),
    ("qwen3", None, "<think>\nabc\n</think>\n\nHello", "\nabc\n", "\n\nHello"),
    ("qwen3", None, "\n<think>\nabc\n</think>\n\nHello", "\n\nabc\n", "\n\nHello"),
    ("qwen3", None, "abc</think>Hello", "abc", "Hello"),
    ("qwen3", None, "Hello there", "Hello there", None),
    ("qwen3", None, "a</think>b</think>c", "a", "bc"),
    ("qwen3", None, "pre<think>abc</think>x", "preabc", "x"),
    ("qwen3", None, 'abc<tool_call>{"name": "f"}</tool_call>', "abc", '<tool_call>{"name": "f"}</tool_call>'),
    ("qwen3", {"enable_thinking": False}, "Hello there", None, "Hello there"),
    ("qwen3", {"enable_thinking": False}, "<think>abc</think>Hello", None, "<think>abc</think>Hello"),
    ("qwen3", {"enable_thinking": True}, "abc</think>Hello", "abc", "Hello"),
]


@pytest.mark.parametrize("name,kwargs,text,reasoning,content", REASONING)
def test_reasoning_split(name, kwargs, text, reasoning, content):
    parser = get_reasoning_parser(name, kwargs)
    assert parser.parse(text) == (reasoning, content)
    rng = random.Random(text)
    for k in range(30):
        stream, thought, said, i = parser.stream(), [], [], 0
        while i < len(text):
            j = i + (1 if k == 0 else rng.randint(1, 5))
            r, c = stream.feed(text[i:j])
            thought.append(r)
            said.append(c)
            i = j
        r, c = stream.flush()
        assert ("".join(thought) + r or None, "".join(said) + c or None) == (reasoning, content)


def test_reasoning_streams_as_it_comes():
    stream = get_reasoning_parser("deepseek_r1").stream()
    assert stream.feed("I think") == ("I think", "")
    assert stream.feed(" so</thi") == (" so", "")            # a partial </think> is held back
    assert stream.feed("nk>Yes") == ("", "Yes")
    assert stream.feed(" indeed") == ("", " indeed")


def test_reasoning_then_tool_calls():
    """The tool parser reads what follows the reasoning (Qwen3 may call a tool right from its thoughts)."""
    text = ("<think>\nThe user wants the weather.\n</think>\n\n<tool_call>\n"
            '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    tools, reasoning = get_tool_parser("qwen3", TOOLS), get_reasoning_parser("qwen3")
    want = ("\nThe user wants the weather.\n", None, [("get_weather", {"city": "Paris"})])
    thought, content, calls = parse_output(text, tools, reasoning)
    assert (thought, content, calls_of(calls)) == want
    direct = parse_output("Need weather.<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                          "</parameter>\n</function>\n</tool_call>", tools, reasoning)
    assert (direct[0], direct[1], calls_of(direct[2])) == ("Need weather.", None, [("get_weather", {"city": "Paris"})])
    rng = random.Random(0)
    for _ in range(30):
        stream, r, c, found, i = OutputStream(tools, reasoning), "", "", [], 0
        while i < len(text):
            j = i + rng.randint(1, 7)
            a, b, k = stream.feed(text[i:j], j >= len(text))
            r, c, found, i = r + a, c + b, found + k, j
        assert (r, c or None, calls_of(found)) == want and stream.num_calls == 1


@pytest.mark.parametrize("name", REASONING_PARSERS)
def test_reasoning_parsers_never_raise(name):
    pieces = ["<think>", "</think>", "<tool_call>", "</", "<", "think", ">", "\n", "a", "<thi"]
    rng = random.Random(name)
    parser = get_reasoning_parser(name)
    for _ in range(200):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 10)))
        whole = parser.parse(text)
        stream, r, c = parser.stream(), "", ""
        for ch in text:
            a, b = stream.feed(ch)
            r, c = r + a, c + b
        a, b = stream.flush()
        assert (r + a or None, c + b or None) == whole


def test_unknown_reasoning_parser():
    with pytest.raises(ValueError, match="known"):
        get_reasoning_parser("nope")
