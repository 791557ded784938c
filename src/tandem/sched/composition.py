"""Which prefills share a step: first tokens before tool results (AugServe's step composition).

A step's time grows with its prefill tokens, and every request in it waits for the whole step. A
new prompt's time to first token is the step it runs in, so a step that also prefills another
request's tool result (or a context recomputed after preemption) makes that first token later by
the tool result's share of the step. The resumed request has shown its first token long ago: one
step more before its tool result is read costs it one step of its end-to-end time, spread over all
of its output tokens.

`FirstTokensFirst` decides, per step, which prefills may wait: a request that already has a first
token and has more than one token to compute (a tool result, a recomputed context) yields to the
prompts of requests that have none, for at most one step per resume. It yields only in a step that
does serve such a prompt; if none could be admitted, the yielded prefills run after all in the same
step (with the budget that is left). The bound keeps a resumed request from starving behind a
stream of arrivals: once deferred, it competes at its rank again until its next tool call or
preemption.

Pure bookkeeping: no torch, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable

from tandem.types import Request


class FirstTokensFirst:
    def __init__(self) -> None:
        # request -> the resume (tool calls, preemptions) at which a first token last deferred it
        self._deferred: dict[str, tuple[int, int]] = {}
        self.num_deferred = 0       # prefills deferred by one step, since the start

    @staticmethod
    def _resume(request: Request) -> tuple[int, int]:
        return request.tool.num_calls, request.num_preemptions

    def may_defer(self, request: Request) -> bool:
        """`request`'s next chunk is a prefill behind its first token (a tool result, a recomputed
        context) that has not yet yielded since its last resume."""
        return (request.times.first_token is not None
                and request.num_tokens - request.num_computed_tokens > 1
                and self._deferred.get(request.request_id) != self._resume(request))

    def may_not_defer(self, request: Request) -> bool:
        return not self.may_defer(request)

    def all_fit(self, waiting: list[Request], running: list[Request], max_num_seqs: int, step: int,
                limit: int) -> bool:
        """Some prompt awaits its first token, and all of them fit this step (`step` tokens, `limit`
        of them for admissions) beside the running requests' tokens that do not yield (prefix cache
        hits not counted): the step can serve them all. Past that (a queue of prompts, an
        overload) yielding would only reorder the queue."""
        new = [r for r in waiting if r.times.first_token is None]
        if not new and all(r.times.first_token is not None for r in running):
            return False
        if len(running) + len(new) > max_num_seqs:
            return False
        need = sum(r.num_tokens - r.num_computed_tokens for r in new)
        kept = sum(r.num_tokens - r.num_computed_tokens for r in running if not self.may_defer(r))
        return need <= limit and kept + need <= step

    @staticmethod
    def all_served(planned: Iterable[Request], waiting: list[Request]) -> bool:
        """The step serves some prompt's first token, and no prompt awaiting one is left waiting:
        then the prefills that could yield do."""
        return any(r.times.first_token is None for r in planned) \
            and all(r.times.first_token is not None for r in waiting)

    def defer(self, request: Request) -> None:
        """`request` waits this step for a first token that the step serves."""
        self._deferred[request.request_id] = self._resume(request)
        self.num_deferred += 1

    def forget(self, request_id: str) -> None:
        self._deferred.pop(request_id, None)
