"""One benchmark request against an OpenAI-compatible endpoint, streamed and timed.

Owns the wire side of `tandem bench serve`: the request body (chat or completions, `stream: true`,
`stream_options.include_usage`), server-sent-event parsing, and per-request timing:
TTFT (send -> first chunk with a choice, as vLLM times it), ITL (gaps between content chunks), E2E (send -> end of stream),
output tokens (the usage block if the server sends one, else the number of content chunks).
ITL is per chunk, as in vLLM's benchmark: a server that streams several tokens per chunk (speculative
decoding) shows fewer, longer gaps; TPOT, (E2E - TTFT) / (output tokens - 1), is per token.
A tool-augmented item is replayed as a chain of calls: each segment's generation, then a sleep of
the trace's tool time, then the tool's return (filler text of its length) appended to the
conversation; TTFT is the first call's, ITL gaps stay within calls. Each call of a chain carries the
OpenAI `user` field, one value per chain, so a cluster's router can keep the session on one replica.
Failures (HTTP status, connection errors, error events, a stream that ends without `[DONE]` or a
finish reason, a stream with no content at all) are recorded on the request, never raised.
Knows nothing of arrivals or statistics.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from tandem.workload.augmented import synthetic_text
from tandem.workload.datasets import WorkItem


@dataclass(frozen=True)
class Target:
    """Where and how to send: base URL (no /v1), endpoint kind, model name and request options."""
    base_url: str
    model: str
    endpoint: str = "chat"                 # "chat" | "completions"
    api_key: str | None = None
    max_tokens: int | None = None          # overrides each item's expected output length
    temperature: float = 0.0
    ignore_eos: bool = False               # vLLM / Tandem extension: produce exactly max_tokens

    @property
    def url(self) -> str:
        return f"{self.base_url}/v1/{'chat/completions' if self.endpoint == 'chat' else 'completions'}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass
class StreamResult:
    """What one streamed call produced."""
    ok: bool = False
    status: int | None = None
    error: str | None = None
    text: str = ""
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    num_chunks: int = 0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


@dataclass
class RequestRecord:
    """One benchmark request, as reported in the JSON results."""
    index: int
    kind: str
    send_s: float                          # offset from the start of the run
    expected_output_tokens: int
    success: bool = False
    status: int | None = None
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None
    num_tool_calls: int = 0
    tool_time_s: float = 0.0

    @property
    def tpot_s(self) -> float | None:
        """(E2E - TTFT - tool time) / (output tokens - 1); 0 for one-token outputs (vLLM's convention)."""
        if not self.success or self.e2e_s is None or self.ttft_s is None:
            return None
        if self.output_tokens <= 1:
            return 0.0
        return (self.e2e_s - self.ttft_s - self.tool_time_s) / (self.output_tokens - 1)

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["tpot_s"] = self.tpot_s
        return d


def request_body(target: Target, conversation: list[dict[str, Any]] | str, max_tokens: int,
                 user: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": target.model, "max_tokens": max_tokens,
                            "temperature": target.temperature, "stream": True,
                            "stream_options": {"include_usage": True}}
    if user is not None:
        body["user"] = user
    body["messages" if target.endpoint == "chat" else "prompt"] = conversation
    if target.ignore_eos:
        body["ignore_eos"] = True
    return body


def chunk_text(chunk: dict[str, Any]) -> str:
    """Content of one streamed chunk (chat delta content / reasoning, or completions text)."""
    parts = []
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta")
        if isinstance(delta, dict):
            parts.append(delta.get("content") or delta.get("reasoning_content") or "")
        else:
            parts.append(choice.get("text") or "")
    return "".join(parts)


async def stream_once(client: httpx.AsyncClient, target: Target, body: dict[str, Any],
                      extra_headers: dict[str, str] | None = None) -> StreamResult:
    """Send one streaming request and time its chunks; errors end up in the result."""
    res, start = StreamResult(), time.perf_counter()
    headers = target.headers | (extra_headers or {})
    try:
        async with client.stream("POST", target.url, json=body, headers=headers) as resp:
            res.status = resp.status_code
            if resp.status_code != 200:
                res.error = (await resp.aread()).decode("utf-8", "replace")[:300] or resp.reason_phrase
                return res
            await _read_events(resp, res, start)
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        res.ok, res.error = False, f"{type(e).__name__}: {e}"[:300]
    return res


async def _read_events(resp: httpx.Response, res: StreamResult, start: float) -> None:
    last, finished = start, False
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            finished = True
            break
        chunk = json.loads(data)
        if "error" in chunk:
            res.error = str(chunk["error"])[:300]
            return
        usage = chunk.get("usage")
        if usage:
            res.prompt_tokens = usage.get("prompt_tokens")
            res.completion_tokens = usage.get("completion_tokens")
        finished = finished or any(c.get("finish_reason") for c in chunk.get("choices") or [])
        text = chunk_text(chunk)
        if res.ttft_s is None and chunk.get("choices"):
            # TTFT at the first chunk with a choice, as vLLM's `bench serve` times it (a server that
            # sent the role before prefill would look fast here, which is why Tandem's does not).
            last = time.perf_counter()
            res.ttft_s = last - start
        if text:
            now = time.perf_counter()
            if res.num_chunks:
                res.itl_s.append(now - last)
            last = now
            res.num_chunks += 1
            res.text += text
    res.ok = finished
    if not finished:
        res.error = "stream ended without [DONE] or a finish reason"


async def run_item(client: httpx.AsyncClient, target: Target, item: WorkItem, index: int,
                   run_start: float, seed: int = 0) -> RequestRecord:
    """Send one work item (a plain request, or the chain of calls of a tool-augmented trace)."""
    sent = time.perf_counter()
    # a tool-augmented trace fixes its own generation lengths; --max-tokens caps plain items only
    expected = item.max_tokens if item.augmented else (target.max_tokens or item.max_tokens)
    rec = RequestRecord(index, item.kind, sent - run_start, expected)
    chat = target.endpoint == "chat"
    conversation: list[dict[str, Any]] | str = list(item.messages) if chat else item.prompt
    segments = item.augmented.segments if item.augmented else [None]
    rng = random.Random(seed * 1_000_003 + index)
    user = f"tandem-bench-{seed}-{index}" if item.augmented else None
    for k, seg in enumerate(segments):
        cap = seg.completion_tokens if seg is not None else expected
        res = await stream_once(client, target, request_body(target, conversation, cap, user))
        _absorb(rec, res, first=k == 0)
        if not res.ok:
            return _finish(rec, sent, success=False)
        if seg is not None and seg.has_call and k < len(segments) - 1:
            await asyncio.sleep(seg.api_time_s)
            rec.num_tool_calls += 1
            rec.tool_time_s += seg.api_time_s
            conversation = _append_tool_return(conversation, res.text, synthetic_text(seg.return_tokens, rng))
    return _finish(rec, sent, success=True)


def _absorb(rec: RequestRecord, res: StreamResult, first: bool) -> None:
    rec.status, rec.error = res.status, res.error
    if first:
        rec.ttft_s = res.ttft_s
        rec.prompt_tokens = res.prompt_tokens
    rec.itl_s.extend(res.itl_s)
    rec.output_tokens += res.completion_tokens if res.completion_tokens is not None else res.num_chunks


def _finish(rec: RequestRecord, sent: float, success: bool) -> RequestRecord:
    rec.e2e_s = time.perf_counter() - sent
    rec.success = success and rec.ttft_s is not None
    if success and rec.ttft_s is None:
        rec.error = "no content tokens received"
    return rec


def _append_tool_return(conversation: list[dict[str, Any]] | str, reply: str,
                        tool_text: str) -> list[dict[str, Any]] | str:
    # A user turn, not the `tool` role: a generic server rejects tool messages without a matching
    # assistant tool call, and the token counts are what the replay is about.
    if isinstance(conversation, str):
        return f"{conversation}{reply}\nTool result: {tool_text}\n"
    return conversation + [{"role": "assistant", "content": reply},
                           {"role": "user", "content": f"Tool result: {tool_text}"}]
