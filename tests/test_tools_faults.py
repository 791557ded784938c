"""Tool-call faults: unknown tool, malformed call, a tool that raises, a timeout, a huge result, too
many calls. Each faulty request gets a tool error message or a clear finish reason; the others are
undisturbed; no KV block leaks. The model is a canned test double (it emits given text token by
token); tokenizer, detokenizer, parser, tool runtime, scheduler and KV manager are the real ones."""

from __future__ import annotations

import time

import pytest

from tandem.config import SchedulerConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.tokenizer import Tokenizer
from tandem.engine.tool_runtime import ToolOptions, ToolRuntime
from tandem.kv import KVCacheManager
from tandem.sampling_params import SamplingParams
from tandem.sched.cost_model import StepCostModel
from tandem.sched.policies import make_policy
from tandem.sched.scheduler import Scheduler
from tandem.tools.registry import ToolRegistry
from tests.doubles import CannedModel


def tool(call: str) -> str:
    return f"<tool_call>{call}</tool_call>"


@pytest.fixture()
def setup(tiny_llama):
    tok = Tokenizer(tiny_llama)
    reg = ToolRegistry.with_builtins(default_timeout_s=2.0)

    def boom(x: str) -> str:
        raise ValueError("boom")

    def slow(x: str) -> str:
        time.sleep(1.0)
        return "late"

    reg.register(boom)
    reg.register(slow, timeout_s=0.1)
    reg.register(lambda n: "z" * int(n), name="huge")
    runtime = ToolRuntime(reg, tok, max_result_chars=100)
    kv = KVCacheManager(128, 4, num_host_blocks=32)
    cost = StepCostModel()
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=500, policy="infercept"), kv,
                      make_policy("infercept", 64, cost), cost=cost)
    model = CannedModel()
    eng = LLMEngine(sched, model, tok, vocab_size=tok.vocab_size, max_model_len=500, tools=runtime)
    eos = tok.eos_token_ids[0]

    def add(texts: list[str], max_tool_calls: int = 8, tools: bool = True) -> str:
        rid = eng.add_request(prompt_token_ids=[5, 6, 7], params=SamplingParams(max_tokens=400, temperature=0),
                              tool_options=ToolOptions(max_tool_calls=max_tool_calls) if tools else None)
        model.queue[rid] = [t for text in texts for t in tok.encode(text, add_special_tokens=False)] + [eos]
        return rid

    def run() -> dict:
        outs = {}
        deadline = time.monotonic() + 30
        while eng.has_unfinished_requests() and time.monotonic() < deadline:
            got = eng.step()
            if not got:
                eng.wait_for_tools()
            outs.update({o.request_id: o for o in got if o.finished})
        assert not eng.has_unfinished_requests()
        return outs

    return eng, add, run


def test_calculator_round_trip_and_faults(setup):
    eng, add, run = setup
    ok = add([tool('{"name": "calculator", "arguments": {"expression": "(2+3)*4"}}'), " it is twenty."])
    unknown = add([tool('{"name": "teleport", "arguments": {}}'), " sorry."])
    malformed = add([tool('{"name": "calculator", "arguments": {"expression": '), " oops."])
    raises = add([tool('{"name": "boom", "arguments": {"x": "1"}}'), " hm."])
    timeout = add([tool('{"name": "slow", "arguments": {"x": "1"}}'), " waited."])
    huge = add([tool('{"name": "huge", "arguments": {"n": "5000"}}'), " long."])
    plain = add(["Just text, no tools."], tools=False)
    outs = run()
    log = {rid: outs[rid].metrics.extra.get("tools", []) for rid in outs}
    assert log[ok][0]["result"] == "20" and not log[ok][0]["error"]
    assert outs[ok].text.endswith(" it is twenty.") and outs[ok].finish_reason == "stop"
    assert "unknown tool 'teleport'" in log[unknown][0]["result"] and log[unknown][0]["error"]
    assert "malformed tool call" in log[malformed][0]["result"]
    assert "ValueError: boom" in log[raises][0]["result"]
    assert "timed out" in log[timeout][0]["result"]
    assert log[huge][0]["result"].startswith("z" * 100) and "[truncated 4900 characters]" in log[huge][0]["result"]
    assert outs[plain].text == "Just text, no tools." and "tools" not in outs[plain].metrics.extra
    for rid in (unknown, malformed, raises, timeout, huge):
        assert outs[rid].finish_reason == "stop"            # each carried on after its error message
    stats = eng.stats()
    assert stats.tool_num_calls == 6 and stats.tool_num_errors == 4
    kv = eng.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks and kv.num_free_host_blocks == kv.num_host_blocks


def test_more_tool_calls_than_allowed_finishes_with_tool_limit(setup):
    eng, add, run = setup
    call = tool('{"name": "calculator", "arguments": {"expression": "1+1"}}')
    greedy = add([call, " a", call, " b", call, " c"], max_tool_calls=2)
    fine = add([call, " done."], max_tool_calls=2)
    outs = run()
    assert outs[greedy].finish_reason == "tool_limit"
    assert len(outs[greedy].metrics.extra["tools"]) == 2
    assert outs[fine].finish_reason == "stop"
    kv = eng.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks


def test_abort_while_paused_frees_everything(setup):
    eng, add, run = setup
    rid = add([tool('{"name": "slow", "arguments": {"x": "1"}}'), " never."])
    for _ in range(200):
        eng.step()
        if eng.scheduler.num_paused:
            break
    assert eng.scheduler.num_paused == 1
    out = eng.abort_request(rid)
    assert out.finish_reason == "abort" and not eng.has_unfinished_requests()
    kv = eng.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks and kv.num_free_host_blocks == kv.num_host_blocks
