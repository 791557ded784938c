"""Server-side tools (`tandem serve --tools calculator`): the official openai client asks a question,
the model's tool call runs inside the engine, and the response is the final answer. The model is
a canned double (it writes a tool call, then an answer); everything else is real."""

from __future__ import annotations

import openai
import pytest

from tandem.config import SchedulerConfig
from tandem.engine.async_engine import AsyncLLMEngine
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.tokenizer import Tokenizer
from tandem.engine.tool_runtime import ToolRuntime
from tandem.kv import KVCacheManager
from tandem.sched.scheduler import Scheduler
from tandem.server.app import create_app
from tandem.tools.registry import ToolRegistry
from tests.doubles import CannedModel
from tests.server_helpers import LiveServer, long_context_copy, wait_until


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    model_dir = long_context_copy(tiny_llama, tmp_path_factory.mktemp("long") / "m")
    tok = Tokenizer(model_dir)
    text = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call> The answer is 42.'
    model = CannedModel(tok.encode(text, add_special_tokens=False) + [tok.eos_token_ids[0]])
    reg = ToolRegistry.with_builtins()
    kv = KVCacheManager(512, 16)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=2048, max_model_len=2048, policy="augserve"), kv)
    engine = LLMEngine(sched, model, tok, vocab_size=tok.vocab_size, max_model_len=2048,
                       tools=ToolRuntime(reg, tok))
    aengine = AsyncLLMEngine(engine)
    live = LiveServer(create_app(aengine, "canned", tools=reg))
    yield live, aengine
    live.stop()
    aengine.shutdown()


def test_tool_runs_inside_the_engine_and_the_answer_comes_back(server):
    live, aengine = server
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="x")
    resp = client.chat.completions.create(model="canned", messages=[{"role": "user", "content": "What is 6*7?"}],
                                          max_tokens=200, temperature=0)
    choice = resp.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.content.strip() == "The answer is 42."
    assert aengine.stats().tool_num_calls == 1 and aengine.stats().tool_num_errors == 0
    kv = aengine.engine.scheduler.kv
    assert wait_until(lambda: kv.num_free_blocks == kv.num_blocks)


def test_streaming_hides_the_server_run_call(server):
    live, _ = server
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="x")
    chunks = list(client.chat.completions.create(model="canned", stream=True, max_tokens=200, temperature=0,
                                                 messages=[{"role": "user", "content": "6*7?"}]))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip() == "The answer is 42."
    assert not any(c.choices and c.choices[0].delta.tool_calls for c in chunks)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
