"""`tandem bench serve` against a stand-in peer server (FastAPI in a thread) that streams canned chunks.

The stand-in speaks the OpenAI wire format with injected delays (TTFT_S before the first content
chunk, ITL_S between chunks) so that the measurements can be checked against known values; a prompt
containing FAIL gets an HTTP 500. The real end-to-end run against `tandem serve` comes with the server.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tandem.bench.serve import ServeBenchConfig, bench_serve
from tandem.bench.serve_client import RequestRecord
from tandem.bench.serve_metrics import meets_slos, parse_goodput, summarize
from tandem.cli import main
from tandem.workload import augmented as aug

TTFT_S, ITL_S, TOKENS = 0.08, 0.02, 5


def _chunk(content: str | None, chat: bool, finish: str | None = None) -> str:
    if chat:
        delta = {} if content is None else {"content": content}
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": content or "", "finish_reason": finish}
        obj = "text_completion"
    return _event({"id": "x", "object": obj, "model": "fake-model", "choices": [choice]})


def _event(obj: dict) -> str:
    return "data: " + json.dumps(obj) + "\n\n"


def make_app(seen: list[dict]) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    async def stream(body: dict, chat: bool):
        await asyncio.sleep(TTFT_S)
        if chat:       # the role goes out with the first token, as vLLM (and Tandem) send it
            yield _event({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        n = body["max_tokens"]
        for i in range(n):
            if i:
                await asyncio.sleep(ITL_S)
            yield _chunk("tok ", chat)
        yield _chunk(None, chat, finish="length")
        # usage on chat only: for completions the client must count chunks
        if chat and body.get("stream_options", {}).get("include_usage"):
            yield _event({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n}})
        yield "data: [DONE]\n\n"

    async def handle(request: Request, chat: bool):
        body = await request.json()
        seen.append(body)
        if "FAIL" in json.dumps(body.get("messages") or body.get("prompt")):
            return JSONResponse({"error": {"message": "injected failure"}}, status_code=500)
        return StreamingResponse(stream(body, chat), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle(request, True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, False)

    return app


class Peer:
    def __init__(self) -> None:
        self.seen: list[dict] = []
        config = uvicorn.Config(make_app(self.seen), host="127.0.0.1", port=0, log_level="warning",
                                lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "Peer":
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "stand-in server did not start"
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def peer():
    with Peer() as p:
        yield p


def write_prompts(path: Path, n: int, fail_every: int = 0) -> str:
    lines = []
    for i in range(n):
        text = "FAIL" if fail_every and i % fail_every == 0 else f"prompt {i}"
        lines.append(json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": TOKENS}))
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def config(url: str, dataset: str, tmp_path: Path, **kw) -> ServeBenchConfig:
    kw.setdefault("num_requests", 8)
    return ServeBenchConfig(url=url, dataset=dataset, json_path=str(tmp_path / "out.json"),
                            progress=False, **kw)


def test_measures_injected_delays(peer, tmp_path):
    ds = write_prompts(tmp_path / "p.jsonl", 8)
    cfg = config(peer.url, ds, tmp_path, concurrency=4, plots_dir=str(tmp_path / "plots"))
    data = bench_serve(cfg, log=lambda _: None)
    s = data["runs"][0]["summary"]
    assert (s["completed"], s["failed"], s["total_output_tokens"], s["total_input_tokens"]) == (8, 0, 40, 24)
    assert data["model"] == "fake-model" and all(b["model"] == "fake-model" for b in peer.seen)
    assert TTFT_S * 1e3 <= s["ttft_ms"]["p50"] < TTFT_S * 1e3 + 60
    assert ITL_S * 1e3 * 0.8 <= s["itl_ms"]["p50"] < ITL_S * 1e3 + 25
    assert ITL_S * 1e3 * 0.8 <= s["tpot_ms"]["p50"] < ITL_S * 1e3 + 25
    e2e_ms = (TTFT_S + (TOKENS - 1) * ITL_S) * 1e3
    assert e2e_ms <= s["e2el_ms"]["p50"] < e2e_ms + 120
    saved = json.loads(Path(cfg.json_path).read_text())
    assert {"bench", "config", "runs", "dataset", "model", "url", "plots"} <= set(saved)
    run = saved["runs"][0]
    assert run["concurrency"] == 4 and len(run["requests"]) == 8
    record_keys = {"ttft_s", "tpot_s", "itl_s", "e2e_s", "output_tokens", "success", "status"}
    assert record_keys <= set(run["requests"][0])
    for key in ("request_throughput", "output_throughput", "ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert key in run["summary"]
    assert "api_key" not in saved["config"]
    plot = tmp_path / "plots" / "latency_cdf.png"
    assert plot.is_file() and plot.stat().st_size > 1000


def test_rate_sweep_goodput_and_plots(peer, tmp_path):
    ds = write_prompts(tmp_path / "p.jsonl", 6)
    cfg = config(peer.url, ds, tmp_path, rates=[20.0, 40.0], num_requests=6,
                 plots_dir=str(tmp_path / "plots"), slos_ms={"ttft": 10_000, "e2el": 10_000})
    data = bench_serve(cfg, log=lambda _: None)
    assert [r["rate"] for r in data["runs"]] == [20.0, 40.0]
    for run in data["runs"]:
        s = run["summary"]
        assert s["completed"] == 6 and s["good_requests"] == 6
        assert s["goodput"] == pytest.approx(s["request_throughput"])
    tight = config(peer.url, ds, tmp_path, rates=[40.0], num_requests=4, slos_ms={"ttft": 1})
    assert bench_serve(tight, log=lambda _: None)["runs"][0]["summary"]["goodput"] == 0
    for name in ("latency_cdf.png", "throughput_vs_rate.png"):
        assert (tmp_path / "plots" / name).stat().st_size > 1000


def test_goodput_counts_requests_meeting_every_slo():
    def rec(i: int, ttft: float, e2e: float, out: int, ok: bool = True) -> RequestRecord:
        return RequestRecord(i, "chat", 0.0, out, success=ok, status=200 if ok else 500, ttft_s=ttft,
                             e2e_s=e2e, output_tokens=out)
    records = [rec(0, 0.1, 0.9, 10),     # tpot 88.9 ms
               rec(1, 0.3, 1.0, 10),     # tpot 77.8 ms, ttft too slow
               rec(2, 0.1, 2.5, 30),     # tpot 82.8 ms, e2e too slow
               rec(3, 0.1, 0.1, 1),      # one token: tpot 0
               rec(4, 0.1, 0.5, 5, ok=False)]
    slos = parse_goodput(["ttft:200 tpot:100", "e2el:2000"])
    assert slos == {"ttft": 200.0, "tpot": 100.0, "e2el": 2000.0}
    assert [meets_slos(r, slos) for r in records] == [True, False, False, True, False]
    s = summarize(records, duration_s=2.0, slos=slos)
    assert (s["good_requests"], s["goodput"], s["completed"], s["failed"]) == (2, 1.0, 4, 1)
    assert s["errors"] == {"HTTP 500": 1}
    assert summarize(records, 2.0, {"tpot": 80})["good_requests"] == 2     # records 1 and 3
    for bad in (["ttft"], ["speed:3"], ["ttft:fast"], ["ttft:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_http_500_counted_as_failed(peer, tmp_path):
    ds = write_prompts(tmp_path / "p.jsonl", 9, fail_every=3)
    data = bench_serve(config(peer.url, ds, tmp_path, concurrency=3, num_requests=9), log=lambda _: None)
    s = data["runs"][0]["summary"]
    assert (s["completed"], s["failed"], s["errors"]) == (6, 3, {"HTTP 500": 3})
    failed = [r for r in data["runs"][0]["requests"] if not r["success"]]
    assert all(r["status"] == 500 and "injected failure" in r["error"] for r in failed)


def test_connection_refused_counted_as_failed(tmp_path):
    with socket.socket() as sock:          # a port that nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ds = write_prompts(tmp_path / "p.jsonl", 4)
    data = bench_serve(config(f"http://127.0.0.1:{port}", ds, tmp_path, rates=[50.0], num_requests=4),
                       log=lambda _: None)
    s = data["runs"][0]["summary"]
    assert (s["completed"], s["failed"]) == (0, 4) and s["ttft_ms"]["p50"] is None
    assert all(r["error"].startswith("ConnectError") for r in data["runs"][0]["requests"])


def test_completions_endpoint_without_usage(peer, tmp_path):
    ds = write_prompts(tmp_path / "p.jsonl", 3)
    data = bench_serve(config(peer.url, ds, tmp_path, concurrency=3, num_requests=3, endpoint="completions",
                              max_tokens=4, model="fake-model"), log=lambda _: None)
    s = data["runs"][0]["summary"]
    assert (s["completed"], s["total_output_tokens"], s["total_input_tokens"]) == (3, 12, None)
    assert peer.seen[-1]["prompt"].startswith("prompt") and peer.seen[-1]["max_tokens"] == 4


def test_augmented_trace_replays_tool_calls(peer, tmp_path):
    req = aug.AugmentedRequest("qa", 12, [aug.Segment(3, 0.2, 5), aug.Segment(2)])
    trace = tmp_path / "trace.json"
    aug.save_trace(trace, [req])
    before = len(peer.seen)
    cfg = config(peer.url, str(trace), tmp_path, concurrency=1, num_requests=1)
    data = bench_serve(cfg, log=lambda _: None)
    r = data["runs"][0]["requests"][0]
    assert r["success"] and r["num_tool_calls"] == 1 and r["tool_time_s"] == pytest.approx(0.2)
    assert r["output_tokens"] == 5 and len(r["itl_s"]) == 3      # gaps within calls only
    assert r["e2e_s"] >= 0.2 + 2 * TTFT_S + 3 * ITL_S
    assert ITL_S * 0.8 <= r["tpot_s"] < ITL_S + 0.1
    first, second = peer.seen[before:]
    assert first["max_tokens"] == 3 and second["max_tokens"] == 2
    assert second["messages"][-1]["content"].startswith("Tool result:")
    assert second["messages"][-2]["role"] == "assistant"
    # one session id for the whole chain (a cluster keeps it on one replica)
    assert first["user"] == second["user"] and first["user"].startswith("tandem-bench-")


def test_cli_runs_and_writes_json(peer, tmp_path, capsys):
    ds = write_prompts(tmp_path / "p.jsonl", 4)
    out = tmp_path / "cli.json"
    rc = main(["bench", "serve", "--url", peer.url + "/v1", "--concurrency", "2", "--num-requests", "4",
               "--dataset", ds, "--tokenizer", "none", "--goodput", "ttft:5000", "tpot:5000",
               "--json", str(out), "--no-progress"])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["runs"][0]["summary"]["good_requests"] == 4 and data["token_counter"] == "estimate"
    assert "goodput" in capsys.readouterr().out
    bad_slo = ["bench", "serve", "--url", peer.url, "--rate", "1", "--dataset", ds, "--goodput", "x:1"]
    assert main(bad_slo) == 2
