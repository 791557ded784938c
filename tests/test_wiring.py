"""One wiring path (issue 15 item 1): the engine, the simulator and the benchmarks build their
scheduler in tandem.sched.build, and a loaded engine switches speculation only through
`tandem.llm.reconfigure_speculation`, which rebuilds both sides from a SpecConfig."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import tandem
from tandem import LLM, ConfigError, SamplingParams
from tandem.bench.spec import use_policy
from tandem.config import SchedulerConfig, SpecConfig
from tandem.llm import reconfigure_speculation
from tandem.sched.spec_length import AdaptiveLength, FixedLength, NoSpeculation
from tandem.sim.build import SimConfig, build_scheduler
from tandem.sim.cost import make_cost_model
from tandem.types import Request

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], list(range(20, 40)) * 2, [11, 12] * 9]
GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
SRC = Path(tandem.__file__).resolve().parent


def test_only_the_factory_constructs_a_scheduler():
    """Every Scheduler(...) call in the package is in sched/build.py: no second wiring to drift."""
    calls = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "Scheduler":
                calls.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert calls and all(c.startswith("sched/build.py:") for c in calls), calls


def test_engine_and_simulator_get_the_same_speculation_side(tiny_loopy):
    spec = SpecConfig(method="ngram", policy="adaptive", max_draft_tokens=6, frontier_size=2, adaptive_frontiers=True)
    llm = LLM(model=str(tiny_loopy), dtype="float32", progress=False, speculative=spec)
    sim = build_scheduler(SimConfig(scheduler=SchedulerConfig(max_model_len=2048), spec=spec),
                          make_cost_model("H100-80GB", "llama3-8b", "llama3-1b"))
    for sched in (llm.engine.scheduler, sim):
        assert isinstance(sched.spec_policy, AdaptiveLength) and sched.max_draft_tokens == 6
        assert sched.frontiers is not None and sched.frontiers.size == 2
        assert sched.spec_policy.cost is sched.cost          # the policy reads the model the scheduler trains
    assert llm.engine.speculation == spec


def test_acceptance_has_one_owner_the_frontier_chooser_reads_the_policys():
    cost = make_cost_model("H100-80GB", "llama3-8b", "llama3-1b")
    for policy, shared in (("adaptive", True), ("fixed", False)):
        spec = SpecConfig(method="draft", draft_model="d", policy=policy, max_draft_tokens=4, frontier_size=2,
                          adaptive_frontiers=True)
        sched = build_scheduler(SimConfig(scheduler=SchedulerConfig(max_model_len=2048), spec=spec), cost)
        chooser = sched.frontiers
        assert (chooser.acceptance is getattr(sched.spec_policy, "acceptance", None)) == shared
        assert chooser.owns_acceptance != shared
        # the chooser reads without the policy's exploration bonus and optimistic start
        assert chooser.acceptance.estimates("new", explore=0.0, optimistic=False)[0] == pytest.approx(0.5)
        if shared:
            assert sched.spec_policy.acceptance.estimates("new")[0] == 1.0   # the policy's own read: untried
        r = Request("r", [1, 2, 3], SamplingParams(max_tokens=8))
        sched.spec_policy.observe_request(r, 4, 1)
        chooser.observe_request(r, 4, 1)                      # what the scheduler calls, in this order
        assert chooser.acceptance._n["r"][:2] == [1.0, 1.0]    # counted once, shared or not


def test_reconfigure_switches_both_sides_keeps_the_proposer_and_stays_lossless(tiny_loopy):
    llm = LLM(model=str(tiny_loopy), dtype="float32", progress=False,
              speculative=SpecConfig(method="ngram", policy="fixed", max_draft_tokens=4))
    engine, runner = llm.engine, llm.engine.executor
    proposer = runner.spec.proposer
    ids = lambda: [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)]  # noqa: E731
    fixed = ids()
    assert engine.scheduler.spec_stats.num_draft_tokens > 0

    adaptive = SpecConfig(method="ngram", policy="adaptive", max_draft_tokens=6, frontier_size=2)
    reconfigure_speculation(engine, adaptive)
    assert isinstance(engine.scheduler.spec_policy, AdaptiveLength) and engine.scheduler.max_draft_tokens == 6
    assert engine.scheduler.spec_stats.num_draft_tokens == 0            # counters start afresh
    assert runner.spec.proposer is proposer and runner.spec.frontier_size == 2
    assert engine.speculation == adaptive
    assert ids() == fixed

    reconfigure_speculation(engine, None)
    assert runner.spec is None and engine.scheduler.spec_policy is None and engine.scheduler.max_draft_tokens == 0
    assert ids() == fixed
    assert engine.scheduler.spec_stats.num_draft_tokens == 0

    reconfigure_speculation(engine, SpecConfig(method="ngram", policy="fixed", max_draft_tokens=3))
    assert isinstance(engine.scheduler.spec_policy, FixedLength) and runner.spec.proposer is not proposer
    assert ids() == fixed


def test_reconfigure_refuses_while_requests_are_in_the_engine(tiny_loopy):
    llm = LLM(model=str(tiny_loopy), dtype="float32", progress=False,
              speculative=SpecConfig(method="ngram", policy="fixed", max_draft_tokens=4))
    llm.engine.add_request(prompt_token_ids=PROMPTS[0], params=GREEDY)
    with pytest.raises(RuntimeError, match="requests"):
        reconfigure_speculation(llm.engine, None)
    with pytest.raises(RuntimeError, match="requests"):
        llm.engine.set_clock(lambda: 0.0)
    assert isinstance(llm.engine.scheduler.spec_policy, FixedLength)     # unchanged


def test_bench_policies_switch_through_one_call(tiny_loopy):
    llm = LLM(model=str(tiny_loopy), dtype="float32", progress=False,
              speculative=SpecConfig(method="layerskip", policy="fixed", max_draft_tokens=4, num_draft_layers=1))
    sched, proposer = llm.engine.scheduler, llm.engine.executor.spec.proposer
    use_policy(llm, "no-sd")
    assert isinstance(sched.spec_policy, NoSpeculation) and sched.max_draft_tokens == 0
    use_policy(llm, "adaptive+early-exit")
    decoder = llm.engine.executor.spec
    assert isinstance(sched.spec_policy, AdaptiveLength) and decoder.proposer is proposer
    assert decoder.early_exit is not None and decoder.frontier_size == 0 and sched.frontiers is None
    use_policy(llm, "fixed-8+auto-frontiers")
    assert sched.frontiers is not None and llm.engine.executor.spec.early_exit is None
    use_policy(llm, "adaptive+overlap")
    worker = llm.engine.executor.spec.overlap
    assert worker is not None and llm.engine.executor.spec.frontier_size == 4
    use_policy(llm, "fixed-8+overlap")
    assert llm.engine.executor.spec.overlap is worker                   # the draft thread is kept


def test_bench_refuses_model_variants_on_an_ngram_engine(tiny_loopy):
    llm = LLM(model=str(tiny_loopy), dtype="float32", progress=False,
              speculative=SpecConfig(method="ngram", policy="fixed", max_draft_tokens=4))
    with pytest.raises(ConfigError, match="model drafter"):
        use_policy(llm, "adaptive+overlap")
    assert isinstance(llm.engine.scheduler.spec_policy, FixedLength)    # nothing half-switched


def test_a_prompt_is_validated_and_tokenized_once(tiny_loopy):
    """LLM.generate and the async engine check each request once and tokenize its prompt once
    (they validated, then add_request validated and tokenized again)."""
    import asyncio

    from tandem.engine.async_engine import AsyncLLMEngine

    llm = LLM(model=str(tiny_loopy), dtype="float32", progress=False)
    engine = llm.engine
    calls = {"encode": 0, "validate": 0}
    encode, validate = engine.tokenizer.encode, engine.validate

    def counting_encode(*a, **k):
        calls["encode"] += 1
        return encode(*a, **k)

    def counting_validate(*a, **k):
        calls["validate"] += 1
        return validate(*a, **k)

    engine.tokenizer.encode, engine.validate = counting_encode, counting_validate
    out = llm.generate(["hello hello", "abc"], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert [len(o.token_ids) for o in out] == [3, 3]
    assert calls == {"encode": 2, "validate": 2}

    calls.update(encode=0, validate=0)
    server = AsyncLLMEngine(engine)

    async def one():
        return [o async for o in server.generate("hello hello", SamplingParams(max_tokens=3, temperature=0))][-1]

    try:
        assert asyncio.run(one()).finished
    finally:
        server.shutdown()
    assert calls == {"encode": 1, "validate": 1}
    with pytest.raises(TypeError):
        engine.add_valid(([1, 2], SamplingParams()))


def test_a_requests_tokens_have_one_copy_the_outputs_read():
    """The engine keeps no second list of generated tokens: outputs read the scheduler's Request,
    whose context is prompt + generated + tool results, less the tool results' spans."""
    r = Request("r", [1, 2, 3], SamplingParams(max_tokens=8))
    r.token_ids.extend([7, 8])
    r.tool.injected_spans.append((len(r.token_ids), 3))
    r.token_ids.extend([100, 101, 102, 9])
    assert r.generated_token_ids == [7, 8, 9] and r.num_output_tokens == 3 and r.num_injected_tokens == 3
    assert r.output_token_ids == [7, 8, 100, 101, 102, 9]
