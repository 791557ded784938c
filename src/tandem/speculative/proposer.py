"""What the speculative decoder needs of a proposer (`Proposer`), and the draft it gets back.

Two kinds implement it: lookups in text (`NgramProposer` in the request's own tokens,
`SuffixProposer` there and in earlier requests' outputs: no forward pass, so nothing to time or
overlap; they say how many drafts they could offer next, so the scheduler gives no slots they
cannot fill) and `ModelDrafter` (a draft model, or the target's first layers,
run autoregressively: one forward pass per draft position, timed, overlappable with verification,
with draft KV that the target's verdict settles). `SpecDecoder` talks to either through this
protocol alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from tandem.types import ScheduledSeq

if TYPE_CHECKING:                           # torch-free at run time: the n-gram proposer needs none
    import torch


@dataclass
class Draft:
    tokens: list[int]
    probs: torch.Tensor | None = None     # [k, V] draft distribution (sampled requests); None: greedy / one-hot


class Proposer(Protocol):
    runs_model: bool        # drafting runs forward passes: timed per pass, overlappable with verification
    pass_s: float           # the last propose(): seconds of one steady forward pass (0 without passes)

    def propose(self, seqs: list[ScheduledSeq], ks: list[int]) -> dict[str, Draft]:
        """Up to ks[i] draft tokens for each seqs[i], by request id."""
        ...

    def offer(self, seq: ScheduledSeq, new_tokens: list[int]) -> int | None:
        """How many drafts the proposer could give `seq` once `new_tokens` follow its history
        (None: as many as asked, as a model drafts whatever it is asked for)."""
        ...

    def settle(self, request_id: str, num_computed: int) -> None:
        """The target kept KV for `num_computed` tokens: state past them is void."""
        ...

    def release(self, request_id: str, finished: bool = False) -> None:
        """Forget the request: `finished` (done or aborted: its output may be kept for others), or
        preempted, or its KV released (it comes back later)."""
        ...
