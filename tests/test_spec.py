"""Speculative decoding is lossless: greedy output identical with and without speculation for every
proposer and policy (tiny models here; the default model in test_spec_default.py), including
mixed draft lengths and preemption; sampling keeps the target's distribution (chi-square)."""

from __future__ import annotations

import itertools

import pytest
import torch

from tandem import LLM, ConfigError, SamplingParams
from tandem.config import SpecConfig
from tandem.speculative.ngram import NgramProposer
from tandem.speculative.verify import verify_sampled

# Prompts with repeated spans, so that n-gram drafting finds matches in a random model's loops too.
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], list(range(20, 40)) * 2, [11, 12] * 9, [3, 4, 5]]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_loopy):
    llm = LLM(model=str(tiny_loopy), dtype="float32", progress=False)
    return [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)]


SPECS = [
    SpecConfig(method="ngram", policy="fixed", max_draft_tokens=4),
    SpecConfig(method="ngram", policy="adaptive", max_draft_tokens=6),
    SpecConfig(method="ngram", policy="table", max_draft_tokens=5),
    SpecConfig(method="suffix", policy="fixed", max_draft_tokens=6),
    SpecConfig(method="suffix", policy="adaptive"),
    SpecConfig(method="layerskip", policy="fixed", max_draft_tokens=3, num_draft_layers=1),
    SpecConfig(method="layerskip", policy="adaptive", max_draft_tokens=4, num_draft_layers=2),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.method}-{s.policy}")
def test_greedy_identical_with_speculation(tiny_loopy, reference, spec):
    llm = LLM(model=str(tiny_loopy), dtype="float32", progress=False, speculative=spec)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    assert [o.token_ids for o in outs] == reference
    stats = llm.engine.scheduler.spec_stats
    assert stats.num_draft_tokens > 0
    if spec.method in ("ngram", "suffix"):
        assert stats.num_accepted_tokens > 0          # the repeated spans do get accepted
    kv = llm.engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks       # rollbacks leaked no block


def test_draft_model_speculation(tiny_models, tiny_loopy, reference):
    """A separate draft model (another architecture, same tokenizer) with its own paged KV."""
    spec = SpecConfig(method="draft", draft_model=str(tiny_models["qwen3"]), policy="fixed", max_draft_tokens=3)
    llm = LLM(model=str(tiny_loopy), dtype="float32", progress=False, speculative=spec)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert llm.engine.scheduler.spec_stats.num_draft_tokens > 0


def test_draft_model_as_its_own_draft_accepts_everything(tiny_loopy, reference):
    spec = SpecConfig(method="draft", draft_model=str(tiny_loopy), policy="fixed", max_draft_tokens=4)
    llm = LLM(model=str(tiny_loopy), dtype="float32", progress=False, speculative=spec)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    assert [o.token_ids for o in outs] == reference
    stats = llm.engine.scheduler.spec_stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_speculation_under_preemption(tiny_loopy, reference, method):
    spec = SpecConfig(method=method, policy="fixed", max_draft_tokens=6)
    llm = LLM(model=str(tiny_loopy), dtype="float32", progress=False, speculative=spec,
              num_kv_blocks=9, block_size=8, max_model_len=72)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == reference
    kv = llm.engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks


def test_spec_metrics_on_outputs(tiny_loopy):
    llm = LLM(model=str(tiny_loopy), dtype="float32", progress=False,
              speculative=SpecConfig(method="ngram", policy="fixed", max_draft_tokens=4))
    out = llm.generate(prompt_token_ids=[PROMPTS[2]], sampling_params=GREEDY)[0]
    spec = out.metrics.spec
    assert spec["num_draft_tokens"] >= spec["num_accepted_tokens"] > 0
    assert 1.0 < spec["mean_accepted_length"] <= 5.0
    assert sum(spec["chosen_lengths"].values()) >= 1
    stats = llm.engine.stats()
    assert stats.spec_num_accepted_tokens == spec["num_accepted_tokens"]


@pytest.mark.parametrize("bad", [
    dict(method="medusa"), dict(max_draft_tokens=0), dict(max_draft_tokens=-2), dict(policy="sometimes"),
    dict(method="draft"), dict(ngram_min=3, ngram_max=2), dict(num_draft_layers=0),
    dict(method="ngram", overlap=True, frontier_size=2), dict(method="layerskip", overlap=True),
    dict(method="layerskip", overlap=True, frontier_size=2, draft_threads=0), dict(adaptive_frontiers=True),
    dict(method="suffix", overlap=True, frontier_size=2), dict(method="suffix", suffix_decoding_max_tree_depth=1),
    dict(method="suffix", suffix_decoding_min_token_prob=1.5), dict(method="suffix", suffix_decoding_max_spec_factor=-1),
    dict(method="suffix", suffix_decoding_max_cached_requests=-1),
])
def test_invalid_spec_config(bad):
    with pytest.raises(ConfigError):
        SpecConfig(**bad)


