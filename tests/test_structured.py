"""Structured outputs (llguidance): the sampler masks every step to what the grammar allows, so a
random tiny model's output still parses as the schema, matches the regex, or is one of the choices;
bad constraints are 400s naming their field; constrained requests speculate losslessly."""

from __future__ import annotations

import json
import re

import pytest
import torch

from tandem import LLM, SamplingParams, StructuredOutputs
from tandem.errors import InvalidRequestError
from tandem.structured import grammar as structured_grammar

pytestmark = pytest.mark.skipif(not structured_grammar.available(), reason="llguidance is not installed")

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tag": {"enum": ["red", "green", "blue"]}},
          "required": ["ok", "n", "tag"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(model=str(tiny_llama), dtype="float32", progress=False)


def _run(llm, so: StructuredOutputs, n: int = 6, temperature: float = 1.0, max_tokens: int = 80):
    params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i, structured_outputs=so)
              for i in range(n)]
    return llm.generate(prompt_token_ids=[[5, 6, 7, 8]] * n, sampling_params=params)


def test_spec_takes_exactly_one_constraint():
    assert StructuredOutputs(json='{"type": "object"}').json == {"type": "object"}
    assert StructuredOutputs(choice=["a", "b"]).key() == ("choice", '["a", "b"]')
    for bad in (dict(), dict(regex="a", choice=["b"]), dict(json="{not json"), dict(choice=[]),
                dict(choice="ab"), dict(regex=""), dict(json=[1])):
        with pytest.raises(InvalidRequestError):
            StructuredOutputs(**bad)


def test_json_schema_output_parses_and_validates(llm):
    import jsonschema

    outs = _run(llm, StructuredOutputs(json=SCHEMA))
    for o in outs:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), SCHEMA)
    assert len({o.text for o in outs}) > 1                  # it samples within the grammar


def test_json_object_regex_and_choice(llm):
    for o in _run(llm, StructuredOutputs(json_object=True), n=3, max_tokens=200):
        if o.finish_reason == "stop":                       # an object may run past max_tokens
            assert isinstance(json.loads(o.text), dict)
        else:
            assert o.text.startswith("{")
    for o in _run(llm, StructuredOutputs(regex=r"[0-9]{3}-[a-c]{2}")):
        assert re.fullmatch(r"[0-9]{3}-[a-c]{2}", o.text), o.text
    choices = ["positive", "negative", "neutral"]
    texts = {o.text for o in _run(llm, StructuredOutputs(choice=choices), n=12)}
    assert texts <= set(choices) and len(texts) > 1


def test_lark_grammar_and_greedy(llm):
    lark = 'start: "x=" NUM ";"\nNUM: /[1-9][0-9]?/'
    for o in _run(llm, StructuredOutputs(grammar=lark), n=2, temperature=0.0):
        assert re.fullmatch(r"x=[1-9][0-9]?;", o.text), o.text


def test_an_invalid_constraint_is_refused_before_it_runs(llm):
    with pytest.raises(InvalidRequestError) as e:
        llm.generate(prompt_token_ids=[[5, 6]], sampling_params=SamplingParams(
            structured_outputs=StructuredOutputs(regex="(unclosed", field="guided_regex")))
    assert e.value.field == "guided_regex"
    assert llm.engine.has_unfinished_requests() is False


def test_unconstrained_rows_in_the_same_batch_are_untouched(llm):
    plain = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    alone = llm.generate(prompt_token_ids=[[9, 10, 11]], sampling_params=plain)[0].token_ids
    mixed = llm.generate(prompt_token_ids=[[9, 10, 11], [5, 6, 7]], sampling_params=[
        plain, SamplingParams(max_tokens=10, temperature=0, structured_outputs=StructuredOutputs(choice=["ab"]))])
    assert mixed[0].token_ids == alone and mixed[1].text == "ab"


