"""The asyncio front: concurrent streams, early exit aborts and frees KV, bad input is refused up front."""

from __future__ import annotations

import asyncio

import pytest

from tandem import InvalidRequestError, LLM, SamplingParams
from tandem.engine.async_engine import AsyncLLMEngine, QueueFullError


@pytest.fixture(scope="module")
def aengine(tiny_llama):
    llm = LLM(model=str(tiny_llama), dtype="float32", progress=False)
    eng = AsyncLLMEngine(llm.engine, max_waiting=4)
    yield eng
    eng.shutdown()


async def collect(eng, ids, params):
    outs = [o async for o in eng.generate(None, params, prompt_token_ids=ids)]
    return outs


def test_concurrent_streams_equal_offline_results(aengine, tiny_llama):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [[5, 6, 7], [8, 9, 10, 11], [12] * 5]

    async def main():
        return await asyncio.gather(*(collect(aengine, p, params) for p in prompts))

    results = asyncio.run(main())
    offline = LLM(model=str(tiny_llama), dtype="float32", progress=False).generate(
        prompt_token_ids=prompts, sampling_params=params)
    for outs, ref in zip(results, offline):
        assert outs[-1].finished and outs[-1].token_ids == ref.token_ids
        assert sum(len(o.delta_token_ids) for o in outs) == 12          # deltas add up to the whole


def test_leaving_the_stream_aborts_and_frees_blocks(aengine):
    kv = aengine.engine.scheduler.kv

    async def main():
        gen = aengine.generate(None, SamplingParams(max_tokens=200, ignore_eos=True), prompt_token_ids=[1, 2, 3])
        async for out in gen:
            if len(out.token_ids) >= 3:
                break
        await gen.aclose()
        return await aengine.drain(5.0)

    assert asyncio.run(main())
    assert kv.num_free_blocks == kv.num_blocks and aengine.num_pending == 0


def test_bad_input_raises_before_queueing(aengine):
    async def main():
        with pytest.raises(InvalidRequestError):
            await collect(aengine, [], SamplingParams())
        return aengine.num_pending

    assert asyncio.run(main()) == 0


def test_queue_full(aengine):
    async def main():
        params = SamplingParams(max_tokens=50, ignore_eos=True)
        gens = [aengine.generate(None, params, prompt_token_ids=[3, 4]) for _ in range(20)]
        tasks = [asyncio.ensure_future(g.__anext__()) for g in gens]
        done = await asyncio.gather(*tasks, return_exceptions=True)
        for g in gens:
            await g.aclose()
        await aengine.drain(10.0)
        return done

    done = asyncio.run(main())
    assert any(isinstance(d, QueueFullError) for d in done)
    assert any(not isinstance(d, BaseException) for d in done)


def test_engine_built_on_its_own_thread_serves_and_build_errors_reach_the_caller(tiny_llama):
    import threading

    from tandem.errors import TandemError

    made_on = {}

    def build():
        made_on["thread"] = threading.current_thread().name
        return LLM(model=str(tiny_llama), dtype="float32", progress=False).engine

    eng = AsyncLLMEngine(build)
    try:
        assert made_on["thread"] == "tandem-engine"
        params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
        outs = asyncio.run(collect(eng, [5, 6, 7], params))
        assert outs[-1].finished and len(outs[-1].token_ids) == 5
    finally:
        eng.shutdown()

    def broken():
        return LLM(model=str(tiny_llama) + "-missing", progress=False).engine

    with pytest.raises(TandemError):
        AsyncLLMEngine(broken)


def test_an_idle_engine_hands_free_heap_back_at_most_once_per_interval(aengine):
    """After a request the idle engine thread trims the C heap (glibc's malloc_trim), not on every
    idle poll: the interval bounds it."""
    import platform
    import time

    from tandem.engine.async_engine import HeapTrim

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("malloc_trim is glibc's")
    asyncio.run(collect(aengine, [5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True)))
    deadline = time.monotonic() + 5
    while aengine.heap.num_trims == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert aengine.heap.num_trims >= 1
    trim = HeapTrim(interval_s=60.0)
    for now in (100.0, 100.5, 159.0):
        trim.idle(now)
    assert trim.num_trims == 1
    trim.idle(160.5)
    assert trim.num_trims == 2
