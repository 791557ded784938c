"""Agent sessions whose tools run on the client, from traces of real sessions (token counts and
timings, no text): `../shared/workloads/agent-sessions/claude-code-opus.jsonl` and any trace of
the same shape (one session a JSON line: `id`, `block_size`, `system_tokens`, `tool_tokens`,
`calls`: [{`t`, `in`, `out`, `stop`, `wait_s`, `api_s`, `blocks`, `reuse_blocks`}]).

Each call is a fresh chat completion that carries the session's whole context. `replay_plan` turns
a session into what a replay sends: per call, how much of the previous call's context (prompt and
output) the new context starts with, how many new tokens follow, how many to generate, and how long
the client waits first. The rules, the same for the engine's replay and the simulator's:
- a call whose leading blocks are all those of the previous call's context continues it: it starts
  with the previous prompt and the previous output (the assistant's turn), then the new tokens;
  otherwise it keeps `reuse_blocks` x `block_size` tokens and the rest is new (the agent rewrote or
  compacted its history);
- waits after `tool_use` are the tool's run time; waits after `end_turn` are a person's, and
  `person_wait` says what to do with them: "cap:S" (wait at most S seconds) or "cut" (the session
  ends at its first `end_turn`);
- `window`: a context that would not fit (with its output) is compacted the way agents compact:
  to the system prompt and tool definitions plus the newest `compact_to` x window tokens, and
  later calls grow from there by the trace's deltas;
- `token_scale` and `time_scale` shrink token counts and waits to fit a small model and machine.

`split` divides sessions into a part to fit knobs on and a part to report on, by a hash of the
session id (stable across runs and machines). Seeded arrivals live with the replays.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

STOPS = ("tool_use", "end_turn", "")


class TraceError(ValueError):
    """A session trace that cannot be replayed (the message names the line and the field)."""


@dataclass(frozen=True)
class AgentCall:
    t: float
    in_tokens: int
    out_tokens: int
    stop: str
    wait_s: float
    api_s: float
    blocks: int
    reuse_blocks: int


@dataclass(frozen=True)
class AgentSession:
    session_id: str
    family: str
    block_size: int
    system_tokens: int
    tool_tokens: int
    calls: tuple[AgentCall, ...]


@dataclass(frozen=True)
class PlannedCall:
    """One call as a replay sends it."""
    keep_tokens: int | None      # of the previous call's context (prompt + output) it starts with;
                                 # None: all of it (the call continues the previous one)
    new_tokens: int              # tokens that follow (tool results, user input, a compacted history)
    output_tokens: int
    wait_s: float                # the client's wait before sending it (0 for the first call)
    after_tool: bool             # the wait was a tool's (False: the first call or a person's)
    context_tokens: int          # the whole prompt it sends


def _call(raw: dict, where: str) -> AgentCall:
    try:
        c = AgentCall(float(raw["t"]), int(raw["in"]), int(raw["out"]), str(raw.get("stop") or ""),
                      float(raw.get("wait_s") or 0.0), float(raw.get("api_s") or 0.0), int(raw.get("blocks") or 0),
                      int(raw.get("reuse_blocks") or 0))
    except (KeyError, TypeError, ValueError) as e:
        raise TraceError(f"{where}: a call needs numbers t, in, out ({e})") from None
    if c.in_tokens < 1 or c.out_tokens < 0 or c.wait_s < 0 or c.reuse_blocks < 0:
        raise TraceError(f"{where}: need in >= 1, out >= 0, wait_s >= 0, reuse_blocks >= 0")
    if c.stop not in STOPS:
        raise TraceError(f"{where}: stop must be one of {STOPS}, got {c.stop!r}")
    return c


def load_sessions(path: str | Path) -> list[AgentSession]:
    """Sessions of a JSON-lines trace, in file order; TraceError on a malformed line."""
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                raw = json.loads(line)
                calls = tuple(_call(c, f"{where} call {i}") for i, c in enumerate(raw["calls"]))
                s = AgentSession(str(raw["id"]), str(raw.get("family", "")), int(raw.get("block_size", 64)),
                                 int(raw.get("system_tokens", 0)), int(raw.get("tool_tokens", 0)), calls)
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                if isinstance(e, TraceError):
                    raise
                raise TraceError(f"{where}: not a session ({type(e).__name__}: {e})") from None
            if not calls or s.block_size < 1:
                raise TraceError(f"{where}: a session needs calls and block_size >= 1")
            out.append(s)
    return out


def split(sessions: list[AgentSession], fit_share: float = 0.3) -> tuple[list[AgentSession], list[AgentSession]]:
    """(fit, report): about `fit_share` of the sessions to fit knobs on, the rest to report on,
    chosen by a hash of the session id."""
    def h(s: AgentSession) -> float:
        return int.from_bytes(hashlib.sha256(s.session_id.encode()).digest()[:8], "big") / 2**64
    return [s for s in sessions if h(s) < fit_share], [s for s in sessions if h(s) >= fit_share]


def parse_person_wait(spec: str) -> float | None:
    """"cap:S" -> S (seconds); "cut" -> None."""
    if spec == "cut":
        return None
    if spec.startswith("cap:"):
        try:
            cap = float(spec[4:])
        except ValueError:
            cap = -1.0
        if cap >= 0:
            return cap
    raise ValueError(f"person_wait must be 'cut' or 'cap:SECONDS', got {spec!r}")


def replay_plan(s: AgentSession, person_wait: str = "cap:60", window: int | None = None, token_scale: float = 1.0,
                time_scale: float = 1.0, compact_to: float = 0.5) -> list[PlannedCall]:
    """What a replay sends for session `s` (see the module's docstring)."""
    cap = parse_person_wait(person_wait)
    if not (token_scale > 0 and time_scale >= 0 and 0 < compact_to < 1):
        raise ValueError("need token_scale > 0, time_scale >= 0 and 0 < compact_to < 1")

    def sc(n: float) -> int:
        return max(1, round(n * token_scale))

    head = sc(s.system_tokens + s.tool_tokens) if s.system_tokens + s.tool_tokens else 0
    bs = s.block_size
    plan: list[PlannedCall] = []
    offset = 0.0                 # trace tokens compacted away so far
    prev_ctx = prev_in = 0       # the previous call's context with its output (scaled), its trace `in`
    for i, c in enumerate(s.calls):
        out = sc(c.out_tokens) if c.out_tokens else 1
        wait, after_tool = 0.0, False
        if i:
            after_tool = s.calls[i - 1].stop == "tool_use"
            if s.calls[i - 1].stop == "end_turn":
                if cap is None:
                    break
                wait = min(c.wait_s, cap)
            else:
                wait = c.wait_s
        ctx = sc(max(1.0, c.in_tokens - offset))
        if window is not None and ctx + out > window:        # compact
            ctx = min(head + int(compact_to * window), window - out - 1)
            if ctx < 1:
                raise ValueError(f"a window of {window} tokens cannot hold a call of {out} output tokens")
            offset = c.in_tokens - ctx / token_scale
            keep = min(head, ctx - 1, prev_ctx) if i else 0
        elif not i:
            keep = 0
        elif c.reuse_blocks * bs >= (prev_in // bs) * bs and ctx > prev_ctx:
            keep = None                                      # continues the previous call
        else:
            reuse = c.reuse_blocks * bs - offset
            keep = min(sc(reuse) if reuse > 0 else 0, ctx - 1, prev_ctx)
        new = ctx - (prev_ctx if keep is None else keep)
        plan.append(PlannedCall(keep, new, out, wait * time_scale, after_tool, ctx))
        prev_ctx, prev_in = ctx + out, c.in_tokens
    return plan
