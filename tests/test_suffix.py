"""The suffix-decoding proposer: what it drafts from the request's own text and from earlier
outputs (exact token lists), how match length, frequency and tree depth bound a draft, and that
its cache of earlier outputs stays within its bounds with an index that matches its text."""

from __future__ import annotations

import random

from tandem.sampling_params import SamplingParams
from tandem.speculative.suffix import SEP, ResponseCache, SuffixProposer, SuffixText, draft_from
from tandem.types import ScheduledSeq


def _seq(rid: str, history: list[int], num_output_tokens: int = 0) -> ScheduledSeq:
    return ScheduledSeq(rid, [history[-1]], len(history) - 1, [], True, SamplingParams(), num_output_tokens,
                        history=list(history))


def _text(tokens: list[int]) -> SuffixText:
    t = SuffixText()
    t.tokens.extend(tokens)
    t.index_upto(len(t) - 1)
    return t


def test_draft_length_follows_the_match_length():
    """Three tokens matched: at most max_spec_factor x 3 drafted (factor 1: 3, factor 2: 6)."""
    h = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 50, 1, 2, 3]
    assert draft_from(_text(h), h, 8, 24, 1.0, 0.1) == ([4, 5, 6], 3.0)
    assert draft_from(_text(h), h, 8, 24, 2.0, 0.1)[0] == [4, 5, 6, 7, 8, 9]
    assert draft_from(_text(h), h, 2, 24, 2.0, 0.1)[0] == [4, 5]           # max_tokens caps it
    # Match + draft within depth 5: the 2-token match [2, 3] leaves room for 3 (the 3-token one, 2).
    assert draft_from(_text(h), h, 8, 5, 2.0, 0.1)[0] == [4, 5, 6]
    assert draft_from(_text(h), h, 8, 4, 2.0, 0.1)[0] == [4, 5]


def test_the_most_frequent_continuation_wins_and_its_chance_bounds_the_draft():
    # [1, 2, 3] was followed by 7 twice and by 8 once: 7 (2/3), then 1 (2/3 x 1), 2, ...
    h = [1, 2, 3, 7, 1, 2, 3, 7, 1, 2, 3, 8, 1, 2, 3]
    draft, score = draft_from(_text(h), h, 3, 24, 1.0, 0.1)
    assert draft == [7, 1, 2]
    assert abs(score - 3 * 2 / 3) < 1e-9
    # Needing a chance of 0.7 per drafted token: 2/3 is too little, nothing is drafted.
    assert draft_from(_text(h), h, 3, 24, 1.0, 0.7) == ([], 0.0)


def test_the_longest_match_picks_the_occurrence():
    # [9, 1, 2] continues with 5 once; [1, 2] alone (more often) with 4.
    h = [1, 2, 4, 0, 1, 2, 4, 0, 9, 1, 2, 5, 0, 9, 1, 2]
    assert draft_from(_text(h), h, 1, 24, 1.0, 0.1)[0] == [5]


def test_no_earlier_occurrence_no_draft():
    h = [10, 11, 12, 13]
    assert draft_from(_text(h), h, 8, 24, 1.0, 0.1) == ([], 0.0)


def test_a_finished_output_drafts_for_later_requests_and_its_prompt_does_not():
    p = SuffixProposer(8)
    prompt = [100, 101, 102]
    out = [7, 40, 41, 42, 43, 44, 45, 46, 47]
    p.offer(_seq("a", prompt + out[:1], 1), out[1:])
    p.release("a", finished=True)
    assert list(p.cache.text.tokens) == out + [SEP]
    # A new request whose text ends like part of that output: the cache continues it.
    drafts = p.propose([_seq("b", [5, 6, 40, 41, 42, 43])], [8])
    assert drafts["b"].tokens == [44, 45, 46, 47]
    assert p.offer(_seq("b", [5, 6, 40, 41, 42, 43]), [44]) == 3       # 45, 46, 47 would follow next
    # A preempted request (not finished) leaves nothing in the cache.
    p.offer(_seq("c", [1, 2, 3, 4]), [5])
    p.release("c")
    assert list(p.cache.text.tokens) == out + [SEP]


def test_the_request_s_own_text_wins_over_a_weaker_cache_match():
    p = SuffixProposer(8)
    p.cache.add([1, 2, 3, 9, 9])
    h = [1, 2, 3, 4, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3]
    assert p.propose([_seq("r", h)], [3])["r"].tokens == [4, 5, 6]


def test_no_cache_when_max_cached_requests_is_zero():
    p = SuffixProposer(8, max_cached_requests=0)
    p.offer(_seq("a", [1, 2], 1), [3, 4])
    p.release("a", finished=True)
    assert not p.cache.sizes and not p.cache.text.tokens


def _reindexed(text: SuffixText) -> SuffixText:
    fresh = SuffixText()
    fresh.tokens.extend(text.tokens)
    fresh.offset = text.offset
    fresh.indexed = text.offset
    fresh.index_upto(len(text))
    return fresh


def test_the_cache_evicts_oldest_first_and_keeps_its_index_exact():
    rng = random.Random(3)
    cache = ResponseCache(max_requests=5, max_tokens=60)
    outputs = [[rng.randrange(6) for _ in range(rng.randrange(1, 25))] for _ in range(40)]
    for out in outputs:
        cache.add(out)
        assert len(cache.sizes) <= 5 and len(cache.text.tokens) <= 60
        kept = []
        for size, o in zip(cache.sizes, outputs[outputs.index(out) - len(cache.sizes) + 1:]):
            kept += o[-(size - 1):] + [SEP]
        assert cache.text.tokens == kept
        assert cache.text.index == _reindexed(cache.text).index


def test_a_long_output_keeps_its_tail():
    cache = ResponseCache(max_requests=10, max_tokens=8)
    cache.add(list(range(20)))
    assert cache.text.tokens == list(range(13, 20)) + [SEP]