@pytest.mark.parametrize("frontier", [0, 2], ids=["one-pass", "frontiers"])
def test_constrained_requests_speculate_losslessly(tiny_llama, llm, frontier):
    """n-gram drafts copied from a prompt full of records: drafts the grammar refuses are cut, each
    verification row is masked by the grammar after the drafts before it, and the greedy output is
    token for token the unspeculated constrained output."""
    from tandem.config import SpecConfig

    assert SamplingParams(structured_outputs=StructuredOutputs(json=SCHEMA)).speculation_ok
    spec = LLM(model=str(tiny_llama), dtype="float32", progress=False,
               speculative=SpecConfig(method="ngram", policy="fixed", max_draft_tokens=4, frontier_size=frontier))
    record = '{"ok": true, "n": 7, "tag": "red"} {"ok": false, "n": 42, "tag": "blue"} '
    prompt = llm.tokenizer.encode(record * 3)
    cases = [StructuredOutputs(json=SCHEMA), StructuredOutputs(regex=r'(\{"ok": (true|false)\} ){2}'),
             StructuredOutputs(choice=['{"ok": true, "n": 7, "tag": "red"}', '{"ok": false}'])]
    for so in cases:
        params = SamplingParams(max_tokens=60, temperature=0, structured_outputs=so)
        want = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
        got = spec.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
        assert got.token_ids == want.token_ids and got.text == want.text, so.kind
    stats = spec.engine.scheduler.spec_stats
    assert stats.num_steps > 0 and stats.num_draft_tokens > stats.num_accepted_tokens > 0
    sampled = spec.generate(prompt_token_ids=[prompt] * 4, sampling_params=[SamplingParams(
        max_tokens=60, temperature=1.0, seed=i, structured_outputs=StructuredOutputs(json=SCHEMA)) for i in range(4)])
    import jsonschema

    for o in sampled:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), SCHEMA)


def test_grammar_masks_follow_the_drafts(llm):
    """Row j's mask is the grammar's after drafts[:j]; a refused draft's later rows repeat its mask;
    the matcher is left where it was."""
    from tandem.runner.sampler import SampleRow

    sampler = llm.engine.executor.sampler
    so = StructuredOutputs(choice=["abc", "abd"])
    params = SamplingParams(structured_outputs=so)
    row = SampleRow("mask-test", params, 0, frozenset())
    tok = llm.tokenizer
    ids = tok.encode("abc", add_special_tokens=False)
    vocab = llm.engine.vocab_size
    masks = sampler.grammar_masks(row, ids, len(ids) + 1, vocab)
    m = sampler._matcher(row)
    for j, t in enumerate(ids):                    # the same masks, consuming for real
        bits = sampler.grammar_masks(row, [], 1, vocab)[0]
        assert torch.equal(bits, masks[j]) and bits[t]
        assert m.consume_token(t)
    assert torch.equal(sampler.grammar_masks(row, [], 1, vocab)[0], masks[len(ids)])
    sampler.release("mask-test")
    bad = [ids[0], tok.encode("z", add_special_tokens=False)[0], ids[0]]
    masks = sampler.grammar_masks(row, bad, 3, vocab)
    assert torch.equal(masks[2], masks[1]) and not masks[1][bad[1]]
    assert sampler.grammar_valid_prefix(row, bad) == 1
    sampler.release("mask-test")


def test_the_server_enforces_response_format_and_vllm_fields(tiny_llama, tmp_path_factory):
    """Through the official client: a json_schema response parses and validates; guided_choice,
    structured_outputs.regex and json_object hold on chat and completions, streamed or not."""
    import jsonschema
    import openai
    from server_helpers import LiveServer, tiny_engine

    from tandem.server import create_app

    engine = tiny_engine(tiny_llama)
    server = LiveServer(create_app(engine, "tiny", max_tokens_limit=256))
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
        messages = [{"role": "user", "content": "Give me a record."}]
        r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=80, seed=1, response_format={
            "type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA, "strict": True}})
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
        r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, n=3, seed=2,
                                           extra_body={"guided_choice": ["alpha", "beta"]})
        assert {c.message.content for c in r.choices} <= {"alpha", "beta"}
        stream = client.completions.create(model="tiny", prompt="Code:", max_tokens=20, stream=True, seed=3,
                                           extra_body={"structured_outputs": {"regex": "[A-Z]{2}[0-9]{2}"}})
        text = "".join(c.choices[0].text for c in stream if c.choices)
        assert re.fullmatch("[A-Z]{2}[0-9]{2}", text), text
        r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=256, seed=4,
                                           temperature=0.0, response_format={"type": "json_object"})
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(r.choices[0].message.content), dict)
        else:
            assert r.choices[0].message.content.startswith("{")
    finally:
        server.stop()
        engine.shutdown()


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1,
                                                                                  "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}


