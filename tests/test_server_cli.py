"""`tandem serve` as users run it: a subprocess that prints its URL and a curl example, answers to
the model directory's name, and on SIGTERM lets an in-flight stream finish before exiting."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading

import httpx
import pytest
from server_helpers import wait_until

from tandem.cli import build_parser, served_model_name
from tandem.cli_engine import spec_config_from_args
from tandem.errors import ConfigError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_serve_defaults():
    a = build_parser().parse_args(["serve"])
    assert (a.host, a.port, a.api_key, a.drain_timeout) == ("127.0.0.1", 8000, None, 30.0)
    assert served_model_name(None) == "SmolLM2-135M-Instruct"
    assert served_model_name("/models/Qwen3-0.6B/") == "Qwen3-0.6B"
    assert served_model_name("/m/tiny.Q4_0.gguf") == "tiny.Q4_0"
    # the server's step budget is vLLM's server default; offline commands keep the smaller one
    assert a.max_num_batched_tokens == 2048 and a.kv_cache_memory_gb is None and a.target_tpot_ms is None
    assert build_parser().parse_args(["generate", "hi"]).max_num_batched_tokens == 512
    assert build_parser().parse_args(["serve", "--max-num-batched-tokens", "256"]).max_num_batched_tokens == 256
    assert a.kv_cache_dtype == "auto"
    assert build_parser().parse_args(["serve", "--kv-cache-dtype", "float32"]).kv_cache_dtype == "float32"


def test_serve_speculation_flags():
    a = build_parser().parse_args(["serve", "--speculative", "layerskip", "--num-draft-layers", "8",
                                   "--frontier-size", "2", "--overlap", "--draft-threads", "1",
                                   "--adaptive-frontiers"])
    cfg = spec_config_from_args(a)
    assert (cfg.method, cfg.num_draft_layers, cfg.frontier_size, cfg.overlap, cfg.draft_threads,
            cfg.adaptive_frontiers) == ("layerskip", 8, 2, True, 1, True)
    assert not spec_config_from_args(build_parser().parse_args(["serve", "--speculative", "ngram"])).adaptive_frontiers
    with pytest.raises(ConfigError, match="frontier_size"):
        spec_config_from_args(build_parser().parse_args(["serve", "--speculative", "layerskip", "--overlap"]))
    with pytest.raises(ConfigError, match="model drafter"):
        spec_config_from_args(build_parser().parse_args(["serve", "--speculative", "ngram", "--frontier-size", "2",
                                                "--overlap"]))


def test_serve_prints_usage_and_drains_on_sigterm(tiny_llama):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "tandem.cli", "serve", "--model", str(tiny_llama), "--dtype",
                             "float32", "--port", str(port), "--drain-timeout", "20"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_until(lambda: healthy(url) or proc.poll() is not None, 60) and proc.poll() is None
        banner = proc.stdout.readline() + proc.stdout.readline()
        assert url in banner and f"curl {url}/v1/chat/completions" in banner
        lines: list[str] = []
        started = threading.Event()

        def stream() -> None:
            body = {"model": tiny_llama.name, "prompt": "Hello", "max_tokens": 300, "ignore_eos": True,
                    "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        started.set()

        t = threading.Thread(target=stream)
        t.start()
        assert started.wait(30)
        proc.send_signal(signal.SIGTERM)
        t.join(60)
        assert proc.wait(30) in (0, -signal.SIGTERM)     # uvicorn re-raises the signal after draining
        data = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        assert lines[-1] == "data: [DONE]" and data[-1]["choices"][0]["finish_reason"] == "length"
        assert not healthy(url)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            pytest.fail(proc.stderr.read()[-2000:])
