"""tandem.cluster: N Tandem replicas on Ray Serve behind one OpenAI ingress and Tandem's router.

The Ray tests share ONE module-scoped 2-replica deployment of the tiny test model
(`ray.init(num_cpus=2)`, half a CPU per replica) and are skipped when Ray is not installed (the
`cluster` extra); the pieces that need no Ray (the ASGI forwarding, the metrics merge, the routing
stats, the builder's arguments) are tested without it. The replica-kill test runs last: it kills
one replica's actor mid-stream and waits (bounded) for Serve to bring it back.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import socket
import time

import httpx
import pytest

from tandem.cluster import args_to_argv, parse_args
from tandem.cluster.asgi import ResponseHead, forward
from tandem.cluster.prom import merge_metrics

HAS_RAY = importlib.util.find_spec("ray") is not None and importlib.util.find_spec("ray.serve") is not None
needs_ray = pytest.mark.skipif(not HAS_RAY, reason="Ray Serve not installed (pip install 'tandem[cluster]')")


# --- no Ray needed ---------------------------------------------------------------------------------
def test_builder_args_are_tandem_serve_flags():
    assert args_to_argv({"model": "m", "max_num_seqs": 8, "no_prefix_caching": True, "strict": False,
                         "replica-cpus": 0.5}) == ["--model", "m", "--max-num-seqs", "8", "--no-prefix-caching",
                                                   "--replica-cpus", "0.5"]
    a = parse_args({"model": "m", "replicas": "3", "replica_cpus": "0.5", "max_waiting": 7})
    assert (a.model, a.replicas, a.replica_cpus, a.max_waiting, a.router_policy) == ("m", 3, 0.5, 7, "tandem")
    assert a.max_num_batched_tokens == 2048          # tandem serve's own default


def test_merge_metrics_labels_each_replica_once_per_family():
    a = ('# HELP tandem:x X.\n# TYPE tandem:x gauge\ntandem:x{model_name="m"} 1.0\n'
         '# HELP tandem:y Y.\n# TYPE tandem:y counter\ntandem:y_total 2.0\n')
    b = a.replace("1.0", "5.0").replace("2.0", "7.0")
    text = merge_metrics({"r1": a, "r2": b})
    lines = text.splitlines()
    assert lines.count("# TYPE tandem:x gauge") == 1 and lines.count("# TYPE tandem:y counter") == 1
    assert 'tandem:x{replica="r1",model_name="m"} 1.0' in lines
    assert 'tandem:x{replica="r2",model_name="m"} 5.0' in lines
    assert 'tandem:y_total{replica="r2"} 7.0' in lines
    # each family's samples follow its own TYPE line
    assert lines.index('tandem:y_total{replica="r1"} 2.0') > lines.index("# TYPE tandem:y counter")
    from prometheus_client.parser import text_string_to_metric_families

    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert {s.labels["replica"] for s in fams["tandem:x"].samples} == {"r1", "r2"}


def test_routing_stats_report_the_schedulers_snapshot_and_prefix_digest(tiny_llama):
    """What a replica tells the router comes from `Scheduler.stats()` and the KV manager's recent
    hashes: a request waiting with its whole prompt, then, once served, its prompt's full blocks
    in the digest and nothing left to prefill."""
    from tandem import LLM, SamplingParams
    from tandem.cluster.stats import routing_stats
    from tandem.router import DIGEST_SIZE, digest_of

    llm = LLM(model=str(tiny_llama), dtype="float32", progress=False)
    eng = llm.engine
    ids = list(range(5, 5 + 3 * eng.scheduler.kv.block_size + 2))      # 3 full blocks and 2 tokens
    eng.add_request(None, SamplingParams(max_tokens=2, ignore_eos=True), prompt_token_ids=ids)
    first = routing_stats(eng, "r0")
    assert (first["waiting_requests"], first["running_requests"], first["waiting_tokens"]) == (1, 0, len(ids))
    assert first["prefix_digest"] == frozenset() and first["_spec"] == (0, 0)
    while eng.has_unfinished_requests():
        eng.step()
    done = routing_stats(eng, "r0", first["_spec"])
    assert (done["waiting_requests"], done["running_requests"], done["waiting_tokens"]) == (0, 0, 0)
    assert len(done["prefix_digest"]) >= 3
    assert done["prefix_digest"] == digest_of(eng.scheduler.recent_prefix_hashes(2 * DIGEST_SIZE), DIGEST_SIZE)


def test_asgi_forward_runs_the_real_app(tiny_llama):
    """The replica's path: the server's own app, called in-process, whole and streamed."""
    from tandem.server.app import create_app
    from tests.server_helpers import tiny_engine

    engine = tiny_engine(tiny_llama)
    app = create_app(engine, "tiny")

    async def go():
        body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "Hello"}],
                           "max_tokens": 5}).encode()
        hdrs = [("content-type", "application/json"), ("content-length", str(len(body)))]
        whole = [x async for x in forward(app, "POST", "/v1/chat/completions", "", hdrs, body, [("x-r", "1")])]
        stream_body = json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 5, "stream": True}).encode()
        streamed = [x async for x in forward(app, "POST", "/v1/completions", "",
                                             [("content-type", "application/json")], stream_body)]
        bad = [x async for x in forward(app, "POST", "/v1/completions", "", [("content-type", "application/json")],
                                        b'{"model": "tiny"}')]
        return whole, streamed, bad

    try:
        whole, streamed, bad = asyncio.run(go())
    finally:
        engine.shutdown()
    assert len(whole) == 1 and isinstance(whole[0], ResponseHead) and whole[0].status == 200
    assert whole[0].header("x-r") == "1" and not whole[0].more
    assert json.loads(whole[0].body)["choices"][0]["message"]["content"] is not None
    head, rest = streamed[0], streamed[1:]
    assert head.status == 200 and head.more and head.header("content-type").startswith("text/event-stream")
    text = (head.body + b"".join(rest)).decode()
    assert text.rstrip().endswith("data: [DONE]") and text.count("data: ") >= 3
    assert bad[0].status == 400 and json.loads(bad[0].body)["error"]["type"]


# --- one 2-replica deployment on Ray Serve ---------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _health(url: str) -> tuple[int, dict]:
    try:
        r = httpx.get(url + "/health", timeout=10)
        return r.status_code, r.json()
    except (httpx.HTTPError, ValueError):
        return 0, {}


def _wait_healthy(url: str, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    body: dict = {}
    while time.monotonic() < deadline:
        code, body = _health(url)
        if code == 200:
            return body
        time.sleep(0.5)
    raise AssertionError(f"cluster not healthy within {timeout_s}s: {body}")


@pytest.fixture(scope="module")
def cluster(tiny_llama):
    import ray
    from ray import serve

    from tandem.cluster import app

    t0 = time.monotonic()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    port = _free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(app({"model": str(tiny_llama), "dtype": "float32", "max_num_seqs": 8, "replicas": 2,
                       "replica_cpus": 0.5, "routing_stats_period": 0.5, "max_num_batched_tokens": 512}),
                  name="tandem", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, 60)
        print(f"\n[cluster up in {time.monotonic() - t0:.1f}s]")
        yield url
    finally:
        serve.shutdown()
        ray.shutdown()


def _chat(url: str, content: str, session: str | None = None, header: bool = False, **kw) -> httpx.Response:
    body = {"model": "default", "messages": [{"role": "user", "content": content}], "max_tokens": 8, **kw}
    headers = {}
    if session and header:
        headers["x-session-id"] = session
    elif session:
        body["user"] = session
    return httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=60)


@needs_ray
@pytest.mark.slow
def test_openai_client_chat_stream_completions_models(cluster):
    from openai import OpenAI

    client = OpenAI(base_url=cluster + "/v1", api_key="unused", max_retries=0)
    models = client.models.list()
    assert models.data and models.data[0].id
    r = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Hello"}], max_tokens=6)
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1
    chunks = list(client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=6, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
    c = client.completions.create(model="default", prompt="The quick brown", max_tokens=5)
    assert c.choices[0].text is not None and c.usage.prompt_tokens >= 1
    text = "".join(ch.choices[0].text for ch in client.completions.create(
        model="default", prompt="Hello", max_tokens=5, stream=True) if ch.choices)
    assert isinstance(text, str)
    # the replicas' own validation answers, through the ingress
    bad = httpx.post(cluster + "/v1/chat/completions", json={"model": "default", "messages": []}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["message"]


@needs_ray
@pytest.mark.slow
def test_session_turns_stay_on_one_replica(cluster):
    ids = set()
    for session, header in (("alice", False), ("bob", True)):
        seen = []
        history = "Hello there, this is a conversation about foxes and dogs."
        for turn in range(4):
            r = _chat(cluster, history, session, header=header)
            assert r.status_code == 200, r.text
            seen.append(r.headers["x-tandem-replica"])
            history += " " + (r.json()["choices"][0]["message"]["content"] or "") + f" turn {turn}"
        assert len(set(seen)) == 1, seen
        ids |= set(seen)
    # the header wins over the body's user field: same header, different users -> same replica
    first = _chat(cluster, "x", "carol", header=True).headers["x-tandem-replica"]
    r = httpx.post(cluster + "/v1/chat/completions", headers={"x-session-id": "carol"}, timeout=60,
                   json={"model": "default", "messages": [{"role": "user", "content": "y"}], "max_tokens": 4,
                         "user": "someone-else"})
    assert r.headers["x-tandem-replica"] == first


@needs_ray
@pytest.mark.slow
def test_health_and_metrics_cover_every_replica(cluster):
    body = _wait_healthy(cluster, 30)
    assert body["replicas_up"] == 2 and len(body["replicas"]) == 2
    r = _chat(cluster, "count me", "metrics-session")
    replica = r.headers["x-tandem-replica"]
    text = httpx.get(cluster + "/metrics", timeout=30).text
    for uid in body["replicas"]:
        assert f'replica="{uid}"' in text
    assert "tandem:cluster_replicas_up 2" in text
    from prometheus_client.parser import text_string_to_metric_families

    fams = {f.name: f for f in text_string_to_metric_families(text)}
    done = {s.labels["replica"]: s.value for s in fams["tandem:request_success"].samples
            if s.name.endswith("_total")}
    assert done.get(replica, 0) >= 1


def _stream(url: str, session: str, max_tokens: int):
    """An open SSE chat stream (the caller reads it)."""
    client = httpx.Client(timeout=60)
    body = {"model": "default", "messages": [{"role": "user", "content": "Tell a long story"}],
            "max_tokens": max_tokens, "ignore_eos": True, "stream": True, "user": session}
    return client, client.stream("POST", url + "/v1/chat/completions", json=body)


@needs_ray
@pytest.mark.slow
def test_replica_killed_mid_run_survivor_completes_and_serve_restarts_it(cluster):
    import ray

    # one session on each replica (short, distinct prompts: no cached block pulls them together)
    home: dict[str, str] = {}
    for i in range(30):
        s = f"kill-{i}"
        rep = _chat(cluster, f"hi {i}", s).headers["x-tandem-replica"]
        home.setdefault(rep, s)
        if len(home) == 2:
            break
    assert len(home) == 2, f"sessions never reached both replicas: {home}"
    victim, survivor = sorted(home)
    actors = [a for a in ray.util.list_named_actors(all_namespaces=True) if victim in a["name"]]
    assert actors, "the replica's actor not found"

    streams = {rep: _stream(cluster, home[rep], 400) for rep in (victim, survivor)}
    opened = {rep: cm.__enter__() for rep, (_, cm) in streams.items()}
    lines = {rep: opened[rep].iter_lines() for rep in opened}
    for rep in opened:                                   # both are generating
        assert opened[rep].status_code == 200
        assert opened[rep].headers["x-tandem-replica"] == rep
        assert next(ln for ln in lines[rep] if ln.startswith("data: "))
    ray.kill(ray.get_actor(actors[0]["name"], namespace=actors[0]["namespace"]), no_restart=True)
    t_kill = time.monotonic()

    rest = {rep: [ln for ln in lines[rep] if ln.startswith("data: ")] for rep in opened}
    for rep, (client, cm) in streams.items():
        cm.__exit__(None, None, None)
        client.close()
    # the survivor's stream ran to its end
    assert rest[survivor][-1] == "data: [DONE]"
    finals = [json.loads(ln[6:]) for ln in rest[survivor][:-1]]
    assert not any("error" in f for f in finals)
    assert any(c["finish_reason"] == "length" for f in finals for c in f.get("choices", []))
    # the victim's stream ended with a clear error event, then [DONE]
    assert rest[victim][-1] == "data: [DONE]"
    err = json.loads(rest[victim][-2][6:])
    assert "error" in err and "died" in err["error"]["message"], rest[victim][-3:]
    # the victim's session is served meanwhile (elsewhere, or retried), never a hang
    r = _chat(cluster, "still there?", home[victim])
    assert r.status_code in (200, 503), r.text
    if r.status_code == 503:
        assert r.json()["error"]["code"] == "replica_died"
    # Serve brings the replica back
    body = _wait_healthy(cluster, 90)
    assert body["replicas_up"] == 2 and victim not in body["replicas"]
    print(f"\n[replica back {time.monotonic() - t_kill:.1f}s after the kill; "
          f"victim's next request -> HTTP {r.status_code} from {r.headers.get('x-tandem-replica')}]")


# --- the ingress's retry rule, with a replica handle that dies on cue (no Ray cluster needed) --------
class _DyingCall:
    """One handle call's response stream: dies before its first message, or yields `items`."""

    def __init__(self, items=None):
        self.items, self.cancelled = list(items or []), False

    def __aiter__(self):
        return self

    async def __anext__(self):
        from ray.exceptions import RayActorError

        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if item == "die":
            raise RayActorError()
        return item

    def cancel(self):
        self.cancelled = True


