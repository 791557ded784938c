"""Tool-call faults: unknown tool, malformed call, a tool that raises, a timeout, a 10 MB result, too
many calls. Each faulty request gets a tool error message or a clear finish reason; the others are
undisturbed; no KV block leaks. The model is a canned test double (it emits given text token by
token); tokenizer, detokenizer, parser, tool runtime, scheduler and KV manager are the real ones."""

from __future__ import annotations

import threading
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
from tandem.tools.builtins import CalculatorError, calculator
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
    huge = add([tool('{"name": "huge", "arguments": {"n": "10485760"}}'), " long."])      # 10 MB
    plain = add(["Just text, no tools."], tools=False)
    outs = run()
    log = {rid: outs[rid].metrics.tool_calls for rid in outs}
    assert log[ok][0]["result"] == "20" and not log[ok][0]["error"]
    assert outs[ok].text.endswith(" it is twenty.") and outs[ok].finish_reason == "stop"
    assert "unknown tool 'teleport'" in log[unknown][0]["result"] and log[unknown][0]["error"]
    assert "malformed tool call" in log[malformed][0]["result"]
    assert "ValueError: boom" in log[raises][0]["result"]
    assert "timed out" in log[timeout][0]["result"]
    assert log[huge][0]["result"].startswith("z" * 100) and "[truncated 10485660 characters]" in log[huge][0]["result"]
    assert outs[plain].text == "Just text, no tools." and outs[plain].metrics.tool_calls == []
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
    assert len(outs[greedy].metrics.tool_calls) == 2
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


# --- the calculator bounds its result's size before computing (issue 16, defect 5) ------------------
def _in_thread(fn, timeout_s: float = 5.0):
    """fn() on a daemon thread: (finished, result or exception). A CPU-bound runaway does not finish."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except Exception as e:  # noqa: BLE001 - handed to the test
            box["value"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout_s)
    return not t.is_alive(), box.get("value")


@pytest.mark.parametrize("expr", ["((10**20)**999)**999", "(10**20)**999", "(2**999)**999", "(9**999)*(9**999)*(9**999)"
                                  "*(9**999)*(9**999)", "(7**900)**6", "-(10**20)**999", "round(1, -100000000)",
                                  "max(1, (10**20)**999)", "(10**20)**(999)*(10**20)**999"])
def test_calculator_refuses_huge_results_quickly(expr):
    finished, value = _in_thread(lambda: calculator(expr))
    assert finished, f"{expr} still computing"
    assert isinstance(value, CalculatorError) and "too large" in str(value), value


@pytest.mark.parametrize("expr,expected", [("2**100", str(2**100)), ("37*91", "3367"), ("(10**20)**10", str(10**200)),
                                          ("2**0.5", str(2**0.5)), ("10**300 * 10**300", str(10**600)),
                                          ("(-3)**3", "-27"), ("round(1234.5678, 2)", "1234.57"),
                                          ("round(123456, -3)", "123000"), ("2.5**1000", None)])
def test_calculator_still_computes_reasonable_sizes(expr, expected):
    if expected is None:                                      # float overflow: an error, computed at once
        with pytest.raises(CalculatorError):
            calculator(expr)
    else:
        assert calculator(expr) == expected


# --- hung tools do not hold the workers (issue 16, defect 7) -------------------------------------------
def test_timed_out_calls_do_not_hold_workers(tiny_llama):
    release = threading.Event()
    reg = ToolRegistry.with_builtins(default_timeout_s=5.0)

    def hang(x: str) -> str:
        release.wait(60)
        return "late"

    reg.register(hang, timeout_s=1.0)
    runtime = ToolRuntime(reg, Tokenizer(tiny_llama), max_workers=2)
    try:
        now = time.monotonic()
        for k in range(5):                                    # more hung calls than workers
            runtime.watch(f"h{k}", ToolOptions())
            runtime.start(f"h{k}", '{"name": "hang", "arguments": {"x": "1"}}', now)
        events = runtime.poll(now + 2.0)                       # all past their deadline: abandoned
        assert sorted(e.request_id for e in events) == [f"h{k}" for k in range(5)]
        assert all(e.error and "timed out" in e.content for e in events)
        runtime.watch("calc", ToolOptions())
        runtime.start("calc", '{"name": "calculator", "arguments": {"expression": "6*7"}}', time.monotonic())
        deadline = time.monotonic() + 5
        got = []
        while not got and time.monotonic() < deadline:
            runtime.wait(0.1)
            got = runtime.poll(time.monotonic())
        assert [(e.request_id, e.content, e.error) for e in got] == [("calc", "42", False)]
    finally:
        release.set()
        runtime.shutdown()


def test_tool_results_with_lone_surrogates_reach_the_model_as_valid_text(tiny_llama):
    reg = ToolRegistry()
    reg.register(lambda x: "bad \ud800 text \U0001f600", name="odd")
    runtime = ToolRuntime(reg, Tokenizer(tiny_llama))
    try:
        runtime.watch("r", ToolOptions())
        runtime.start("r", '{"name": "odd", "arguments": {"x": "1"}}', time.monotonic())
        runtime.wait(5)
        (event,) = runtime.poll(time.monotonic())
        assert event.content == "bad \ufffd text \U0001f600" and not event.error
        assert runtime.result_tokens(event)                   # the tokenizer takes it
    finally:
        runtime.shutdown()


def test_tool_workers_cap_live_calls_and_refuse_past_the_abandoned_cap():
    from tandem.engine.tool_runtime import ToolWorkers

    release = threading.Event()
    workers = ToolWorkers(max_live=1, max_abandoned=2)
    try:
        hung = workers.submit(release.wait, 60)
        assert wait_for(hung.running)
        queued = workers.submit(lambda: "second")
        assert workers.num_live == 1 and not queued.running()       # the cap holds the second back
        workers.abandon(hung)                                       # timed out: it stops counting
        assert queued.result(timeout=5) == "second"
        hung2 = workers.submit(release.wait, 60)
        assert wait_for(hung2.running)                              # (a loaded machine starts threads late)
        workers.abandon(hung2)
        assert workers.num_abandoned == 2 and workers.num_live == 0
        refused = workers.submit(lambda: "third")                   # two hung threads are enough
        assert isinstance(refused.exception(timeout=1), RuntimeError)
        release.set()
        assert wait_for(lambda: workers.num_abandoned == 0)
        assert workers.submit(lambda: "fourth").result(timeout=5) == "fourth"
    finally:
        release.set()
        workers.shutdown()


def wait_for(cond, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not cond():
        time.sleep(0.01)
    return cond()
