"""Per-position draft acceptance estimates of each request (`AcceptanceModel`): what FASER's
adaptive length policy (sched/spec_length.py), the frontier chooser and the run-ahead chooser
read. Pure Python."""

from __future__ import annotations

import math


class AcceptanceModel:
    """Per-position acceptance estimates of each request, pooled with what is known around them.

    a_i(m) is the probability that draft m is accepted given drafts 1..m-1 were. Position 1 is
    pooled with the global average; a deeper position with the request's own estimate of the
    position before it:  a_i(1) = (acc_i(1) + w g(1)) / (n_i(1) + w),
    a_i(m) = (acc_i(m) + w a_i(m-1)) / (n_i(m) + w). So a request that keeps accepting at
    positions 1..5 is expected to keep accepting at 6 until it is shown otherwise: acceptance runs
    (copying a passage, a code block) are exactly where long drafts pay, and positions a policy
    rarely tries would otherwise stay at a pessimistic prior and never be tried. A new request
    starts at the global estimate; counts decay so that a request whose text changes character
    (copying, then free writing) is followed. An optimism bonus `explore / sqrt(1 + n_i(m))`
    keeps rarely tried positions from never being tried (an upper confidence bound, as FASER's
    search uses one); the global estimate starts optimistic (`global_start`), so a drafter nobody
    has tried yet is tried.

    Evidence also ages while it is not renewed (`age`): a request that could draft and got no
    slots, and the global estimate in a step where nobody drafted, keep their means but lose
    weight, so their estimates drift back towards the optimistic start and drafting is tried
    again. Without it a few early rejections (a chat template's markers are drafted wrongly at
    every request's start) stop drafting for good, and nothing could show that the text turned
    to copying later. Each ages slower the more retries in a row failed (`idle_decay` to the
    power 2^-streak: each doubles the wait before the next), so a drafter that keeps failing is
    retried ever more rarely. A retry is a round drafted after idle steps whose first draft was
    rejected (for the global estimate: a step after steps where nobody drafted, all of whose
    judged first drafts failed); an accepted first draft ends the streak.
    """

    def __init__(self, max_len: int, prior: float = 0.5, weight: float = 2.0, decay: float = 0.9,
                 explore: float = 0.1, optimistic: bool = True, global_decay: float = 0.98,
                 idle_decay: float = 0.98) -> None:
        self.max_len = max_len
        self.prior = prior
        self.weight = weight
        self.decay = decay
        self.idle_decay = idle_decay
        self.explore = explore
        self.optimistic = optimistic
        self.global_decay = global_decay    # per judged first draft: the global mean spans ~50 of them
        self._g_acc = self._g_n = 0.0
        self._acc: dict[str, list[float]] = {}
        self._n: dict[str, list[float]] = {}
        self._streak: dict[str, int] = {}      # failed retries in a row, per request
        self._idle: set[str] = set()           # requests aged since they last drafted
        self._g_streak = 0                     # failed retries in a row, of the global estimate
        self._g_idle = False                   # a step where nobody drafted since the last judged one
        self._step_judged = self._step_hits = 0

    @property
    def global_first(self) -> float:
        """Position 1's acceptance over all requests: a decayed mean of judged first drafts,
        pooled with `prior`."""
        return (self._g_acc + self.weight * self.prior) / (self._g_n + self.weight)

    def global_start(self, optimistic: bool | None = None) -> float:
        """Where a request's estimates start. `optimistic`: the global mean plus (1 - mean) / (1 + n)
        for n judged first drafts, so a drafter nobody has tried yet counts as always accepted and
        gets tried: with a draft model whose pass costs half a target step, the prior alone would
        never pay for drafting, and nothing would ever show that its drafts are accepted 95% of
        the time. Each judged draft brings the bound down towards what was seen (a drafter that
        misses is dropped after a few tries)."""
        g = self.global_first
        return g + (1.0 - g) / (1.0 + self._g_n) if (self.optimistic if optimistic is None else optimistic) else g

    def estimates(self, request_id: str, explore: float | None = None, optimistic: bool | None = None,
                  upto: int | None = None) -> list[float]:
        """a_i(1..max_len) (or the first `upto` of them); `explore` and `optimistic` override the
        model's own for this read (a reader that decides how to verify, not whether to try, wants
        neither)."""
        explore = self.explore if explore is None else explore
        optimistic = self.optimistic if optimistic is None else optimistic
        acc, n = self._acc.get(request_id), self._n.get(request_id)
        start = self.global_start(optimistic)
        size = self.max_len if upto is None else min(upto, self.max_len)
        if acc is None:
            return [min(1.0, start + explore)] * size
        w, out, prior = self.weight, [], start
        for m in range(size):
            prior = (acc[m] + w * prior) / (n[m] + w)
            out.append(min(1.0, prior + explore / math.sqrt(1.0 + n[m])))
        return out

    def observe(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        acc = self._acc.setdefault(request_id, [0.0] * self.max_len)
        n = self._n.setdefault(request_id, [0.0] * self.max_len)
        # Draft m+1 was judged only if drafts 1..m were accepted.
        for m in range(min(num_drafted, num_accepted + 1, self.max_len)):
            hit = 1.0 if m < num_accepted else 0.0
            acc[m] = acc[m] * self.decay + hit
            n[m] = n[m] * self.decay + 1.0
            if m == 0:
                self._g_acc = self._g_acc * self.global_decay + hit
                self._g_n = self._g_n * self.global_decay + 1.0
                if hit:
                    self._streak[request_id] = 0
                elif request_id in self._idle:
                    self._streak[request_id] = self._streak.get(request_id, 0) + 1
                self._step_judged += 1
                self._step_hits += int(hit)
        self._idle.discard(request_id)

    def end_step(self) -> None:
        """The step whose outcomes were observed is over (the global streak counts steps)."""
        if self._step_judged:
            if self._step_hits:
                self._g_streak = 0
            elif self._g_idle:
                self._g_streak += 1
            self._g_idle = False
        self._step_judged = self._step_hits = 0

    def age(self, request_ids: list[str], global_too: bool) -> None:
        """A step in which `request_ids` could draft and got no slots (`global_too`: nobody
        drafted): their evidence keeps its means and loses weight (see the class)."""
        for rid in request_ids:
            acc, n = self._acc.get(rid), self._n.get(rid)
            if acc is not None:
                f = self.idle_decay ** (0.5 ** min(self._streak.get(rid, 0), 16))
                self._acc[rid] = [a * f for a in acc]
                self._n[rid] = [c * f for c in n]
                self._idle.add(rid)
        if global_too:
            f = self.idle_decay ** (0.5 ** min(self._g_streak, 16))
            self._g_acc *= f
            self._g_n *= f
            self._g_idle = True

    def forget(self, request_id: str) -> None:
        self._acc.pop(request_id, None)
        self._n.pop(request_id, None)
        self._streak.pop(request_id, None)
        self._idle.discard(request_id)
