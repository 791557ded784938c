"""Tandem's scheduler inside a real `vllm serve --scheduler-cls` (vLLM's CPU build, in the separate
environment `scripts/setup_vllm_env.sh` makes; `make test` makes it when it is missing).

Two servers of the default model with the same flags, one running vLLM's own scheduler and one
running `tandem.integrations.vllm.TandemScheduler`, each serving one request at a time
(`--max-num-seqs 1`), so the order in which a queue is served is the order in which it finishes.
Driven with the `openai` client. The plugin's server expects a session's next call within 10 ms
(`session_gap_prior_s`), so that min-waste holds a finished call's context even on an idle server."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

import tandem

VLLM_ENV = Path(os.environ.get("TANDEM_VLLM_ENV", Path.home() / ".cache" / "tandem-peers" / "vllm"))
SRC = Path(tandem.__file__).resolve().parent.parent
PLUGIN = "tandem.integrations.vllm.TandemScheduler"
PLUGIN_OPTIONS = '{"tandem": {"policy": "augserve", "session_gap_prior_s": 0.01}}'

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (VLLM_ENV / "bin" / "vllm").exists(),
                       reason=f"no vLLM environment at {VLLM_ENV}: run scripts/setup_vllm_env.sh (make test does)"),
]

SENTENCE = "The quick brown fox jumps over the lazy dog near the river bank. "
# Queued behind a running request, longest prompt first: FCFS serves them in this order, Stage I
# (predicted service time: with a cold predictor every output is predicted alike, so the prompt to
# prefill decides) from the shortest.
BURST = {"q40": 40, "q20": 20, "q10": 10, "q2": 2}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    def __init__(self, model_dir: Path, log: Path, scheduler_cls: str | None) -> None:
        self.port = free_port()
        self.log = log
        cmd = [str(VLLM_ENV / "bin" / "vllm"), "serve", str(model_dir), "--served-model-name", "smol",
               "--port", str(self.port), "--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", "1",
               "--enforce-eager", "--kv-cache-memory-bytes", str(256 << 20), "--seed", "0",
               "--enable-prompt-tokens-details"]
        if scheduler_cls:
            cmd += ["--scheduler-cls", scheduler_cls, "--additional-config", PLUGIN_OPTIONS]
        env = dict(os.environ, PYTHONPATH=str(SRC), VLLM_CPU_NUM_OF_RESERVED_CPU="0")
        self.proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        tail = self.log.read_text()[-4000:]
        self.stop()
        pytest.fail(f"vllm serve did not come up:\n{tail}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@pytest.fixture(scope="module")
def servers(default_model_dir, tmp_path_factory):
    """vLLM's scheduler and Tandem's, started together (start-up is mostly waiting on imports)."""
    logs = tmp_path_factory.mktemp("vllm")
    both = {"vllm": VllmServer(default_model_dir, logs / "vllm.log", None),
            "tandem": VllmServer(default_model_dir, logs / "tandem.log", PLUGIN)}
    try:
        for s in both.values():
            s.wait_ready()
        yield both
    finally:
        for s in both.values():
            s.stop()


async def chat(client, content: str, max_tokens: int, delay_s: float = 0.0) -> tuple[list[int], float]:
    await asyncio.sleep(delay_s)
    r = await client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": content}], max_tokens=max_tokens, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True})
    return list(r.choices[0].token_ids), time.monotonic()


async def burst(url: str) -> dict[str, tuple[list[int], float]]:
    """One long request occupies the only slot; the burst queues behind it, 50 ms apart."""
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=url + "/v1", api_key="x") as client:
        await chat(client, "Say hi.", 2)                       # warm-up
        names = ["head", *BURST]
        jobs = [chat(client, "Write a long story about a lighthouse keeper.", 96)]
        jobs += [chat(client, SENTENCE * n + "Summarize.", 8, 0.3 + 0.05 * i) for i, n in enumerate(BURST.values())]
        return dict(zip(names, await asyncio.gather(*jobs)))


@pytest.fixture(scope="module")
def bursts(servers):
    return {name: asyncio.run(burst(s.url)) for name, s in servers.items()}


def test_plugin_is_loaded(servers, bursts):
    log = servers["tandem"].log.read_text()
    assert "Tandem scheduler (TandemScheduler" in log or "Tandem scheduler (TandemAsyncScheduler" in log
    assert "policy='augserve'" in log
    assert "Tandem scheduler" not in servers["vllm"].log.read_text()


def test_service_order_follows_stage1_under_a_burst(bursts):
    def order(result):
        return sorted(BURST, key=lambda name: result[name][1])

    assert order(bursts["vllm"]) == ["q40", "q20", "q10", "q2"]       # FCFS
    assert order(bursts["tandem"]) == ["q2", "q10", "q20", "q40"]     # shortest predicted service first


def test_greedy_outputs_equal_vllms_own_scheduler(bursts):
    for name in ["head", *BURST]:
        ids = bursts["tandem"][name][0]
        assert ids == bursts["vllm"][name][0], name
        assert len(ids) == (96 if name == "head" else 8)


def kv_capacity_tokens(log: Path) -> int:
    match = re.search(r"KV cache size: ([\d,]+) tokens", log.read_text())
    assert match, "the server logs its KV cache size"
    return int(match.group(1).replace(",", ""))


def session_then_flood(server: VllmServer) -> int:
    """A session's first call, then distinct prompts worth the whole KV cache (so vLLM's LRU prefix
    cache evicts everything older, the session's context first), then the session's next call,
    which extends the first one's prompt. Returns the next call's prompt tokens found cached."""
    from openai import OpenAI

    rng = random.Random(0)
    context = [rng.randrange(100, 40000) for _ in range(1500)]
    flood_len = 800
    flood = [[rng.randrange(100, 40000) for _ in range(flood_len)]
             for _ in range(kv_capacity_tokens(server.log) // flood_len + 2)]
    with OpenAI(base_url=server.url + "/v1", api_key="x") as client:
        def call(prompt: list[int], session: str | None):
            return client.completions.create(model="smol", prompt=prompt, max_tokens=2, temperature=0,
                                             extra_headers={"X-Session-ID": session} if session else None)

        first = call(context, "agent-1")
        for prompt in flood:
            call(prompt, None)
        nxt = call(context + [rng.randrange(100, 40000) for _ in range(20)], "agent-1")
    assert first.usage.prompt_tokens == 1500
    return nxt.usage.prompt_tokens_details.cached_tokens


def test_a_session_keeps_its_context_through_a_flood(servers, bursts):
    """vLLM's prefix cache loses the session's context to the flood; Tandem's hold keeps it (the
    next call finds all but the last block or two of the first call's 1,500 prompt tokens: vLLM's
    CPU blocks hold 64 tokens, and only full ones are cached)."""
    assert session_then_flood(servers["vllm"]) < 256
    assert session_then_flood(servers["tandem"]) >= 1500 - 2 * 64


def test_faser_cuts_the_drafts_of_vllms_proposer(default_model_dir):
    """In vLLM's own scheduler classes (no model: scripted steps, vLLM's n-gram slots with 4 drafts
    offered every step): FASER's lengths are what vLLM schedules. The first decode steps of a batch
    size run plain (measured before drafting pays), drafts that are all accepted keep all 4, and
    drafts that are all rejected are cut to none (retried once the evidence has aged, rarely)."""
    probe = Path(__file__).with_name("vllm_scheduler_probe.py")
    proc = subprocess.run([str(VLLM_ENV / "bin" / "python"), str(probe), str(default_model_dir)], capture_output=True,
                          text=True, timeout=600, env=dict(os.environ, PYTHONPATH=str(SRC)))
    assert proc.returncode == 0, proc.stderr[-4000:]
    steps = json.loads(proc.stdout.strip().splitlines()[-1])
    for mode in ("accept", "reject"):
        assert steps[mode][:2] == [[0, 0], [0, 0]], mode
        assert all(k <= 4 for step in steps[mode] for k in step)
    assert steps["accept"][2] == [4, 4] and all(s == [4, 4] for s in steps["accept"][-10:])
    assert steps["reject"][2] == [4, 4] and sum(s != [0, 0] for s in steps["reject"][-10:]) <= 1
