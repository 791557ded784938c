"""Tool pauses on the real engine (tiny model): preserve, swap and discard give the same greedy
tokens after resuming, equal to one uninterrupted request given the same appended text; no block leaks."""

from __future__ import annotations

import pytest

from tandem import LLM, SamplingParams
from tandem.engine.tool_runtime import ToolOptions
from tandem.sched.pause_kv import FixedAction, fit_tool_result
from tandem.types import KVAction

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]
SCRIPT = [(6, 0.02, 9), (5, 0.01, 4), (7, 0.0, 0)]      # generate 6, tool, generate 5, tool, generate 7


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(model=str(tiny_llama), dtype="float32", progress=False, tools=True, block_size=4,
               num_kv_blocks=64, max_model_len=256)


def run_scripted(llm, action: KVAction | None, n: int = 1):
    eng = llm.engine
    if action is not None:
        eng.scheduler.pauses.policy = FixedAction(action)
    params = SamplingParams(max_tokens=sum(s[0] for s in SCRIPT), temperature=0, ignore_eos=True)
    ids = [eng.add_request(prompt_token_ids=PROMPT, params=params, tool_options=ToolOptions(script=list(SCRIPT)))
           for _ in range(n)]
    outs = {}
    while eng.has_unfinished_requests():
        got = eng.step()
        if not got:
            eng.wait_for_tools()
        for o in got:
            if o.finished:
                outs[o.request_id] = o
    return [outs[i] for i in ids]


@pytest.mark.parametrize("action", [KVAction.PRESERVE, KVAction.SWAP, KVAction.DISCARD])
def test_every_kv_action_resumes_to_the_same_tokens(llm, action):
    ref = run_scripted(llm, KVAction.PRESERVE)[0]
    out = run_scripted(llm, action, n=2)
    assert all(o.token_ids == ref.token_ids for o in out)
    assert len(ref.token_ids) == 18 and ref.finish_reason == "length"
    counts = llm.engine.scheduler.pauses.num_actions
    assert counts[action] >= 4                           # 2 requests x 2 pauses took this action
    kv = llm.engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks and kv.num_free_host_blocks == kv.num_host_blocks
    tools = out[0].metrics.tool_calls
    assert [t["tool"] for t in tools] == ["script", "script"] and tools[0]["duration_s"] >= 0.02


def test_resumed_generation_equals_an_uninterrupted_request_with_the_same_text(llm):
    out = run_scripted(llm, KVAction.SWAP)[0]
    runtime = llm.engine.tools
    filler = runtime.result_tokens(type("E", (), {"log": {"return_tokens": 9}, "content": ""})())
    first = out.token_ids[:6]
    plain = llm.generate(prompt_token_ids=[PROMPT + first + filler],
                         sampling_params=SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    assert plain.token_ids == out.token_ids[6:11]


def test_a_tool_result_is_cut_to_leave_room_for_one_generated_token():
    """The rule both the engine and the simulator apply when a result would overrun max_model_len."""
    ids = list(range(10))
    assert fit_tool_result(ids, 100, 111) == ids                 # 110 < 111: all of it
    assert fit_tool_result(ids, 100, 110) == ids[:9]             # 110 would fill the context
    assert fit_tool_result(ids, 100, 105) == ids[:4]
    assert fit_tool_result(ids, 109, 110) == []
    assert fit_tool_result(ids, 200, 110) == []                  # never a negative slice


def test_a_swapped_context_whose_blocks_were_reused_comes_back_through_host_memory(llm):
    """A swap-out copies nothing until its device blocks are reused: here a long prompt takes all
    but one block while the request waits on its tool, so the blocks it took are copied out in that
    step, copied back on resume, and the rest are taken back as they are. The tokens are those of
    a request that kept its KV."""
    ref = run_scripted(llm, KVAction.PRESERVE)[0]
    eng = llm.engine
    eng.scheduler.pauses.policy = FixedAction(KVAction.SWAP)
    pool = eng.scheduler.kv.pool
    copies_due = pool.num_copies_due
    params = SamplingParams(max_tokens=sum(s[0] for s in SCRIPT), temperature=0, ignore_eos=True)
    slow = [(6, 1.0, 9)] + SCRIPT[1:]                   # the first tool call waits 1 s
    rid = eng.add_request(prompt_token_ids=PROMPT, params=params, tool_options=ToolOptions(script=slow))
    while not eng.scheduler.num_paused:
        eng.step()
    assert pool.num_copies_due == copies_due                  # swapped out: nothing copied yet
    hog = eng.add_request(prompt_token_ids=list(range(30, 282)),    # 252 tokens: 63 of the 64 blocks
                          params=SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    outs = {}
    while eng.has_unfinished_requests():
        got = eng.step()
        if not got:
            eng.wait_for_tools()
        finished = {o.request_id: o for o in got if o.finished}
        if hog in finished:
            assert eng.scheduler.num_paused == 1, "the hog must run while the request waits on its tool"
        outs.update(finished)
    assert outs[rid].token_ids == ref.token_ids
    assert pool.num_copies_due - copies_due >= 5              # its blocks the hog took, copied out
    kv = eng.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks and kv.num_free_host_blocks == kv.num_host_blocks
