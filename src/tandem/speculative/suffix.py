"""Suffix decoding (SuffixDecoding, arXiv 2411.04975): draft what most often followed the
request's latest tokens, in its own text and in a bounded cache of earlier requests' outputs.

Each text is indexed as a depth-bounded suffix tree would be walked, without building one:
n-grams (lengths `SEEDS`) map to the positions where they end, a seed lookup finds the earlier
occurrences of the context's last tokens, and comparing backwards from each gives its match
length. The deepest match is the tree node; its occurrences' next tokens are the node's children,
counted. The draft follows the most frequent child while the running product of the children's
frequencies (the estimated chance that the draft is still right) stays at or above
`min_token_prob`. How far to draft follows how much matched: at most `max_spec_factor` x the match
length, and match plus draft within `max_depth` (vLLM's `suffix_decoding_*` options mean the same).

Two texts are searched: the request's own (prompt and output so far) and the cache of earlier
requests' outputs (FIFO, bounded in requests and in tokens). The draft with the higher score (the
sum of its tokens' estimated chances, i.e. the expected accepted length) wins. The proposer says
how many tokens it would draft next (`offer`), so FASER's per-request length policy never gives a
request slots that frequency says are not worth verifying. No model, no torch.
"""

from __future__ import annotations

from collections import deque

from tandem.speculative.proposer import Draft
from tandem.types import ScheduledSeq

SEP = -1                    # between documents of the cache: no n-gram or match crosses it
SEEDS = (4, 2, 1)           # n-gram lengths that seed a match, longest first
MAX_CANDIDATES = 64         # most recent occurrences of the seed that are compared


class SuffixText:
    """A token sequence (positions counted from its start, even after a prefix is dropped) and the
    end positions of each of its seed n-grams, in increasing order."""

    __slots__ = ("tokens", "offset", "index", "indexed")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.offset = 0                       # positions before this were dropped
        self.index: tuple[dict, dict, dict] = ({}, {}, {})     # keyed as SEEDS
        self.indexed = 0                      # n-grams ending before this position are indexed

    def __len__(self) -> int:
        return self.offset + len(self.tokens)

    def _keys(self, q: int) -> list[tuple[dict, object]]:
        """(index, key) of each seed n-gram ending at list position q (none crosses a SEP)."""
        toks = self.tokens
        t = toks[q]
        if t == SEP:
            return []
        keys: list[tuple[dict, object]] = [(self.index[2], t)]
        if q >= 1 and toks[q - 1] != SEP:
            keys.append((self.index[1], (toks[q - 1], t)))
            if q >= 3 and toks[q - 2] != SEP and toks[q - 3] != SEP:
                keys.append((self.index[0], (toks[q - 3], toks[q - 2], toks[q - 1], t)))
        return keys

    def index_upto(self, end: int) -> None:
        """Index the n-grams that end before position `end`."""
        off = self.offset
        for p in range(self.indexed, end):
            for index, key in self._keys(p - off):
                index.setdefault(key, []).append(p)
        self.indexed = max(self.indexed, end)

    def drop_front(self, n: int) -> None:
        """Forget the first `n` tokens (already indexed) and their index entries."""
        off = self.offset
        for p in range(off, off + n):
            for index, key in self._keys(p - off):
                ends = index[key]
                if ends[0] == p:
                    del ends[0]
                if not ends:
                    del index[key]
        del self.tokens[:n]
        self.offset += n

    def matches(self, ctx: list[int], max_match: int) -> tuple[int, list[tuple[int, int]]]:
        """(seed length, [(end position, match length)]): the earlier occurrences of ctx's last
        tokens, most recent first, each with how far back it matches ctx (at most max_match)."""
        toks, off, n_ctx = self.tokens, self.offset, len(ctx)
        for n, index in zip(SEEDS, self.index):
            if n_ctx < n or n > max_match:
                continue
            ends = index.get(ctx[-1] if n == 1 else tuple(ctx[-n:]))
            if not ends:
                continue
            found = []
            for e in reversed(ends[-MAX_CANDIDATES:]):
                m, lo = n, min(max_match, n_ctx, e - off + 1)
                while m < lo and toks[e - off - m] == ctx[n_ctx - 1 - m]:
                    m += 1
                found.append((e, m))
            return n, found
        return 0, []


