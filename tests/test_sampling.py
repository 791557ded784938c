"""Sampling, stopping, logprobs and detokenization, end to end through `LLM` on a tiny model."""

from __future__ import annotations

import math

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.runner.sampler import Sampler, warp_probs


@pytest.fixture(scope="module")
def llm(tiny_llama):
    # logprobs are checked against transformers: the exact path (float32 weights and KV cache)
    return LLM(model=str(tiny_llama), dtype="float32", progress=False, max_num_batched_tokens=64,
               kv_cache_dtype="float32")


PROMPT = [5, 6, 7, 8, 9, 10, 11]


def gen(llm, params, prompts=None):
    return llm.generate(prompt_token_ids=prompts or [PROMPT], sampling_params=params)


def test_greedy_matches_transformers(llm, tiny_llama):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
    out = gen(llm, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == ref[0, len(PROMPT):].tolist()
    assert out.finish_reason == "length"


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(llm):
    p = SamplingParams(max_tokens=20, temperature=1.5, seed=1234, ignore_eos=True)
    alone = gen(llm, p)[0].token_ids
    others = SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True)
    batch = llm.generate(prompt_token_ids=[[1, 2, 3], PROMPT, [40, 41]], sampling_params=[others, p, others])
    assert batch[1].token_ids == alone
    assert gen(llm, SamplingParams(max_tokens=20, temperature=1.5, seed=99, ignore_eos=True))[0].token_ids != alone


def test_top_k_one_and_tiny_top_p_are_greedy(llm):
    greedy = gen(llm, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].token_ids
    assert gen(llm, SamplingParams(max_tokens=12, temperature=2.0, top_k=1, ignore_eos=True))[0].token_ids == greedy
    assert gen(llm, SamplingParams(max_tokens=12, temperature=2.0, top_p=1e-6, ignore_eos=True))[0].token_ids == greedy


@pytest.mark.parametrize("fields", [dict(temperature=1e-300), dict(temperature=1e-38), dict(temperature=5e-6, seed=3),
                                    dict(temperature=1.0, top_p=1e-300, seed=3), dict(temperature=1.0, top_p=1e-46),
                                    dict(temperature=1e-300, top_p=1e-300)])
def test_tiny_temperature_and_top_p_sample_greedily_not_nan(llm, fields):
    """Issue 16, defect 8: below the documented thresholds sampling is greedy, not NaN (token 0)."""
    greedy = gen(llm, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].token_ids
    assert gen(llm, SamplingParams(max_tokens=12, ignore_eos=True, **fields))[0].token_ids == greedy


def test_tiny_values_are_mapped_as_documented():
    from tandem.sampling_params import GREEDY_TEMPERATURE, MIN_TOP_P

    assert SamplingParams(temperature=GREEDY_TEMPERATURE / 2).greedy
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE).greedy
    assert SamplingParams(top_p=1e-300).top_p == MIN_TOP_P and SamplingParams(top_p=0.5).top_p == 0.5


def test_warp_probs_top_k_and_top_p():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    p = warp_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (p > 0).sum() == 2 and p[:2].sum().item() == pytest.approx(1.0)
    full = torch.softmax(logits, 0)
    # top_p=0.8: the two best hold 0.665+0.245=0.91 >= 0.8 with the first alone 0.665 < 0.8 -> keep 2.
    p = warp_probs(logits, SamplingParams(temperature=1.0, top_p=0.8))
    assert (p > 0).tolist() == [True, True, False, False, False]
    assert p[0].item() == pytest.approx(full[0].item() / (full[0] + full[1]).item())
    p = warp_probs(logits, SamplingParams(temperature=0.5))
    assert torch.allclose(p, torch.softmax(logits / 0.5, 0))


def test_sampler_draws_follow_the_distribution():
    """Chi-square goodness of fit of 20k exponential-race draws (critical value df=4, p=0.001: 18.47)."""
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(5)
    n = 20000
    for _ in range(n):
        counts[Sampler.draw(probs, g)] += 1
    chi2 = (((counts - n * probs) ** 2) / (n * probs)).sum().item()
    assert chi2 < 18.47