def test_draft_model_with_another_vocabulary_is_refused(tiny_models, tmp_path):
    import shutil

    from tests.conftest import make_tiny_model

    other = make_tiny_model("llama", tmp_path / "other")
    # Same shapes, different tokenizer: retrain with another corpus size changes the vocabulary.
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(other / "tokenizer.json"))
    vocab = tok.get_vocab()
    shutil.copy(other / "tokenizer.json", tmp_path / "t.json")
    tok.add_tokens(["<|extra|>"])
    tok.save(str(other / "tokenizer.json"))
    assert len(tok.get_vocab()) == len(vocab) + 1
    with pytest.raises(ConfigError, match="tokenizer|vocabulary"):
        LLM(model=str(tiny_models["llama"]), dtype="float32", progress=False,
            speculative=SpecConfig(method="draft", draft_model=str(other)))


def test_ngram_lookup_prefers_longest_latest_match():
    p = NgramProposer(1, 3, 8)
    hist = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # The trigram (5? no) -> bigram [2, 3]: latest earlier occurrence ends at index 7 -> continues 7, 8, 5 ...
    assert p.lookup("r", hist, 3) == [7, 8, 5]
    assert p.lookup("s", [4, 5, 6], 3) == []
    assert p.available("r", hist, [7]) >= 1          # [2, 3, 7] occurred before: 8, 5, ... follow


def _emitted_histogram(p, q, drafts_from_q: bool, n: int, rule=verify_sampled, seed=0):
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(p.shape[1])
    for _ in range(n):
        d = int(torch.multinomial(q[0], 1, generator=g)) if drafts_from_q else 0
        out = rule(p, [d], q if drafts_from_q else None, g)
        counts[out[0]] += 1
    return counts


def _chi2(counts, probs) -> float:
    n = counts.sum()
    return float((((counts - n * probs) ** 2) / (n * probs)).sum())


CHI2_DF5_P001 = 20.52


def test_rejection_sampling_keeps_the_target_distribution():
    p = torch.tensor([[0.35, 0.25, 0.15, 0.1, 0.1, 0.05], [0.2] * 5 + [0.0]])
    q = torch.tensor([[0.05, 0.1, 0.5, 0.2, 0.1, 0.05]])
    counts = _emitted_histogram(p, q, drafts_from_q=True, n=12000)
    assert _chi2(counts, p[0]) < CHI2_DF5_P001
    counts = _emitted_histogram(p, None, drafts_from_q=False, n=12000)   # deterministic (n-gram) draft of token 0
    assert _chi2(counts, p[0]) < CHI2_DF5_P001


def test_chi_square_catches_a_wrong_acceptance_rule():
    def accept_always(p, drafts, q, g):
        return list(drafts) + [0]

    p = torch.tensor([[0.35, 0.25, 0.15, 0.1, 0.1, 0.05], [0.2] * 5 + [0.0]])
    q = torch.tensor([[0.05, 0.1, 0.5, 0.2, 0.1, 0.05]])
    counts = _emitted_histogram(p, q, drafts_from_q=True, n=12000, rule=accept_always)
    assert _chi2(counts, p[0]) > CHI2_DF5_P001


@pytest.mark.parametrize("spec, temperature", [
    (SpecConfig(method="ngram", policy="fixed", max_draft_tokens=2), 0.15),
    (SpecConfig(method="layerskip", policy="fixed", max_draft_tokens=2, num_draft_layers=2), 1.0),
    (SpecConfig(method="layerskip", policy="fixed", max_draft_tokens=4, num_draft_layers=2, frontier_size=1,
                overlap=True), 1.0),
], ids=["ngram", "layerskip", "layerskip-overlap"])
def test_sampled_speculation_end_to_end_matches_the_target(tiny_loopy, spec, temperature):
    """The last of 6 sampled tokens (drafted and verified) with speculation vs without: the same
    distribution (two-sample chi-square at p = 0.001): speculation must not change the joint law."""
    from scipy.stats import chi2 as chi2_dist

    prompt = [11, 12] * 9
    base = LLM(model=str(tiny_loopy), dtype="float32", progress=False)
    fast = LLM(model=str(tiny_loopy), dtype="float32", progress=False, speculative=spec)
    n = 500
    # Seeded rows (independent seeds for the two runs): the samples do not depend on the overlapped
    # drafter's thread timing, so the verdict cannot flip from run to run.
    def seeded(first):
        return [SamplingParams(max_tokens=6, temperature=temperature, ignore_eos=True, seed=first + i)
                for i in range(n)]

    a = base.generate(prompt_token_ids=[prompt] * n, sampling_params=seeded(0))
    b = fast.generate(prompt_token_ids=[prompt] * n, sampling_params=seeded(n))
    assert fast.engine.scheduler.spec_stats.num_draft_tokens > 50
    ca: dict[int, int] = {}
    cb: dict[int, int] = {}
    for outs, c in ((a, ca), (b, cb)):
        for o in outs:
            c[o.token_ids[-1]] = c.get(o.token_ids[-1], 0) + 1
    keys = [k for k in set(ca) | set(cb) if ca.get(k, 0) + cb.get(k, 0) >= 10]
    chi2 = sum((ca.get(k, 0) - cb.get(k, 0)) ** 2 / (ca.get(k, 0) + cb.get(k, 0)) for k in keys)
    assert len(keys) >= 2
    assert chi2 < chi2_dist.ppf(0.999, len(keys) - 1)


