"""The batched sampler: same warping as the per-row reference, draws that follow the distribution,
and seeded draws keyed by (seed, position) only. No model needed."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tandem.runner.sampler import SampleRow, Sampler, batched_probs, inverse_cdf, keyed_uniform, warp_probs
from tandem.sampling_params import SamplingParams

PARAMS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5),
          SamplingParams(temperature=1.3, top_p=0.6), SamplingParams(temperature=0.9, top_k=40, top_p=0.9),
          SamplingParams(temperature=2.0, top_k=1), SamplingParams(temperature=1.0, top_p=0.05)]


def test_batched_probs_equal_the_per_row_reference():
    logits = torch.randn(len(PARAMS), 300, generator=torch.Generator().manual_seed(1)) * 3
    got = batched_probs(logits, PARAMS)
    want = torch.stack([warp_probs(logits[i], p) for i, p in enumerate(PARAMS)])
    assert torch.allclose(got, want, atol=1e-6)
    assert ((got > 0) == (want > 0)).all()          # the same tokens survive top-k and top-p


def test_inverse_cdf_draws_follow_the_distribution():
    """Chi-square goodness of fit of 20k draws in one batch (critical value df=4, p=0.001: 18.47)."""
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    n = 20000
    u = 1.0 - torch.rand(n, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    counts = torch.bincount(inverse_cdf(probs.expand(n, 5), u), minlength=5).double()
    chi2 = (((counts - n * probs) ** 2) / (n * probs)).sum().item()
    assert chi2 < 18.47


def test_inverse_cdf_never_picks_a_zero_probability_token():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]]).expand(4, 5)
    u = torch.tensor([1e-300, 0.5, 0.5000001, 1.0], dtype=torch.float64)
    assert inverse_cdf(probs, u).tolist() == [1, 1, 3, 3]


def test_keyed_uniform_is_in_range_and_depends_on_every_part():
    values = {keyed_uniform(seed, 0, pos) for seed in range(20) for pos in range(50)}
    assert len(values) == 1000 and all(0.0 < v <= 1.0 for v in values)
    assert keyed_uniform(7, 0, 3) == keyed_uniform(7, 0, 3) != keyed_uniform(7, 1, 3)


def _row(rid: str, seed: int | None, pos: int, **kw) -> SampleRow:
    return SampleRow(rid, SamplingParams(temperature=1.0, seed=seed, **kw), pos, frozenset())


def test_seeded_tokens_do_not_depend_on_the_batch_or_on_earlier_draws():
    vocab = 1000
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(2))
    alone = [Sampler(torch.device("cpu")).sample(logits, [_row("a", 5, pos)])[0][0] for pos in range(30)]
    sampler = Sampler(torch.device("cpu"), seed=123)
    noise = torch.randn(3, vocab)
    batched = []
    for pos in range(30):          # the seeded row sits among unseeded, greedy and top-k rows
        rows = [_row("x", None, pos), _row("a", 5, pos), SampleRow("g", SamplingParams(temperature=0), 0, frozenset()),
                _row("k", None, pos, top_k=3)]
        batch = torch.cat([noise[:1], logits, noise[1:]])
        batched.append(sampler.sample(batch, rows)[0][1])
    assert batched == alone
    assert len(set(alone)) > 5                       # it does sample: temperature 1 over 1000 tokens


def test_greedy_rows_take_the_argmax_and_logprobs_are_raw():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(3))
    rows = [SampleRow("g", SamplingParams(temperature=0, logprobs=2), 0, frozenset()),
            _row("s", 1, 0), SampleRow("h", SamplingParams(temperature=0), 0, frozenset())]
    tokens, lps = Sampler(torch.device("cpu")).sample(logits, rows)
    assert tokens[0] == int(logits[0].argmax()) and tokens[2] == int(logits[2].argmax())
    assert lps[1] is None and lps[2] is None
    assert lps[0].logprob == pytest.approx(torch.log_softmax(logits[0], -1)[tokens[0]].item(), abs=1e-6)
    assert [t for t, _ in lps[0].top] == torch.topk(logits[0], 2).indices.tolist()


def _reference(sampler: Sampler) -> Sampler:
    """The same sampler without the fused kernel (the tensor-op path it replaces)."""
    sampler._fused = None
    return sampler


@pytest.mark.skipif(Sampler(torch.device("cpu"))._fused is None, reason="CPU kernels could not be built here")
def test_fused_temperature_draws_equal_the_tensor_path():
    """Rows with a temperature alone go through the fused kernel; every row's token equals the
    tensor path's (softmax, float64 cumsum, searchsorted) for the same uniforms, amid greedy and
    top-k/top-p rows, seeded and unseeded, and over a vocabulary that is not a multiple of 8."""
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(40, 1003, generator=gen) * 4
    logits[:, 500:] -= 30                                   # a long tail of tiny probabilities
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0), SamplingParams(temperature=0.6),
              SamplingParams(temperature=1.4, top_p=0.9), SamplingParams(temperature=1.0, top_k=20)]
    rows = [SampleRow(f"r{i}", dataclasses.replace(params[i % 5], seed=i if i % 2 else None), 3,
                      frozenset()) for i in range(40)]
    fused, ref = Sampler(torch.device("cpu"), seed=5), _reference(Sampler(torch.device("cpu"), seed=5))
    for _ in range(5):
        assert fused.sample(logits, rows)[0] == ref.sample(logits, rows)[0]


@pytest.mark.skipif(Sampler(torch.device("cpu"))._fused is None, reason="CPU kernels could not be built here")
def test_fused_kernel_never_draws_a_zero_probability_token_and_covers_the_ends():
    kernel = Sampler(torch.device("cpu"))._fused
    logits = torch.full((4, 21), float("-inf"))
    logits[:, [3, 11, 17]] = torch.tensor([0.0, 1.0, 2.0])
    u = torch.tensor([1e-300, 0.5, 0.999999, 1.0], dtype=torch.float64)
    got = kernel(logits, torch.arange(4), torch.ones(4), u).tolist()
    assert got[0] == 3 and got[3] == 17 and set(got) <= {3, 11, 17}
    with pytest.raises(RuntimeError, match="temperatures must be > 0"):
        kernel(logits, torch.arange(1), torch.zeros(1), u[:1])
    with pytest.raises(RuntimeError, match="out of range"):
        kernel(logits, torch.tensor([4]), torch.ones(1), u[:1])