def test_stop_token_ids_and_min_tokens(llm):
    greedy = gen(llm, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0].token_ids
    stop_at = greedy[2]
    first = greedy.index(stop_at)
    out = gen(llm, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, stop_token_ids=[stop_at]))[0]
    assert out.token_ids == greedy[:first + 1] and out.finish_reason == "stop"
    # min_tokens forbids the stop token until 8 tokens exist, so the output never contains it before that.
    out = gen(llm, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, stop_token_ids=[stop_at],
                                  min_tokens=8))[0]
    assert stop_at not in out.token_ids[:8]
    assert len(out.token_ids) >= 8


def test_logprobs_match_transformers(llm, tiny_llama):
    from transformers import AutoModelForCausalLM

    out = gen(llm, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=3))[0]
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([PROMPT + out.token_ids])).logits[0], -1)
    assert len(out.outputs[0].logprobs) == 5
    for i, lp in enumerate(out.outputs[0].logprobs):
        pos = len(PROMPT) + i - 1
        assert lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(ref[pos, lp.token_id].item(), abs=1e-4)
        assert [t for t, _ in lp.top] == torch.topk(ref[pos], 3).indices.tolist()
        assert lp.top[0][0] == lp.token_id          # greedy picks the best


def test_stop_strings_cut_the_text(llm):
    base = gen(llm, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    text = base.text
    assert len(text) > 6
    stop = text[3:6]
    cut = text.index(stop)
    out = gen(llm, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop]))[0]
    assert out.text == text[:cut] and out.finish_reason == "stop"
    out = gen(llm, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop],
                                  include_stop_str_in_output=True))[0]
    assert out.text == text[:cut + len(stop)]


@pytest.mark.parametrize("skip_special", [True, False])
def test_the_stop_token_is_output_but_not_text(llm, skip_special):
    """vLLM's rule: a request ending on a stop token (EOS or stop_token_ids) has it in token_ids but
    not in its text, even with special tokens decoded, unless include_stop_str_in_output."""
    base = gen(llm, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].token_ids
    tok = llm.tokenizer
    stop = next(t for t in base[2:] if tok.decode([t]).strip().isascii() and tok.decode([t]).strip())  # shows text
    n = base.index(stop) + 1
    for include in (False, True):
        out = gen(llm, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=[stop],
                                      skip_special_tokens=skip_special, include_stop_str_in_output=include))[0]
        assert out.token_ids == base[:n] and out.finish_reason == "stop"
        shown = gen(llm, SamplingParams(max_tokens=n if include else n - 1, temperature=0, ignore_eos=True,
                                        skip_special_tokens=skip_special))[0]      # the same tokens, cut by length
        assert out.text == shown.text


def test_streamed_deltas_rebuild_multibyte_text(llm):
    """Byte-level tokens split multi-byte characters: deltas never show half a character."""
    tok = llm.tokenizer
    target = tok.encode("Caf\u00e9 \u4f60\u597d \U0001f600 na\u00efve", add_special_tokens=False)
    eng = llm.engine
    # Force the output to be `target` by scoring only (a prompt whose continuation we do not control would
    # not be multi-byte); instead check the detokenizer directly on those ids, one token at a time.
    from tandem.engine.detokenizer import IncrementalDetokenizer

    d = IncrementalDetokenizer(tok, [1, 2], SamplingParams())
    pieces = []
    for t in target:
        d.add_tokens([t])
        pieces.append(d.delta(finished=False))
    pieces.append(d.delta(finished=True))
    assert "".join(pieces) == tok.decode(target) == "Caf\u00e9 \u4f60\u597d \U0001f600 na\u00efve"
    assert all("\ufffd" not in p for p in pieces)
    assert eng.has_unfinished_requests() is False