PRUNING = [
    SpecConfig(method="ngram", policy="fixed", max_draft_tokens=6, frontier_size=2),
    SpecConfig(method="ngram", policy="fixed", max_draft_tokens=6, early_exit_layer=1, early_exit_topk=2),
    SpecConfig(method="ngram", policy="fixed", max_draft_tokens=6, frontier_size=3, early_exit_layer=2,
               early_exit_topk=1),
    SpecConfig(method="layerskip", policy="fixed", max_draft_tokens=4, num_draft_layers=1, frontier_size=2),
]


@pytest.mark.parametrize("spec", PRUNING, ids=["frontiers", "early-exit", "both", "layerskip-frontiers"])
def test_early_pruning_is_lossless(tiny_loopy, reference, spec):
    llm = LLM(model=str(tiny_loopy), dtype="float32", progress=False, speculative=spec)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    assert [o.token_ids for o in outs] == reference
    stats = llm.engine.scheduler.spec_stats
    assert stats.num_accepted_tokens > 0
    assert stats.num_pruned_tokens > 0               # some rows were never computed
    kv = llm.engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks


@pytest.mark.parametrize("spec", [
    SpecConfig(method="ngram", policy="fixed", max_draft_tokens=6, frontier_size=2, adaptive_frontiers=True),
    SpecConfig(method="layerskip", policy="fixed", max_draft_tokens=5, num_draft_layers=1, frontier_size=2,
               overlap=True, adaptive_frontiers=True),
], ids=["ngram", "layerskip-overlap"])
def test_frontiers_chosen_per_step_are_honoured_and_lossless(tiny_loopy, reference, spec):
    llm = LLM(model=str(tiny_loopy), dtype="float32", progress=False, speculative=spec)
    sched, decoder = llm.engine.scheduler, llm.engine.executor.spec
    assert sched.frontiers is not None and sched.frontiers.size == 2
    # This CPU's cost model would keep every step whole; alternate to run both kinds of step.
    choices, seen = itertools.cycle([2, 0]), []
    sched.frontiers.choose = lambda reqs, ks, base: next(choices)
    real_draft = decoder.draft

    def draft(plan):
        out = real_draft(plan)
        if out:
            seen.append((plan.frontier_size, decoder.step_frontier))
        return out

    decoder.draft = draft
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert {s for s, _ in seen} == {0, 2} and all(a == b for a, b in seen)
    assert sched.spec_stats.num_pruned_tokens > 0           # only the split steps prune
    kv = sched.kv
    assert kv.num_free_blocks == kv.num_blocks


def test_early_pruning_with_sampling_keeps_seeded_reproducibility(tiny_loopy):
    spec = SpecConfig(method="ngram", policy="fixed", max_draft_tokens=4, frontier_size=2, early_exit_layer=1)
    llm = LLM(model=str(tiny_loopy), dtype="float32", progress=False, speculative=spec)
    params = SamplingParams(max_tokens=20, temperature=0.3, seed=7, ignore_eos=True)
    a = llm.generate(prompt_token_ids=[PROMPTS[2]], sampling_params=params)[0].token_ids
    b = llm.generate(prompt_token_ids=[PROMPTS[2], PROMPTS[0]], sampling_params=params)[0].token_ids
    assert a == b


