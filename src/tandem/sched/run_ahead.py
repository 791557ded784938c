"""Run-ahead drafting (FASER's next lever): while step t verifies, the proposer drafts step t+1 on
the guess that every draft of step t passes and that the bonus token is the proposer's own next
token. A request whose guess held verifies those drafts next step with no drafting in the open;
one whose guess failed decodes one token plainly, while its next drafts are made on the guess of
that token.

Per request this is a two-state chain. Drafting k ahead, with survival s(j) = prod_{m<=j} a(m) of
its per-position acceptance a(m): after a step that verified k drafts the guess holds with
probability s(k + 1) (all k pass and the bonus matches), after a plain step with s(1). In steady
state it holds in a share pi = s(1) / (1 - s(k + 1) + s(1)) of steps, which give 1 + E(k)
tokens (E(k) = sum_{j<=k} s(j)); the other steps give 1. A step costs the target's verification
of the drafts that held, plus what the drafting ahead beside it shows of its own time
(`StepCostModel.exposed_share`: on disjoint compute little, on shared bandwidth more).

`RunAheadChooser.choose` compares, each step, the steady-state tokens per second of drafting in
the open (the length policy's choice) with running ahead at the policy's lengths or at any
uniform cap, over all requests or only those the policy drafts for. It keeps its mode unless the
other is better by the dead band: switching into run-ahead costs a step of plain decodes (nobody
has drafts ready yet). "always" runs ahead at the best lengths every step. Where drafting costs
nothing (n-gram and suffix lookups) running ahead only loses drafts, and the chooser says so.
Torch-free and clock-free.
"""

from __future__ import annotations

from tandem.sched.cost_model import StepCostModel
from tandem.sched.acceptance import AcceptanceModel


class RunAheadChooser:
    def __init__(self, acceptance: AcceptanceModel, cost: StepCostModel, max_len: int, always: bool = False,
                 dead_band: float = 0.03) -> None:
        self.acceptance = acceptance
        self.cost = cost
        self.max_len = max_len
        self.always = always
        self.dead_band = dead_band
        self.ahead = always            # the mode: running ahead, or drafting in the open
        self.num_ahead_steps = 0       # steps that drafted ahead
        self.num_steps = 0             # steps it chose for

    def choose(self, request_ids: list[str], limits: list[int], num_base_tokens: int, lengths: list[int],
               ready: list[int], ahead_limits: list[int]) -> tuple[list[int], list[int]]:
        """(drafts to verify now, drafts to make ahead) per request. `lengths`: the length policy's
        choice for drafting in the open; `ready[i]`: drafts request i has from the last step's run
        ahead; `ahead_limits[i]`: the most it can use next step."""
        n = len(request_ids)
        self.num_steps += 1
        if not self.cost.measured(num_base_tokens):        # as the length policy: the plain step first
            return lengths, [0] * n
        now_ahead = [min(r, lim) for r, lim in zip(ready, limits)]
        tables = [self._survival(rid) for rid in request_ids]
        open_rate = self._open_rate(tables, lengths, num_base_tokens)
        best, best_rate = [0] * n, 0.0
        drafting = [k > 0 for k in lengths]
        caps = [list(lengths)] + [[c] * n for c in range(1, self.max_len + 1)]
        for mask in ([True] * n, drafting):
            if not any(mask):
                continue
            for cap in caps:
                ks = [min(c, al) if m else 0 for c, al, m in zip(cap, ahead_limits, mask)]
                if any(ks) and (rate := self._ahead_rate(tables, ks, num_base_tokens)) > best_rate:
                    best, best_rate = ks, rate
        if not self.always:
            band = self.dead_band
            self.ahead = best_rate > open_rate * (1 - band if self.ahead else 1 + band)
        if not self.ahead:
            return lengths, [0] * n
        self.num_ahead_steps += 1
        return now_ahead, best

    def _survival(self, request_id: str) -> list[float]:
        """[s(0) = 1, s(1), ..., s(max_len + 1)] of a request (its last position's rate repeats)."""
        est = self.acceptance.estimates(request_id, explore=0.0, optimistic=False)
        out, s = [1.0], 1.0
        for m in range(self.max_len + 1):
            s *= est[min(m, len(est) - 1)]
            out.append(s)
        return out

    def _open_rate(self, tables: list[list[float]], ks: list[int], base: int) -> float:
        """Tokens per second of a step that drafts `ks` in the open and then verifies them."""
        n = len(tables)
        tokens = n + sum(sum(s[1:k + 1]) for s, k in zip(tables, ks))
        rows = sum(1 for k in ks if k)
        t = self.cost.draft_times(base, n, sum(ks) + 1)[-1] + self.cost.draft_pass_s(rows) * max(ks, default=0)
        return tokens / max(1e-9, t)

    def _ahead_rate(self, tables: list[list[float]], ks: list[int], base: int) -> float:
        """Steady-state tokens per second of running ahead with lengths `ks` (see the module)."""
        n = len(tables)
        tokens = verified = 0.0
        for s, k in zip(tables, ks):
            if not k:
                tokens += 1.0
                continue
            pi = s[1] / max(1e-9, 1.0 - s[k + 1] + s[1])
            tokens += 1.0 + pi * sum(s[1:k + 1])
            verified += pi * k
        m = round(verified)
        rows = sum(1 for k in ks if k)
        alone = self.cost.draft_pass_s(rows) * max(ks)
        t = self.cost.draft_times(base, n, m + 1)[-1] + self.cost.exposed_share(rows) * alone
        return tokens / max(1e-9, t)
