"""Fuzz the two generation endpoints from the app's own OpenAPI schema (schemathesis): whatever a
client sends, the answer is never a 5xx. Bounded in CI (20 fixed examples per endpoint and variant,
at most 8 output tokens); `TANDEM_SCHEMA_EXAMPLES=N` runs N random ones each, the long run on demand
(docs/benchmarks.md records one)."""

from __future__ import annotations

import os
from collections import Counter

import pytest
import schemathesis
from schemathesis import GenerationMode
from hypothesis import HealthCheck, given, settings
from server_helpers import module_engine

from tandem.server import create_app


fuzz_engine = module_engine("fuzz_engine")
LONG_RUN = os.environ.get("TANDEM_SCHEMA_EXAMPLES")
EXAMPLES = int(LONG_RUN or 20)


@pytest.fixture(scope="module")
def api_schema(fuzz_engine):
    app = create_app(fuzz_engine, "tiny", max_tokens_limit=8, max_n=2)
    return schemathesis.openapi.from_asgi("/openapi.json", app)


# Dropped from servable cases: options this server refuses, and ones whose random values would
# almost always be refused (logit_bias keys, stop_token_ids outside the tiny vocabulary).
UNSUPPORTED = ("logit_bias", "stop_token_ids", "echo", "suffix", "best_of",
               "response_format", "tool_choice", "top_logprobs", "seed")


def servable(case):
    """Steer a schema-valid case towards what this server generates for (so the engine runs):
    the served model, no unsupported options, a small output, messages with text, ids in the vocabulary."""
    body = case.body
    if not isinstance(body, dict):
        return case
    for name in UNSUPPORTED + ("max_completion_tokens",):
        body.pop(name, None)
    body.update(model="tiny", n=1, max_tokens=min(int(body.get("max_tokens") or 8), 8))
    for m in body.get("messages") or []:
        if isinstance(m, dict) and not isinstance(m.get("content"), str):
            m["content"] = "hi"
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        body["prompt"] = [abs(t) % 300 + 1 for t in prompt if isinstance(t, int)] or "hi"
    return case


VARIANTS = {"positive": (GenerationMode.POSITIVE, False), "negative": (GenerationMode.NEGATIVE, False),
            "servable": (GenerationMode.POSITIVE, True)}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_no_server_errors(api_schema, path, variant):
    # Driven by hand: schemathesis.pytest.from_fixture does not work with pytest 9 (it reads a
    # private pytest attribute), so the test asks for the operation's strategy directly.
    mode, steer = VARIANTS[variant]
    strategy = api_schema[path]["POST"].as_strategy(generation_mode=mode)
    statuses: list[int] = []

    @given(case=strategy.map(servable) if steer else strategy)
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=not LONG_RUN, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    def run(case) -> None:
        response = case.call()
        statuses.append(response.status_code)
        assert response.status_code < 500, (case.body, response.text)
        if response.status_code >= 400:
            assert response.json()["error"]["message"]

    run()
    print(f"{path} {variant}: {len(statuses)} cases, statuses {dict(sorted(Counter(statuses).items()))}")
    if steer:
        assert 200 in statuses, statuses   # the steered cases do reach the engine
