"""vLLM's operational routes and names: /tokenize and /detokenize (prompt or chat messages, the
same ids the generation endpoints use), /version, /metrics under both `tandem:` and `vllm:`
names, `python -m tandem`, and CLI errors instead of tracebacks."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import LiveServer, module_engine

import tandem
from tandem.server import create_app

MODEL = "tiny"


engine = module_engine("engine")


@pytest.fixture(scope="module")
def server(engine):
    srv = LiveServer(create_app(engine, MODEL, max_tokens_limit=64))
    yield srv
    srv.stop()


def test_tokenize_a_prompt_and_back(server, engine):
    r = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": "Hello world", "return_token_strs": True})
    assert r.status_code == 200
    body = r.json()
    assert body["tokens"] == engine.tokenizer.encode("Hello world")
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == engine.engine.max_model_len
    assert len(body["token_strs"]) == body["count"]
    back = httpx.post(server.url + "/detokenize", json={"model": MODEL, "tokens": body["tokens"]})
    assert back.status_code == 200 and "Hello world" in back.json()["prompt"]


def test_tokenize_messages_gives_the_chat_endpoints_prompt(server):
    messages = [{"role": "user", "content": "Count to three"}]
    ids = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()["tokens"]
    chat = httpx.post(server.url + "/v1/chat/completions",
                      json={"model": MODEL, "messages": messages, "max_tokens": 2}, timeout=30).json()
    assert len(ids) == chat["usage"]["prompt_tokens"]
    without = httpx.post(server.url + "/tokenize", json={"messages": messages, "add_generation_prompt": False})
    assert without.status_code == 200 and without.json()["count"] < len(ids)


@pytest.mark.parametrize("path, body, param", [
    ("/detokenize", {"tokens": [10**9]}, "tokens[0]"),
    ("/detokenize", {"tokens": [-1]}, "tokens[0]"),
    ("/tokenize", {"prompt": "\ud800"}, "prompt"),
    ("/tokenize", {"model": "other", "prompt": "hi"}, "model"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"model": MODEL}, "prompt or messages"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt or messages"),
])
def test_bad_tokenizer_requests_name_the_field(server, path, body, param):
    # json.dumps escapes a lone surrogate as \ud800, as a client's JSON would carry it
    r = httpx.post(server.url + path, content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code in (400, 404), r.text
    err = r.json()["error"]
    assert param in (err.get("param") or "") + err["message"], err


def test_version(server):
    assert httpx.get(server.url + "/version").json() == {"version": tandem.__version__}


def test_metrics_under_vllm_names_too(server):
    httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3}, timeout=30)
    samples = {s.name + str(sorted(s.labels.items())): s.value
               for fam in text_string_to_metric_families(httpx.get(server.url + "/metrics").text) for s in fam.samples}
    tandem_names = {k: v for k, v in samples.items() if k.startswith("tandem:") and "_created" not in k}
    assert tandem_names and any(k.startswith("vllm:generation_tokens_total") for k in samples)
    for k, v in tandem_names.items():
        assert samples["vllm:" + k.removeprefix("tandem:")] == v, k
    assert samples["process_resident_memory_bytes[]"] > 10 * 2**20      # the process's own, as on vLLM


def test_metrics_prefix_can_be_only_vllms(engine):
    srv = LiveServer(create_app(engine, MODEL, metrics_prefixes=("vllm:",)))
    try:
        names = {fam.name for fam in text_string_to_metric_families(httpx.get(srv.url + "/metrics").text)}
    finally:
        srv.stop()
    assert "vllm:num_requests_running" in names and not any(n.startswith("tandem:") for n in names)


def test_python_dash_m_and_cli_errors():
    run = lambda *args: subprocess.run([sys.executable, "-m", "tandem", *args], capture_output=True,  # noqa: E731
                                       text=True, timeout=120)
    ok = run("--help")
    assert ok.returncode == 0 and "serve" in ok.stdout
    bad = run("serve", "--metrics-prefix", "prom")
    assert bad.returncode == 2 and "metrics-prefix" in bad.stderr and "Traceback" not in bad.stderr
    typo = run("generate", "hi", "--dtype", "flaot32", "--max-tokens", "1")
    assert typo.returncode == 2 and "unknown dtype" in typo.stderr and "Traceback" not in typo.stderr