def test_metrics_are_filled(llm):
    out = gen(llm, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert m.num_prompt_tokens == len(PROMPT) and m.num_output_tokens == 4
    assert math.isfinite(m.ttft) and m.e2e_latency >= m.ttft


# --- penalties, logit bias, min_p (vLLM's sampling fields) ---------------------------------------
def _row(params, history=(), n_out=0, rid="r"):
    from tandem.runner.sampler import SampleRow

    return SampleRow(rid, params, n_out, frozenset(), list(history))


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_greedy_with_repetition_penalty_matches_transformers(llm, tiny_llama, penalty):
    """HF's RepetitionPenaltyLogitsProcessor is vLLM's definition (prompt and output tokens)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                      repetition_penalty=penalty)
    out = gen(llm, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, repetition_penalty=penalty))[0]
    assert out.token_ids == ref[0, len(PROMPT):].tolist()
    plain = gen(llm, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0]
    assert out.token_ids != plain.token_ids            # the penalty changed something on this model


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    from tandem.runner.sampler import apply_adjustments

    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0]])
    got = apply_adjustments(logits, [_row(SamplingParams(repetition_penalty=2.0), history=[0, 1])])
    assert got.tolist() == [[1.0, -4.0, 1.0, -1.0]]
    assert logits.tolist() == [[2.0, -2.0, 1.0, -1.0]]              # the input is not modified


def test_frequency_and_presence_penalties_count_output_tokens_only():
    from tandem.runner.sampler import apply_adjustments

    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    # history: prompt [1, 2], output [2, 3, 3]
    got = apply_adjustments(torch.zeros(1, 5), [_row(params, history=[1, 2, 2, 3, 3], n_out=3)])
    assert got.tolist() == [[0.0, 0.0, -0.75, -1.25, 0.0]]


def test_logit_bias_steers_greedy_and_rows_are_independent():
    from tandem.runner.sampler import Sampler

    sampler = Sampler(torch.device("cpu"))
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 5.0, 1.0]])
    rows = [_row(SamplingParams(temperature=0, logit_bias={2: 10}), rid="a"),
            _row(SamplingParams(temperature=0), rid="b")]
    tokens, _ = sampler.sample(logits, rows)
    assert tokens == [2, 1]
    tokens, _ = sampler.sample(logits[:1], [_row(SamplingParams(temperature=1.0, logit_bias={1: -100, 2: -100}))])
    assert tokens == [0]


def test_min_p_never_samples_unlikely_tokens():
    from tandem.runner.sampler import batched_probs

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.12, 0.08]]))
    probs = batched_probs(logits, [SamplingParams(min_p=0.3)])      # keeps p >= 0.15
    assert probs[0, 2:].tolist() == [0.0, 0.0]
    torch.testing.assert_close(probs[0, :2], torch.tensor([0.625, 0.375]))
    torch.testing.assert_close(warp_probs(logits[0], SamplingParams(min_p=0.3)), probs[0])


@pytest.mark.parametrize("fields, field", [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"min_p": -0.1}, "min_p"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"), ({"logit_bias": {3: 1e3}}, "logit_bias"),
    ({"logit_bias": {3: True}}, "logit_bias"),
])
def test_bad_adjustments_are_refused(fields, field):
    from tandem import InvalidRequestError

    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**fields)
    assert e.value.field == field


def test_logit_bias_outside_the_vocabulary_is_refused(llm):
    from tandem import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        gen(llm, SamplingParams(logit_bias={10**6: 1.0}))


def test_penalised_requests_decode_without_speculation(tiny_loopy):
    """With n-gram speculation on, a penalised request drafts nothing and its greedy output equals
    the same request's without speculation; an unpenalised one in the same batch still drafts."""
    spec = LLM(model=str(tiny_loopy), dtype="float32", progress=False, speculative="ngram")
    plain = LLM(model=str(tiny_loopy), dtype="float32", progress=False)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, repetition_penalty=1.2,
                            frequency_penalty=0.3)
    got = spec.generate(prompt_token_ids=[PROMPT, PROMPT], sampling_params=[
        params, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)])
    ref = plain.generate(prompt_token_ids=[PROMPT], sampling_params=params)[0]
    assert got[0].token_ids == ref.token_ids
    assert (got[0].metrics.spec or {}).get("num_draft_tokens", 0) == 0
    assert (got[1].metrics.spec or {}).get("num_draft_tokens", 0) > 0


def test_output_kind_final_only_reports_the_end_alone(llm):
    """"final_only" (what LLM.generate uses) reports one output, the finished one, equal to the last
    cumulative output; an unknown kind is refused."""
    from tandem.errors import InvalidRequestError

    eng = llm.engine
    seen: dict[str, list] = {}
    for kind in ("cumulative", "final_only"):
        eng.add_request(params=SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, output_kind=kind),
                        prompt_token_ids=PROMPT, request_id=f"kind-{kind}")
    while eng.has_unfinished_requests():
        for out in eng.step():
            seen.setdefault(out.request_id, []).append(out)
    cumulative, final = seen["kind-cumulative"], seen["kind-final_only"]
    assert len(cumulative) > 1 and len(final) == 1 and final[0].finished
    assert final[0].token_ids == cumulative[-1].token_ids and final[0].text == cumulative[-1].text
    with pytest.raises(InvalidRequestError):
        SamplingParams(output_kind="delta-ish")
