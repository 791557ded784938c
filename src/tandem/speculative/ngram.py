"""N-gram (prompt lookup) drafting: continue the request's own text where its last n tokens occurred.

For n from `n_max` down to `n_min`, the latest earlier occurrence of the last n tokens (in prompt
or output) proposes the tokens that followed it. An index per request (n-gram -> latest end
position) is extended incrementally, so a lookup costs O(n_max) whatever the length. No model,
no torch (its `Draft`s carry no distribution): the cheapest proposer, and a strong one for rewriting, extraction and code edits.
"""

from __future__ import annotations

from tandem.speculative.proposer import Draft
from tandem.types import ScheduledSeq


class _Index:
    def __init__(self, n_min: int, n_max: int) -> None:
        self.tokens: list[int] = []
        self.maps: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(n_min, n_max + 1)}
        self.indexed = 0                 # n-grams ending before this position are indexed

    def sync(self, history: list[int]) -> None:
        if len(history) > len(self.tokens):
            self.tokens.extend(history[len(self.tokens):])

    def lookup(self, k: int) -> list[int]:
        toks = self.tokens
        end = len(toks) - 1              # index n-grams ending at positions < end (not the suffix itself)
        for p in range(self.indexed, end):
            for n, m in self.maps.items():
                if p + 1 >= n:
                    m[tuple(toks[p + 1 - n:p + 1])] = p
        self.indexed = max(self.indexed, end)
        for n in sorted(self.maps, reverse=True):
            if len(toks) < n:
                continue
            e = self.maps[n].get(tuple(toks[-n:]))
            if e is not None:
                return toks[e + 1:e + 1 + k]
        return []


class NgramProposer:
    """Prompt-lookup drafting (a `Proposer`): the continuation of the longest, latest earlier
    occurrence of the request's last n tokens (n_max down to n_min)."""

    runs_model = False
    pass_s = 0.0

    def __init__(self, n_min: int, n_max: int, max_draft_tokens: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.max_draft_tokens = max_draft_tokens
        self._index: dict[str, _Index] = {}

    def _get(self, rid: str, history: list[int]) -> _Index:
        idx = self._index.get(rid)
        if idx is None:
            idx = self._index[rid] = _Index(self.n_min, self.n_max)
        idx.sync(history)
        return idx

    def propose(self, seqs: list[ScheduledSeq], ks: list[int]) -> dict[str, Draft]:
        return {s.request_id: Draft(self.lookup(s.request_id, s.history, k)) for s, k in zip(seqs, ks)}

    def offer(self, seq: ScheduledSeq, new_tokens: list[int]) -> int:
        return self.available(seq.request_id, seq.history, new_tokens)

    def settle(self, request_id: str, num_computed: int) -> None:
        """Nothing to settle: the table is rebuilt from the committed tokens it is given."""

    def lookup(self, rid: str, history: list[int], k: int) -> list[int]:
        """Up to k draft tokens continuing `history` (the request's committed tokens)."""
        return self._get(rid, history).lookup(k)

    def available(self, rid: str, history: list[int], new_tokens: list[int]) -> int:
        """How many drafts a lookup would offer after `new_tokens` are appended to `history`."""
        idx = self._get(rid, history)
        idx.tokens.extend(new_tokens)
        return len(idx.lookup(self.max_draft_tokens))

    def release(self, rid: str, finished: bool = False) -> None:
        self._index.pop(rid, None)
