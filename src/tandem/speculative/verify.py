"""Verification of drafted tokens against the target model: lossless by construction.

Greedy: draft j is accepted while it equals the target's argmax at its position; the first
mismatch is replaced by the target's argmax; if all pass, the target's next token is added.

Sampling (speculative sampling, Leviathan et al. / Chen et al.): draft token d drawn from q is
accepted with probability min(1, p(d) / q(d)); on rejection the token is redrawn from the
residual max(0, p - q) / Z. The emitted token is then distributed exactly as p. A deterministic
drafter (n-gram) has q = one-hot(d): accept with probability p(d), residual = p without d.
"""

from __future__ import annotations

import torch

from tandem.runner.sampler import Sampler


def verify_greedy(target_argmax: list[int], drafts: list[int]) -> list[int]:
    """target_argmax: the target's argmax at the rows before each draft (the last committed token,
    then each draft), plus the row after the last draft if it was computed (then a bonus token is
    added when every draft passes). Without that row, an all-accepted result is just the drafts."""
    out = []
    for j, d in enumerate(drafts):
        out.append(target_argmax[j])
        if target_argmax[j] != d:
            return out
    if len(target_argmax) > len(drafts):
        out.append(target_argmax[len(drafts)])
    return out


def verify_sampled(p: torch.Tensor, drafts: list[int], q: torch.Tensor | None,
                   generator: torch.Generator) -> list[int]:
    """p: [k+1, V] target probabilities (after temperature / top-k / top-p), or [k, V] when the row
    after the last draft was not computed; q: [k, V] draft probabilities, or None for a
    deterministic drafter. Returns accepted drafts + one more token (none if all k pass and p has
    only k rows)."""
    out: list[int] = []
    u = torch.rand(len(drafts), generator=generator, device=p.device).tolist() if drafts else []
    for j, d in enumerate(drafts):
        pd = float(p[j, d])
        qd = 1.0 if q is None else float(q[j, d])
        if u[j] * qd < pd:                       # accept with probability min(1, pd / qd)
            out.append(d)
            continue
        residual = p[j].clone()
        if q is None:
            residual[d] = 0.0
        else:
            residual = (residual - q[j]).clamp_min_(0.0)
        total = float(residual.sum())
        out.append(Sampler.draw(residual / total if total > 0 else p[j], generator))
        return out
    if p.shape[0] > len(drafts):
        out.append(Sampler.draw(p[len(drafts)], generator))
    return out