class _Handle:
    """Stands in for the replicas' DeploymentHandle: each `forward.remote` takes the next call."""

    def __init__(self, calls):
        self.calls, self.made = list(calls), []

    def options(self, **_):
        return self

    @property
    def forward(self):
        return self

    def remote(self, *args, **kwargs):
        call = self.calls.pop(0)
        self.made.append(call)
        return call


def _ingress(handle):
    from tandem.cluster import deployments

    # the class as written, under Serve's ASGI wrapper (whose async __init__ needs a replica)
    cls = next(c for c in deployments.TandemIngress.__mro__ if "_forward" in c.__dict__)
    ingress = object.__new__(cls)
    cls.__init__(ingress, handle, 2, None)
    return ingress


def _post(ingress, body=b'{"messages": []}'):
    from starlette.requests import Request

    request = Request({"type": "http", "method": "POST", "path": "/v1/chat/completions", "query_string": b"",
                       "headers": [(b"content-type", b"application/json")]})
    return asyncio.run(ingress._forward(request, None, body))


@needs_ray
def test_ingress_retries_once_when_a_replica_dies_before_answering():
    ok = ResponseHead(200, [("content-type", "application/json")], b'{"id": "x"}')
    handle = _Handle([_DyingCall(["die"]), _DyingCall([ok])])
    resp = _post(_ingress(handle))
    assert resp.status_code == 200 and resp.body == b'{"id": "x"}'
    assert len(handle.made) == 2 and handle.made[0].cancelled     # the dead call was let go


@needs_ray
def test_ingress_gives_503_when_the_retry_dies_too():
    handle = _Handle([_DyingCall(["die"]), _DyingCall(["die"])])
    resp = _post(_ingress(handle))
    assert resp.status_code == 503
    err = json.loads(resp.body)["error"]
    assert err["code"] == "replica_died" and "retried once" in err["message"]
    assert len(handle.made) == 2                                  # never a third try


@needs_ray
def test_ingress_never_retries_a_stream_that_has_begun():
    head = ResponseHead(200, [("content-type", "text/event-stream")], b'data: {"choices": []}\n\n', more=True)
    handle = _Handle([_DyingCall([head, b'data: {"choices": [1]}\n\n', "die"])])
    resp = _post(_ingress(handle))

    async def drain():
        return b"".join([chunk async for chunk in resp.body_iterator])

    body = asyncio.run(drain()).decode()
    events = [e for e in body.split("\n\n") if e]
    assert events[:2] == ['data: {"choices": []}', 'data: {"choices": [1]}']
    assert "replica_died" in events[-2] and events[-1] == "data: [DONE]"
    assert len(handle.made) == 1