def _overlap_specs(tiny_loopy, tiny_models):
    return {
        "layerskip": SpecConfig(method="layerskip", policy="fixed", max_draft_tokens=5, num_draft_layers=1,
                                frontier_size=2, overlap=True),
        "draft-model": SpecConfig(method="draft", draft_model=str(tiny_models["qwen3"]), policy="fixed",
                                  max_draft_tokens=4, frontier_size=1, overlap=True),
        "self-draft": SpecConfig(method="draft", draft_model=str(tiny_loopy), policy="fixed", max_draft_tokens=6,
                                 frontier_size=2, overlap=True),
        "early-exit": SpecConfig(method="layerskip", policy="fixed", max_draft_tokens=6, num_draft_layers=2,
                                 frontier_size=3, overlap=True, early_exit_layer=1, early_exit_topk=2),
    }


@pytest.mark.parametrize("name", ["layerskip", "draft-model", "self-draft", "early-exit"])
def test_overlapped_drafting_is_lossless(tiny_loopy, tiny_models, reference, name):
    """Frontier f+1 drafted on the worker thread while frontier f is verified: the same tokens."""
    spec = _overlap_specs(tiny_loopy, tiny_models)[name]
    llm = LLM(model=str(tiny_loopy), dtype="float32", progress=False, speculative=spec, num_threads=2)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    assert [o.token_ids for o in outs] == reference
    stats = llm.engine.scheduler.spec_stats
    assert stats.num_draft_tokens > 0
    assert llm.engine.executor.spec.overlap.num_overlapped > 0
    if name == "self-draft":                         # the target drafting for itself: every frontier accepted
        assert stats.num_accepted_tokens == stats.num_draft_tokens
        assert stats.num_pruned_tokens == 0
    kv = llm.engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks


def test_a_rejection_cancels_the_drafting_of_later_frontiers(tiny_loopy):
    """Same plans (fixed length, greedy): overlapped drafting drafts fewer tokens than drafting every
    frontier up front, accepts exactly as many, and counts the cancelled frontier in flight as pruned."""
    base = dict(method="layerskip", policy="fixed", max_draft_tokens=6, num_draft_layers=1, frontier_size=2)
    stats = {}
    for overlap in (False, True):
        llm = LLM(model=str(tiny_loopy), dtype="float32", progress=False, num_threads=2,
                  speculative=SpecConfig(**base, overlap=overlap))
        llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
        stats[overlap] = llm.engine.scheduler.spec_stats
    assert stats[True].num_accepted_tokens == stats[False].num_accepted_tokens > 0
    assert stats[True].num_steps == stats[False].num_steps
    assert stats[True].num_draft_tokens < stats[False].num_draft_tokens
    verified = {o: s.num_draft_tokens - s.num_pruned_tokens for o, s in stats.items()}
    assert verified[True] == verified[False]         # the same drafts reached verification
    assert stats[True].num_pruned_tokens > 0


def test_overlap_with_sampling_keeps_seeded_reproducibility(tiny_loopy):
    """Seeded drafts are a function of (seed, position) on their own stream, so neither the batch
    companions nor when a cancellation reaches the drafting thread change a seeded request's tokens:
    overlapped drafting gives exactly the tokens of drafting every frontier up front."""
    params = SamplingParams(max_tokens=20, temperature=0.8, seed=7, ignore_eos=True)
    got = {}
    for overlap in (False, True):
        spec = SpecConfig(method="layerskip", policy="fixed", max_draft_tokens=4, num_draft_layers=2,
                          frontier_size=2, overlap=overlap)
        llm = LLM(model=str(tiny_loopy), dtype="float32", progress=False, speculative=spec, num_threads=2)
        a = llm.generate(prompt_token_ids=[PROMPTS[2]], sampling_params=params)[0].token_ids
        b = llm.generate(prompt_token_ids=[PROMPTS[2], PROMPTS[0], PROMPTS[1]], sampling_params=params)[0].token_ids
        assert a == b
        assert llm.engine.scheduler.spec_stats.num_draft_tokens > 0
        got[overlap] = a
    assert got[True] == got[False]


def test_overlap_needs_a_thread_to_spare():
    from tandem.speculative.overlap import DraftWorker

    with pytest.raises(ConfigError, match="draft_threads"):
        DraftWorker(torch.device("cpu"), draft_threads=torch.get_num_threads())


def test_draft_worker_runs_on_its_threads_and_goes_away_with_its_engine():
    import gc
    import threading
    import time

    from tandem.speculative.overlap import DraftWorker

    worker = DraftWorker(torch.device("cpu"), draft_threads=1)
    ident, threads = worker.result(worker.submit(lambda: (threading.get_ident(), torch.get_num_threads())))
    assert ident != threading.get_ident() and threads == 1
    del worker
    gc.collect()
    deadline = time.monotonic() + 5
    while any(t.ident == ident for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(t.ident == ident for t in threading.enumerate())    # no thread leaked per engine