def test_forced_tool_choice_always_yields_a_valid_call(tiny_llama, tmp_path_factory):
    """tool_choice "required" and a named function are enforced by the grammar: a random model's
    every answer is a call to an offered tool whose arguments validate, streamed or not."""
    import jsonschema
    import openai
    from server_helpers import LiveServer, long_context_copy, tiny_engine

    from tandem.server import create_app

    # the tools' system prompt is long for the tiny model's 512 positions
    engine = tiny_engine(long_context_copy(tiny_llama, tmp_path_factory.mktemp("tiny-2k")))
    server = LiveServer(create_app(engine, "tiny", max_tokens_limit=256))
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
        messages = [{"role": "user", "content": "What is the weather?"}]
        for seed in range(4):
            r = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER, TIME], seed=seed,
                                               tool_choice="required", max_tokens=200)
            calls = r.choices[0].message.tool_calls
            assert r.choices[0].finish_reason == "tool_calls" and calls
            for c in calls:
                jsonschema.validate(json.loads(c.function.arguments), schemas[c.function.name])
        named = {"type": "function", "function": {"name": "get_time"}}
        r = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER, TIME], seed=9,
                                           tool_choice=named, max_tokens=100)
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
        chunks = list(client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER], seed=3,
                                                     tool_choice="required", max_tokens=200, stream=True))
        deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
        assert deltas and all(d.function.name == "get_weather" for d in deltas)
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        with pytest.raises(openai.BadRequestError, match="both constrain the output"):
            client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER], tool_choice="required",
                                           response_format={"type": "json_object"}, max_tokens=10)
    finally:
        server.stop()
        engine.shutdown()


def test_forced_parser_reads_calls_and_keeps_a_cut_output_as_content():
    from tandem.tools.parsers.forced import ForcedToolParser

    required = ForcedToolParser(None)
    content, calls = required.parse('[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("a", {"x": 1}), ("b", {})]
    assert required.parse('[{"name": "a", "param') == ('[{"name": "a", "param', [])
    named = ForcedToolParser("f")
    stream = named.stream()
    assert stream.feed('{"q": ') == ("", []) and stream.feed('"hi"}') == ("", [])
    content, calls = stream.flush()
    assert content == "" and calls[0].name == "f" and json.loads(calls[0].arguments) == {"q": "hi"}
    assert stream.num_calls == 1


def test_the_bitmask_kernel_matches_the_tensor_path():
    """csrc's mask_by_bits_ refuses exactly the tokens whose bit is clear (vocabularies that do and do
    not fill the last 32-bit word; an all-ones row is left alone)."""
    from tandem.runner.kernels import load_cpu_kernels
    from tandem.runner.sampler import _unpack_bits

    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("the CPU kernels did not build here")
    g = torch.Generator().manual_seed(0)
    for vocab in (49152, 1000, 37):
        words = (vocab + 31) // 32
        logits = torch.randn(5, vocab, generator=g)
        bits = torch.randint(-2**31, 2**31 - 1, (3, words), generator=g, dtype=torch.int64).to(torch.int32)
        bits[0] = -1
        rows = torch.tensor([4, 0, 2])
        want = logits.clone()
        want[rows] = want[rows].masked_fill(~_unpack_bits(bits, vocab), float("-inf"))
        got = logits.clone()
        kernels.mask_by_bits_(got, rows, bits)
        assert torch.equal(got, want), vocab
        assert torch.isinf(got[2]).sum() > 0 and not torch.isinf(got[4]).any()