def draft_from(text: SuffixText, ctx: list[int], max_tokens: int, max_depth: int, max_spec_factor: float,
               min_token_prob: float) -> tuple[list[int], float]:
    """The draft (and its score) that `text` suggests after `ctx`."""
    seed, found = text.matches(ctx, max_depth - 1)
    if not found:
        return [], 0.0
    best = max(m for _, m in found)

    use, limit = seed, -1                     # the match length with the most room, then the longest
    for m in range(seed, best + 1):
        room = min(max_tokens, max_depth - m, int(max_spec_factor * m))
        if room >= limit:
            use, limit = m, room
    occ = [e for e, m in found if m >= use]
    toks, off, end = text.tokens, text.offset, len(text)
    draft: list[int] = []
    prob, score = 1.0, 0.0
    j = 1
    while len(draft) < limit and occ:
        if len(occ) == 1:                     # one occurrence left: its continuation, at the same chance
            e = occ[0] + j - off
            tail = toks[e:min(e + limit - len(draft), end - off)]
            if SEP in tail:
                tail = tail[:tail.index(SEP)]
            draft += tail
            score += prob * len(tail)
            break
        counts: dict[int, int] = {}
        for e in occ:                         # most recent first: ties go to the latest occurrence
            if e + j < end:
                t = toks[e + j - off]
                if t != SEP:
                    counts[t] = counts.get(t, 0) + 1
        if not counts:
            break
        tok = max(counts, key=counts.__getitem__)
        prob *= counts[tok] / len(occ)
        if prob < min_token_prob:
            break
        draft.append(tok)
        score += prob
        occ = [e for e in occ if e + j < end and toks[e + j - off] == tok]
        j += 1
    return draft, score


class _Local:
    __slots__ = ("text", "prompt_len", "draft", "drafted_at")

    def __init__(self, prompt_len: int) -> None:
        self.text = SuffixText()
        self.prompt_len = prompt_len
        self.draft: list[int] = []
        self.drafted_at = -1                  # the text length `draft` continues


class ResponseCache:
    """Earlier requests' outputs, newest last, as one text separated by SEP; FIFO within
    `max_requests` requests and `max_tokens` tokens (0 requests: no cache)."""

    def __init__(self, max_requests: int, max_tokens: int) -> None:
        self.max_requests, self.max_tokens = max_requests, max_tokens
        self.text = SuffixText()
        self.sizes: deque[int] = deque()      # tokens of each cached output (its SEP included)

    def add(self, output: list[int]) -> None:
        if not self.max_requests or not output:
            return
        output = output[-(self.max_tokens - 1):] if len(output) >= self.max_tokens else output
        self.text.tokens.extend(output)
        self.text.tokens.append(SEP)
        self.sizes.append(len(output) + 1)
        self.text.index_upto(len(self.text))
        drop = 0
        while len(self.sizes) > self.max_requests or len(self.text.tokens) - drop > self.max_tokens:
            drop += self.sizes.popleft()
        if drop:
            self.text.drop_front(drop)


class SuffixProposer:
    """Suffix decoding (a `Proposer`): drafts from the request's own text and from earlier
    requests' outputs, as long as their match and frequencies support."""

    runs_model = False
    pass_s = 0.0

    def __init__(self, max_draft_tokens: int, max_depth: int = 24, max_cached_requests: int = 10000,
                 max_spec_factor: float = 1.0, min_token_prob: float = 0.1,
                 max_cached_tokens: int = 1 << 20) -> None:
        self.max_draft_tokens = max_draft_tokens
        self.max_depth, self.max_spec_factor, self.min_token_prob = max_depth, max_spec_factor, min_token_prob
        self.cache = ResponseCache(max_cached_requests, max_cached_tokens)
        # the longest draft any match allows
        self.most_tokens = max(min(max_draft_tokens, max_depth - m, int(max_spec_factor * m))
                               for m in range(1, max_depth))
        self._local: dict[str, _Local] = {}

    def _sync(self, rid: str, history: list[int], num_output_tokens: int) -> _Local:
        local = self._local.get(rid)
        if local is None:
            local = self._local[rid] = _Local(len(history) - num_output_tokens)
        text = local.text
        if len(history) > len(text):
            text.tokens.extend(history[len(text):])
        return local

    def _draft(self, local: _Local) -> list[int]:
        """The request's draft after its whole text (up to max_draft_tokens), computed once per length."""
        text = local.text
        if local.drafted_at != len(text):
            text.index_upto(len(text) - 1)    # earlier occurrences only: not the suffix itself
            ctx = text.tokens[-self.max_depth:]
            args = (self.max_draft_tokens, self.max_depth, self.max_spec_factor, self.min_token_prob)
            own, own_score = draft_from(text, ctx, *args)
            # The cache can only win with a higher score, and no draft scores above its most tokens
            past, past_score = draft_from(self.cache.text, ctx, *args) \
                if self.cache.sizes and own_score < self.most_tokens else ([], 0.0)
            local.draft = past if past_score > own_score else own
            local.drafted_at = len(text)
        return local.draft

    def propose(self, seqs: list[ScheduledSeq], ks: list[int]) -> dict[str, Draft]:
        return {s.request_id: Draft(self._draft(self._sync(s.request_id, s.history, s.num_output_tokens))[:k])
                for s, k in zip(seqs, ks)}

    def offer(self, seq: ScheduledSeq, new_tokens: list[int]) -> int:
        local = self._sync(seq.request_id, seq.history, seq.num_output_tokens)
        local.text.tokens.extend(new_tokens)
        return len(self._draft(local))

    def settle(self, request_id: str, num_computed: int) -> None:
        """Nothing to settle: the texts hold committed tokens only."""

    def release(self, request_id: str, finished: bool = False) -> None:
        local = self._local.pop(request_id, None)
        if finished and local is not None:
            self.cache.add(local.text.tokens[local.prompt_len:])
